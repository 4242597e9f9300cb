"""The notebooks run in a fresh environment installed with the site's one install line.

A reader who takes a tutorial page home downloads the site's source archive (written by
docs/hooks/source_archive.py, linked from the home page), unpacks it, runs ``INSTALL_LINE``
(docs/hooks/notebooks.py: ``pip install -c constraints.txt ".[learn]"``) at its root in a new
virtual environment, and opens a notebook. This test does exactly that: it unpacks the built
site's archive into a temporary folder, creates a virtual environment with ``python -m
venv``, runs the install line there with the shell, word for word, and then runs every
notebook of the archive (each the same file as the built page's) top to bottom as a script
with that environment's Python, outside the repository (so the package is the installed
one): all in one process, each notebook from a folder and with a namespace of its own. It fails on any error, on any ``127.0.0.1`` and on any ``\\(`` in a
notebook. It also checks that the home page, the README and the notebooks use the line. And it
judges the tutorial pages' shown code from that run (tests/docs/test_shown_code.py leaves them to
it then): each cell must print what the build printed for its block, seeded otherwise, so a page's
code runs twice per check (the build and its notebook), not three times.

It installs from the package registries (torch 2.13.0 from the machine's local CPU wheel,
pip's cache for the rest): measured here 27 s for the install (2026-12-07, 2 cores, nothing
compiled at install) and 40 s for the twelve notebooks, so it runs only when ``ATTENTION_REF_SLOW_TESTS=1`` or
``ATTENTION_REF_FRESH_NOTEBOOKS=1`` is set (``python3 dev.py check`` and ``.ci/run`` pass the
environment through). ``ATTENTION_REF_FRESH_VENV=DIR`` reuses (or creates) the environment in
``DIR`` instead of a temporary one, to iterate on the notebooks without reinstalling; pytest-xdist
workers given one ``DIR`` share the environment (a lock file: the first makes it, the others wait).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from test_browser import built_page
from test_notebooks import TUTORIAL_SOURCES, built_notebook, notebooks_hook

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    """A module loaded by path (the hooks and the test modules of another folder are not packages)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


#: tests/docs/test_shown_code.py: its check of a page, which the tutorial pages take from their notebooks here
shown_code = sys.modules.get("test_shown_code") or _load("attention_ref_shown_code", ROOT / "tests/docs/test_shown_code.py")
RUN = os.environ.get("ATTENTION_REF_SLOW_TESTS") or os.environ.get("ATTENTION_REF_FRESH_NOTEBOOKS")
slow = pytest.mark.skipif(
    not RUN, reason="installs a fresh environment from the registries and runs every notebook "
    "(about 2.5 min): set ATTENTION_REF_SLOW_TESTS=1 or ATTENTION_REF_FRESH_NOTEBOOKS=1")

archive_hook = _load("source_archive_hook", ROOT / "docs/hooks/source_archive.py")


def unpacked(built_site: Path, where: Path) -> Path:
    """The site's source archive, unpacked under ``where``: the folder a reader ``cd``s into."""
    archive = built_site / "downloads" / archive_hook.archive_name()
    assert archive.is_file(), f"the built site has no source archive {archive.name}"
    with tarfile.open(archive) as tar:
        tar.extractall(where, filter="data")
    (folder,) = where.iterdir()
    return folder


def test_one_install_line_everywhere():
    """The home page, the README and the how-to pages give the notebooks' install line."""
    line = notebooks_hook.INSTALL_LINE
    for path in ["README.md", "docs/index.md", "docs/howto/visualize-your-model.md"]:
        text = (ROOT / path).read_text(encoding="utf-8")
        assert line in text, f"{path} does not give the install line {line!r}"
    assert line in notebooks_hook.INSTALL_CELL
    home = (ROOT / "docs/index.md").read_text(encoding="utf-8")
    name = archive_hook.archive_name()
    assert f"(downloads/{name})" in home and f"tar xzf {name} && cd {name.removesuffix('.tar.gz')}" in home


def test_the_source_archive_holds_the_install_files_and_the_notebooks(built_site: Path, tmp_path: Path):
    folder = unpacked(built_site, tmp_path)
    for name in archive_hook.SOURCE_FILES:
        assert (folder / name).exists(), f"the archive has no {name}"
    assert (folder / "attention_ref" / "functional.py").read_bytes() == (ROOT / "attention_ref" / "functional.py").read_bytes()
    for source in TUTORIAL_SOURCES:
        path = built_page(built_site, source).parent / notebooks_hook.notebook_name(source)
        assert (folder / "notebooks" / path.name).read_bytes() == path.read_bytes(), source
    assert not list(folder.rglob("__pycache__"))


@pytest.fixture(scope="module")
def fresh_python(built_site: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("ATTENTION_REF_FRESH_VENV")
    base = Path(where) if where else tmp_path_factory.mktemp("fresh")
    base.mkdir(parents=True, exist_ok=True)
    # pytest-xdist workers given one folder share one environment: the first makes it, the others wait
    with (base / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fresh_python(built_site, base, bool(where))


def _fresh_python(built_site: Path, base: Path, reuse: bool) -> Path:
    venv = base / "venv"
    python = venv / "bin" / "python"
    if python.exists() and reuse:
        return python
    if (base / "download").exists():
        shutil.rmtree(base / "download")
    clone = unpacked(built_site, base / "download")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    # pip compiles every module it installs to bytecode, one at a time; here only what the notebooks
    # import is compiled, as they import it (dev.py lets its processes write bytecode): the install
    # line is the reader's, word for word, and so are the files it installs. pip reads a boolean
    # setting of a --no-* option as the option's value, not as the flag: PIP_NO_COMPILE=1 sets
    # compile=True (it compiled 12,345 files, 36 of the install's 58 CPU-seconds, measured on 2 cores
    # 2026-12-07), PIP_NO_COMPILE=0 sets compile=False (26 CPU-seconds in all).
    env["PIP_NO_COMPILE"] = "0"
    install = subprocess.run(notebooks_hook.INSTALL_LINE, shell=True, cwd=clone, env=env,
                             capture_output=True, text=True)
    if install.returncode != 0:
        pytest.fail(f"`{notebooks_hook.INSTALL_LINE}` failed in a fresh environment:\n"
                    f"{install.stdout[-3000:]}\n{install.stderr[-3000:]}", pytrace=False)
    print(f"fresh environment installed in {time.perf_counter() - start:.0f} s")
    compiled = list((venv / "lib").glob("python*/site-packages/torch/__pycache__/*.pyc"))
    assert not compiled, f"pip compiled what it installed ({compiled[0].name}...): PIP_NO_COMPILE did not apply"
    torch = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert torch == "2.13.0+cpu", f"the install line gave torch {torch}, not the CPU build 2.13.0"
    return python


def notebook_cells(notebook) -> list[dict]:
    """The notebook's code cells as the driver runs them: ``{"index", "source", "check"}``, its
    index among all cells, its code (Jupyter's ``%`` and ``!`` lines left out) and whether it is a
    "Checks" cell (the page's hidden asserts)."""
    cells = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            source = "\n".join(line for line in cell.source.splitlines()
                               if not line.lstrip().startswith(("%", "!")))
            cells.append({"index": index, "source": source,
                          "check": cell.source.startswith(notebooks_hook.CHECKS_HEADER)})
    return cells


#: Runs every notebook in one process of the fresh environment, each from its own folder, cell by cell
#: in a namespace of its own, and writes what each did to a JSON file: the output of each cell, and the
#: first error with its cell. One process instead of one per notebook: each would import torch, NumPy
#: and matplotlib again (about 2.5 s of a core apiece). A notebook that raises does not stop the next;
#: each test below reads its own notebook's line. The random generators are seeded before each notebook
#: as tests/docs/test_shown_code.py seeds the shown code (a page seeds what it draws, so another seed
#: than the build's must print the same), and a "Checks" cell runs on a copy of the namespace (with the
#: names the checks before it bound), the generators' state put back after it: the other cells' output
#: is then the shown code's alone, which the shown-code check below compares with the page's (a hidden
#: `torch.manual_seed(1)` planted at the end of a block of page 2 passed that check when a Checks cell
#: could move the generators, and fails it now).
DRIVER = """
import contextlib, io, json, os, random, sys, time, traceback
import numpy, torch
seed = int(sys.argv[3])
missing = object()
numpy_print = numpy.get_printoptions()
results = {}
for source, folder in json.loads(sys.argv[1]):
    os.chdir(folder)
    with open(os.path.join(folder, "cells.json")) as f:
        cells = json.load(f)
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_printoptions(profile="default")
    numpy.set_printoptions(**numpy_print)
    namespace, checks = {"__name__": "__main__"}, {}
    printed, error = {}, None
    start = time.perf_counter()
    for cell in cells:
        out = io.StringIO()
        try:
            code = compile(cell["source"], f"<cell {cell['index']}>", "exec")
            with contextlib.redirect_stdout(out):
                if cell["check"]:  # on the notebook's names and those of the checks before it
                    scope = {**namespace, **checks}
                    state = random.getstate(), numpy.random.get_state(), torch.get_rng_state()
                    exec(code, scope)
                    random.setstate(state[0]), numpy.random.set_state(state[1]), torch.set_rng_state(state[2])
                    checks.update((k, v) for k, v in scope.items() if namespace.get(k, missing) is not v)
                else:  # what it binds hides what the checks bound under those names
                    before = dict(namespace)
                    exec(code, namespace)
                    for k in [k for k in checks if namespace.get(k, missing) is not before.get(k, missing)]:
                        del checks[k]
        except BaseException:  # SystemExit and KeyboardInterrupt of a notebook too
            error = f"in cell {cell['index']}:\\n" + traceback.format_exc()
        printed[cell["index"]] = out.getvalue()
        if error is not None:
            break
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
    results[source] = {"error": error, "cells": printed, "printed": "".join(printed.values())[-2000:],
                       "seconds": time.perf_counter() - start}
    with open(sys.argv[2], "w") as out:  # after each notebook: a crash keeps what ran before it
        json.dump(results, out)
"""


@pytest.fixture(scope="module")
def notebook_runs(built_site: Path, fresh_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{source: {"error": its cell and traceback or None, "cells": {cell index: what it printed}, "printed":
    the end of its output, "seconds"}} of every tutorial notebook, run with the fresh environment's Python
    (`DRIVER`)."""
    base = tmp_path_factory.mktemp("notebooks")
    plan = []
    for source in TUTORIAL_SOURCES:
        folder = base / notebooks_hook.notebook_name(source).removesuffix(".ipynb")
        folder.mkdir()
        cells = notebook_cells(built_notebook(built_site, source))
        (folder / "cells.json").write_text(json.dumps(cells), encoding="utf-8")
        plan.append((source, str(folder)))
    (base / "driver.py").write_text(DRIVER, encoding="utf-8")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(fresh_python), "-X", "faulthandler", str(base / "driver.py"), json.dumps(plan),
                           str(base / "results.json"), str(shown_code.SHOWN_SEED)], cwd=base, env=env,
                          capture_output=True, text=True, timeout=1800)
    results = json.loads((base / "results.json").read_text()) if (base / "results.json").is_file() else {}
    for source, _ in plan:  # a notebook the process never finished: the process's own error
        results.setdefault(source, {"error": f"the process running the notebooks exited {done.returncode} "
                                    f"before this one ended:\n{done.stderr[-4000:]}", "cells": {}, "printed": "",
                                    "seconds": 0.0})
    return results


@slow
@pytest.mark.parametrize("source", TUTORIAL_SOURCES)
def test_notebook_runs_in_a_fresh_environment(built_site: Path, source: str, notebook_runs: dict):
    notebook = built_notebook(built_site, source)  # the same bytes as the archive's (test above)
    text = json.dumps(notebook)  # sources and stored outputs alike
    assert "127.0.0.1" not in text, f"{source}: the notebook names 127.0.0.1"
    raw = "\n".join(json.dumps(cell.source)[1:-1] for cell in notebook.cells) + json.dumps(
        [c.get("outputs", []) for c in notebook.cells])
    assert "\\\\(" not in raw, f"{source}: the notebook keeps \\( math (Jupyter expects $)"
    run = notebook_runs[source]
    if run["error"] is not None:
        cells = len(notebook.cells)
        pytest.fail(f"{source}: the notebook failed in a fresh environment (cells 0 to {cells - 1}; "
                    f"`<cell N>` in the traceback is cell N)\n{run['error'][-4000:]}", pytrace=False)
    assert run["printed"].strip(), f"{source}: the notebook printed nothing"
    print(f"{source}: {run['seconds']:.1f} s")


def shown_outputs(notebook, source: str, run: dict) -> list[str] | None:
    """What each executed block of the page printed as its notebook cell in the fresh run, in order
    (blank as ""); None when the run cannot tell: it failed, or a block's cell is not its shown code
    (the explorer, made a static picture)."""
    if run["error"] is not None:
        return None
    cells = [(i, c) for i, c in enumerate(notebook.cells)
             if c.cell_type == "code" and c.source != notebooks_hook.YOUR_TURN][2:]  # after install, set-up
    outputs = []
    for block in shown_code.fences.find_blocks(ROOT / "docs" / source):
        shown, checks = notebooks_hook.split_hidden(block.code)
        index, cell = cells.pop(0)
        if cell.source != shown:
            return None
        printed = run["cells"][str(index)]
        outputs.append(printed if printed.strip() else "")  # the build stores no blank output
        if checks:
            cells.pop(0)
    return outputs


@slow
@pytest.mark.parametrize("source", TUTORIAL_SOURCES)
def test_the_notebook_prints_what_its_page_printed(built_site: Path, source: str, notebook_runs: dict,
                                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """tests/docs/test_shown_code.py's check of a tutorial page (its shown code, seeded otherwise, run from
    a folder of its own, prints what the page printed), with the notebook's run above as the shown code's
    run: the notebook's code cells are the page's shown code. Where that run cannot tell (the explorer's
    static picture, a failed run), the shown code runs here, as test_shown_code.py runs it."""
    if shown_code.JUDGED_IN_NOTEBOOKS:  # the pages test_shown_code.py leaves to this test are these
        assert sorted(set(shown_code.ALL_PAGES) - set(shown_code.PAGES)) == [f"docs/{s}" for s in TUTORIAL_SOURCES]
    shown = shown_outputs(built_notebook(built_site, source), source, notebook_runs[source])
    shown_code.judge_page(f"docs/{source}", monkeypatch, tmp_path, shown=shown)
