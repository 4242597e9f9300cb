"""The built site in headless Chromium, served on 127.0.0.1 with no network.

Every page (one test per Markdown page) loads with no console error, no failed request and no
request to another host; its math is typeset by KaTeX; pages whose executed blocks inline a
figure (``to_svg(``) show an SVG. Instant navigation keeps working (math typeset after it) and
the search finds a page offline.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _find_blocks():
    # the docs-block collector's fence parser (tests/docs/conftest.py)
    spec = importlib.util.spec_from_file_location("docs_blocks_parser", ROOT / "tests/docs/conftest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.find_blocks


find_blocks = _find_blocks()
SOURCES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))


def page_path(source: str) -> str:
    """URL path of a page relative to the site root (mkdocs' use_directory_urls)."""
    stem = source.removesuffix(".md")
    if stem == "index" or stem.endswith("/index"):
        return stem.removesuffix("index")
    return stem + "/"


def shows_figure(source: str) -> bool:
    """Whether an executed block of the page inlines a figure as SVG."""
    return any(re.search(r"\bto_svg\(", block.code) for block in find_blocks(DOCS / source))


def built_page(built_site: Path, source: str) -> Path:
    html = built_site / page_path(source) / "index.html"
    if not html.is_file():
        if os.environ.get("ATTENTION_REF_MKDOCS_CONFIG"):
            pytest.skip(f"{source} is not in this build (ATTENTION_REF_MKDOCS_CONFIG)")
        pytest.fail(f"{source} was not built: no {html}")
    return html


UNTYPESET_MATH = """() => [...document.querySelectorAll('.arithmatex')]
  .filter(el => !el.querySelector('.katex') || el.querySelector('.katex-error')
    || [...el.childNodes].some(n => n.nodeType === Node.TEXT_NODE && /\\\\[\\(\\[]/.test(n.textContent)))
  .map(el => el.outerHTML.slice(0, 160))"""


def assert_clean(page, site_url: str) -> None:
    """No console error, no failed response, no request that leaves the local server."""
    host = urllib.parse.urlsplit(site_url).hostname
    outside = [url for url in page.requests
               if urllib.parse.urlsplit(url).scheme in ("http", "https", "ws", "wss")
               and urllib.parse.urlsplit(url).hostname != host]
    assert not outside, f"requests that leave {host}: {outside}"
    assert not page.failed_responses, f"failed requests: {page.failed_responses}"
    assert not page.console_errors, "\n".join(page.console_errors)


def assert_math_typeset(page) -> None:
    count = page.locator(".arithmatex").count()
    if count:
        page.wait_for_function(
            "() => [...document.querySelectorAll('.arithmatex')].every(el => el.querySelector('.katex'))")
        bad = page.evaluate(UNTYPESET_MATH)
        assert not bad, f"{len(bad)} of {count} formulas not typeset on {page.url}: {bad[:5]}"


@pytest.mark.parametrize("source", SOURCES)
def test_page(page, site_url: str, built_site: Path, source: str):
    html = built_page(built_site, source).read_text(encoding="utf-8")
    page.goto(site_url + page_path(source))
    page.wait_for_load_state("networkidle")
    assert page.locator("article.md-content__inner").count() == 1
    assert_clean(page, site_url)
    if 'class="arithmatex"' in html:
        assert page.locator(".arithmatex").count() > 0
        assert_math_typeset(page)
        assert page.locator(".arithmatex .katex").count() > 0
    if shows_figure(source):
        sizes = page.evaluate("""() => [...document.querySelectorAll('article svg')]
            .map(svg => svg.getBoundingClientRect()).map(r => [r.width, r.height])""")
        figures = [s for s in sizes if s[0] >= 150 and s[1] >= 100]
        assert figures, f"{source} runs to_svg( but shows no SVG figure (svg sizes: {sizes})"


def test_figure_detection_reads_executed_blocks(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text('```python\nto_svg(fig)\n```\n\n```python exec="on"\nprint(1)\n```\n')
    assert not any("to_svg(" in b.code for b in find_blocks(page))
    page.write_text('```python exec="on" html="1"\nprint(viz.to_svg(fig))\n```\n')
    assert any(re.search(r"\bto_svg\(", b.code) for b in find_blocks(page))


def test_instant_navigation_typesets_math(page, site_url: str, built_site: Path, instant_navigate):
    with_math = [s for s in SOURCES if s != "index.md"
                 and 'class="arithmatex"' in built_page(built_site, s).read_text(encoding="utf-8")]
    assert with_math, "no page with math"
    page.goto(site_url)
    page.wait_for_load_state("networkidle")
    target = site_url + page_path(with_math[0])
    assert instant_navigate(target), (
        f"Material reloaded {target} instead of swapping it in (instant navigation): is the "
        "site served at the site_url it was built for?")
    assert page.locator(".arithmatex").count() > 0
    assert_math_typeset(page)
    assert_clean(page, site_url)


def test_search_finds_a_page_offline(page, site_url: str):
    query, expected = "padding_mask_from_tokens", "reference/masks/"
    page.goto(site_url)
    page.wait_for_load_state("networkidle")
    page.locator(".md-search__input").click()
    page.locator(".md-search__input").press_sequentially(query)  # Material listens to keys
    results = page.locator(".md-search-result__item a")
    results.first.wait_for()
    hrefs = [results.nth(i).get_attribute("href") for i in range(results.count())]
    assert any(expected in (href or "") for href in hrefs), hrefs
    assert_clean(page, site_url)


FIGURE_COLOURS = """() => [...document.querySelectorAll('svg.ar-figure')].map(svg => ({
  background: getComputedStyle(svg.querySelector('#patch_1 path')).fill,
  text: getComputedStyle(svg.querySelector('text')).fill,
}))"""


def test_figures_follow_the_colour_scheme(page, site_url: str):
    """A figure's background and text take the page's colours in the dark scheme, not a white slab."""
    page.goto(site_url + page_path("tutorial/09-cost.md"))
    page.wait_for_load_state("networkidle")
    light = page.evaluate(FIGURE_COLOURS)
    assert light and all(f["background"] == "rgb(255, 255, 255)" for f in light), light
    page.evaluate("document.body.setAttribute('data-md-color-scheme', 'slate')")  # Material's dark scheme
    dark = page.evaluate(FIGURE_COLOURS)
    page_background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert all(f["background"] == page_background != "rgb(255, 255, 255)" for f in dark), (dark, page_background)
    assert all(f["text"] != light[0]["text"] for f in dark), dark


SCROLLING_BLOCKS = """() => [...document.querySelectorAll('article pre > code')]
  .filter(code => code.scrollWidth > code.clientWidth + 1)
  .map(code => code.textContent.split('\\n').find(line => line.length > 40) || code.textContent.slice(0, 60))"""


@pytest.mark.parametrize("source", [s for s in SOURCES if s.startswith("tutorial/")])
def test_tutorial_code_does_not_scroll_sideways_on_a_phone(browser, site_url: str, source: str):
    """At 390 px (a phone), no code or output block of a tutorial page needs a sideways swipe."""
    context = browser.new_context(viewport={"width": 390, "height": 844})
    try:
        phone = context.new_page()
        phone.goto(site_url + page_path(source))
        phone.wait_for_load_state("networkidle")
        scrolling = phone.evaluate(SCROLLING_BLOCKS)
        assert not scrolling, f"{len(scrolling)} blocks scroll sideways at 390 px, e.g. {scrolling[:3]}"
        assert phone.evaluate("document.documentElement.scrollWidth") <= 390
    finally:
        context.close()


WRAPPED_LINES = """() => [...document.querySelectorAll('article pre > code > span[id^="__span-"]')]
  .filter(line => line.getClientRects().length && line.textContent.trim())
  .filter(line => {
    const height = parseFloat(getComputedStyle(line).lineHeight);
    return line.getBoundingClientRect().height > 1.5 * height;
  })
  .map(line => line.textContent.trimEnd())"""


@pytest.mark.parametrize("source", [s for s in SOURCES if re.match(r"tutorial/0[1-6]", s)])
def test_tutorial_code_lines_fit_a_phone_unwrapped(browser, site_url: str, built_site: Path, source: str):
    """Tutorial pages 1 to 6 are written at most 44 columns wide, code and printed output: at 390 px no
    line of theirs wraps (a wrapped line hangs under its start with a bar, but reads worse)."""
    built_page(built_site, source)
    context = browser.new_context(viewport={"width": 390, "height": 844})
    try:
        phone = context.new_page()
        phone.goto(site_url + page_path(source))
        phone.wait_for_load_state("networkidle")
        phone.evaluate("document.querySelectorAll('article details').forEach(d => d.open = true)")
        wrapped = phone.evaluate(WRAPPED_LINES)
    finally:
        context.close()
    assert not wrapped, f"{source}: {len(wrapped)} lines wrap at 390 px, e.g. {wrapped[:3]}"


def shows_head_grid(source: str) -> bool:
    """Whether an executed block of the page inlines a per-head grid (one SVG per head)."""
    return any("head_grid_html(" in block.code for block in find_blocks(DOCS / source))


FIGURE_CAPTIONS = """() => [...document.querySelectorAll('article svg.ar-figure')].map(svg => {
  const box = svg.closest('figure.ar-figure-box');
  const caption = box && box.querySelector(':scope > figcaption');
  const style = caption && getComputedStyle(caption);
  return {label: svg.getAttribute('aria-label'), caption: caption ? caption.textContent.trim() : null,
          centred: !!style && style.textAlign === 'center'};
})"""


@pytest.mark.parametrize("source", [s for s in SOURCES if shows_figure(s) or shows_head_grid(s)])
def test_figures_have_captions(page, site_url: str, built_site: Path, source: str):
    """Every figure of every page sits in a figure with a centred caption that says what to look at."""
    built_page(built_site, source)
    page.goto(site_url + page_path(source))
    page.wait_for_load_state("networkidle")
    figures = page.evaluate(FIGURE_CAPTIONS)
    assert figures, f"{source} runs to_svg( or head_grid_html( but shows no svg.ar-figure"
    missing = [f["label"] for f in figures if not f["caption"]]
    assert not missing, f"{source}: figures without a <figcaption>: {missing}"
    assert all(f["centred"] for f in figures), figures
    assert all(f["caption"].count(" ") >= 4 for f in figures), "a caption is a sentence, not a label"


HEAD_GRIDS = """() => {
  const right = document.querySelector('article.md-content__inner').getBoundingClientRect().right + 1;
  return [...document.querySelectorAll('article .ar-head-grid')].map(grid => {
    const heads = [...grid.children].filter(el => el.matches('svg.ar-figure'));
    const boxes = heads.map(svg => svg.getBoundingClientRect());
    let smallest = Infinity;
    for (const t of grid.querySelectorAll('svg text')) {
      if (!t.getClientRects().length || !t.textContent.trim()) continue;
      const m = t.getScreenCTM();
      smallest = Math.min(smallest, parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b));
    }
    return {
      labels: heads.map(svg => svg.getAttribute('aria-label')),
      perRow: new Set(boxes.map(b => Math.round(b.left))).size,
      columns: parseInt(getComputedStyle(grid).getPropertyValue('--ar-head-columns')),
      smallest,
      outside: boxes.filter(b => b.right > right).length,
    };
  });
}"""


@pytest.mark.parametrize("source", [s for s in SOURCES if shows_head_grid(s)])
@pytest.mark.parametrize("width", [390, 1280])
def test_head_grids_show_two_heads_per_row_on_a_phone(browser, site_url: str, built_site: Path,
                                                               source: str, width: int):
    """A per-head grid shows its N heads per row on a wide screen and 2 per row at 390 px, where
    every head's text still renders at 9 px or more; each head is named for screen readers."""
    built_page(built_site, source)
    context = browser.new_context(viewport={"width": width, "height": 844})
    try:
        screen = context.new_page()
        screen.goto(site_url + page_path(source))
        screen.wait_for_load_state("networkidle")
        grids = screen.evaluate(HEAD_GRIDS)
    finally:
        context.close()
    assert grids, f"{source} calls head_grid_html( but shows no .ar-head-grid"
    for grid in grids:
        assert len(grid["labels"]) >= 2 and all(grid["labels"]), grid
        assert len(set(grid["labels"])) == len(grid["labels"]), f"heads share a name: {grid['labels']}"
        assert not grid["outside"], f"{grid['outside']} heads end past the column at {width} px"
        if width == 390:
            assert grid["perRow"] <= 2, f"{grid['perRow']} heads per row at 390 px: {grid['labels']}"
            assert grid["smallest"] >= 9.0, f"head text renders at {grid['smallest']:.1f} px at 390 px"
        else:
            assert grid["perRow"] == min(grid["columns"], len(grid["labels"])), grid
            assert grid["smallest"] >= 11.0, f"head text renders at {grid['smallest']:.1f} px at 1280 px"


def shows_wide_content(source: str) -> bool:
    """Whether the page shows a figure (an SVG of attention_ref.viz), a display formula or a table."""
    text = (DOCS / source).read_text()
    return bool(re.search(r"to_svg\(|head_grid_html\(|map_slider_html\(|^\s*\$\$|^\s*\\\[|^\s*\|.*\|\s*$",
                          text, re.M))


WIDE_CONTENT = """() => {
  const smallestText = (svg) => {
    let smallest = Infinity;
    for (const t of svg.querySelectorAll('text')) {
      if (!t.getClientRects().length || !t.textContent.trim()) continue;
      const m = t.getScreenCTM();
      smallest = Math.min(smallest, parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b));
    }
    return smallest;
  };
  const box = (el, what) => {
    const r = el.getBoundingClientRect();
    return {what, wider: el.scrollWidth > el.clientWidth + 1, marked: el.classList.contains('ar-wide'),
            scrolls: ['auto', 'scroll'].includes(getComputedStyle(el).overflowX),
            note: getComputedStyle(el, '::after').content, left: r.left, right: r.right};
  };
  return {
    figures: [...document.querySelectorAll('article svg.ar-figure')].map(svg => ({
      label: svg.getAttribute('aria-label').slice(0, 60), smallest: smallestText(svg),
      box: box(svg.closest('figure.ar-figure-box'), svg.getAttribute('aria-label').slice(0, 60))})),
    formulas: [...document.querySelectorAll('article div.arithmatex')].map(
      d => box(d, d.querySelector('annotation')?.textContent.trim().slice(0, 60) || '?')),
    tables: [...document.querySelectorAll('article table')].map(t => {
      const wrap = t.closest('.md-typeset__scrollwrap');
      return {what: t.textContent.trim().slice(0, 60), right: t.getBoundingClientRect().right,
              wrapRight: wrap ? wrap.getBoundingClientRect().right : null,
              scrolls: !!wrap && ['auto', 'scroll'].includes(getComputedStyle(wrap).overflowX)};
    }),
    pageWidth: document.documentElement.scrollWidth,
  };
}"""


@pytest.mark.parametrize("source", [s for s in SOURCES if shows_wide_content(s)])
@pytest.mark.parametrize("width", [390, 1280])
def test_figure_text_is_readable_and_wide_content_scrolls_in_its_own_box(browser, site_url: str,
                                                                         built_site: Path, source: str,
                                                                         width: int):
    """At 390 px (a phone) and 1280 px, every figure's smallest text renders at 9 px or more (up to
    layout rounding), and a figure or display formula wider than the column scrolls sideways inside
    its own box, which says so under it; a wider table scrolls in its own box too; the page itself
    never scrolls sideways."""
    built_page(built_site, source)
    context = browser.new_context(viewport={"width": width, "height": 844})
    try:
        screen = context.new_page()
        screen.goto(site_url + page_path(source))
        screen.wait_for_load_state("networkidle")
        shown = screen.evaluate(WIDE_CONTENT)
    finally:
        context.close()
    small = [(f["label"], round(f["smallest"], 2)) for f in shown["figures"] if f["smallest"] < 9.0 - 0.01]
    assert not small, f"{source} at {width} px: figure text below 9 px: {small}"
    boxes = [f["box"] for f in shown["figures"]] + shown["formulas"]
    assert boxes or shown["tables"], f"{source}: no figure, display formula or table found"
    for b in boxes:
        assert b["left"] >= -1 and b["right"] <= width + 1, f"{b['what']!r} ends outside the screen: {b}"
        if b["wider"]:
            assert b["scrolls"] and b["marked"], f"{b['what']!r} is cut or scrolls unannounced: {b}"
            assert "Swipe sideways" in b["note"], b
        else:
            assert not b["marked"], f"{b['what']!r} fits but says to swipe: {b}"
    for t in shown["tables"]:  # Material puts each table in a box of its own that scrolls
        if t["right"] > width:
            assert t["scrolls"] and t["wrapRight"] <= width + 1, f"table {t['what']!r} is cut: {t}"
    assert shown["pageWidth"] <= width, f"{source} scrolls sideways at {width} px"
