"""The built site teaches: code in view, nothing clipped, readable figures, exercises, notebooks.

On every teaching page (the home page, tutorial, how-to, explanation, contributors):

- every executed block shows its code above its result (markdown-exec ``source="above"``), but
  for the few whose result is what a newcomer came for (`RESULT_FIRST`: the home page's reading
  plan), which show it below; no block's code hides behind a "Source" tab in the built page;
- in Chromium at 1280 px, with every collapsible (exercise, solution) opened, no code block,
  output block, formula or table is wider than its column (nothing scrolls sideways) and no
  figure text renders below 7 px (``test_nothing_clipped_and_figure_text_readable_at_1280px`` in
  tests/site/test_browser.py, which loads each page once per width for all its checks);

on every page, no raw TeX reaches the navigation, the table of contents or the search index;
and every tutorial page has at least two exercises, each with a solution that runs code, and a
link at its top to its own notebook (tests/site/test_notebooks.py runs the notebooks).
"""

from __future__ import annotations

import html.parser
import json
import re
from pathlib import Path

import pytest

from test_browser import DOCS, SOURCES, TEACHING, built_page, find_blocks

TUTORIAL = [s for s in SOURCES if s.startswith("tutorial/")]
RAW_TEX = re.compile(r"\\[(\[]|\\[a-zA-Z]+\{|\$")


def test_the_page_lists_are_not_empty():
    assert len(TUTORIAL) >= 10 and len(TEACHING) > len(TUTORIAL)


#: (page, session) of the blocks whose result comes first and their code below it: the result is
#: what the reader came for, and the code would push it down a screen or two.
RESULT_FIRST = {("index.md", "home-plan")}


@pytest.mark.parametrize("source", TEACHING)
def test_every_executed_block_shows_its_code_above_its_result(source: str):
    blocks = find_blocks(DOCS / source)
    hidden = [f"{source}:{b.line} source={b.options.get('source')!r}" for b in blocks
              if b.options.get("source") != ("below" if (source, b.session) in RESULT_FIRST else "above")]
    assert not hidden, ("executed blocks whose code is not shown above their result "
                        "(use source=\"above\"):\n" + "\n".join(hidden))
    empty = [f"{source}:{b.line}" for b in blocks if not b.shown_code.strip()]
    assert not empty, "executed blocks that show no code at all: " + ", ".join(empty)


def test_the_home_page_shows_its_reading_plan_before_any_code(built_site: Path):
    text = built_page(built_site, "index.md").read_text(encoding="utf-8")
    article = text[text.index("<article"):]
    plan = article.index("<th>know first</th>")
    first_code = article.index('<div class="highlight">')  # a block of code, highlighted
    assert plan < first_code, "the reading plan comes after a block of Python on the home page"


@pytest.mark.parametrize("source", TEACHING)
def test_no_code_behind_a_tab_in_the_built_page(built_site: Path, source: str):
    text = built_page(built_site, source).read_text(encoding="utf-8")
    labels = re.findall(r'<label[^>]*for="__tabbed_[^"]*"[^>]*>([^<]*)</label>', text)
    assert "Source" not in labels, f"{source}: a block's code is behind a 'Source' tab"


class _Collector(html.parser.HTMLParser):
    """Text of the elements whose class contains one of ``classes`` (nav links, TOC, titles)."""

    def __init__(self, classes: tuple[str, ...]) -> None:
        super().__init__()
        self.classes, self.depth, self.texts = classes, 0, []

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class") or ""
        if self.depth:
            self.depth += 1
        elif any(c in cls.split() for c in self.classes):
            self.depth = 1
            self.texts.append("")

    def handle_endtag(self, tag):
        if self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.texts[-1] += data


@pytest.mark.parametrize("source", SOURCES)
def test_no_raw_tex_in_navigation_or_table_of_contents(built_site: Path, source: str):
    collector = _Collector(("md-nav__link", "md-ellipsis"))
    collector.feed(built_page(built_site, source).read_text(encoding="utf-8"))
    assert collector.texts, f"{source}: no navigation found"
    raw = sorted({t.strip() for t in collector.texts if RAW_TEX.search(t)})
    assert not raw, f"{source}: raw TeX in the navigation or table of contents: {raw}"


def test_no_raw_tex_in_search_titles(built_site: Path):
    index = json.loads((built_site / "search" / "search_index.json").read_text(encoding="utf-8"))
    raw = sorted({d["title"] for d in index["docs"] if RAW_TEX.search(d.get("title", ""))})
    assert not raw, f"raw TeX in search titles: {raw}"


def test_the_checks_see_raw_tex_and_tabs():
    collector = _Collector(("md-nav__link",))
    collector.feed('<a class="md-nav__link"><span>Why divide by \\(\\sqrt{d_k}\\)</span></a>')
    assert RAW_TEX.search(collector.texts[0])
    assert not RAW_TEX.search("Why divide by the square root of d_k")


@pytest.mark.parametrize("source", TUTORIAL)
def test_tutorial_page_has_exercises_with_executed_solutions(built_site: Path, source: str):
    blocks = find_blocks(DOCS / source)
    text = (DOCS / source).read_text(encoding="utf-8")
    exercises = re.findall(r'^\?\?\?\+? question "([^"]+)"', text, flags=re.M)
    assert len(exercises) >= 2, f"{source}: {len(exercises)} exercises, expected at least 2"
    solved = [b for b in blocks if b.code and _inside_solution(text, b.line)]
    assert len(solved) >= len(exercises), (
        f"{source}: {len(exercises)} exercises but {len(solved)} executed solution blocks")
    page = built_page(built_site, source).read_text(encoding="utf-8")
    assert page.count('<details class="question"') >= 2
    assert page.count('<details class="success"') >= 2
    assert "Recap" in page, f"{source}: no recap"


def _inside_solution(text: str, line: int) -> bool:
    """Whether the fence at 1-based ``line`` sits in a ``??? success "Solution"`` admonition."""
    lines = text.splitlines()[:line - 1]
    fence_indent = len(text.splitlines()[line - 1]) - len(text.splitlines()[line - 1].lstrip())
    for previous in reversed(lines):
        stripped = previous.lstrip()
        indent = len(previous) - len(stripped)
        if stripped and indent < fence_indent:
            return stripped.startswith('??? success')
    return False


@pytest.mark.parametrize("source", TUTORIAL)
def test_tutorial_page_links_its_notebook(built_site: Path, source: str):
    html_path = built_page(built_site, source)
    links = re.findall(r'<p class="ar-notebook"><a href="([^"]+\.ipynb)" download>',
                       html_path.read_text(encoding="utf-8"))
    assert len(links) == 1, f"{source}: expected one notebook link at the top, got {links}"
    assert (html_path.parent / links[0]).is_file(), f"{source}: {links[0]} was not built"


def test_the_tutorial_leads_to_its_last_page_and_that_page_says_where_to_go_next():
    pages = sorted(TUTORIAL)
    for here, after in zip(pages, pages[1:]):
        text = (DOCS / here).read_text(encoding="utf-8")
        assert f"]({after.removeprefix('tutorial/')}" in text, f"{here} has no link to the next page, {after}"
    last = (DOCS / pages[-1]).read_text(encoding="utf-8")
    assert "## Where to go next" in last, f"{pages[-1]}, the tutorial's last page, says nowhere to go next"
    section = last[last.index("## Where to go next"):]
    assert len(re.findall(r"\]\((?:\.\./)[^)]+\.md\)", section)) >= 3, section

