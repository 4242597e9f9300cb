"""The attention explorer on the intuition page, driven in headless Chromium.

Every number the explorer shows (q.k, the scaled score, the causal mask, exp(s - max), the sum
and the softmax) after a click, the direction toggle, a model, sentence, layer or head switch, a
thumbnail click or a keyboard move must equal the JSON that attention_ref embedded in the page
when the site was built, and each weight shown must be its exp divided by its sum; that JSON
must equal the package's own computation (the softmax of the scaled scores is the weights, and
the weights are all-MiniLM-L6-v2's); the caption must follow the model chosen; the explorer must
fit a 390 px phone (no cell cut, tap targets of 44 px, the table brought into view after a tap)
and keep working after Material's instant navigation.
Fixtures (``site_url``, ``page``) come from tests/site/conftest.py.
"""

from __future__ import annotations

import base64
import json
import urllib.parse

import numpy as np
import pytest

PAGE = "tutorial/01-intuition/"
EXPLORER = "div.attention-explorer"
TOKEN = "button.attention-explorer-token"
THUMB = "button.attention-explorer-thumb"
ROW = "tr.attention-explorer-row"
MINUS = "\u2212"
ROUNDING = 5e-4  # the table shows 3 decimals
# The exps come from the embedded scores (in steps of 0.01), the weights from the embedded
# weights (steps of 1e-4): softmax of the first differs from the second by up to 4.3e-4 here.
QUANTISED = 5e-4
PHONE = {"width": 390, "height": 844}


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
            for c in ("label", "score", "scaled", "masked", "exp", "sum", "value")}


def softmax_steps(model: dict, scores: np.ndarray, layer: int, head: int, query: int):
    """exp(s - max) for every key of one query's row, and their sum, from the embedded q.k."""
    s = scores[layer, head, query] * model["scale"]
    if model["causal"]:
        s = np.where(np.arange(len(s)) <= query, s, -np.inf)  # True = takes part
    e = np.exp(s - s.max())
    return e, e.sum()


def total_rows(explorer) -> list[dict[str, str]]:
    """The sum lines under the table: each one's exp and weight cells as shown."""
    return explorer.evaluate(TOTAL_ROWS)


#: The sum lines under the steps table (one when a row is shown, "attends to"; none for a column).
TOTAL_ROWS = """el => [...el.querySelectorAll('tr.attention-explorer-total')].map(r => ({
  exp: r.querySelector('.attention-explorer-exp').textContent,
  value: r.querySelector('.attention-explorer-value').textContent}))"""


def check_exp_over_sum(shown: dict[str, list[str]], totals: list[dict[str, str]], data, model: int, sentence: int,
                       layer: int, head: int, token: int, to=True):
    """The exp and sum columns (or the sum row) are the JSON's, and weight = exp / sum to rounding.
    ``shown``: the table's columns (`table`); ``totals``: its sum lines (`total_rows`)."""
    m = data["models"][model]
    w, scores = unpack(m, m["sentences"][sentence])
    L = len(shown["label"])
    exp = np.array(shown["exp"], float)
    weight = np.array(shown["value"], float)
    if to:
        e, total = softmax_steps(m, scores, layer, head, token)
        assert shown["sum"] == []  # one sum for the whole row: the last line
        assert len(totals) == 1, totals
        sums = np.full(L, float(totals[0]["exp"]))
        assert abs(sums[0] - total) <= ROUNDING + 1e-9, (sums[0], total)
        assert totals[0]["value"] == f"{w[layer, head, token].sum():.3f}"
    else:
        rows = [softmax_steps(m, scores, layer, head, i) for i in range(L)]  # each query its own row
        e = np.array([r[0][token] for r in rows])
        total = np.array([r[1] for r in rows])
        sums = np.array(shown["sum"], float)
        np.testing.assert_allclose(sums, total, atol=ROUNDING + 1e-9, rtol=0)
        assert totals == []
    np.testing.assert_allclose(exp, e, atol=ROUNDING + 1e-9, rtol=0)
    # what a reader checks by hand: the weight shown is the exp shown over the sum shown
    tolerance = ROUNDING + (ROUNDING + exp / sums * ROUNDING) / (sums - ROUNDING) + QUANTISED
    assert np.all(np.abs(weight - exp / sums) <= tolerance), np.abs(weight - exp / sums) - tolerance


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
        check_exp_over_sum(shown, total_rows(explorer), data, model, sentence, layer, head, token, to)


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
        assert min(sizes["thumbs"]) >= 40, sizes["thumbs"]  # a 44 px button around each map
        assert min(sizes["text"]) >= 11, sizes["text"]
    assert page.console_errors == []


# --- what a reader sees: captions, cut cells, bars, tap targets, the table after a tap, exp / sum ---


def switch(explorer, kind: str, value: int):
    explorer.locator(f"select.attention-explorer-{kind}").select_option(str(value))


def test_the_caption_follows_the_model(page, site_url):
    """The page captions the encoder only: the causal model must not show the encoder's caption."""
    explorer, data = open_explorer(page, site_url)
    caption = explorer.locator(".attention-explorer-caption")
    first = data["models"][0].get("caption")
    assert first and "all-MiniLM-L6-v2" in first
    assert caption.is_visible() and caption.text_content() == first
    switch(explorer, "model", 1)
    other = data["models"][1].get("caption")
    if other:
        assert caption.is_visible() and caption.text_content() == other
    else:
        assert not caption.is_visible()  # no caption rather than the encoder's
    assert not (caption.is_visible() and "MiniLM" in caption.text_content())
    switch(explorer, "model", 0)
    assert caption.is_visible() and caption.text_content() == first
    assert page.console_errors == []


def test_each_model_can_have_its_own_caption(page, site_url):
    """explorer_html takes a caption per model (other_models); the script swaps them."""
    viz = pytest.importorskip("attention_ref.viz")
    one = np.eye(3)[None]  # (H, L, L) = (1, 3, 3): each token on itself
    spec = {"sentences": {"x y z": (["x", "y", "z"], one)}}
    fragment = viz.explorer_html(["a", "b", "c"], one, caption="The first model.", element_id="cap",
                                 other_models={"second": {**spec, "caption": "The second model."},
                                               "third": spec})
    page.set_content(f"<!doctype html><html><body>{fragment}</body></html>")
    for script in ("widgets.js", "explorer.js"):  # the shared start-up, then the widget
        page.add_script_tag(url=urllib.parse.urljoin(site_url, f"javascripts/{script}"))
    page.wait_for_function("document.getElementById('cap').dataset.explorerReady === 'true'")
    caption = page.locator("#cap .attention-explorer-caption")
    shown = []
    for model in (0, 1, 2, 0):
        switch(page.locator("#cap"), "model", model)
        shown.append(caption.text_content() if caption.is_visible() else None)
    assert shown == ["The first model.", "The second model.", None, "The first model."]
    # a first model without a caption: the paragraph is there, hidden, for the others'
    fragment = viz.explorer_html(["a", "b", "c"], one, other_models={"second": {**spec, "caption": "Two."}})
    assert '<p class="attention-explorer-caption" hidden></p>' in fragment
    assert "attention-explorer-caption" not in viz.explorer_html(["a", "b", "c"], one)
    with pytest.raises(TypeError, match=r"other_models\['second'\] caption must be a str or None, got int"):
        viz.explorer_html(["a", "b", "c"], one, other_models={"second": {**spec, "caption": 1}})
    assert page.console_errors == []


def views(data):
    """(model, sentence, token) for the first, a middle and the last token of every sentence."""
    for m, model in enumerate(data["models"]):
        for s, sentence in enumerate(model["sentences"]):
            L = len(sentence["tokens"])
            for token in sorted({0, L // 2, L - 1}):
                yield m, s, token


#: The JavaScript both calls below share, inside a function of the explorer ``el``: ``menu(kind)``, its
#: select; ``show(m, s, token)`` sets the model and sentence menus (a change event only where the value
#: changes, as a reader's choice) and clicks the token.
SHOW_VIEW = """
  const menu = kind => el.querySelector(`select.attention-explorer-${kind}`);
  const choose = (kind, value) => {
    const select = menu(kind);
    if (Number(select.value) !== value) {
      select.value = String(value);
      select.dispatchEvent(new Event('change', {bubbles: true}));
    }
  };
  const show = (m, s, token) => {
    choose('model', m);
    choose('sentence', s);
    el.querySelectorAll('button.attention-explorer-token')[token].click();
  };"""


#: For each (model, sentence, token) of `views`: the menus set and the token clicked as a reader's
#: click would (the handlers run synchronously), then for each direction the cells of the steps table
#: whose text overflows (scrollWidth past clientWidth by more than 1 px), and whether the page is
#: wider than the window. In one call: a Playwright round trip per click cost 30 s for 66 views.
EVERY_VIEW_CUT = """(el, views) => {""" + SHOW_VIEW + """
  const cut = [], sideways = [];
  let seen = 0;
  for (const [m, s, token] of views) {
    show(m, s, token);
    for (const direction of ['to', 'by']) {
      el.querySelector(`.attention-explorer-direction-button[data-direction='${direction}']`).click();
      const cells = [...el.querySelectorAll('table.attention-explorer-table tr > *')];
      seen += cells.length;
      for (const c of cells) {
        const over = c.scrollWidth - c.clientWidth;
        if (over > 1) cut.push([m, s, token, direction, c.textContent, over]);
      }
    }
    const wide = [document.documentElement.scrollWidth, innerWidth];
    if (wide[0] > wide[1]) sideways.push([m, s, token, ...wide]);
  }
  return {seen, cut, sideways, shown: [Number(menu('model').value), Number(menu('sentence').value)]};
}"""


@pytest.mark.parametrize("width", [390, 1280])
def test_no_cell_is_cut(page, site_url, width):
    """Every cell of the steps table shows all of its text, for every sentence, both directions."""
    page.set_viewport_size({"width": width, "height": 900})
    explorer, data = open_explorer(page, site_url)
    every = list(views(data))
    result = explorer.evaluate(EVERY_VIEW_CUT, every)
    assert result["shown"] == list(every[-1][:2])  # the menus took the last view
    assert result["sideways"] == [], result["sideways"]  # the page never scrolls sideways
    assert result["seen"] > 1000 and result["cut"] == [], result["cut"]
    assert page.console_errors == []


@pytest.mark.parametrize("width", [390, 1280])
def test_the_weight_bar_leaves_the_digits_readable(page, site_url, width):
    """The bar of a weight is drawn beside or under its digits, never over them."""
    page.set_viewport_size({"width": width, "height": 900})
    explorer, data = open_explorer(page, site_url)
    boxes = []
    for token in range(len(data["models"][0]["sentences"][0]["tokens"])):
        explorer.locator(TOKEN).nth(token).click()
        boxes += explorer.evaluate(
            """el => [...el.querySelectorAll('tr.attention-explorer-row td.attention-explorer-value')].map(c => {
                const w = Number(c.closest('tr').dataset.weight);
                const bar = c.querySelector('.attention-explorer-bar');
                let b = bar && bar.getBoundingClientRect();
                if (!bar && getComputedStyle(c).backgroundImage !== 'none') {  // a bar painted in the cell
                    const r = c.getBoundingClientRect();
                    b = {left: r.left, right: r.left + w * r.width, top: r.top, bottom: r.bottom};
                }
                const range = document.createRange();
                range.selectNodeContents(c.querySelector('.attention-explorer-number') || c);
                const d = range.getBoundingClientRect();
                return {w, text: c.textContent, bar: b && [b.left, b.right, b.top, b.bottom],
                        digits: [d.left, d.right, d.top, d.bottom]};
            })""")
    strong = [b for b in boxes if b["w"] > 0.45]
    assert strong, "no weight above 0.45 to check"
    for b in strong:
        assert b["bar"] is not None, b
        (bl, br, bt, bb), (dl, dr, dt, db) = b["bar"], b["digits"]
        assert br - bl > 0 and dr - dl > 0, b
        apart = br <= dl or dr <= bl or bb <= dt or db <= bt
        assert apart, f"the bar covers the digits {b['text']}: bar {b['bar']}, digits {b['digits']}"
    assert page.console_errors == []


@pytest.mark.parametrize("width", [390, 1280])
def test_the_overview_has_tap_targets(page, site_url, width):
    """Every head's map is a button of at least 44 x 44 px; on a phone the overview scrolls in its
    own box (the page never sideways), showing the head that is open."""
    page.set_viewport_size({"width": width, "height": 844})
    explorer, data = open_explorer(page, site_url)
    for model in (0, 1):
        switch(explorer, "model", model)
        sizes = explorer.evaluate(
            """el => {
                const box = el.querySelector('.attention-explorer-thumbs').getBoundingClientRect();
                const open = el.querySelector("button.attention-explorer-thumb[aria-pressed='true']")
                    .getBoundingClientRect();
                const axis = el.querySelector('.attention-explorer-axis-layer').getBoundingClientRect();
                return {
                    buttons: [...el.querySelectorAll('button.attention-explorer-thumb')].map(b => {
                        const r = b.getBoundingClientRect(); return [r.width, r.height]; }),
                    page: document.documentElement.scrollWidth,
                    open: open.left >= axis.right - 1 && open.right <= box.right + 1,
                };
            }""")
        assert len(sizes["buttons"]) == len(data["models"][model]["layers"]) * len(data["models"][model]["heads"])
        assert min(min(wh) for wh in sizes["buttons"]) >= 44, sizes["buttons"]
        assert sizes["page"] <= width, sizes["page"]
        assert sizes["open"], "the head that is open is scrolled out of the overview's box"
    switch(explorer, "model", 0)  # 12 heads
    marked = explorer.evaluate(
        """el => { const o = el.querySelector('.attention-explorer-overview'),
                         t = el.querySelector('.attention-explorer-thumbs');
                   return {scrolls: t.scrollWidth > t.clientWidth + 1, marked: o.classList.contains('ar-wide'),
                           note: getComputedStyle(o, '::after').content}; }""")
    assert marked["scrolls"] == marked["marked"], marked  # heads out of sight are announced, and only then
    assert ("Swipe the maps sideways" in marked["note"]) == marked["scrolls"], marked
    assert marked["scrolls"] == (width == 390), marked
    last = explorer.locator(f"{THUMB}[data-layer='5'][data-head='11']")
    last.scroll_into_view_if_needed()  # scrolls the overview's own box on a phone
    last.click()
    assert (menu(explorer, "layer"), menu(explorer, "head")) == (5, 11)
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    assert page.console_errors == []


@pytest.fixture
def phone(browser, site_url):
    """A 390 x 844 touch screen, offline as the ``page`` fixture."""
    context = browser.new_context(viewport=PHONE, has_touch=True, is_mobile=True)
    phone = context.new_page()
    phone.set_default_timeout(15_000)
    phone.console_errors = []
    local = urllib.parse.urlsplit(site_url).netloc
    phone.on("pageerror", lambda error: phone.console_errors.append(f"uncaught: {error}"))
    phone.route("**/*", lambda route: route.continue_() if urllib.parse.urlsplit(route.request.url).netloc
                == local else route.abort())
    yield phone
    context.close()


def _table_in_view(page) -> dict:
    return page.evaluate(
        """() => {
            const rows = [...document.querySelectorAll('table.attention-explorer-table tr')];
            const header = document.querySelector('.md-header').getBoundingClientRect().bottom;
            return {top: rows[0].getBoundingClientRect().top, third: rows[3].getBoundingClientRect().bottom,
                    header, height: innerHeight, y: scrollY};
        }""")


def test_a_tap_on_a_phone_brings_the_table_into_view(phone, site_url):
    explorer, _ = open_explorer(phone, site_url)
    for sentence, token in ((0, 1), (1, 7)):
        switch(explorer, "sentence", sentence)
        # the tokens at the bottom of the screen: the table below the fold
        phone.evaluate("""() => { const t = document.querySelector('.attention-explorer-tokens');
            window.scrollBy(0, t.getBoundingClientRect().bottom - innerHeight + 20); }""")
        before = _table_in_view(phone)
        assert before["top"] > before["height"], before
        explorer.locator(TOKEN).nth(token).tap()
        phone.wait_for_function(
            """() => { const t = document.querySelector('table.attention-explorer-table').rows;
                const h = document.querySelector('.md-header').getBoundingClientRect().bottom;
                return t[0].getBoundingClientRect().top >= h - 1
                    && t[3].getBoundingClientRect().bottom <= innerHeight; }""")
        after = _table_in_view(phone)  # the head of the table and its first three rows
        assert after["header"] - 1 <= after["top"] and after["third"] <= after["height"], after
        assert explorer.locator(f"{TOKEN}[aria-pressed='true']").get_attribute("data-index") == str(token)
    assert phone.console_errors == []


def test_a_click_on_a_wide_screen_does_not_scroll(page, site_url):
    page.set_viewport_size({"width": 1280, "height": 900})
    explorer, _ = open_explorer(page, site_url)
    page.evaluate("""() => { const t = document.querySelector('.attention-explorer-tokens');
        window.scrollBy(0, t.getBoundingClientRect().bottom - innerHeight + 20); }""")
    y = page.evaluate("scrollY")
    explorer.locator(TOKEN).nth(1).click()
    page.wait_for_timeout(500)
    assert page.evaluate("scrollY") == y


#: For each (model, sentence, token) of `views`: the menus set and the token clicked as in
#: `EVERY_VIEW_CUT`, then for each direction the menus' layer and head, the table's columns (as
#: `table` reads them) and its sum lines (`TOTAL_ROWS`). In one call: with a Playwright round trip per
#: click and per column the test took 14.8 s beside another test worker on 2 cores, in one call 1.9 s alone.
EVERY_VIEW_TABLE = """(el, views) => {""" + SHOW_VIEW + """
  const column = c => [...el.querySelectorAll(`tr.attention-explorer-row .attention-explorer-${c}`)]
    .map(cell => cell.textContent);
  const seen = [];
  for (const [m, s, token] of views) {
    show(m, s, token);
    for (const direction of ['to', 'by']) {
      el.querySelector(`.attention-explorer-direction-button[data-direction='${direction}']`).click();
      const shown = {};
      for (const c of ['label', 'score', 'scaled', 'masked', 'exp', 'sum', 'value']) shown[c] = column(c);
      seen.push({view: [m, s, token], to: direction === 'to', layer: Number(menu('layer').value),
                 head: Number(menu('head').value), model: Number(menu('model').value),
                 sentence: Number(menu('sentence').value), shown,
                 totals: (""" + TOTAL_ROWS + """)(el)});
    }
  }
  return seen;
}"""


def test_each_weight_is_its_exp_over_the_sum(page, site_url):
    """For every row shown, weight = exp(s - max) / sum with the numbers shown, all from the JSON."""
    explorer, data = open_explorer(page, site_url)
    every = list(views(data))
    seen = explorer.evaluate(EVERY_VIEW_TABLE, every)
    assert [(tuple(v["view"]), v["to"]) for v in seen] == [(view, to) for view in every for to in (True, False)]
    for v in seen:
        m, s, token = v["view"]
        assert (v["model"], v["sentence"]) == (m, s)  # the menus took the view
        # the layer and head the menus hold: the encoder's opening head, the decoder's one
        check_exp_over_sum(v["shown"], v["totals"], data, m, s, v["layer"], v["head"], token, v["to"])
    headers = explorer.locator("table.attention-explorer-table thead th").all_text_contents()
    assert "exp(s \u2212 max)" in headers and "row sum" in headers  # "is attended by": a sum per row
    assert page.console_errors == []
