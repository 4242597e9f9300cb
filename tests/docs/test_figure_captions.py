"""Every figure a page prints is captioned: no ``to_svg(`` or ``head_grid_html(`` call without ``caption=``.

The site's rule: a matplotlib figure is centred, captioned and named for screen readers. With
``caption=``, `attention_ref.viz.to_svg` (and `head_grid_html`) put the figure inside
``<figure class="ar-figure-box">``, which the site's CSS centres, with the caption as its
``<figcaption>``; without it the ``<svg>`` stands alone. So every executed block of every page
under docs/ (```python exec="on"```, found by the same fence parser as the build) is parsed
with `ast`, and each call to ``to_svg`` or ``head_grid_html`` (``to_svg(...)``,
``viz.to_svg(...)``, spread over lines or not) must pass ``caption=`` a value that is not
``None`` or ``""``. A failure names the page and the line of the call.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_shown_code import (
    fences,  # the one fence parser (docs/hooks/fences.py), loaded there
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FIGURE_FUNCTIONS = {"to_svg", "head_grid_html"}



def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _captioned(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg == "caption":
            value = keyword.value
            return not (isinstance(value, ast.Constant) and value.value in (None, ""))
    return False


def uncaptioned(page: Path) -> list[str]:
    """``page:line: call`` for every figure call without a caption in the executed blocks of ``page``."""
    relative = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else str(page)
    found = []
    for block in fences.find_blocks(page):
        try:
            tree = ast.parse(block.code)
        except SyntaxError as error:  # a block that cannot run cannot show a figure either
            found.append(f"{relative}:{block.line + (error.lineno or 1)}: does not parse: {error.msg}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _called_name(node) in FIGURE_FUNCTIONS \
                    and not _captioned(node):
                # block.line is the opening fence; the code's line 1 is the page's next line
                found.append(f"{relative}:{block.line + node.lineno}: "
                             f"{_called_name(node)}( without caption=")
    return sorted(found, key=lambda entry: int(entry.split(":")[1]))


PAGES = sorted(p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.md") if fences.find_blocks(p))


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_has_a_caption(page: str):
    missing = uncaptioned(ROOT / page)
    assert not missing, (
        "figures without a caption (pass caption=\"...\": one sentence on what the figure "
        "shows and what to notice):\n" + "\n".join(missing)
    )


def test_a_call_spread_over_lines_counts_and_prose_does_not(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(
        "Prose: `to_svg(fig)` is not code.\n\n"
        "```python\nprint(to_svg(fig))\n```\n\n"  # shown, not executed
        '```python exec="on" html="1"\n'
        "print(viz.to_svg(fig,\n"
        '                 caption="Two lines."))\n'
        "print(viz.to_svg(fig))\n"
        "print(to_svg(fig, caption=None))\n"
        'print(viz.head_grid_html(w, caption=f"{n} heads."))\n'
        "print(viz.head_grid_html(\n    w,\n    ncols=2))\n"
        "```\n"
    )
    assert [entry.split(": ", 1)[1] for entry in uncaptioned(page)] == [
        "to_svg( without caption=", "to_svg( without caption=", "head_grid_html( without caption="]
    assert [int(entry.split(":")[1]) for entry in uncaptioned(page)] == [10, 11, 13]
