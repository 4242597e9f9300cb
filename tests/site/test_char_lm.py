"""The language model of page 11 in the browser (docs/javascripts/char-lm.js), in headless Chromium.

- The JavaScript forward pass gives the logits of the package's model (torch, float32) to 1e-4
  on 20 prompts, at every position; a run that reuses an earlier one's keys and values (the
  widget's cache) gives the logits of a run from scratch.
- Typing redraws the next-character bars, the 4 x 4 attention maps and the shaded text; a
  character outside the vocabulary gets a visible message and never a NaN; an empty box shows
  a prompt; temperature 0 puts everything on one character.
- Generate adds characters one at a time and Stop stops it; the controls are reachable by Tab;
  the box follows what it generates; an empty or wrong top-k samples among every character and
  says so; an empty box disables Next and Generate; the controls read at 4.5:1 in both schemes.
- The chosen head's map, drawn large, gives the weight of the cell under the pointer (torch's,
  to 1e-4) at 128 characters; a head tapped on a phone brings the text it shades into view.
- The widget fits a 390 px phone; no console error.
- The "step through" panel: the JavaScript trace of one position, layer and head gives every
  stage of attention_ref.lm.forward_trace (float64, the same float16 weights) to 1e-5; the panel
  opens and is driven by keyboard, shows those numbers, reads in both schemes and never makes a
  390 px page scroll sideways.
- Heads switched off: the JavaScript forward pass with heads off gives the logits of the package's
  model with those heads ablated (``ablate=``), and its loss on the text their cross-entropy; the
  widget's switches do that, say it, and "All heads on" undoes it.
Fixtures (``site_url``, ``page``) come from tests/site/conftest.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from attention_ref import lm
from test_map_slider import _luminance  # WCAG's relative luminance of an sRGB colour


def _contrast(a, b) -> float:
    """WCAG's contrast ratio of two sRGB colours, 1 to 21."""
    a, b = _luminance(a), _luminance(b)
    return (max(a, b) + 0.05) / (min(a, b) + 0.05)

PAGE = "tutorial/11-language-model/"
WIDGET = "div.charlm"
MANIFEST = "assets/char-lm/char-lm.json"

PROMPTS = [
    "T", "To be, or not to be", "HAMLET.\n", "ROMEO.\nBut soft, what light through yonder window",
    "  ", "\n\n", "Enter MACBETH", "[Exit.]", "What, ho! Horatio!", "O Romeo, Romeo!",
    "zzzz", "Friends, Romans, countrymen, lend me your ears;", "KING LEAR.\nNothing will come",
    "If music be the food of love, play on;", "?!", "The lady doth protest too much, methinks.",
    "Is this a dagger which I see before me,", "a" * 128, "OTHELLO.\nIt is the cause",
    "Lord, what fools these mortals be!",
]


@pytest.fixture(scope="module")
def model():
    return lm.load_char_lm()


def open_widget(page, site_url: str):
    page.goto(site_url + PAGE)
    widget = page.locator(WIDGET).first
    widget.wait_for()
    page.wait_for_function("sel => document.querySelector(sel)?.dataset.loaded === '1'", arg=WIDGET)
    return widget


def test_javascript_logits_equal_torch(page, site_url: str, model):
    net, tok, _ = model
    assert len(PROMPTS) >= 20
    page.goto(site_url + PAGE)
    got = page.evaluate(
        """async ([url, prompts]) => {
            const m = await window.attentionRefCharLM.load(url);
            return prompts.map((p) => Array.from(m.run(m.encode(p).ids).logits));
        }""",
        [site_url + MANIFEST, PROMPTS],
    )
    worst = 0.0
    for prompt, logits in zip(PROMPTS, got):
        ids = tok.encode(prompt)[None]
        with torch.no_grad():
            expected = net(ids)[0].numpy()  # (L, V), float32
        js = np.array(logits).reshape(expected.shape)
        worst = max(worst, float(np.abs(js - expected).max()))
    assert worst < 1e-4, f"largest |JS - torch| logit difference {worst:.2e}"


def test_javascript_cache_equals_a_fresh_run(page, site_url: str):
    page.goto(site_url + PAGE)
    gap = page.evaluate(
        """async (url) => {
            const m = await window.attentionRefCharLM.load(url);
            const ids = m.encode("To be, or not to be, that is the question").ids;
            const first = m.run(ids.slice(0, 20));
            const grown = m.run(ids, first);
            const fresh = m.run(ids);
            let worst = 0;
            for (let i = 0; i < fresh.logits.length; i++) worst = Math.max(worst, Math.abs(grown.logits[i] - fresh.logits[i]));
            const L = ids.length;
            for (let l = 0; l < m.layers; l++) for (let h = 0; h < m.H; h++) for (let i = 0; i < L * L; i++)
                worst = Math.max(worst, Math.abs(grown.weights[l][h][i] - fresh.weights[l][h][i]));
            return [grown.computed, worst];
        }""",
        site_url + MANIFEST,
    )
    computed, worst = gap
    assert computed == len("To be, or not to be, that is the question") - 20
    assert worst < 1e-12


def test_manifest_is_the_shipped_model(built_site, model):
    net, tok, _ = model
    manifest = json.loads((built_site / MANIFEST).read_text())
    assert manifest["chars"] == tok.chars
    assert manifest["numbers"] == net.num_parameters()
    assert (built_site / "assets/char-lm" / manifest["weights"]).stat().st_size == 2 * net.num_parameters()


def test_typing_redraws_everything(page, site_url: str):
    widget = open_widget(page, site_url)
    box = widget.locator("textarea")
    box.fill("")
    box.type("To be, or not to b")
    page.wait_for_function("sel => document.querySelector(sel).querySelectorAll('.charlm-token').length === 18", arg=WIDGET)
    bars = widget.locator(".charlm-probs li")
    assert bars.count() == 10
    first = bars.first.locator(".charlm-char").text_content()
    assert first == "e"  # "To be, or not to b" -> "e"
    assert widget.locator(".charlm-map").count() == 16
    assert widget.locator(".charlm-map canvas").first.get_attribute("width") == "18"
    weights = [float(w) for w in widget.locator(".charlm-token").evaluate_all("s => s.map(x => x.dataset.weight)")]
    assert abs(sum(weights) - 1) < 1e-3
    # another head: the shaded text changes
    widget.locator(".charlm-map").nth(5).click()
    assert widget.locator(".charlm-map[aria-pressed='true']").get_attribute("aria-label") == "layer 1, head 1"
    other = [float(w) for w in widget.locator(".charlm-token").evaluate_all("s => s.map(x => x.dataset.weight)")]
    assert other != weights
    assert not page.console_errors


def test_unknown_characters_and_empty_input(page, site_url: str):
    widget = open_widget(page, site_url)
    box = widget.locator("textarea")
    box.fill("héllo — 1€")
    status = widget.locator(".charlm-status")
    page.wait_for_function("sel => document.querySelector(sel).dataset.unknown === '3'", arg=WIDGET)
    assert "3 characters are not in the model's vocabulary" in status.text_content()
    assert "“é” (at 1)" in status.text_content()
    text = widget.text_content()
    assert "NaN" not in text
    assert widget.locator(".charlm-probs li").count() == 10
    box.fill("")
    page.wait_for_function("sel => document.querySelector(sel).dataset.unknown === '0'", arg=WIDGET)
    assert "Type some text above" in status.text_content()
    assert widget.locator(".charlm-probs li").count() == 0
    assert not page.console_errors


def test_temperature_zero_is_certain(page, site_url: str):
    widget = open_widget(page, site_url)
    widget.locator(".charlm-controls input[type=range]").fill("0")
    assert widget.locator(".charlm-probs li").count() == 1
    assert widget.locator(".charlm-probs .charlm-p").first.text_content() == "100.0%"
    widget.locator(".charlm-controls input[type=range]").fill("1.5")
    assert widget.locator(".charlm-probs li").count() == 10


def test_generate_adds_characters_and_stops(page, site_url: str):
    widget = open_widget(page, site_url)
    box = widget.locator("textarea")
    box.fill("HAMLET.\n")
    page.wait_for_function("sel => document.querySelector(sel).querySelectorAll('.charlm-token').length === 8", arg=WIDGET)
    widget.get_by_role("button", name="Generate 60").click()
    page.wait_for_function("sel => document.querySelector(sel + ' textarea').value.length >= 14", arg=WIDGET)
    widget.get_by_role("button", name="Stop").click()
    page.wait_for_function("sel => document.querySelector(sel).dataset.generating === '0'", arg=WIDGET)
    stopped = box.input_value()
    page.wait_for_timeout(300)
    assert box.input_value() == stopped and stopped.startswith("HAMLET.\n") and len(stopped) >= 14
    tokens = widget.locator(".charlm-token").count()
    assert tokens == len(stopped)
    widget.get_by_role("button", name="Next character").click()
    assert len(box.input_value()) == len(stopped) + 1
    assert not page.console_errors


def test_keyboard_reaches_the_controls(page, site_url: str):
    widget = open_widget(page, site_url)
    widget.locator("textarea").focus()
    labels = []
    for _ in range(5):
        page.keyboard.press("Tab")
        labels.append(page.evaluate("document.activeElement.getAttribute('aria-label') || document.activeElement.textContent"))
    assert labels[:4] == ["Sampling temperature", "Sample among the k most likely characters", "Next character",
                          "Generate 60"]
    page.keyboard.press("Shift+Tab")
    page.keyboard.press("Enter")  # "Next character" by keyboard
    page.wait_for_function("sel => document.querySelector(sel + ' textarea').value.length > 0", arg=WIDGET)


def test_fits_a_phone(page, site_url: str):
    page.set_viewport_size({"width": 390, "height": 800})
    widget = open_widget(page, site_url)
    box = widget.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    maps = widget.locator(".charlm-map").first.bounding_box()
    assert maps["width"] >= 40
    assert not page.console_errors


#: The start of a function ``(widget, scheme) => ...`` that reads colours: the scheme set, transitions
#: off (Material's buttons fade to a new colour in 125 ms, longer on a loaded machine: what is read is
#: the colour they settle on), ``page`` the page's background and ``over(c, under)`` a colour with an
#: alpha as the eye sees it over ``under``.
IN_SCHEME = """(widget, scheme) => {
  const still = document.createElement('style');
  still.textContent = '* { transition: none !important; }';
  document.head.append(still);
  document.body.setAttribute('data-md-color-scheme', scheme);
  const page = getComputedStyle(document.body).backgroundColor.match(/[\\d.]+/g).slice(0, 3).map(Number);
  const over = (c, under) => {
    const [r, g, b, a = 1] = c.match(/[\\d.]+/g).map(Number);
    return [r, g, b].map((x, k) => a * x + (1 - a) * under[k]);
  };
"""

BUTTON_COLOURS = IN_SCHEME + """  return Array.from(widget.querySelectorAll('.charlm-controls button:not(:disabled), .charlm-controls input[type=number]'))
    .map((b) => {
      const style = getComputedStyle(b);
      const background = over(style.backgroundColor, page);
      return { name: b.textContent || b.getAttribute('aria-label'), text: over(style.color, background), background };
    });
}"""


@pytest.mark.parametrize("scheme", ["default", "slate"])
def test_the_controls_read_in_both_schemes(page, site_url: str, scheme: str):
    widget = open_widget(page, site_url)
    controls = widget.evaluate(BUTTON_COLOURS, scheme)
    assert {c["name"] for c in controls} >= {"Next character", "Generate 60"}
    for control in controls:
        assert _contrast(control["text"], control["background"]) >= 4.5, (scheme, control)  # WCAG AA for text


CONTROL_EDGES = IN_SCHEME + """  return Array.from(widget.querySelectorAll('textarea, .charlm-controls input, .charlm-controls button:not(:disabled)'))
    .map((c) => {
      const style = getComputedStyle(c);
      // what marks the control's edge: its border (when drawn), its fill, a slider's accent colour
      const edges = [over(style.backgroundColor, page)];
      if (style.borderTopStyle !== 'none' && parseFloat(style.borderTopWidth) >= 1) edges.push(over(style.borderTopColor, page));
      // a slider's track and thumb take its accent colour; 'auto' is the browser's own: not known here
      if (c.type === 'range') edges.splice(0, 1, style.accentColor === 'auto' ? page : over(style.accentColor, page));
      return { name: c.tagName === 'BUTTON' ? c.textContent : c.type, page, edges };
    });
}"""


@pytest.mark.parametrize("scheme", ["default", "slate"])
def test_every_controls_edge_stands_out_from_the_page_in_both_schemes(page, site_url: str, scheme: str):
    """WCAG 1.4.11: the edge of each control (the text box, the slider, the number box, the buttons)
    differs from the page's background by at least 3:1, in its border, its fill or (a slider) its
    accent colour."""
    widget = open_widget(page, site_url)
    controls = widget.evaluate(CONTROL_EDGES, scheme)
    assert {c["name"] for c in controls} >= {"textarea", "range", "number", "Next character", "Generate 60"}
    for control in controls:
        best = max(_contrast(edge, control["page"]) for edge in control["edges"])
        assert best >= 3, (scheme, control["name"], round(best, 2), control)


def test_a_cleared_or_wrong_top_k_samples_among_every_character_and_says_so(page, site_url: str):
    widget = open_widget(page, site_url)
    status, top_k = widget.locator(".charlm-status"), widget.locator("input[type=number]")
    widget.locator(".charlm-controls input[type=range]").fill("1.5")
    top_k.fill("1")
    assert widget.locator(".charlm-probs li").count() == 1  # one character kept: certain
    top_k.fill("")
    assert "top-k is empty: sampling among all characters" in status.text_content()
    assert widget.locator(".charlm-probs li").count() == 10  # the ten likeliest of all 73 shown
    top_k.fill("-3")
    assert "top-k must be a whole number of at least 1 (got “-3”)" in status.text_content()
    assert top_k.get_attribute("aria-invalid") == "true"
    assert widget.locator(".charlm-probs li").count() == 10
    top_k.fill("5")
    assert "top-k" not in status.text_content() and top_k.get_attribute("aria-invalid") == "false"
    assert widget.locator(".charlm-probs li").count() == 5


def test_an_empty_box_leaves_nothing_to_continue(page, site_url: str):
    widget = open_widget(page, site_url)
    buttons = [widget.get_by_role("button", name=name) for name in ("Next character", "Generate 60")]
    assert all(b.is_enabled() for b in buttons)
    widget.locator("textarea").fill("")
    page.wait_for_function("sel => document.querySelector(sel + ' .charlm-probs').childElementCount === 0", arg=WIDGET)
    assert not any(b.is_enabled() for b in buttons)
    widget.locator("textarea").fill("ROMEO.\n")
    page.wait_for_function("sel => document.querySelector(sel + ' .charlm-probs').childElementCount > 0", arg=WIDGET)
    assert all(b.is_enabled() for b in buttons)


def test_the_box_follows_the_text_it_generates(page, site_url: str):
    widget = open_widget(page, site_url)
    box = widget.locator("textarea")
    box.fill("HAMLET.\n" * 12)  # taller than the box: it scrolls
    page.wait_for_function("sel => document.querySelector(sel).dataset.unknown === '0'", arg=WIDGET)
    box.evaluate("b => { b.scrollTop = 0; }")
    widget.get_by_role("button", name="Next character").click()
    gap = box.evaluate("b => b.scrollHeight - b.clientHeight - b.scrollTop")
    assert gap <= 1, f"the box shows {gap} px above its end: the new character is out of view"


def test_a_tapped_head_on_a_phone_shows_the_text_it_shades(page, site_url: str):
    page.set_viewport_size({"width": 390, "height": 700})
    widget = open_widget(page, site_url)
    last = widget.locator(".charlm-map").last
    last.scroll_into_view_if_needed()
    assert page.evaluate("() => document.querySelector('.charlm-focus').getBoundingClientRect().bottom < 0")
    last.click()
    shaded = page.evaluate("() => { const r = document.querySelector('.charlm-focus').getBoundingClientRect();"
                           " return [r.top, r.bottom, window.innerHeight]; }")
    assert shaded[0] >= 0 and shaded[0] < shaded[2], f"the shaded text is off screen after the tap: {shaded}"
    assert widget.locator(".charlm-focus-title").text_content().startswith("Layer 3, head 3")


def test_past_the_context_the_window_jumps_as_lm_says_and_reads_what_torch_reads(page, site_url: str, model):
    """Past 128 characters the widget reads from `lm.widget_window_start`: its window jumps 64 at a time,
    and what it shows is the model's reading of exactly those characters, typed one by one across a jump
    (each reusing the keys and values of the run before it) or pasted at once."""
    net, tok, _ = model
    widget = open_widget(page, site_url)
    for context in (128, 64):  # page 11's model, the copy model
        starts = page.evaluate(
            "([n, c]) => Array.from({length: n}, (_, i) => window.attentionRefCharLM.windowStart(i, c))", [600, context])
        assert starts == [lm.widget_window_start(n, context) for n in range(600)]
    text = ("O Romeo, Romeo! wherefore art thou Romeo? Deny thy father and refuse thy name; " * 3)[:200]
    box = widget.locator("textarea")
    box.fill(text[:188])
    box.type(text[188:])  # across the jump at 193: the window starts at 64, then at 128
    page.wait_for_function("sel => document.querySelector(sel).querySelectorAll('.charlm-token').length === 72", arg=WIDGET)
    start = lm.widget_window_start(len(text))
    assert start == 128 and widget.get_attribute("data-window-start") == "128"
    assert "reads the last 72 characters" in widget.locator(".charlm-status").text_content()
    widget.get_by_role("button", name="layer 1, head 2").click()
    shown = [float(w) for w in widget.locator(".charlm-token").evaluate_all("s => s.map(x => x.dataset.weight)")]
    ids = tok.encode(text[start:])[None]
    with torch.no_grad():
        _, weights = net(ids, return_weights=True)
    expected = weights[1][0, 2, -1].tolist()  # the last character's weights in layer 1, head 2
    assert max(abs(a - b) for a, b in zip(shown, expected, strict=True)) < 1e-4
    assert not page.console_errors


@pytest.mark.parametrize("width", [390, 1280])
def test_the_chosen_heads_map_is_readable_at_any_length_and_gives_each_weight(page, site_url: str, model, width):
    net, tok, _ = model
    page.set_viewport_size({"width": width, "height": 900})
    widget = open_widget(page, site_url)
    # 192 characters: the window starts at 64 (lm.widget_window_start) and reads the last 128
    text = ("ROMEO.\nBut soft, what light through yonder window breaks? " * 4)[:192]
    widget.locator("textarea").fill(text)
    page.wait_for_function("sel => document.querySelector(sel).querySelectorAll('.charlm-token').length === 128", arg=WIDGET)
    widget.get_by_role("button", name="layer 1, head 2").click()
    zoom = widget.locator("canvas.charlm-zoom")
    box = zoom.bounding_box()
    assert box["width"] >= 300 and abs(box["width"] - box["height"]) <= 1, box  # 2 px or more per cell at 128
    ids = tok.encode(text[64:])[None]
    with torch.no_grad():
        _, weights = net(ids, return_weights=True)
    for i, j in ((127, 126), (90, 3), (64, 64), (10, 50)):
        zoom.hover(position={"x": (j + 0.5) * box["width"] / 128, "y": (i + 0.5) * box["height"] / 128})
        value = widget.locator(".charlm-zoom-value")
        assert value.get_attribute("data-cell") == f"{i},{j}"
        expected = float(weights[1][0, 2, i, j]) if j <= i else 0.0
        assert abs(float(value.get_attribute("data-weight")) - expected) < 1e-4, (i, j, expected)
        assert f"(position {i})" in value.text_content() and f"(position {j})" in value.text_content()
    assert not page.console_errors


#: (text, position, layer, head) traced in both languages: several texts and positions (the first
#: character, the last of a full window, one in the middle), every layer and head at least once.
TRACES = [
    ("To be, or not to b", 17, 0, 0), ("To be, or not to b", 5, 3, 2), ("T", 0, 2, 1), ("HAMLET.\n", 7, 0, 1),
    ("ROMEO.\nBut soft, what light through yonder window", 40, 1, 3), ("a" * 128, 127, 3, 3),
    ("Is this a dagger which I see before me,", 20, 2, 2), ("What, ho! Horatio!", 11, 1, 0),
]


def test_javascript_trace_equals_forward_trace(page, site_url: str, model):
    net, tok, _ = model
    assert {layer for _, _, layer, _ in TRACES} == {0, 1, 2, 3} and {h for *_, h in TRACES} == {0, 1, 2, 3}
    page.goto(site_url + PAGE)
    got = page.evaluate(
        """async ([url, cases]) => {
            const m = await window.attentionRefCharLM.load(url);
            return cases.map(([text, position, layer, head]) => Object.entries(
                m.trace(m.encode(text).ids, position, layer, head)).map(([k, v]) => [k, typeof v === "number" ? v : Array.from(v)]));
        }""",
        [site_url + MANIFEST, TRACES],
    )
    for (text, position, layer, head), stages in zip(TRACES, got):
        expected = lm.forward_trace(net, tok.encode(text), position, layer, head)
        assert [name for name, _ in stages] == list(expected), (text, position)
        for name, value in stages:
            want = expected[name].numpy()
            js = np.array(value, dtype=np.float64).reshape(want.shape)
            gap = float(np.abs(js - want).max()) if want.size else 0.0
            assert gap < 1e-5, f"{text!r} position {position}, layer {layer} head {head}: {name} differs by {gap:.2e}"


STEP_EDGES = IN_SCHEME + """  return Array.from(widget.querySelectorAll('.charlm-step-controls select, .charlm-step-controls input'))
    .map((c) => {
      const style = getComputedStyle(c);
      const edges = [over(style.backgroundColor, page)];
      if (style.borderTopStyle !== 'none' && parseFloat(style.borderTopWidth) >= 1) edges.push(over(style.borderTopColor, page));
      if (c.type === 'range') edges.splice(0, 1, style.accentColor === 'auto' ? page : over(style.accentColor, page));
      const text = over(style.color, edges[0]);
      return { name: c.getAttribute('aria-label'), page, edges, text, fill: edges[0] };
    });
}"""


def _stage_norms(widget) -> dict[str, float]:
    return dict(widget.locator(".charlm-step .charlm-vec").evaluate_all(
        "vs => vs.map(v => [v.dataset.name, Number(v.dataset.norm)])"))


def test_step_panel_opens_by_keyboard_shows_the_trace_and_fits_a_phone(page, site_url: str, model):
    net, tok, _ = model
    page.set_viewport_size({"width": 390, "height": 800})
    widget = open_widget(page, site_url)
    text = "To be, or not to b"
    widget.locator("textarea").fill(text)
    page.wait_for_function("sel => document.querySelector(sel).querySelectorAll('.charlm-token').length === 18", arg=WIDGET)
    assert widget.locator(".charlm-step").is_hidden()
    widget.locator("textarea").focus()
    for _ in range(8):  # the controls after the box, then the panel's button
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.classList.contains('charlm-step-toggle')"):
            break
    else:
        raise AssertionError("Tab never reached the step-through button")
    page.keyboard.press("Enter")
    toggle = widget.locator(".charlm-step-toggle")
    assert toggle.get_attribute("aria-expanded") == "true"
    panel = widget.locator(".charlm-step")
    assert panel.is_visible() and panel.get_attribute("data-position") == "17"  # the last character at first
    assert widget.locator(".charlm-stage").evaluate_all("s => s.map(x => x.dataset.stage)") == [
        "embedding", "norm1", "qkv", "rope", "scores", "weights", "head_output", "out", "residual", "mlp",
        "final_norm", "probabilities"]
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    box = panel.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390, box

    def shown_equals_python(position: int, layer: int, head: int) -> None:
        expected = lm.forward_trace(net, tok.encode(text), position, layer, head)
        for name, value in _stage_norms(widget).items():
            assert abs(value - float(expected[name].norm())) < 1e-5, (position, layer, head, name)

    shown_equals_python(17, 0, 0)
    # the keyboard moves the character (slider) and picks the layer (menu)
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.getAttribute('aria-label')") == "Position of the character traced"
    page.keyboard.press("ArrowLeft")
    page.wait_for_function("() => document.querySelector('.charlm-step').dataset.position === '16'")
    assert "“␣”" in widget.locator(".charlm-step-pos").text_content()
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.getAttribute('aria-label')") == "Layer traced"
    page.keyboard.press("ArrowDown")
    page.wait_for_function("() => document.querySelector('.charlm-map[aria-pressed=true]').getAttribute('aria-label')"
                           " === 'layer 1, head 0'")
    assert "block_input" in _stage_norms(widget)  # past layer 0, the residual stream is its own stage
    shown_equals_python(16, 1, 0)
    # a whole window of text (192 characters: the last 128 read), every stage open: still no sideways scroll
    widget.locator("textarea").fill(("ROMEO.\nBut soft, what light through yonder window breaks? " * 4)[:192])
    widget.get_by_label("Position of the character traced").press("End")
    page.wait_for_function("() => document.querySelector('.charlm-step').dataset.position === '127'")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    toggle.focus()
    page.keyboard.press("Space")
    assert toggle.get_attribute("aria-expanded") == "false" and panel.is_hidden()
    assert not page.console_errors


@pytest.mark.parametrize("scheme", ["default", "slate"])
def test_step_panel_controls_read_in_both_schemes(page, site_url: str, scheme: str):
    widget = open_widget(page, site_url)
    widget.locator(".charlm-step-toggle").click()
    controls = widget.evaluate(STEP_EDGES, scheme)
    assert {c["name"] for c in controls} == {"Position of the character traced", "Layer traced", "Head traced"}
    for control in controls:
        assert max(_contrast(edge, control["page"]) for edge in control["edges"]) >= 3, (scheme, control)
        if control["name"] != "Position of the character traced":  # the menus' text
            assert _contrast(control["text"], control["fill"]) >= 4.5, (scheme, control)


OFF = [[], [[0, 1]], [[1, 0], [2, 3]], [[3, 0], [3, 1], [3, 2], [3, 3]]]


def test_heads_switched_off_in_javascript_equal_lm_ablate(page, site_url: str, model):
    net, tok, _ = model
    texts = ["To be, or not to be, that is the question", "MACBETH.\nIs this a dagger which I see", "KING LEAR.\nNo"]
    page.goto(site_url + PAGE)
    got = page.evaluate(
        """async ([url, texts, offs]) => {
            const m = await window.attentionRefCharLM.load(url);
            return texts.flatMap((t) => offs.map((off) => {
                const run = m.run(m.encode(t).ids, null, null, off);
                return [Array.from(run.logits), m.loss(run)];
            }));
        }""",
        [site_url + MANIFEST, texts, OFF],
    )
    pairs = iter(got)
    for text in texts:
        ids = tok.encode(text)[None]
        for off in OFF:
            logits, loss = next(pairs)
            with torch.no_grad():
                expected = net(ids, ablate=[tuple(p) for p in off])[0]  # (L, V)
            gap = float(np.abs(np.array(logits).reshape(expected.shape) - expected.numpy()).max())
            assert gap < 1e-4, (text, off, gap)
            expected_loss = float(torch.nn.functional.cross_entropy(expected[:-1], ids[0, 1:]))
            assert abs(loss - expected_loss) < 1e-4, (text, off, loss, expected_loss)
    # switching heads off changes what the model predicts
    assert got[1][0] != got[0][0] and got[3][1] != got[0][1]
    # a head that does not exist is named, never ignored
    refused = page.evaluate(
        """async (url) => {
            const m = await window.attentionRefCharLM.load(url);
            return [[4, 0], [0, 4], [-1, 0], [0.5, 1], 3].map((pair) => {
                try { m.run(m.encode("To be").ids, null, null, [pair]); return "ran"; }
                catch (error) { return error.message; }
            });
        }""",
        site_url + MANIFEST,
    )
    assert all(r.startswith("off: no head ") and "in 4 layers x 4 heads" in r for r in refused), refused


def test_the_widget_switches_heads_off_and_says_what_it_costs(page, site_url: str, model):
    net, tok, _ = model
    widget = open_widget(page, site_url)
    text = "To be, or not to be, that is the question"
    before = widget.get_attribute("data-loss")  # the page's own prompt's
    widget.locator("textarea").fill(text)
    page.wait_for_function("([sel, old]) => document.querySelector(sel).dataset.loss !== old", arg=[WIDGET, before])
    ids = tok.encode(text)[None]

    def python_loss(off):
        with torch.no_grad():
            logits = net(ids, ablate=off)[0]
        return float(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]))

    assert abs(float(widget.get_attribute("data-loss")) - python_loss([])) < 1e-4
    switch = widget.locator('[aria-label="switch head 2 of layer 1 off"]')
    switch.focus()
    page.keyboard.press("Enter")  # by keyboard: the switch is a button
    page.wait_for_function("sel => document.querySelector(sel).dataset.off === '[[1,2]]'", arg=WIDGET)
    assert widget.locator('[aria-label="switch head 2 of layer 1 off"]').get_attribute("aria-pressed") == "true"
    assert abs(float(widget.get_attribute("data-loss")) - python_loss([(1, 2)])) < 1e-4
    status = widget.locator(".charlm-loss").inner_text()
    assert "with 1 head off (every head on: " in status and f"{python_loss([]):.3f}" in status
    widget.locator('[aria-label="switch head 0 of layer 3 off"]').click()
    assert abs(float(widget.get_attribute("data-loss")) - python_loss([(1, 2), (3, 0)])) < 1e-4
    widget.locator(".charlm-all-on").click()
    assert abs(float(widget.get_attribute("data-loss")) - python_loss([])) < 1e-4
    assert widget.locator('.charlm-switch[aria-pressed="true"]').count() == 0
    assert page.evaluate("document.documentElement.scrollWidth") <= page.viewport_size["width"]
    assert page.console_errors == []


COPY_MANIFEST = "assets/char-lm/copy-lm.json"


def test_the_copy_model_in_javascript_equals_torch(page, site_url: str, built_site):
    """The second widget's model, page 11's copy model (two layers of two heads, no MLP, 64 characters):
    its manifest is the shipped model, and the JavaScript's logits are torch's, heads on and off."""
    net, tok, _ = lm.load_char_lm("copy")
    manifest = json.loads((built_site / COPY_MANIFEST).read_text())
    assert manifest["config"]["mlp"] is False and manifest["numbers"] == net.num_parameters()
    texts = ["kq3v!m.Xz,wR;Te Jh?bQ pL kq3v!m.Xz,wR;Te Jh?bQ", "HAMLET.\nTo be, or not to be HAMLET.\nTo be"]
    offs = [[], [[1, 0]], [[0, 1], [1, 1]]]
    page.goto(site_url + PAGE)
    got = page.evaluate(
        """async ([url, texts, offs]) => {
            const m = await window.attentionRefCharLM.load(url);
            return texts.map((t) => offs.map((off) => Array.from(m.run(m.encode(t).ids, null, null, off).logits)));
        }""",
        [site_url + COPY_MANIFEST, texts, offs],
    )
    worst = 0.0
    for text, per_off in zip(texts, got):
        ids = tok.encode(text)[None]
        for off, logits in zip(offs, per_off):
            with torch.no_grad():
                expected = net(ids, ablate=[tuple(p) for p in off])[0].numpy()
            worst = max(worst, float(np.abs(np.array(logits).reshape(expected.shape) - expected).max()))
    assert worst < 1e-4, f"largest |JS - torch| logit difference {worst:.2e}"


def test_the_copy_widget_loses_its_copying_when_a_head_is_off(page, site_url: str):
    """Page 11's second widget opens on a span written twice; its loss line is the copy model's loss on
    that text, every head on and with a head switched off, as `CharLM(..., ablate=)` gives it."""
    net, tok, _ = lm.load_char_lm("copy")
    page.goto(site_url + PAGE)
    widget = page.locator(WIDGET).nth(1)
    widget.wait_for()
    page.wait_for_function("sel => document.querySelectorAll(sel)[1]?.dataset.loaded === '1'", arg=WIDGET)
    ids = tok.encode(widget.locator("textarea").input_value())[None]
    assert ids.shape[1] == 58  # the page's text: a span of 20 written twice

    def python_loss(off):
        with torch.no_grad():
            logits = net(ids, ablate=off)[0]
        return float(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:]))

    assert abs(float(widget.get_attribute("data-loss")) - python_loss([])) < 1e-4
    widget.locator('[aria-label="switch head 0 of layer 1 off"]').click()
    page.wait_for_function("sel => document.querySelectorAll(sel)[1].dataset.off === '[[1,0]]'", arg=WIDGET)
    off = float(widget.get_attribute("data-loss"))
    assert abs(off - python_loss([(1, 0)])) < 1e-4 and off > python_loss([]) + 0.5
    assert page.console_errors == []
