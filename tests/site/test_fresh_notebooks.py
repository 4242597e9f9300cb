"""The notebooks run in a fresh environment installed with the site's one install line.

A reader who takes a tutorial page home runs ``INSTALL_LINE`` (docs/hooks/notebooks.py:
``pip install -c constraints.txt ".[learn]"``) at the root of a clone, in a new virtual
environment, and opens the page's notebook. This test does exactly that: it copies what a
clone holds for the install (pyproject.toml, README.md, constraints.txt, the package) into a
temporary folder, creates a virtual environment with ``python -m venv``, runs the install line
there with the shell, word for word, and then runs every notebook of the built site top to
bottom as a script with that environment's Python, outside the repository (so the package is
the installed one). It fails on any error, on any ``127.0.0.1`` and on any ``\\(`` in a
notebook. It also checks that the home page, the README and the notebooks use the line.

It installs from the package registries (torch 2.13.0 from the machine's local CPU wheel,
pip's cache for the rest): measured here about 75 s for the install and 70 s for the eleven
notebooks, so it runs only when ``ATTENTION_REF_SLOW_TESTS=1`` or
``ATTENTION_REF_FRESH_NOTEBOOKS=1`` is set (``python3 dev.py check`` and ``.ci/run`` pass the
environment through). ``ATTENTION_REF_FRESH_VENV=DIR`` reuses (or creates) the environment in
``DIR`` instead of a temporary one, to iterate on the notebooks without reinstalling.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_notebooks import TUTORIAL_SOURCES, built_notebook, notebooks_hook

ROOT = Path(__file__).resolve().parents[2]
RUN = os.environ.get("ATTENTION_REF_SLOW_TESTS") or os.environ.get("ATTENTION_REF_FRESH_NOTEBOOKS")
pytestmark = pytest.mark.skipif(
    not RUN, reason="installs a fresh environment from the registries and runs every notebook "
    "(about 2.5 min): set ATTENTION_REF_SLOW_TESTS=1 or ATTENTION_REF_FRESH_NOTEBOOKS=1")
CLONE_FILES = ["pyproject.toml", "README.md", "constraints.txt", "attention_ref"]


def test_one_install_line_everywhere():
    """The home page, the README and the how-to pages give the notebooks' install line."""
    line = notebooks_hook.INSTALL_LINE
    for path in ["README.md", "docs/index.md", "docs/howto/visualize-your-model.md"]:
        text = (ROOT / path).read_text(encoding="utf-8")
        assert line in text, f"{path} does not give the install line {line!r}"
    assert line in notebooks_hook.INSTALL_CELL


@pytest.fixture(scope="module")
def fresh_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("ATTENTION_REF_FRESH_VENV")
    base = Path(where) if where else tmp_path_factory.mktemp("fresh")
    venv = base / "venv"
    python = venv / "bin" / "python"
    clone = base / "clone"
    if python.exists() and where:
        return python
    if clone.exists():
        shutil.rmtree(clone)
    clone.mkdir(parents=True)
    for name in CLONE_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, clone / name)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    install = subprocess.run(notebooks_hook.INSTALL_LINE, shell=True, cwd=clone, env=env,
                             capture_output=True, text=True)
    if install.returncode != 0:
        pytest.fail(f"`{notebooks_hook.INSTALL_LINE}` failed in a fresh environment:\n"
                    f"{install.stdout[-3000:]}\n{install.stderr[-3000:]}", pytrace=False)
    print(f"fresh environment installed in {time.perf_counter() - start:.0f} s")
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


@pytest.mark.parametrize("source", TUTORIAL_SOURCES)
def test_notebook_runs_in_a_fresh_environment(built_site: Path, source: str, fresh_python: Path,
                                              tmp_path: Path):
    notebook = built_notebook(built_site, source)
    text = json.dumps(notebook)  # sources and stored outputs alike
    assert "127.0.0.1" not in text, f"{source}: the notebook names 127.0.0.1"
    raw = "\n".join(json.dumps(cell.source)[1:-1] for cell in notebook.cells) + json.dumps(
        [c.get("outputs", []) for c in notebook.cells])
    assert "\\\\(" not in raw, f"{source}: the notebook keeps \\( math (Jupyter expects $)"
    script = tmp_path / "notebook.py"
    script.write_text(notebook_script(notebook), encoding="utf-8")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    env.pop("PYTHONPATH", None)
    start = time.perf_counter()
    result = subprocess.run([str(fresh_python), "-X", "faulthandler", str(script)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        cells = re.findall(r"__cell__ = (\d+)", script.read_text())
        pytest.fail(f"{source}: the notebook failed in a fresh environment "
                    f"(its code cells: {len(cells)})\n{result.stderr[-4000:]}", pytrace=False)
    assert result.stdout.strip(), f"{source}: the notebook printed nothing"
    print(f"{source}: {time.perf_counter() - start:.1f} s")
