"""The attention explorer on the intuition page, driven in headless Chromium.

The weights shown after a click, a sentence, layer or head switch, a thumbnail click or a
keyboard move must equal the JSON that attention_ref embedded in the page when the site was
built, and the explorer must keep working after Material's instant navigation.
Fixtures (``site_url``, ``page``) come from tests/site/conftest.py.
"""

from __future__ import annotations

import json

import pytest

PAGE = "tutorial/01-intuition/"
EXPLORER = "div.attention-explorer"
TOKEN = "button.attention-explorer-token"
THUMB = "button.attention-explorer-thumb"


def open_explorer(page, site_url: str):
    page.goto(site_url + PAGE)
    explorer = page.locator(EXPLORER).first
    explorer.wait_for()
    page.wait_for_function(
        "sel => document.querySelector(sel)?.dataset.explorerReady === 'true'", arg=EXPLORER
    )
    data = json.loads(explorer.get_attribute("data-attention"))
    return explorer, data


def menu(explorer, kind: str) -> int:
    return int(explorer.locator(f"select.attention-explorer-{kind}").input_value())


def shown(explorer) -> dict:
    """What the explorer displays: menus, tokens, the pressed token and thumbnail, each row's value."""
    rows = explorer.locator("li.attention-explorer-row")
    return {
        "sentence": menu(explorer, "sentence"),
        "layer": menu(explorer, "layer"),
        "head": menu(explorer, "head"),
        "tokens": explorer.locator(TOKEN).all_text_contents(),
        "pressed": [int(b.get_attribute("data-index"))
                    for b in explorer.locator(f"{TOKEN}[aria-pressed='true']").all()],
        "thumb": [int(b.get_attribute("data-head"))
                  for b in explorer.locator(f"{THUMB}[aria-pressed='true']").all()],
        "labels": rows.locator(".attention-explorer-label").all_text_contents(),
        "values": rows.locator(".attention-explorer-value").all_text_contents(),
        "weights": [float(w) for w in rows.evaluate_all("rows => rows.map(r => r.dataset.weight)")],
        "shades": explorer.locator(TOKEN).evaluate_all(
            "bs => bs.map(b => b.style.getPropertyValue('--attention-weight'))"
        ),
    }


def thumbnails(explorer) -> list[list[float]]:
    """Each thumbnail's cells (fill opacity, row-major) and where its query-row outline is."""
    return explorer.locator(THUMB).evaluate_all(
        """bs => bs.map(b => ({
            head: Number(b.dataset.head),
            label: b.querySelector('.attention-explorer-thumb-label').textContent,
            cells: [...b.querySelectorAll('.attention-explorer-cell')].map(
                c => Number(c.getAttribute('fill-opacity'))),
            row: b.querySelector('.attention-explorer-thumb-row').getAttribute('visibility') === 'visible'
                ? Number(b.querySelector('.attention-explorer-thumb-row').getAttribute('y')) : null,
        }))"""
    )


def assert_shows(explorer, data: dict, sentence: int, layer: int, head: int, query: int) -> None:
    view = shown(explorer)
    tokens = data["sentences"][sentence]["tokens"]
    expected = data["sentences"][sentence]["weights"][layer][head][query]
    assert (view["sentence"], view["layer"], view["head"]) == (sentence, layer, head)
    assert view["tokens"] == tokens
    assert view["pressed"] == [query]
    assert view["thumb"] == [head]
    assert view["labels"] == tokens
    assert view["weights"] == expected  # the embedded numbers, exactly
    assert [float(s) for s in view["shades"]] == expected  # tokens shaded by the same numbers
    assert len(view["values"]) == len(expected)
    for text, weight in zip(view["values"], expected):
        assert len(text.split(".")[-1]) == 3, text  # 3 decimals
        assert abs(float(text) - weight) <= 0.0005 + 1e-9, (text, weight)
    thumbs = thumbnails(explorer)
    assert [t["head"] for t in thumbs] == list(range(len(data["heads"])))
    assert [t["label"] for t in thumbs] == data["heads"]
    for t in thumbs:  # every head of the chosen layer, drawn from the same numbers
        matrix = data["sentences"][sentence]["weights"][layer][t["head"]]
        assert t["cells"] == [w for row in matrix for w in row]
        assert t["row"] == query


def test_explorer_data_is_well_formed(page, site_url):
    explorer, data = open_explorer(page, site_url)
    assert len(data["layers"]) == 6 and len(data["heads"]) == 12  # all of all-MiniLM-L6-v2
    texts = [s["text"] for s in data["sentences"]]
    assert texts == ["The bank of the river was flooded.",
                     "The animal didn't cross the street because it was too tired."]
    for sentence in data["sentences"]:
        L = len(sentence["tokens"])
        assert sentence["tokens"][0] == "[CLS]" and sentence["tokens"][-1] == "[SEP]"
        assert len(sentence["weights"]) == 6
        for layer in sentence["weights"]:
            assert len(layer) == 12
            for head in layer:
                assert len(head) == L
                for row in head:
                    assert len(row) == L
                    assert abs(sum(row) - 1) < 2e-3  # rows sum to 1 (4-decimal JSON)
    assert data["sentences"][1]["tokens"][data["sentences"][1]["initial"]] == "it"
    options = {kind: explorer.locator(f"select.attention-explorer-{kind} option").all_text_contents()
               for kind in ("sentence", "layer", "head")}
    assert options == {"sentence": texts, "layer": data["layers"], "head": data["heads"]}
    assert page.console_errors == []


def test_initial_view_and_layer_5(page, site_url):
    explorer, data = open_explorer(page, site_url)
    layer, head = menu(explorer, "layer"), menu(explorer, "head")
    query = data["sentences"][0]["initial"]
    assert data["sentences"][0]["tokens"][query] == "bank"
    assert_shows(explorer, data, 0, layer, head, query)
    before = shown(explorer)["weights"]

    explorer.locator("select.attention-explorer-layer").select_option("5")
    assert_shows(explorer, data, 0, 5, head, query)
    assert shown(explorer)["weights"] != before  # another layer, other weights
    assert page.console_errors == []


def test_thumbnail_opens_its_head(page, site_url):
    explorer, data = open_explorer(page, site_url)
    layer, head = menu(explorer, "layer"), menu(explorer, "head")
    query = data["sentences"][0]["initial"]
    other = (head + 5) % len(data["heads"])
    explorer.locator(f"{THUMB}[data-head='{other}']").click()
    assert_shows(explorer, data, 0, layer, other, query)
    explorer.locator(TOKEN).nth(1).click()  # another token: the thumbnails outline its row
    assert_shows(explorer, data, 0, layer, other, 1)
    explorer.locator("select.attention-explorer-layer").select_option("3")
    explorer.locator(f"{THUMB}[data-head='1']").click()
    assert_shows(explorer, data, 0, 3, 1, 1)
    assert page.console_errors == []


def test_switching_sentence(page, site_url):
    explorer, data = open_explorer(page, site_url)
    bank = data["sentences"][0]["initial"]
    explorer.locator("select.attention-explorer-layer").select_option("3")
    explorer.locator(f"{THUMB}[data-head='1']").click()
    explorer.locator("select.attention-explorer-sentence").select_option("1")
    it = data["sentences"][1]["initial"]
    assert_shows(explorer, data, 1, 3, 1, it)  # the "it" sentence opens on "it"
    other = 5 if bank != 5 else 6
    explorer.locator(TOKEN).nth(other).click()
    assert_shows(explorer, data, 1, 3, 1, other)
    explorer.locator("select.attention-explorer-sentence").select_option("0")
    assert_shows(explorer, data, 0, 3, 1, bank)  # back: the bank sentence kept its token
    explorer.locator("select.attention-explorer-sentence").select_option("1")
    assert_shows(explorer, data, 1, 3, 1, other)  # and so did the "it" sentence
    assert page.console_errors == []


def test_keyboard(page, site_url):
    explorer, data = open_explorer(page, site_url)
    layer, head = menu(explorer, "layer"), menu(explorer, "head")
    H = len(data["heads"])
    explorer.locator("select.attention-explorer-head").focus()
    page.keyboard.press("Tab")  # from the head menu to the chosen head's thumbnail
    assert page.evaluate("document.activeElement.dataset.head") == str(head)
    page.keyboard.press("ArrowRight")  # arrows move between heads and open them
    nxt = min(head + 1, H - 1)
    assert page.evaluate("document.activeElement.dataset.head") == str(nxt)
    assert_shows(explorer, data, 0, layer, nxt, data["sentences"][0]["initial"])
    page.keyboard.press("Home")
    assert page.evaluate("document.activeElement.dataset.head") == "0"
    page.keyboard.press("Enter")
    page.keyboard.press("Tab")  # one tab stop for the thumbnails: on to the first token
    assert page.evaluate("document.activeElement.dataset.index") == "0"
    assert_shows(explorer, data, 0, layer, 0, 0)
    page.keyboard.press("ArrowRight")  # arrows move between tokens
    assert page.evaluate("document.activeElement.dataset.index") == "1"
    assert_shows(explorer, data, 0, layer, 0, 1)
    page.keyboard.press("End")
    last = len(data["sentences"][0]["tokens"]) - 1
    assert_shows(explorer, data, 0, layer, 0, last)
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
    again = json.loads(explorer.get_attribute("data-attention"))
    assert again == data
    explorer.locator(TOKEN).nth(2).click()
    layer, head = menu(explorer, "layer"), menu(explorer, "head")
    assert_shows(explorer, again, 0, layer, head, 2)
    explorer.locator("select.attention-explorer-layer").select_option("5")
    explorer.locator(f"{THUMB}[data-head='7']").click()
    assert_shows(explorer, again, 0, 5, 7, 2)
    assert explorer.locator("li.attention-explorer-row").count() == len(again["sentences"][0]["tokens"])
    assert explorer.locator(THUMB).count() == len(again["heads"])  # drawn once
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
    while (bg && (b === 'rgba(0, 0, 0, 0)' || b === 'transparent')) {
        bg = bg.parentElement; b = bg ? getComputedStyle(bg).backgroundColor : 'rgb(255, 255, 255)';
    }
    return [rgb(getComputedStyle(el).color), rgb(b)];
}"""


@pytest.mark.parametrize("scheme", ["default", "slate"])
def test_explorer_is_readable_in_both_schemes(page, site_url, scheme):
    explorer, _ = open_explorer(page, site_url)
    page.evaluate("s => document.body.setAttribute('data-md-color-scheme', s)", scheme)
    explorer.locator(TOKEN).nth(1).click()
    for selector in (".attention-explorer-value", ".attention-explorer-thumb-label",
                     f"{THUMB}[aria-pressed='false'] .attention-explorer-thumb-label"):
        fg, bg = (_luminance(c) for c in explorer.locator(selector).first.evaluate(_COLOURS))
        contrast = (max(fg, bg) + 0.05) / (min(fg, bg) + 0.05)
        assert contrast >= 4.5, (scheme, selector, contrast)  # WCAG AA for body text


@pytest.mark.parametrize("width", [390, 1280])
def test_explorer_fits_the_column(page, site_url, width):
    page.set_viewport_size({"width": width, "height": 900})
    explorer, data = open_explorer(page, site_url)
    explorer.locator("select.attention-explorer-sentence").select_option("1")  # the longer sentence
    sizes = explorer.evaluate(
        """el => ({
            overflow: el.scrollWidth - el.clientWidth,
            page: document.documentElement.scrollWidth - document.documentElement.clientWidth,
            thumbs: [...el.querySelectorAll('.attention-explorer-thumb-map')].map(
                s => s.getBoundingClientRect().width),
            labels: [...el.querySelectorAll('.attention-explorer-thumb-label, label, select')].map(
                s => parseFloat(getComputedStyle(s).fontSize)),
        })"""
    )
    assert sizes["overflow"] <= 0 and sizes["page"] <= 0, sizes
    assert len(sizes["thumbs"]) == len(data["heads"])
    assert min(sizes["thumbs"]) >= 48, sizes["thumbs"]  # big enough to see the pattern
    assert min(sizes["labels"]) >= 10, sizes["labels"]
    assert page.console_errors == []
