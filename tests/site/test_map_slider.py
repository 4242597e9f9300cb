"""The map slider of page 6b (``viz.map_slider_html``, docs/javascripts/map-slider.js) in headless Chromium.

The page embeds every attention map its training run stored. Moving the slider (by the mouse or
the arrow keys) must redraw the map, each cell in the colour of its weight in the embedded JSON,
and the step's name and anti-diagonal weight; Play must step through the frames and stop at the
last, Pause must stop; the widget must fit a 390 px phone with readable labels, read in the light
and dark schemes, show the last frame without JavaScript, and keep working after Material's
instant navigation. Fixtures (``browser``, ``site_url``, ``page``) come from tests/site/conftest.py.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from attention_ref import viz

PAGE = "tutorial/06b-watch-attention-learn/"
FIGURE = "figure.ar-map-slider"
RANGE = "input.ar-map-slider-range"
PLAY = "button.ar-map-slider-play"

SHOWN = """fig => ({
  frame: Number(fig.querySelector('input.ar-map-slider-range').value),
  name: fig.querySelector('.ar-map-slider-frame').textContent,
  value: fig.querySelector('.ar-map-slider-value').textContent,
  spoken: fig.querySelector('input.ar-map-slider-range').getAttribute('aria-valuetext'),
  fills: [...fig.querySelectorAll('rect.ar-map-slider-cell')].map(c => c.getAttribute('fill')),
  weights: [...fig.querySelectorAll('rect.ar-map-slider-cell')].map(c => Number(c.dataset.weight)),
  play: fig.querySelector('button.ar-map-slider-play').textContent,
})"""


def open_slider(page, site_url: str):
    page.goto(site_url + PAGE)
    figure = page.locator(FIGURE).first
    figure.wait_for()
    page.wait_for_function("sel => document.querySelector(sel)?.dataset.mapSliderReady === 'true'", arg=FIGURE)
    return figure, json.loads(figure.get_attribute("data-map-slider"))


def decoded(data: dict) -> np.ndarray:
    """The (F, L, S) maps as the page holds them."""
    counts = np.frombuffer(base64.b64decode(data["weights"]), "<u2")
    return counts.reshape(data["frames"], data["L"], data["S"]) * data["unit"]


def assert_shows(figure, data: dict, f: int) -> dict:
    """Frame ``f``: every cell's colour and weight, the slider, the step's name and its value."""
    shown = figure.evaluate(SHOWN)
    maps = decoded(data)
    assert shown["frame"] == f
    assert shown["name"] == data["names"][f] == f"step {f}"
    value = f"anti-diagonal weight: {data['values'][f]}"
    assert shown["value"] == value and shown["spoken"] == f"step {f}, {value}"
    assert shown["fills"] == [viz._ramp_colour(w) for w in maps[f].ravel()]
    np.testing.assert_allclose(shown["weights"], maps[f].ravel(), atol=1e-9)
    return shown


def test_the_data_is_the_training_run(page, site_url):
    """151 maps of the probe, labelled by position and digit; the right key of query i is j = L-1-i."""
    _, data = open_slider(page, site_url)
    maps = decoded(data)
    F, L, S = maps.shape
    assert (F, L, S) == (151, 8, 8) and data["names"] == [f"step {s}" for s in range(F)]
    digits = [3, 1, 4, 1, 5, 9, 2, 6]
    assert data["rows"] == [f"i={i} \u00b7 {d}" for i, d in enumerate(digits)]
    assert data["cols"] == [f"j={j} \u00b7 {d}" for j, d in enumerate(digits)]
    np.testing.assert_allclose(maps.sum(-1), 1, atol=1e-3)  # rows of softmax weights
    anti = maps[:, np.arange(L), L - 1 - np.arange(L)].mean(-1)  # (F,): w[i, L-1-i], averaged
    np.testing.assert_allclose([float(v) for v in data["values"]], anti, atol=0.005 + 1e-3)  # 2 decimals
    assert anti[0] < 0.2 and anti[-1] > 0.9
    assert np.array_equal(maps[-1].argmax(-1), L - 1 - np.arange(L))  # the anti-diagonal, at the end


def test_moving_the_slider_redraws_the_map(page, site_url):
    figure, data = open_slider(page, site_url)
    last = assert_shows(figure, data, data["frames"] - 1)  # opens on the last frame, as without JavaScript
    figure.locator(RANGE).fill("0")  # as a drag does: sets the value, fires "input"
    first = assert_shows(figure, data, 0)
    assert first["fills"] != last["fills"]
    figure.locator(RANGE).fill("30")
    assert_shows(figure, data, 30)
    figure.locator(RANGE).fill(str(data["frames"] - 1))
    assert assert_shows(figure, data, data["frames"] - 1) == last
    # a drag with the mouse redraws while the button is still down, not only when it is let go
    box = figure.locator(RANGE).bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] - 4, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] / 2, y, steps=5)
    dragged = figure.evaluate(SHOWN)["frame"]
    assert 0 < dragged < data["frames"] - 1
    assert_shows(figure, data, dragged)
    page.mouse.up()
    assert page.console_errors == []


def test_the_script_draws_the_frame_the_page_was_built_with(page, site_url, built_site):
    """Before the script, the SVG holds the last frame; the script's colours for it are the same."""
    html = (built_site / PAGE / "index.html").read_text(encoding="utf-8")
    built = html[html.index('class="ar-map-slider-cells"'):]
    built = built[:built.index("</g>")]
    static = [part.split('"')[0] for part in built.split(' fill="')[1:]]
    figure, data = open_slider(page, site_url)
    figure.locator(RANGE).fill("0")
    figure.locator(RANGE).fill(str(data["frames"] - 1))
    assert len(static) == 64 and figure.evaluate(SHOWN)["fills"] == static
    assert page.console_errors == []


def test_play_steps_through_the_frames_and_pause_stops(page, site_url):
    figure, data = open_slider(page, site_url)
    last = data["frames"] - 1
    figure.locator(PLAY).click()  # from the last frame, Play starts again at frame 0
    page.wait_for_function(
        "sel => Number(document.querySelector(sel).value) >= 5", arg=f"{FIGURE} {RANGE}", timeout=5_000)
    assert figure.locator(PLAY).text_content() == "Pause"
    assert figure.locator(PLAY).get_attribute("aria-label") == "Pause"
    figure.locator(PLAY).click()
    stopped = figure.evaluate(SHOWN)["frame"]
    assert 5 <= stopped < last
    page.wait_for_timeout(400)  # six frames' time at 15 frames a second
    assert_shows(figure, data, stopped)
    assert figure.locator(PLAY).text_content() == "Play"
    figure.locator(RANGE).fill(str(last - 4))
    figure.locator(PLAY).click()
    page.wait_for_function("sel => document.querySelector(sel).textContent === 'Play'", arg=f"{FIGURE} {PLAY}",
                           timeout=5_000)  # it stops by itself at the end
    assert_shows(figure, data, last)
    assert page.console_errors == []


def test_keyboard(page, site_url):
    figure, data = open_slider(page, site_url)
    figure.locator(RANGE).fill("10")
    figure.locator(RANGE).focus()
    page.keyboard.press("ArrowRight")
    assert_shows(figure, data, 11)
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    assert_shows(figure, data, 9)
    page.keyboard.press("Home")
    assert_shows(figure, data, 0)
    page.keyboard.press("Shift+Tab")  # the Play button comes before the slider
    assert page.evaluate("() => document.activeElement.matches('figure.ar-map-slider button.ar-map-slider-play')")
    page.keyboard.press("Enter")
    page.wait_for_function(
        "sel => Number(document.querySelector(sel).value) >= 2", arg=f"{FIGURE} {RANGE}", timeout=5_000)
    page.keyboard.press("Enter")
    assert figure.locator(PLAY).text_content() == "Play"
    assert figure.locator(RANGE).get_attribute("aria-label") and figure.locator(PLAY).get_attribute("aria-label")
    assert page.console_errors == []


MEASURE = """fig => {
  let smallest = Infinity;
  for (const t of fig.querySelectorAll('svg text')) {
    const m = t.getScreenCTM();
    smallest = Math.min(smallest, parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b));
  }
  const box = fig.getBoundingClientRect();
  const inner = [...fig.querySelectorAll('*')].map(el => el.getBoundingClientRect().right);
  return {left: box.left, right: Math.max(box.right, ...inner), width: box.width,
          page: document.documentElement.scrollWidth, viewport: window.innerWidth, smallest,
          map: fig.querySelector('svg').getBoundingClientRect().width};
}"""


@pytest.mark.parametrize("width, smallest", [(390, 9.0), (1280, 11.0)])
def test_the_slider_fits_the_screen_with_readable_labels(browser, site_url, width, smallest):
    context = browser.new_context(viewport={"width": width, "height": 844})
    try:
        screen = context.new_page()
        screen.goto(site_url + PAGE)
        screen.wait_for_function("() => document.querySelector('figure.ar-map-slider')?.dataset.mapSliderReady")
        sizes = screen.locator(FIGURE).evaluate(MEASURE)
    finally:
        context.close()
    assert sizes["left"] >= 0 and sizes["right"] <= sizes["viewport"] and sizes["page"] <= width, sizes
    assert sizes["smallest"] >= smallest, sizes  # labels in px as rendered
    assert sizes["map"] >= min(300, width - 60), sizes  # the map uses the column


def _luminance(rgb) -> float:
    def channel(c):
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


COLOURS = """(fig, scheme) => {
  document.body.setAttribute('data-md-color-scheme', scheme);
  const page = getComputedStyle(document.body).backgroundColor.match(/[\\d.]+/g).slice(0, 3).map(Number);
  // a colour with an alpha, as the eye sees it over the page
  const rgb = c => {
    const [r, g, b, a = 1] = c.match(/[\\d.]+/g).map(Number);
    return [r, g, b].map((x, k) => a * x + (1 - a) * page[k]);
  };
  return {
    page,
    frame: rgb(getComputedStyle(fig.querySelector('.ar-map-slider-frame')).color),
    value: rgb(getComputedStyle(fig.querySelector('.ar-map-slider-value')).color),
    label: rgb(getComputedStyle(fig.querySelector('svg text.ar-map-slider-row')).fill),
    play: [rgb(getComputedStyle(fig.querySelector('button')).color),
           rgb(getComputedStyle(fig.querySelector('button')).backgroundColor)],
  };
}"""


@pytest.mark.parametrize("scheme", ["default", "slate"])
def test_the_slider_reads_in_both_schemes(page, site_url, scheme):
    figure, _ = open_slider(page, site_url)
    colours = figure.evaluate(COLOURS, scheme)

    def contrast(a, b):
        a, b = _luminance(a), _luminance(b)
        return (max(a, b) + 0.05) / (min(a, b) + 0.05)

    for name in ("frame", "value", "label"):
        assert contrast(colours[name], colours["page"]) >= 4.5, (scheme, name, colours)  # WCAG AA
    assert contrast(*colours["play"]) >= 4.5, (scheme, colours["play"])


def test_without_javascript_the_last_frame_shows(browser, site_url):
    context = browser.new_context(java_script_enabled=False, viewport={"width": 390, "height": 844})
    try:
        screen = context.new_page()
        screen.goto(site_url + PAGE)
        figure = screen.locator(FIGURE)
        data = json.loads(figure.get_attribute("data-map-slider"))
        assert not figure.locator(".ar-map-slider-controls").is_visible()  # nothing that does nothing
        assert figure.locator("svg").bounding_box()["width"] > 300
        assert figure.locator(".ar-map-slider-frame").text_content() == "step 150"
        fills = figure.locator("rect.ar-map-slider-cell").evaluate_all("cs => cs.map(c => c.getAttribute('fill'))")
        assert fills == [viz._ramp_colour(w) for w in decoded(data)[-1].ravel()]
    finally:
        context.close()


def test_the_slider_works_after_instant_navigation(page, site_url):
    figure, data = open_slider(page, site_url)
    page.evaluate("window.__sliderTestMarker = 1")  # survives only if no full reload happens
    figure.locator(PLAY).click()  # still playing when the page is left
    page.locator("a.md-footer__link--next").click()
    page.wait_for_url("**/tutorial/07-cross-attention/")
    page.locator(FIGURE).wait_for(state="detached")
    page.wait_for_timeout(300)  # the animation's timer finds its figure gone and stops
    page.locator("a.md-footer__link--prev").click()
    page.wait_for_url("**/" + PAGE)
    assert page.evaluate("window.__sliderTestMarker") == 1, "navigation reloaded the page: not instant"
    figure = page.locator(FIGURE).first
    page.wait_for_function("sel => document.querySelector(sel)?.dataset.mapSliderReady === 'true'", arg=FIGURE)
    assert json.loads(figure.get_attribute("data-map-slider")) == data
    figure.locator(RANGE).fill("7")
    assert_shows(figure, data, 7)
    assert page.console_errors == []
