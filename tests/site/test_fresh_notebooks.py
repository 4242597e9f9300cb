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
notebook. It also checks that the home page, the README and the notebooks use the line.

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
RUN = os.environ.get("ATTENTION_REF_SLOW_TESTS") or os.environ.get("ATTENTION_REF_FRESH_NOTEBOOKS")
slow = pytest.mark.skipif(
    not RUN, reason="installs a fresh environment from the registries and runs every notebook "
    "(about 2.5 min): set ATTENTION_REF_SLOW_TESTS=1 or ATTENTION_REF_FRESH_NOTEBOOKS=1")

def _hook():
    spec = importlib.util.spec_from_file_location("source_archive_hook", ROOT / "docs/hooks/source_archive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


archive_hook = _hook()


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


def notebook_script(notebook) -> str:
    """The notebook's code cells as one script, each cell announced (for the error report)."""
    parts = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            source = "\n".join(line for line in cell.source.splitlines()
                               if not line.lstrip().startswith(("%", "!")))
            parts.append(f"__cell__ = {index}\n{source}\n")
    return "\n".join(parts)


#: Runs every notebook's script in one process of the fresh environment, each from its own folder and
#: with a namespace of its own (``runpy.run_path``), and writes what each did to a JSON file. One process
#: instead of one per notebook: each would import torch, NumPy and matplotlib again (about 2.5 s of a core
#: apiece). A notebook that raises does not stop the next; each test below reads its own notebook's line.
DRIVER = """
import contextlib, io, json, os, runpy, sys, time, traceback
results = {}
for source, folder in json.loads(sys.argv[1]):
    os.chdir(folder)
    printed = io.StringIO()
    start = time.perf_counter()
    error = None
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(os.path.join(folder, "notebook.py"), run_name="__main__")
    except BaseException:  # SystemExit and KeyboardInterrupt of a notebook too
        error = traceback.format_exc()
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
    results[source] = {"error": error, "printed": printed.getvalue()[-2000:],
                       "seconds": time.perf_counter() - start}
    with open(sys.argv[2], "w") as out:  # after each notebook: a crash keeps what ran before it
        json.dump(results, out)
"""


@pytest.fixture(scope="module")
def notebook_runs(built_site: Path, fresh_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{source: {"error": traceback or None, "printed": the end of its output, "seconds"}} of every
    tutorial notebook, run top to bottom as a script with the fresh environment's Python (`DRIVER`)."""
    base = tmp_path_factory.mktemp("notebooks")
    plan = []
    for source in TUTORIAL_SOURCES:
        folder = base / notebooks_hook.notebook_name(source).removesuffix(".ipynb")
        folder.mkdir()
        (folder / "notebook.py").write_text(notebook_script(built_notebook(built_site, source)), encoding="utf-8")
        plan.append((source, str(folder)))
    (base / "driver.py").write_text(DRIVER, encoding="utf-8")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([str(fresh_python), "-X", "faulthandler", str(base / "driver.py"), json.dumps(plan),
                           str(base / "results.json")], cwd=base, env=env, capture_output=True, text=True,
                          timeout=1800)
    results = json.loads((base / "results.json").read_text()) if (base / "results.json").is_file() else {}
    for source, _ in plan:  # a notebook the process never finished: the process's own error
        results.setdefault(source, {"error": f"the process running the notebooks exited {done.returncode} "
                                    f"before this one ended:\n{done.stderr[-4000:]}", "printed": "", "seconds": 0.0})
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
        cells = notebook_script(notebook).count("__cell__ = ")
        pytest.fail(f"{source}: the notebook failed in a fresh environment (its code cells: {cells}; "
                    f"`__cell__` in the traceback's frame is the cell)\n{run['error'][-4000:]}", pytrace=False)
    assert run["printed"].strip(), f"{source}: the notebook printed nothing"
    print(f"{source}: {run['seconds']:.1f} s")
