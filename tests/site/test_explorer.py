"""The attention explorer on the intuition page, driven in headless Chromium.

Every number the explorer shows (q.k, the scaled score, the causal mask, the softmax) after a
click, the direction toggle, a model, sentence, layer or head switch, a thumbnail click or a
keyboard move must equal the JSON that attention_ref embedded in the page when the site was
built; that JSON must equal the package's own computation (the softmax of the scaled scores is
the weights, and the weights are all-MiniLM-L6-v2's); the explorer must fit a 390 px phone and
keep working after Material's instant navigation.
Fixtures (``site_url``, ``page``) come from tests/site/conftest.py.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

PAGE = "tutorial/01-intuition/"
EXPLORER = "div.attention-explorer"
TOKEN = "button.attention-explorer-token"
THUMB = "button.attention-explorer-thumb"
ROW = "tr.attention-explorer-row"
MINUS = "\u2212"


def open_explorer(page, site_url: str):
    page.goto(site_url + PAGE)
    explorer = page.locator(EXPLORER).first
    explorer.wait_for()
    page.wait_for_function(
        "sel => document.querySelector(sel)?.dataset.explorerReady === 'true'", arg=EXPLORER
    )
    data = json.loads(explorer.get_attribute("data-attention"))
    return explorer, data


def unpack(model: dict, sentence: dict) -> tuple[np.ndarray, np.ndarray | None]:
    """The weights and the q.k scores of a sentence, (layers, H, L, L), as the page holds them."""
    shape = (len(model["layers"]), len(model["heads"]), len(sentence["tokens"]), len(sentence["tokens"]))
    w = np.frombuffer(base64.b64decode(sentence["weights"]), "<u2").reshape(shape) * model["weightUnit"]
    if "scores" not in sentence:
        return w, None
    s = np.frombuffer(base64.b64decode(sentence["scores"]), "<i2").reshape(shape) * model["scoreUnit"]
    return w, s


def fixed(x: float, digits: int) -> str:
    text = f"{x:.{digits}f}"
    if float(text) == 0:
        text = f"{0:.{digits}f}"
    return text.replace("-", MINUS)


def menu(explorer, kind: str) -> int:
    return int(explorer.locator(f"select.attention-explorer-{kind}").input_value())


def table(explorer) -> dict[str, list[str]]:
    rows = explorer.locator(ROW)
    return {c: rows.locator(f".attention-explorer-{c}").all_text_contents()
            for c in ("label", "score", "scaled", "masked", "value")}


def assert_shows(explorer, data, model: int, sentence: int, layer: int, head: int, token: int, to=True):
    """The menus, the pressed token and thumbnail, the shades and every number of the table."""
    m = data["models"][model]
    s = m["sentences"][sentence]
    w, scores = unpack(m, s)
    assert menu(explorer, "sentence") == sentence
    assert (menu(explorer, "layer"), menu(explorer, "head")) == (layer, head)
    if "model" in data and len(data["models"]) > 1:
        assert menu(explorer, "model") == model
    assert explorer.locator(TOKEN).all_text_contents() == s["tokens"]
    pressed = explorer.locator(f"{TOKEN}[aria-pressed='true']")
    assert pressed.count() == 1 and int(pressed.get_attribute("data-index")) == token
    thumb = explorer.locator(f"{THUMB}[aria-pressed='true']")
    assert (int(thumb.get_attribute("data-layer")), int(thumb.get_attribute("data-head"))) == (layer, head)
    direction = explorer.locator(".attention-explorer-direction-button[aria-pressed='true']")
    assert direction.get_attribute("data-direction") == ("to" if to else "by")
    weights = w[layer, head, token, :] if to else w[layer, head, :, token]
    shown = table(explorer)
    assert shown["label"] == s["tokens"]
    assert shown["value"] == [f"{x:.3f}" for x in weights]
    shades = explorer.locator(TOKEN).evaluate_all(
        "bs => bs.map(b => Number(b.style.getPropertyValue('--attention-weight')))")
    np.testing.assert_allclose(shades, weights, atol=1e-9)
    if scores is not None:
        qk = scores[layer, head, token, :] if to else scores[layer, head, :, token]
        assert shown["score"] == [fixed(x, 2) for x in qk]
        assert shown["scaled"] == [fixed(x * m["scale"], 2) for x in qk]
        if m["causal"]:
            L = len(s["tokens"])
            future = [j > token for j in range(L)] if to else [token > i for i in range(L)]
            assert shown["masked"] == [MINUS + "\u221e" if f else fixed(x * m["scale"], 2)
                                       for x, f in zip(qk, future)]
        else:
            assert shown["masked"] == []


def test_the_numbers_are_the_packages(page, site_url):
    """The JSON holds the minimal pair, scores whose softmax is the weights, and MiniLM's weights."""
    _, data = open_explorer(page, site_url)
    assert [m["causal"] for m in data["models"]] == [False, True]
    texts = [s["text"] for s in data["models"][0]["sentences"]]
    assert "The animal didn't cross the street because it was too tired." in texts
    assert "The animal didn't cross the street because it was too wide." in texts
    assert 4 <= sum(len(m["sentences"]) for m in data["models"]) <= 6
    for model in data["models"]:
        for sentence in model["sentences"]:
            w, s = unpack(model, sentence)
            assert s is not None, sentence["text"]
            scaled = s * model["scale"]
            if model["causal"]:
                L = scaled.shape[-1]
                scaled = np.where(np.tril(np.ones((L, L), bool)), scaled, -np.inf)
            softmax = np.exp(scaled - scaled.max(-1, keepdims=True))
            softmax /= softmax.sum(-1, keepdims=True)
            np.testing.assert_allclose(softmax, w, atol=3e-3)  # scores in 0.01 steps
            np.testing.assert_allclose(w.sum(-1), 1, atol=2e-3)
    pretrained = pytest.importorskip("attention_ref.pretrained")
    encoder = data["models"][0]
    assert encoder["scale"] == pytest.approx(32 ** -0.5)
    for sentence in encoder["sentences"]:
        tokens, weights = pretrained.minilm_attention_layers(sentence["text"])
        assert tokens == sentence["tokens"]
        np.testing.assert_allclose(unpack(encoder, sentence)[0], weights.numpy(), atol=6e-5)
    # the causal model: a triangle, and a sink on the first token for queries 1-3
    w, _ = unpack(data["models"][1], data["models"][1]["sentences"][0])
    assert np.all(np.triu(w, 1) == 0)
    assert np.all(w[0, 0, 1:4, 0] > 0.35)
    assert len(json.dumps(data)) < 300_000


def test_click_a_token_shows_the_steps(page, site_url):
    explorer, data = open_explorer(page, site_url)
    start = data["start"]
    layer, head = start["layer"], start["head"]
    bank = data["models"][0]["sentences"][0]["initial"]
    assert_shows(explorer, data, 0, 0, layer, head, bank)  # opens on 'bank'
    explorer.locator(TOKEN).nth(4).click()
    assert_shows(explorer, data, 0, 0, layer, head, 4)
    explorer.locator("select.attention-explorer-layer").select_option("5")
    explorer.locator("select.attention-explorer-head").select_option("11")
    assert_shows(explorer, data, 0, 0, 5, 11, 4)
    explorer.locator(f"{THUMB}[data-layer='3'][data-head='1']").click()
    assert_shows(explorer, data, 0, 0, 3, 1, 4)
    assert page.console_errors == []


def test_the_toggle_shows_who_attends(page, site_url):
    explorer, data = open_explorer(page, site_url)
    layer, head = data["start"]["layer"], data["start"]["head"]
    explorer.locator(TOKEN).nth(2).click()
    explorer.locator(".attention-explorer-direction-button[data-direction='by']").click()
    assert_shows(explorer, data, 0, 0, layer, head, 2, to=False)
    assert "as the key" in explorer.locator(".attention-explorer-status").text_content()
    explorer.locator(TOKEN).nth(0).click()
    assert_shows(explorer, data, 0, 0, layer, head, 0, to=False)
    line = explorer.locator(f"{THUMB}[aria-pressed='true'] .attention-explorer-thumb-row")
    assert (line.get_attribute("x"), line.get_attribute("width")) == ("0", "1")  # a column
    explorer.locator(".attention-explorer-direction-button[data-direction='to']").click()
    assert_shows(explorer, data, 0, 0, layer, head, 0, to=True)
    assert page.console_errors == []


def test_switching_sentence_and_model(page, site_url):
    explorer, data = open_explorer(page, site_url)
    layer, head = data["start"]["layer"], data["start"]["head"]
    explorer.locator("select.attention-explorer-sentence").select_option("2")  # "...too wide."
    it = data["models"][0]["sentences"][2]["initial"]
    assert_shows(explorer, data, 0, 2, layer, head, it)
    explorer.locator("select.attention-explorer-model").select_option("1")
    assert explorer.locator("select.attention-explorer-layer option").count() == 1
    assert explorer.locator(THUMB).count() == 1
    assert_shows(explorer, data, 1, 0, 0, 0, data["models"][1]["sentences"][0]["initial"])
    assert MINUS + "\u221e" in table(explorer)["masked"]
    explorer.locator(TOKEN).nth(6).click()
    explorer.locator(".attention-explorer-direction-button[data-direction='by']").click()
    assert_shows(explorer, data, 1, 0, 0, 0, 6, to=False)
    explorer.locator("select.attention-explorer-sentence").select_option("1")
    explorer.locator(TOKEN).nth(3).click()
    assert_shows(explorer, data, 1, 1, 0, 0, 3, to=False)
    explorer.locator("select.attention-explorer-model").select_option("0")  # back: the view is kept
    assert_shows(explorer, data, 0, 2, layer, head, it, to=False)
    assert explorer.locator(THUMB).count() == 6 * 12
    assert page.console_errors == []


def test_thumbnails_have_their_own_contrast(page, site_url):
    explorer, data = open_explorer(page, site_url)
    maps = explorer.locator(THUMB).evaluate_all(
        """bs => bs.map(b => [...b.querySelectorAll('.attention-explorer-cell')].map(
               c => Number(c.getAttribute('fill-opacity'))))""")
    model = data["models"][0]
    w, _ = unpack(model, model["sentences"][0])
    assert len(maps) == w.shape[0] * w.shape[1]
    assert all(max(cells) == 1 for cells in maps)  # each map's darkest cell is its own maximum
    faint = int(np.argmin(w.reshape(len(maps), -1).max(-1)))  # the head with the smallest maximum
    assert w.reshape(len(maps), -1)[faint].max() < 1
    assert "own largest weight" in explorer.locator(".attention-explorer-legend").text_content()


def test_keyboard(page, site_url):
    explorer, data = open_explorer(page, site_url)
    layer, head = data["start"]["layer"], data["start"]["head"]
    explorer.locator(TOKEN).nth(0).focus()
    assert_shows(explorer, data, 0, 0, layer, head, 0)
    page.keyboard.press("ArrowRight")
    assert_shows(explorer, data, 0, 0, layer, head, 1)
    explorer.locator(f"{THUMB}[aria-pressed='true']").focus()
    page.keyboard.press("ArrowDown")
    assert_shows(explorer, data, 0, 0, min(layer + 1, 5), head, 1)
    page.keyboard.press("ArrowRight")
    assert_shows(explorer, data, 0, 0, min(layer + 1, 5), min(head + 1, 11), 1)
    assert page.console_errors == []


def test_explorer_works_after_instant_navigation(page, site_url):
    explorer, data = open_explorer(page, site_url)
    page.evaluate("window.__explorerTestMarker = 1")  # survives only if no full reload happens
    page.locator("a.md-footer__link--next").click()  # to page 2, by Material's instant navigation
    page.wait_for_url("**/tutorial/02-qkv/")
    page.locator(EXPLORER).first.wait_for(state="detached")
    page.locator("a.md-footer__link--prev").click()  # and back
    page.wait_for_url("**/tutorial/01-intuition/")
    assert page.evaluate("window.__explorerTestMarker") == 1, "navigation reloaded the page: not instant"
    explorer = page.locator(EXPLORER).first
    explorer.wait_for()
    page.wait_for_function(
        "sel => document.querySelector(sel)?.dataset.explorerReady === 'true'", arg=EXPLORER
    )
    assert json.loads(explorer.get_attribute("data-attention")) == data
    explorer.locator(TOKEN).nth(2).click()
    explorer.locator(f"{THUMB}[data-layer='5'][data-head='7']").click()
    assert_shows(explorer, data, 0, 0, 5, 7, 2)
    assert explorer.locator(THUMB).count() == 72  # drawn once
    assert page.console_errors == []


def _luminance(rgb):
    def channel(c):
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


_COLOURS = """el => {
    const rgb = c => c.match(/[\\d.]+/g).slice(0, 3).map(Number);
    let bg = el, b = getComputedStyle(bg).backgroundColor;
    while (bg && (b === 'rgba(0, 0, 0, 0)' || b === 'transparent' || b.startsWith('linear'))) {
        bg = bg.parentElement; b = bg ? getComputedStyle(bg).backgroundColor : 'rgb(255, 255, 255)';
    }
    return [rgb(getComputedStyle(el).color), rgb(b)];
}"""


@pytest.mark.parametrize("scheme", ["default", "slate"])
def test_explorer_is_readable_in_both_schemes(page, site_url, scheme):
    explorer, _ = open_explorer(page, site_url)
    page.evaluate("s => document.body.setAttribute('data-md-color-scheme', s)", scheme)
    explorer.locator(TOKEN).nth(1).click()
    for selector in ("td.attention-explorer-score", "th.attention-explorer-label",
                     ".attention-explorer-direction-button[aria-pressed='true']",
                     ".attention-explorer-direction-button[aria-pressed='false']"):
        fg, bg = (_luminance(c) for c in explorer.locator(selector).first.evaluate(_COLOURS))
        contrast = (max(fg, bg) + 0.05) / (min(fg, bg) + 0.05)
        assert contrast >= 4.5, (scheme, selector, contrast)  # WCAG AA for body text


@pytest.mark.parametrize("width", [390, 1280])
def test_explorer_fits_the_column(page, site_url, width):
    page.set_viewport_size({"width": width, "height": 900})
    explorer, _ = open_explorer(page, site_url)
    for model, sentence in ((0, "1"), (1, "0")):  # the longest sentence; the model with a mask column
        if model:
            explorer.locator("select.attention-explorer-model").select_option("1")
        explorer.locator("select.attention-explorer-sentence").select_option(sentence)
        explorer.locator(TOKEN).nth(3).click()
        sizes = explorer.evaluate(
            """el => ({
                overflow: el.scrollWidth - el.clientWidth,
                page: document.documentElement.scrollWidth - document.documentElement.clientWidth,
                cells: [...el.querySelectorAll('table.attention-explorer-table tr > *')].filter(
                    c => c.scrollWidth > c.clientWidth + 1).map(c => c.textContent),
                thumbs: [...el.querySelectorAll('.attention-explorer-thumb-map')].map(
                    s => s.getBoundingClientRect().width),
                text: [...el.querySelectorAll('label, select, td, th, button.attention-explorer-token')].map(
                    s => parseFloat(getComputedStyle(s).fontSize)),
            })"""
        )
        assert sizes["overflow"] <= 0 and sizes["page"] <= 0, sizes
        assert sizes["cells"] == [], sizes["cells"]  # no number or header cut off
        assert min(sizes["thumbs"]) >= 18, sizes["thumbs"]  # 12 heads a row on a phone
        assert min(sizes["text"]) >= 11, sizes["text"]
    assert page.console_errors == []
