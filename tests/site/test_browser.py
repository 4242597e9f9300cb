"""The built site in headless Chromium, served on 127.0.0.1 with no network.

Every page (one test per Markdown page) loads with no console error, no failed request and no
request to another host; its math is typeset by KaTeX; pages whose executed blocks inline a
figure (``to_svg(``) show an SVG. Instant navigation keeps working (math typeset after it) and
the search finds a page offline. At 390 px (a phone) and 1280 px, figures, formulas, tables, code
and per-head grids fit or scroll in their own box, and figures carry captions; at 1280 px nothing
on a teaching page is clipped (tests/site/test_teaching.py has that file's other checks).

Each page is loaded once per width it is checked at, for all the checks of that page and width
(``page_shown``): a load runs the script (``probe``) of every check that covers that page and
width, and each test reads what its script returned. So every check keeps its own test, named
for the check and parametrized by page and width, and its message names both too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from playwright.sync_api import Error as PlaywrightError

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


#: The viewport of each width a page is checked at: a phone, and a laptop.
PHONE, DESKTOP = 390, 1280
VIEWPORTS = {PHONE: {"width": PHONE, "height": 844}, DESKTOP: {"width": DESKTOP, "height": 900}}


class Probe(NamedTuple):
    script: str  # a JavaScript function of no argument; what it returns is kept
    sources: frozenset[str]
    widths: frozenset[int]
    details_open: bool  # run after every <details> of the page has been opened


#: Every check's script, by name, in the order a load runs them (those with details closed first).
PROBES: dict[str, Probe] = {}


def probe(name: str, script: str, sources: Iterable[str], widths: Iterable[int],
          details_open: bool = False) -> str:
    """Have every load of a page of ``sources`` at a width of ``widths`` run ``script`` for the
    check ``name``: ``page_shown(source, width)[name]`` is what it returned. Call it at import,
    before any page loads (pytest imports every test module before it runs a test)."""
    assert name not in PROBES, f"probe {name!r} registered twice"
    PROBES[name] = Probe(script, frozenset(sources), frozenset(widths), details_open)
    return name


@dataclasses.dataclass
class Shown:
    """What a page showed at one width: its requests, errors and the results of its probes."""

    source: str
    width: int
    url: str
    requests: list[str]
    failed_responses: list[str]
    console_errors: list[str]
    math_typeset: bool  # every formula had been typeset within 15 s of the load event
    results: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        if name not in self.results:
            raise KeyError(f"probe {name!r} did not run on {self.source} at {self.width} px "
                           f"(its sources and widths leave this out)")
        return self.results[name]


ALL_MATH_TYPESET = """() => [...document.querySelectorAll('.arithmatex')]
  .every(el => el.querySelector('.katex'))"""
OPEN_DETAILS = "document.querySelectorAll('article details').forEach(d => d.open = true)"
_SHOWN: dict[tuple[str, str, int], Shown | str] = {}  # (site URL, source, width) -> Shown, or why not


def _load(page, site_url: str, source: str, width: int) -> Shown:
    page.visit(site_url + page_path(source))
    try:
        page.wait_for_function(ALL_MATH_TYPESET)
        math_typeset = True
    except PlaywrightError:  # a timeout: the checks say which formulas
        math_typeset = False
    page.settle()
    due = {name: p for name, p in PROBES.items() if source in p.sources and width in p.widths}
    results = {name: page.evaluate(p.script) for name, p in due.items() if not p.details_open}
    # requests and errors as of now, before the collapsibles open (as test_page saw them alone)
    shown = Shown(source, width, page.url, list(page.requests), list(page.failed_responses),
                  list(page.console_errors), math_typeset, results)
    if any(p.details_open for p in due.values()):
        page.evaluate(OPEN_DETAILS)
        results.update({name: page.evaluate(p.script) for name, p in due.items() if p.details_open})
    return shown


@pytest.fixture
def page_shown(tabs, site_url: str, built_site: Path):
    """``page_shown(source, width)``: what the page showed at that width (``Shown``). The first
    call for a page and width loads it (in conftest's tab of that viewport, with storage, cookies
    and records emptied first) and runs every probe registered for them; later calls, from any
    test of this session, get the same record."""

    def shown(source: str, width: int) -> Shown:
        built_page(built_site, source)  # skips or fails when the page was not built
        key = (site_url, source, width)
        if key not in _SHOWN:
            try:
                _SHOWN[key] = _load(tabs(VIEWPORTS[width]), site_url, source, width)
            except (PlaywrightError, TimeoutError) as error:
                tabs.drop(VIEWPORTS[width])  # the next page gets a new tab
                _SHOWN[key] = f"{type(error).__name__}: {error}"
        if isinstance(_SHOWN[key], str):
            pytest.fail(f"{source} at {width} px did not load: {_SHOWN[key]}", pytrace=False)
        return _SHOWN[key]

    return shown


def assert_clean(page, site_url: str, where: str = "") -> None:
    """No console error, no failed response, no request that leaves the local server (``page``:
    a live page of conftest's ``open_page``, or a ``Shown``; ``where`` names it, its URL if not)."""
    where = where or page.url
    host = urllib.parse.urlsplit(site_url).hostname
    outside = [url for url in page.requests
               if urllib.parse.urlsplit(url).scheme in ("http", "https", "ws", "wss")
               and urllib.parse.urlsplit(url).hostname != host]
    assert not outside, f"{where}: requests that leave {host}: {outside}"
    assert not page.failed_responses, f"{where}: failed requests: {page.failed_responses}"
    assert not page.console_errors, f"{where}: console errors:\n" + "\n".join(page.console_errors)


def assert_math_typeset(page) -> None:
    count = page.locator(".arithmatex").count()
    if count:
        page.wait_for_function(
            "() => [...document.querySelectorAll('.arithmatex')].every(el => el.querySelector('.katex'))")
        bad = page.evaluate(UNTYPESET_MATH)
        assert not bad, f"{len(bad)} of {count} formulas not typeset on {page.url}: {bad[:5]}"


PAGE = probe("page", """() => ({
  articles: document.querySelectorAll('article.md-content__inner').length,
  formulas: document.querySelectorAll('.arithmatex').length,
  typeset: document.querySelectorAll('.arithmatex .katex').length,
  untypeset: (%s)(),
  svgSizes: [...document.querySelectorAll('article svg')]
    .map(svg => svg.getBoundingClientRect()).map(r => [r.width, r.height]),
})""" % UNTYPESET_MATH, SOURCES, [DESKTOP])


@pytest.mark.parametrize("source", SOURCES)
def test_page(page_shown, site_url: str, built_site: Path, source: str):
    html = built_page(built_site, source).read_text(encoding="utf-8")
    shown = page_shown(source, DESKTOP)
    found, at = shown[PAGE], f"{source} at {DESKTOP} px"
    assert found["articles"] == 1, f"{at}: {found['articles']} article.md-content__inner, expected 1"
    assert_clean(shown, site_url, f"{at} ({shown.url})")
    if 'class="arithmatex"' in html:
        assert found["formulas"] > 0, f"{at}: its HTML has math but the page shows no .arithmatex"
        bad = found["untypeset"]
        assert not bad, f"{at}: {len(bad)} of {found['formulas']} formulas not typeset: {bad[:5]}"
        assert found["typeset"] > 0, f"{at}: no formula typeset by KaTeX"
    if shows_figure(source):
        sizes = found["svgSizes"]
        figures = [s for s in sizes if s[0] >= 150 and s[1] >= 100]
        assert figures, f"{at}: runs to_svg( but shows no SVG figure (svg sizes: {sizes})"


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
    page.settle()
    target = site_url + page_path(with_math[0])
    assert instant_navigate(target), (
        f"Material reloaded {target} instead of swapping it in (instant navigation): is the "
        "site served at the site_url it was built for?")
    assert page.locator(".arithmatex").count() > 0
    assert_math_typeset(page)
    assert_clean(page, site_url)


@pytest.fixture
def searching_page(open_page):
    with open_page(search=True) as page:  # the built search index, not conftest's empty one
        yield page


def test_search_finds_a_page_offline(searching_page, site_url: str):
    page = searching_page
    query, expected = "padding_mask_from_tokens", "reference/masks/"
    page.goto(site_url)
    page.settle()
    page.locator(".md-search__input").click()
    page.locator(".md-search__input").press_sequentially(query)  # Material listens to keys
    # Material redraws the list on each key the worker answers: read it in one go, and wait (up to the
    # page's timeout) for the page expected to be among the results, rather than counting a list that
    # may still change under the reading
    links = ".md-search-result__item a"
    page.locator(links).first.wait_for()
    try:
        page.wait_for_function("""([sel, want]) => [...document.querySelectorAll(sel)]
            .some(a => (a.getAttribute("href") || "").includes(want))""", arg=[links, expected])
    except Exception:  # noqa: BLE001 - the assert below reports what the list held
        pass
    hrefs = page.eval_on_selector_all(links, "els => els.map(a => a.getAttribute('href'))")
    assert any(expected in (href or "") for href in hrefs), hrefs
    assert_clean(page, site_url)


FIGURE_COLOURS = """() => [...document.querySelectorAll('svg.ar-figure')].map(svg => ({
  background: getComputedStyle(svg.querySelector('#patch_1 path')).fill,
  text: getComputedStyle(svg.querySelector('text')).fill,
}))"""


def test_figures_follow_the_colour_scheme(page, site_url: str):
    """A figure's background and text take the page's colours in the dark scheme, not a white slab."""
    page.goto(site_url + page_path("tutorial/09-cost.md"))
    page.settle()
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


TUTORIAL = [s for s in SOURCES if s.startswith("tutorial/")]
PHONE_SCROLL = probe("phone scroll", """() => ({blocks: (%s)(),
  pageWidth: document.documentElement.scrollWidth})""" % SCROLLING_BLOCKS, TUTORIAL, [PHONE])


@pytest.mark.parametrize("source", TUTORIAL)
def test_tutorial_code_does_not_scroll_sideways_on_a_phone(page_shown, source: str):
    """At 390 px (a phone), no code or output block of a tutorial page needs a sideways swipe."""
    found = page_shown(source, PHONE)[PHONE_SCROLL]
    scrolling = found["blocks"]
    assert not scrolling, f"{source}: {len(scrolling)} blocks scroll sideways at 390 px, e.g. {scrolling[:3]}"
    assert found["pageWidth"] <= 390, f"{source} scrolls sideways at 390 px ({found['pageWidth']} px wide)"


WRAPPED_LINES = """() => [...document.querySelectorAll('article pre > code > span[id^="__span-"]')]
  .filter(line => line.getClientRects().length && line.textContent.trim())
  .filter(line => {
    const height = parseFloat(getComputedStyle(line).lineHeight);
    return line.getBoundingClientRect().height > 1.5 * height;
  })
  .map(line => line.textContent.trimEnd())"""


NARROW_TUTORIAL = [s for s in SOURCES if re.match(r"tutorial/0[1-6]", s)]
WRAPPED = probe("wrapped lines", WRAPPED_LINES, NARROW_TUTORIAL, [PHONE], details_open=True)


@pytest.mark.parametrize("source", NARROW_TUTORIAL)
def test_tutorial_code_lines_fit_a_phone_unwrapped(page_shown, source: str):
    """Tutorial pages 1 to 6 are written at most 44 columns wide, code and printed output: at 390 px,
    with every collapsible (exercise, solution) opened, no line of theirs wraps (a wrapped line
    hangs under its start with a bar, but reads worse)."""
    wrapped = page_shown(source, PHONE)[WRAPPED]
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


FIGURE_PAGES = [s for s in SOURCES if shows_figure(s) or shows_head_grid(s)]
CAPTIONS = probe("captions", FIGURE_CAPTIONS, FIGURE_PAGES, [DESKTOP])


@pytest.mark.parametrize("source", FIGURE_PAGES)
def test_figures_have_captions(page_shown, source: str):
    """Every figure of every page sits in a figure with a centred caption that says what to look at."""
    figures = page_shown(source, DESKTOP)[CAPTIONS]
    at = f"{source} at {DESKTOP} px"
    assert figures, f"{at}: runs to_svg( or head_grid_html( but shows no svg.ar-figure"
    missing = [f["label"] for f in figures if not f["caption"]]
    assert not missing, f"{at}: figures without a <figcaption>: {missing}"
    assert all(f["centred"] for f in figures), f"{at}: captions not centred: {figures}"
    assert all(f["caption"].count(" ") >= 4 for f in figures), (
        f"{at}: a caption is a sentence, not a label: {[f['caption'] for f in figures]}")


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


HEAD_GRID_PAGES = [s for s in SOURCES if shows_head_grid(s)]
GRIDS = probe("head grids", HEAD_GRIDS, HEAD_GRID_PAGES, [PHONE, DESKTOP])


@pytest.mark.parametrize("source", HEAD_GRID_PAGES)
@pytest.mark.parametrize("width", [PHONE, DESKTOP])
def test_head_grids_show_two_heads_per_row_on_a_phone(page_shown, source: str, width: int):
    """A per-head grid shows its N heads per row on a wide screen and 2 per row at 390 px, where
    every head's text still renders at 9 px or more; each head is named for screen readers."""
    grids = page_shown(source, width)[GRIDS]
    assert grids, f"{source} calls head_grid_html( but shows no .ar-head-grid"
    at = f"{source} at {width} px"
    for grid in grids:
        assert len(grid["labels"]) >= 2 and all(grid["labels"]), f"{at}: unnamed heads: {grid}"
        assert len(set(grid["labels"])) == len(grid["labels"]), f"{at}: heads share a name: {grid['labels']}"
        assert not grid["outside"], f"{at}: {grid['outside']} heads end past the column"
        if width == PHONE:
            assert grid["perRow"] <= 2, f"{at}: {grid['perRow']} heads per row: {grid['labels']}"
            assert grid["smallest"] >= 9.0, f"{at}: head text renders at {grid['smallest']:.1f} px"
        else:
            assert grid["perRow"] == min(grid["columns"], len(grid["labels"])), f"{at}: heads per row: {grid}"
            assert grid["smallest"] >= 11.0, f"{at}: head text renders at {grid['smallest']:.1f} px"


def shows_wide_content(source: str) -> bool:
    """Whether the page shows a figure (an SVG of attention_ref.viz), a concept diagram (of
    attention_ref.diagrams), a display formula or a table."""
    text = (DOCS / source).read_text()
    return bool(re.search(r"to_svg\(|head_grid_html\(|map_slider_html\(|diagrams\.\w+\(|^\s*\$\$|^\s*\\\[|"
                          r"^\s*\|.*\|\s*$", text, re.M))


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
    figures: [...document.querySelectorAll('article svg.ar-figure, article svg.ar-diagram')].map(svg => ({
      label: svg.getAttribute('aria-label').slice(0, 60), smallest: smallestText(svg),
      box: box(svg.closest('figure.ar-figure-box, div.ar-diagram-box'), svg.getAttribute('aria-label').slice(0, 60))})),
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


WIDE_PAGES = [s for s in SOURCES if shows_wide_content(s)]
WIDE = probe("wide content", WIDE_CONTENT, WIDE_PAGES, [PHONE, DESKTOP])


@pytest.mark.parametrize("source", WIDE_PAGES)
@pytest.mark.parametrize("width", [PHONE, DESKTOP])
def test_figure_text_is_readable_and_wide_content_scrolls_in_its_own_box(page_shown, source: str,
                                                                         width: int):
    """At 390 px (a phone) and 1280 px, every figure's smallest text renders at 9 px or more (up to
    layout rounding), and a figure or display formula wider than the column scrolls sideways inside
    its own box, which says so under it; a wider table scrolls in its own box too; the page itself
    never scrolls sideways."""
    shown = page_shown(source, width)[WIDE]
    at = f"{source} at {width} px"
    small = [(f["label"], round(f["smallest"], 2)) for f in shown["figures"] if f["smallest"] < 9.0 - 0.01]
    assert not small, f"{at}: figure text below 9 px: {small}"
    boxes = [f["box"] for f in shown["figures"]] + shown["formulas"]
    assert boxes or shown["tables"], f"{at}: no figure, display formula or table found"
    for b in boxes:
        assert b["left"] >= -1 and b["right"] <= width + 1, f"{at}: {b['what']!r} ends outside the screen: {b}"
        if b["wider"]:
            assert b["scrolls"] and b["marked"], f"{at}: {b['what']!r} is cut or scrolls unannounced: {b}"
            assert "Swipe sideways" in b["note"], f"{at}: {b['what']!r} scrolls with no note under it: {b}"
        else:
            assert not b["marked"], f"{at}: {b['what']!r} fits but says to swipe: {b}"
    for t in shown["tables"]:  # Material puts each table in a box of its own that scrolls
        if t["right"] > width:
            assert t["scrolls"] and t["wrapRight"] <= width + 1, f"{at}: table {t['what']!r} is cut: {t}"
    assert shown["pageWidth"] <= width, f"{at}: the page scrolls sideways ({shown['pageWidth']} px wide)"


# The teaching pages (tests/site/test_teaching.py): the home page, tutorial, how-to, inference,
# explanation and contributors' pages.
TEACHING = [s for s in SOURCES
            if s == "index.md" or s.startswith(("tutorial/", "howto/", "inference/", "explanation/", "contributors/"))]
MIN_FIGURE_TEXT_PX = 7.0


MEASURE = """() => {
  document.querySelectorAll('article details').forEach(d => d.open = true);
  const article = document.querySelector('article.md-content__inner');
  const right = article.getBoundingClientRect().right + 1;
  const describe = el => (el.closest('.highlight, .arithmatex, table, pre, svg') || el)
      .textContent.trim().replace(/\\s+/g, ' ').slice(0, 70);
  const wide = [];
  for (const el of article.querySelectorAll('pre > code, div.arithmatex, table, svg, .highlight')) {
    const box = el.getBoundingClientRect();
    if (!box.width) continue;
    if (el.scrollWidth > el.clientWidth + 1 && getComputedStyle(el).overflowX !== 'visible')
      wide.push(`${el.tagName.toLowerCase()} scrolls ${el.scrollWidth}px in ${el.clientWidth}px: ${describe(el)}`);
    else if (box.right > right)
      wide.push(`${el.tagName.toLowerCase()} ends ${Math.round(box.right - right)}px past the column: ${describe(el)}`);
  }
  const small = [];
  let smallest = Infinity;
  for (const t of article.querySelectorAll('svg text')) {
    if (!t.getClientRects().length || !t.textContent.trim()) continue;
    const m = t.getScreenCTM();
    const px = parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b);
    smallest = Math.min(smallest, px);
    if (px < %(min)s) small.push(`${px.toFixed(1)}px "${t.textContent.trim().slice(0, 20)}"`);
  }
  return {wide, small, smallest, column: article.getBoundingClientRect().width};
}""" % {"min": MIN_FIGURE_TEXT_PX}


CLIPPED = probe("clipped", MEASURE, TEACHING, [DESKTOP], details_open=True)


@pytest.mark.parametrize("source", TEACHING)
def test_nothing_clipped_and_figure_text_readable_at_1280px(page_shown, source: str):
    """On a teaching page at 1280 px, with every collapsible (exercise, solution) opened, no code
    block, output block, formula or table is wider than its column (nothing scrolls sideways) and
    no figure text renders below 7 px."""
    shown = page_shown(source, DESKTOP)
    assert shown.math_typeset, f"{source} at 1280 px: formulas still not typeset 15 s after the page loaded"
    found = shown[CLIPPED]
    assert not found["wide"], (f"{source} at 1280 px: {len(found['wide'])} blocks wider than the "
                               f"{found['column']:.0f}px column:\n" + "\n".join(found["wide"]))
    assert not found["small"], (f"{source} at 1280 px: {len(found['small'])} figure texts below "
                                f"{MIN_FIGURE_TEXT_PX}px:\n" + "\n".join(found["small"][:20]))
