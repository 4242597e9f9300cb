"""A reader who copies the code a page shows, block by block, gets the output the page prints,
from a folder of their own (not the checkout: a page reads committed files through
`attention_ref.measured`, never a path relative to the working directory).

Every executed block may hide lines from the reader (``# markdown-exec: hide``: the asserts
that keep the page honest, figure styling). Hidden lines must not change what the page prints
(a figure may lose its styling, such as axis labels, never change a word). And a page must
seed the random numbers it draws, so that its output does not depend on what ran before it
(the notebooks and `mkdocs serve` run pages alone). So for every page, its blocks run once as
written and once with the hidden lines left out and the random generators seeded differently,
each session in its own namespace, and every block must print the same in both runs. A block
whose output changes from one run of the full code to the next (a measured time, a plot of
one) cannot be compared, and is reported as skipped; it is found by running the page as
written a second time, seeded as the first.

In ``python3 dev.py check`` the page as written is not run again here: the strict build
recorded what each block printed (docs/hooks/build_record.py, the file named by
``ATTENTION_REF_BUILD_RECORD``), and the shown code is compared with that. Only a page whose
shown code prints something else than the build is then run as written here (once: the
build's run counts as the first) and judged as above: so a page's code runs twice per check
(the build, the shown code), not three times. A block that prints a measured value runs twice more, with
the blocks of its own session before it (page 11 times its KV cache in a session of its own, so
that this is one block), and the page as written up to it only when that cannot tell. The tutorial
pages are judged from their notebooks' run in tests/site/test_fresh_notebooks.py then
(`JUDGED_IN_NOTEBOOKS`): the notebooks run anyway, and a notebook is its page's shown code.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("MPLBACKEND", "Agg")


def _fences():
    name = "attention_ref_docs_fences"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / "fences.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


fences = _fences()
BUILD_RECORD = os.environ.get("ATTENTION_REF_BUILD_RECORD")
DEFAULT_NUMPY_PRINT = np.get_printoptions()
#: The seeds of the two runs: the page as written (where the build's record does not stand in for it)
#: and the shown code; tests/site/test_fresh_notebooks.py seeds the notebooks as the shown code.
FULL_SEED, SHOWN_SEED = 1, 2
ALL_PAGES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")
                   if fences.find_blocks(p))
#: Where tests/site/test_fresh_notebooks.py runs every tutorial notebook in a fresh environment, from a
#: built site (``dev.py check``, CI), it judges those pages' shown code from that run (a notebook's code
#: cells are its page's shown code, each cell's stored output what the build printed), so that their
#: code runs twice per check (the build, the notebook), not three times; they are left out here then.
JUDGED_IN_NOTEBOOKS = bool((os.environ.get("ATTENTION_REF_SLOW_TESTS") or os.environ.get("ATTENTION_REF_FRESH_NOTEBOOKS"))
                           and os.environ.get("ATTENTION_REF_BUILT_SITE"))
NOTEBOOK_PAGES = [p for p in ALL_PAGES if p.startswith("docs/tutorial/")]  # docs/hooks/notebooks.py's SECTIONS
PAGES = [p for p in ALL_PAGES if not (JUDGED_IN_NOTEBOOKS and p in NOTEBOOK_PAGES)]


def run_page(blocks, *, shown: bool, seed: int = 0) -> list[str]:
    """What each block prints, running the whole code or only the shown code, after seeding
    the random generators with ``seed``. (A caller that needs the first blocks only passes those:
    a block's output depends on the blocks before it, never on those after.)"""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # how tensors and arrays print: a page that sets it (position.md) must not change the next page's
    torch.set_printoptions(profile="default")
    np.set_printoptions(**DEFAULT_NUMPY_PRINT)
    namespaces: dict[str, dict] = {}
    outputs = []
    for block in blocks:
        if block.session:
            namespace = namespaces.setdefault(block.session, {"__name__": f"page_{block.session}"})
        else:
            namespace = {"__name__": "page_block"}
        printed = io.StringIO()
        namespace["print"] = lambda *texts, end="\n", **kwargs: printed.write(
            " ".join(str(t) for t in texts) + end)
        code = block.shown_code if shown else block.code
        try:
            exec(compile("\n" * block.line + code, str(block.path), "exec"), namespace)
        except Exception as error:  # noqa: BLE001 - the difference is what the test reports
            printed.write(f"\n[raised {type(error).__name__}: {error}]")
        outputs.append(printed.getvalue())
    return outputs


_SVG = re.compile(r"<svg\b.*?</svg>", re.DOTALL)
_SVG_TEXT = re.compile(r"<text\b[^>]*>([^<]*)</text>")


def built_outputs(page: str, blocks) -> list[str] | None:
    """What the strict build printed for each block of ``page`` (docs/hooks/build_record.py), or None
    when there is no record of it (no ``ATTENTION_REF_BUILD_RECORD``, or not every block recorded)."""
    if not BUILD_RECORD:
        return None
    path = Path(BUILD_RECORD)
    if not path.is_file():
        raise AssertionError(f"ATTENTION_REF_BUILD_RECORD={BUILD_RECORD} names no file: did the build run?")
    recorded = json.loads(path.read_text(encoding="utf-8"))["pages"].get(page.removeprefix("docs/"))
    if recorded is None or [b["line"] for b in recorded["blocks"]] != [b.line for b in blocks]:
        return None
    return [b["output"] for b in recorded["blocks"]]


def same_output(full: str, shown: str) -> bool:
    """Whether the shown code printed what the whole code printed. Text must be equal. A figure
    (inline SVG) may lose words, since hidden lines may style it (axis labels, titles, legends),
    but every word it shows must be one the page's figure shows, and the figures are as many."""
    full_svgs, shown_svgs = _SVG.findall(full), _SVG.findall(shown)
    if _SVG.sub("<svg>", full) != _SVG.sub("<svg>", shown) or len(full_svgs) != len(shown_svgs):
        return False
    return all(set(_SVG_TEXT.findall(b)) <= set(_SVG_TEXT.findall(a))
               for a, b in zip(full_svgs, shown_svgs))


def describe(output: str) -> str:
    return _SVG.sub(lambda m: "<svg with words: " + " | ".join(_SVG_TEXT.findall(m.group())) + ">",
                    output)[:600]


def varying_alone(blocks, which: list[int], run_blocks) -> list[int]:
    """Those of the blocks ``which`` that print something else when the blocks of their own session
    up to them (a block of no session: itself alone) are run twice by ``run_blocks(subset)``."""
    sessions = {blocks[i].session for i in which if blocks[i].session}
    last = max(which)
    subset = [j for j in range(last + 1) if j in which or blocks[j].session in sessions]
    first, second = run_blocks([blocks[j] for j in subset]), run_blocks([blocks[j] for j in subset])
    return [i for i in which if first[subset.index(i)] != second[subset.index(i)]]


@pytest.mark.parametrize("page", PAGES)
def test_shown_code_prints_what_the_page_prints(page: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    judge_page(page, monkeypatch, tmp_path)


def judge_page(page: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shown: list[str] | None = None) -> None:
    """Fail when ``page``'s shown code prints something else than the page (see the module's docstring);
    skip when the only differences are blocks that print measured values. ``shown``: what each block's
    shown code printed in a run already made (a notebook's, seeded with `SHOWN_SEED`), else it runs here."""
    blocks = fences.find_blocks(ROOT / page)

    def run(shown: bool, seed: int, upto: int | None = None) -> list[str]:
        # the page as the site builds it, from the checkout; the shown code as a reader runs
        # it, from an empty folder of their own (a path into the checkout fails there)
        monkeypatch.chdir(tmp_path if shown else ROOT)
        return run_page(blocks[:upto], shown=shown, seed=seed)

    if shown is None:
        shown = run(True, seed=SHOWN_SEED)  # a page seeds what it draws
    assert len(shown) == len(blocks), f"{page}: {len(shown)} outputs given for {len(blocks)} blocks"
    built = built_outputs(page, blocks)
    full = built if built is not None else run(False, seed=FULL_SEED)
    differ = [i for i, (a, b) in enumerate(zip(full, shown)) if not same_output(a, b)]
    if not differ:
        return  # the shown code printed what the site shows
    # A block that prints a measurement (a time, a slope fitted to times) may print the same
    # twice by chance: it varies if either version, run again, prints something else. First the
    # cheap test: the blocks of its own session only (other sessions have other namespaces), as
    # written, twice with the same seed; a block that prints two things there varies. (A block
    # whose output depends on the blocks of other sessions prints the same twice there, and goes on.)
    def as_written(subset):
        monkeypatch.chdir(ROOT)
        return run_page(subset, shown=False, seed=FULL_SEED)

    varying = varying_alone(blocks, differ, as_written)
    rest = [i for i in differ if i not in varying]
    if rest:
        # Then the page as written up to the last block left (what follows cannot change it), once
        # here (with the build's record, the build's run was the first), and the shown code again.
        last = max(rest) + 1
        again = run(False, seed=FULL_SEED, upto=last)
        varying += [i for i in rest if again[i] != full[i]]
        if any(i not in varying for i in rest):
            shown_again = run(True, seed=SHOWN_SEED, upto=last)
            varying += [i for i in rest if i not in varying and shown_again[i] != shown[i]]
    wrong = [i for i in differ if i not in varying]
    report = [f"{page}:{blocks[i].line}: printed\n{describe(full[i])}\n"
              f"but its shown code alone printed\n{describe(shown[i])}" for i in wrong]
    assert not wrong, "hidden lines change what the page prints:\n\n" + "\n\n".join(report)
    pytest.skip(f"{page}: {len(varying)} block(s) print measured values that vary from run to run "
                f"(lines {', '.join(str(blocks[i].line) for i in varying)})")


def test_a_hidden_line_that_changes_the_output_is_caught(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text('```python exec="on" session="s"\nx = 1\nx += 1  # markdown-exec: hide\n'
                    'print(x)\n```\n')
    blocks = fences.find_blocks(page)
    assert run_page(blocks, shown=False) == ["2\n"]
    assert run_page(blocks, shown=True) == ["1\n"]


def test_a_figure_may_lose_its_styling_but_not_change_its_words():
    styled = '<svg x="1"><g style="fill: red"><text>weight</text><text>0.5</text></g></svg>'
    assert same_output("a " + styled, "a " + styled.replace("<text>weight</text>", ""))
    assert not same_output("a " + styled, "a " + styled.replace("0.5", "0.6"))
    assert not same_output("a " + styled, "b " + styled)
    assert not same_output(styled + styled, styled)


def test_only_a_block_that_prints_two_things_when_run_twice_counts_as_measured(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text('```python exec="on" session="a"\nimport time\nprint(time.perf_counter())\n```\n\n'
                    '```python exec="on" session="b"\nx = 1\n```\n\n'
                    '```python exec="on" session="b"\nprint(x)\n```\n\n'
                    '```python exec="on"\nimport random\nprint(random.random())\n```\n')
    blocks = fences.find_blocks(page)
    ran = []

    def run(subset):
        ran.append([b.line for b in subset])
        return run_page(subset, shown=False, seed=1)

    # the time varies; the seeded draw and the block that reads its session's x do not
    assert varying_alone(blocks, [0, 2, 3], run) == [0]
    assert ran == [[b.line for b in blocks]] * 2
    ran.clear()
    assert varying_alone(blocks, [2], run) == [] and ran == [[blocks[1].line, blocks[2].line]] * 2
