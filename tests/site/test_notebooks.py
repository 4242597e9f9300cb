"""The notebooks of the tutorial pages (written by docs/hooks/notebooks.py) hold the pages' code and run.

Each notebook of the built site is read and validated with nbformat. Its code cells must be a
commented install cell with the site's install line, the Jupyter set-up, then per executed
block the code the page shows (with the output the page printed) and the block's hidden
checks as one "Checks" cell, and an empty "Your turn" cell before each solution; no ``\\(``
math, no 127.0.0.1, no links to .md files. Then its code cells run top to bottom in one fresh
namespace, as Jupyter would run them (in this process: the package is already imported, so
the notebooks cost only their own code). test_fresh_notebooks.py runs them in a fresh
environment installed with the install line; when it runs (CI), the run here is left out, so
each notebook runs once per check.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
from pathlib import Path

import nbformat
import pytest

from test_browser import DOCS, ROOT, SOURCES, built_page, find_blocks

TUTORIAL_SOURCES = [s for s in SOURCES if s.startswith("tutorial/")]


def _hook():
    spec = importlib.util.spec_from_file_location("attention_ref_docs_notebooks",
                                                  ROOT / "docs" / "hooks" / "notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


notebooks_hook = _hook()


def built_notebook(built_site: Path, source: str):
    path = built_page(built_site, source).parent / notebooks_hook.notebook_name(source)
    assert path.is_file(), f"{source}: no notebook {path} in the built site"
    notebook = nbformat.read(str(path), as_version=4)
    nbformat.validate(notebook)
    return notebook


def expected_code_cells(source: str) -> list[str]:
    """The code cells a page's notebook should have, "Your turn" cells left out: per block, the
    code the page shows (the explorer made static), then its hidden whole statements as a
    "Checks" cell."""
    cells = [notebooks_hook.INSTALL_CELL, notebooks_hook.SETUP_CELL.rstrip()]
    for block in find_blocks(DOCS / source):
        shown, checks = notebooks_hook.split_hidden(block.code)
        static = notebooks_hook.static_explorer(shown, "")
        cells.append(shown if static is None else static[0])
        if checks:
            cells.append(notebooks_hook.CHECKS_HEADER + checks)
    return cells


@pytest.mark.parametrize("source", TUTORIAL_SOURCES)
def test_notebook_holds_the_pages_code(built_site: Path, source: str):
    notebook = built_notebook(built_site, source)
    code = [cell.source for cell in notebook.cells if cell.cell_type == "code"]
    mine = [c for c in code if c != notebooks_hook.YOUR_TURN]
    expected = expected_code_cells(source)
    explorer = [i for i, c in enumerate(expected) if "interactive explorer" in c]
    for i in explorer:  # the static picture links the page, whose address depends on the build
        expected[i] = re.sub(r"layer and head\): \S*", "", expected[i])
        mine[i] = re.sub(r"layer and head\): \S*", "", mine[i]) if i < len(mine) else None
    assert mine == expected, f"{source}: the notebook's code cells are not the page's blocks"
    assert code[0] == notebooks_hook.INSTALL_CELL and notebooks_hook.INSTALL_LINE in code[0]
    assert all(line.startswith("#") for line in code[0].splitlines()), "install cell must be commented"
    page = (DOCS / source).read_text(encoding="utf-8")
    solutions = len(re.findall(r'^[ \t]*\?\?\?\+?\s+success\b', page, re.M))
    assert code.count(notebooks_hook.YOUR_TURN) == solutions, f"{source}: one Your turn cell per solution"
    for index, cell in enumerate(notebook.cells[:-1]):
        if cell.cell_type == "code" and cell.source == notebooks_hook.YOUR_TURN:
            following = notebook.cells[index + 1]
            assert following.cell_type == "markdown" and "Solution" in following.source
    markdown = "\n".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    assert "???" not in markdown, "Material admonition syntax left in the notebook's Markdown"
    assert "\\(" not in markdown and "\\[" not in markdown, f"{source}: \\( math left (Jupyter wants $)"
    relative = re.findall(r"\]\((?![a-z]+:)[^)]*\.md[)#]", markdown)
    assert not relative, f"{source}: links to the site's .md files, broken in a notebook: {relative}"
    text = json.dumps(notebook)
    assert "127.0.0.1" not in text, f"{source}: the notebook names 127.0.0.1"
    assert "markdown-exec: hide" not in text, f"{source}: hidden-line markers left in the notebook"
    # the output the page printed is stored: every block that prints as text or HTML has some
    cells = [c for c in notebook.cells if c.cell_type == "code" and c.source in mine[2:]]
    shown_cells = {c.source: c for c in cells}
    for block in find_blocks(DOCS / source):
        if block.options.get("result") == "text" or block.options.get("html"):
            shown = notebooks_hook.split_hidden(block.code)[0]
            cell = shown_cells.get(shown)
            if cell is not None:  # (the explorer's cell is rewritten, checked above)
                assert cell.outputs, f"{source}: no stored output for the block at line {block.line}"


#: Set when test_fresh_notebooks.py runs every notebook in a fresh environment (as CI does): that run is
#: this one's and more (outside the checkout, the package as installed), so the notebooks run once.
FRESH_RUN = os.environ.get("ATTENTION_REF_SLOW_TESTS") or os.environ.get("ATTENTION_REF_FRESH_NOTEBOOKS")


@pytest.mark.skipif(bool(FRESH_RUN), reason="test_fresh_notebooks.py runs every notebook this run, in a fresh "
                    "environment installed with the install line")
@pytest.mark.parametrize("source", TUTORIAL_SOURCES)
def test_notebook_runs(built_site: Path, source: str, monkeypatch: pytest.MonkeyPatch):
    notebook = built_notebook(built_site, source)
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = {"__name__": "__notebook__"}
    printed = io.StringIO()
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        code = compile(cell.source, f"{source} notebook cell {index}", "exec")
        with contextlib.redirect_stdout(printed):
            try:
                exec(code, namespace)
            except Exception as error:  # the cell, the error, then what it printed
                pytest.fail(f"{source}: notebook cell {index} raised {type(error).__name__}: "
                            f"{error}\n--- cell ---\n{cell.source}\n--- printed ---\n"
                            f"{printed.getvalue()[-2000:]}", pytrace=False)
    assert printed.getvalue(), f"{source}: the notebook printed nothing"


def test_admonitions_become_plain_markdown():
    text = ('Intro.\n\n??? question "Exercise 1: shapes"\n    What is the shape?\n\n'
            '    ??? success "Solution"\n        It is (2, 3).\n\nAfter.')
    plain = notebooks_hook.prose_to_notebook_markdown(text)
    assert plain.splitlines() == ["Intro.", "", "**Exercise 1: shapes**", "What is the shape?", "",
                                  "**Solution**", "It is (2, 3).", "", "After."]


def test_text_after_a_code_block_inside_a_solution_is_dedented_and_links_point_to_the_site():
    page = ('# T\n\nSee [page 4](04-shapes.md#top).\n\n??? question "Exercise 1: x"\n    Do it.\n\n'
            '    ??? success "Solution"\n        ```python exec="on" session="s"\n        print(1)\n'
            '        ```\n        It prints 1.\n\nAfter.\n')
    notebook = notebooks_hook.page_notebook(page, title="T", url="u", src_uri="tutorial/t.md",
                                            site_url="https://example.org/site/")
    markdown = [c.source for c in notebook.cells if c.cell_type == "markdown"]
    assert "See [page 4](https://example.org/site/tutorial/04-shapes/#top)." in markdown[1]
    assert markdown[-1] == "It prints 1.\n\nAfter."  # not an indented (code) block


def test_a_failing_cell_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    page = tmp_path / "page.md"
    page.write_text('# T\n\n```python exec="on" session="s"\nassert 1 == 2\n```\n')
    notebook = notebooks_hook.page_notebook(page.read_text(), title="T", url="u")
    cells = [c.source for c in notebook.cells if c.cell_type == "code"]
    assert cells[-1] == "assert 1 == 2"
    with pytest.raises(AssertionError):
        exec(compile("\n".join(cells), "nb", "exec"), {})

