"""The attention explorer on the intuition page, driven in headless Chromium.

The weights shown after a click, a head switch or a keyboard focus must equal
the JSON that attention_ref embedded in the page when the site was built, and
the explorer must keep working after Material's instant navigation.
Fixtures (``site_url``, ``page``) come from tests/site/conftest.py.
"""

from __future__ import annotations

import json

import pytest

PAGE = "tutorial/01-intuition/"
EXPLORER = "div.attention-explorer"


def open_explorer(page, site_url: str):
    page.goto(site_url + PAGE)
    explorer = page.locator(EXPLORER).first
    explorer.wait_for()
    page.wait_for_function(
        "sel => document.querySelector(sel)?.dataset.explorerReady === 'true'", arg=EXPLORER
    )
    data = json.loads(explorer.get_attribute("data-attention"))
    return explorer, data


def shown(explorer) -> dict:
    """What the explorer displays: the pressed token, the head, and each row's value."""
    rows = explorer.locator("li.attention-explorer-row")
    return {
        "pressed": [
            int(b.get_attribute("data-index"))
            for b in explorer.locator("button.attention-explorer-token[aria-pressed='true']").all()
        ],
        "head": int(explorer.locator("select.attention-explorer-head").input_value()),
        "labels": rows.locator(".attention-explorer-label").all_text_contents(),
        "values": rows.locator(".attention-explorer-value").all_text_contents(),
        "weights": [float(w) for w in rows.evaluate_all("rows => rows.map(r => r.dataset.weight)")],
        "shades": explorer.locator("button.attention-explorer-token").evaluate_all(
            "bs => bs.map(b => b.style.getPropertyValue('--attention-weight'))"
        ),
    }


def assert_shows(explorer, data: dict, head: int, query: int) -> None:
    view = shown(explorer)
    expected = data["weights"][head][query]
    assert view["pressed"] == [query]
    assert view["head"] == head
    assert view["labels"] == data["tokens"]
    assert view["weights"] == expected  # the embedded numbers, exactly
    assert [float(s) for s in view["shades"]] == expected  # tokens shaded by the same numbers
    assert len(view["values"]) == len(expected)
    for text, weight in zip(view["values"], expected):
        assert len(text.split(".")[-1]) == 3, text  # 3 decimals
        assert abs(float(text) - weight) <= 0.0005 + 1e-9, (text, weight)


def test_explorer_data_is_well_formed(page, site_url):
    explorer, data = open_explorer(page, site_url)
    H, L = len(data["heads"]), len(data["tokens"])
    assert H >= 2 and L >= 3
    assert len(data["weights"]) == H
    for head in data["weights"]:
        assert len(head) == L
        for row in head:
            assert len(row) == L
            assert abs(sum(row) - 1) < 1e-3  # rows of attention weights sum to 1 (4-decimal JSON)
    assert explorer.locator("button.attention-explorer-token").all_text_contents() == data["tokens"]
    assert explorer.locator("select.attention-explorer-head option").all_text_contents() == data["heads"]
    assert page.console_errors == []


def test_initial_selection_click_and_head_switch(page, site_url):
    explorer, data = open_explorer(page, site_url)
    initial = explorer.get_attribute("data-initial-token")
    if initial is not None:  # the page opens on a chosen token and head
        head = int(explorer.locator("select.attention-explorer-head").input_value())
        assert_shows(explorer, data, head, int(initial))

    L, H = len(data["tokens"]), len(data["heads"])
    query = 1 if initial != "1" else 2
    explorer.locator("button.attention-explorer-token").nth(query).click()
    head = int(explorer.locator("select.attention-explorer-head").input_value())
    assert_shows(explorer, data, head, query)

    other = (head + 1) % H
    explorer.locator("select.attention-explorer-head").select_option(str(other))
    assert_shows(explorer, data, other, query)  # same token, the other head's row

    last = L - 1
    explorer.locator("button.attention-explorer-token").nth(last).click()
    assert_shows(explorer, data, other, last)
    assert page.console_errors == []


def test_keyboard_focus_shows_weights(page, site_url):
    explorer, data = open_explorer(page, site_url)
    select = explorer.locator("select.attention-explorer-head")
    head = int(select.input_value())
    select.focus()
    page.keyboard.press("Tab")  # from the head menu to the first token
    assert page.evaluate("document.activeElement.dataset.index") == "0"
    assert_shows(explorer, data, head, 0)
    page.keyboard.press("ArrowRight")  # arrows move between tokens
    assert page.evaluate("document.activeElement.dataset.index") == "1"
    assert_shows(explorer, data, head, 1)
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
    explorer.locator("button.attention-explorer-token").nth(2).click()
    head = int(explorer.locator("select.attention-explorer-head").input_value())
    assert_shows(explorer, again, head, 2)
    other = (head + 1) % len(again["heads"])
    explorer.locator("select.attention-explorer-head").select_option(str(other))
    assert_shows(explorer, again, other, 2)
    assert explorer.locator("li.attention-explorer-row").count() == len(again["tokens"])  # drawn once
    assert page.console_errors == []


@pytest.mark.parametrize("scheme", ["default", "slate"])
def test_explorer_is_readable_in_both_schemes(page, site_url, scheme):
    explorer, _ = open_explorer(page, site_url)
    page.evaluate("s => document.body.setAttribute('data-md-color-scheme', s)", scheme)
    explorer.locator("button.attention-explorer-token").nth(1).click()
    colours = explorer.locator(".attention-explorer-value").first.evaluate(
        """el => {
            const rgb = c => c.match(/[\\d.]+/g).slice(0, 3).map(Number);
            let bg = el, b = getComputedStyle(bg).backgroundColor;
            while (bg && (b === 'rgba(0, 0, 0, 0)' || b === 'transparent')) {
                bg = bg.parentElement; b = bg ? getComputedStyle(bg).backgroundColor : 'rgb(255, 255, 255)';
            }
            return [rgb(getComputedStyle(el).color), rgb(b)];
        }"""
    )

    def luminance(rgb):
        def channel(c):
            c /= 255
            return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

        r, g, b = (channel(c) for c in rgb)
        return 0.2126 * r + 0.7152 * g + 0.0722 * b

    fg, bg = (luminance(c) for c in colours)
    contrast = (max(fg, bg) + 0.05) / (min(fg, bg) + 0.05)
    assert contrast >= 4.5, (scheme, colours)  # WCAG AA for body text
