"""MkDocs hook: make `mkdocs serve` show edits to the package without a restart.

`mkdocs serve` rebuilds in the same Python process, so without this hook the executed blocks
would keep using `attention_ref` as it was first imported, and markdown-exec sessions would keep
the variables of the previous build. Before each build (the first one and every rebuild after an
edit; `watch:` in mkdocs.yml makes package edits trigger one) this drops the package's modules
from `sys.modules` and empties markdown-exec's session namespaces.

Under `mkdocs serve` only, it also keeps the output of every executed block from the previous
builds, and re-executes a block only when something it depends on changed: its own code, the
code of the earlier blocks of its session, or the code of the package functions that it or
those earlier blocks actually ran. While a block executes, a trace function records every
function of the package that runs (one call event per Python call, no line events); the cached
output remembers a digest of those functions' code (syntax trees without docstrings, so comments,
layout and docstrings do not count) and of their modules' top-level code (imports, constants,
class bodies, signatures). After an edit, only the blocks whose recorded functions changed run
again: editing `viz.heatmap` re-runs the blocks that drew a heatmap, editing the core function
re-runs everything. A rebuild after editing one page executes only that page's changed blocks
(replaying the earlier blocks of their session first, silently, so the namespace is right).
Sessions that read source text themselves (`inspect`, `__doc__`, `help(`) are keyed by the
package's text instead. Before each build, the sessions with a stale block are sent to a
worker process (serve_workers.py), which runs them while this process renders the pages; a
block then takes its output from the worker's run (or runs here, if the worker could not run
it). `mkdocs build` (CI, the tests, publishing) never uses the cache.

`mkdocs build` uses worker processes only when ``ATTENTION_REF_BUILD_WORKERS`` is a positive
number (``python3 dev.py check`` sets it): every session that lies on one page, has no
``workdir`` and draws no explorer (the notebook hook draws its static picture from the session's
namespace, which must then be this process's) is sent to the workers in the order of the
navigation, each in a fresh namespace, and the build takes their outputs as it reaches each
block; the other sessions run here as usual. A block that raises in a worker runs again here,
after the earlier blocks of its session, so its error is reported as without workers.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

PACKAGE = "attention_ref"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE
log = logging.getLogger(f"mkdocs.hooks.{__name__}")

# The helpers shared with the worker processes live in serve_workers.py, imported by name: the
# workers are spawned with this sys.path and import it the same way (see _run_ahead).
if str(Path(__file__).parent) not in sys.path:
    sys.path.append(str(Path(__file__).parent))
import serve_workers  # noqa: E402

#: Worker processes that run stale sessions ahead of the build, while the server renders the
#: pages (0: run every block in the server process). One by default, with torch's default
#: threads, so the served pages equal `mkdocs build`'s to the last digit. With more, each gets
#: an equal share of the cores: faster, but a multi-threaded sum may then add in another
#: order, and a printed digit differ from the build's.
def _count(name: str, default: str) -> int:
    """The whole number >= 0 in the environment variable ``name`` (``default`` when unset or empty)."""
    text = os.environ.get(name, "") or default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a whole number of worker processes >= 0, got {text!r}")
    return value


WORKERS = _count("ATTENTION_REF_SERVE_WORKERS", "1")


#: Worker processes that run the pages' sessions ahead of `mkdocs build` (0: none; see above).
#: Each keeps torch's default threads, which OMP_NUM_THREADS sets (dev.py: as many as a test worker).
BUILD_WORKERS = _count("ATTENTION_REF_BUILD_WORKERS", "0")


def _clear_markdown_exec_sessions() -> int:
    try:  # a private module of markdown-exec (checked with 1.12): fail loudly if it moves
        from markdown_exec._internal.formatters import python as formatter
    except ImportError as error:
        raise RuntimeError(
            "docs/hooks/reload.py: markdown-exec's session store moved; update the hook"
        ) from error
    count = len(formatter._sessions_globals)
    formatter._sessions_globals.clear()
    formatter._sessions_counter.clear()
    formatter._code_blocks.clear()
    return count


def on_startup(command, **kwargs) -> None:
    import torch

    if not torch.cuda.is_available():
        # Triton kernels run on the CPU only under its interpreter, which must be switched on
        # before triton is first imported (a later page may import it before the kernel page).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if command == "serve":
        _SERVING["on"] = True
        _install_block_cache()
        # re-importing an edited module would write its .pyc into attention_ref/__pycache__,
        # which `watch:` sees as another change: one edit would trigger two rebuilds
        sys.dont_write_bytecode = True
    elif command == "build" and BUILD_WORKERS > 0:
        _BUILD["on"] = True
        _install_build_ahead()


def on_pre_build(config, **kwargs) -> None:
    dropped = [name for name in sys.modules if name == PACKAGE or name.startswith(PACKAGE + ".")]
    for name in dropped:
        del sys.modules[name]
    sessions = _clear_markdown_exec_sessions()
    _CACHE_STATE.update(text=_package_text(), chains={}, chain_deps={}, pending={}, reads_source=set(),
                        modules={}, digests={}, ahead={}, generation=_CACHE_STATE["generation"] + 1)
    if _SERVING["on"]:
        _run_ahead(config)
    if dropped or sessions:
        log.info("reload hook: dropped %d %s modules, cleared %d markdown-exec sessions",
                 len(dropped), PACKAGE, sessions)


# ---- serve-only cache of executed block outputs --------------------------------------------

#: A block whose code contains one of these may print the package's source or docstrings.
_READS_SOURCE = ("inspect", "__doc__", "help(")


class _Entry(NamedTuple):
    output: str  # what the block printed
    deps: frozenset[tuple[str, str]]  # (file, qualified name) of the package code it and its chain ran
    digest: str  # _deps_digest(deps) when it ran


#: key (session, code chain) -> its cached runs, newest last; a few are kept, so that undoing an
#: edit of the package finds the run from before the edit
_CACHE: dict[str, list[_Entry]] = {}
_RUNS_KEPT = 3
_CACHE_STATE: dict = {"text": "", "chains": {}, "chain_deps": {}, "pending": {}, "reads_source": set(),
                      "modules": {}, "digests": {}, "ahead": {}, "generation": 0, "hits": 0, "runs": 0,
                      "seconds": 0.0, "worker_runs": 0, "worker_seconds": 0.0, "slowest": []}
_POOL: dict = {"executor": None, "broken": False}
_SERVING = {"on": False}


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _package_text() -> str:
    """Digest of the package's source text as written (for the sessions that print source)."""
    return _digest(*(f"{f.relative_to(PACKAGE_DIR)}\n{f.read_text()}" for f in sorted(PACKAGE_DIR.rglob("*.py"))))


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if isinstance(body, list):
            kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                            and isinstance(s.value.value, str))]
            child.body = kept or [ast.Pass()]
    return node


def _code_of(source: str) -> str:
    """The syntax tree of ``source`` without its string statements (docstrings), as text."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a file in the middle of an edit: its text is all there is
        return source
    return ast.dump(_strip_docstrings(tree))


def _module_index(source: str) -> tuple[str, dict[str, str]]:
    """A module's top-level code (function bodies left out) and the code of each function.

    Functions are named by qualified name (``Class.method``); nested functions, lambdas and
    comprehensions belong to the function around them.
    """
    try:
        tree = _strip_docstrings(ast.parse(source))
    except SyntaxError:  # mid-edit: every function "changed"
        return source, {}
    functions: dict[str, str] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[prefix + node.name] = ast.dump(node)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    for node in ast.walk(tree):  # the top-level code keeps signatures and decorators only
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not serve_workers.is_jit(node):
            node.body = [ast.Pass()]  # (Triton kernels record no calls: they stay whole)
    return ast.dump(tree), functions


def _dep_digest(path: str, qualname: str) -> str:
    memo = _CACHE_STATE["digests"]  # per build: (path, qualname) -> digest
    if (path, qualname) in memo:
        return memo[path, qualname]
    modules = _CACHE_STATE["modules"]  # per build: path -> digest of its top-level code, functions
    if path not in modules:
        try:
            top_level, functions = _module_index(Path(path).read_text())
        except OSError:  # a deleted module
            top_level, functions = "", {}
        modules[path] = (_digest(path, top_level), functions)
    top_level, functions = modules[path]
    outer = qualname.split(".<locals>.", 1)[0]
    memo[path, qualname] = _digest(top_level, functions.get(outer, ""))
    return memo[path, qualname]


def _deps_digest(deps: frozenset[tuple[str, str]]) -> str:
    return _digest(*(f"{path}:{name}:{_dep_digest(path, name)}" for path, name in sorted(deps)))


def _next_key(state: dict, session: str | None, code: str) -> str:
    """The cache key of the next block of ``session`` (or of a block without one): its code and
    the code of the session's earlier blocks, and the package's text from the first block that
    may print source on."""
    if session is None:
        reads_source = any(token in code for token in _READS_SOURCE)
        return _digest(state["text"] if reads_source else "", "", code)
    if any(token in code for token in _READS_SOURCE):  # the namespace may hold source text now
        state["reads_source"].add(session)
    chain = _digest(state["chains"].get(session, ""), code)
    state["chains"][session] = chain
    return _digest(state["text"] if session in state["reads_source"] else "", session, chain)


def _valid_entry(key: str) -> _Entry | None:
    """The newest cached run of ``key`` whose recorded package functions are unchanged."""
    return next((e for e in reversed(_CACHE.get(key, [])) if _deps_digest(e.deps) == e.digest), None)


# ---- stale sessions run ahead, in worker processes -------------------------------------------

def _pool() -> ProcessPoolExecutor | None:
    if WORKERS < 1 or _POOL["broken"]:
        return None
    if _POOL["executor"] is None:
        _POOL["executor"] = ProcessPoolExecutor(
            WORKERS, mp_context=multiprocessing.get_context("spawn"),
            initializer=serve_workers.init_worker,
            initargs=(None if WORKERS == 1 else max(1, (os.cpu_count() or 1) // WORKERS),))
    return _POOL["executor"]


def _sessions(docs_dir: Path, order: list[Path] | None = None,
              keep_here: tuple[str, ...] = ()) -> list[tuple[str | None, list[str]]]:
    """Every session of the site with the code of its blocks, as markdown-exec receives it (a
    block without a session is a session of its own), the pages of ``order`` first, in that
    order. Sessions that span pages, run in another directory, or have a block whose code holds
    one of ``keep_here`` are left to the server process."""
    fences = serve_workers.fences()
    groups: dict[object, tuple[str | None, list[str]]] = {}
    pages: dict[str, set[Path]] = {}
    unsafe: set[str] = set()
    rank = {path: i for i, path in enumerate(order or [])}
    for page in sorted(docs_dir.rglob("*.md"), key=lambda path: (rank.get(path, len(rank)), path)):
        if "hooks" in page.relative_to(docs_dir).parts:
            continue
        for index, block in enumerate(fences.find_blocks(page)):
            code = block.code.removesuffix("\n")  # markdown-exec gets the fence without it
            if block.session is None:
                if not any(token in code for token in keep_here):
                    groups[page, index] = (None, [code])
                continue
            pages.setdefault(block.session, set()).add(page)
            if block.workdir or any(token in code for token in keep_here):
                unsafe.add(block.session)
            groups.setdefault(block.session, (block.session, []))[1].append(code)
    unsafe |= {session for session, where in pages.items() if len(where) > 1}
    return [group for group in groups.values() if group[0] not in unsafe]


def _run_ahead(config) -> None:
    """Send every session with a stale block to the workers, in page order."""
    pool = _pool()
    if pool is None:
        return
    # spawned workers get this process's sys.path, then unpickle serve_workers.* by name; MkDocs
    # takes docs/hooks off sys.path again after loading the hooks, so it is put back here
    hooks = str(Path(__file__).parent)
    if hooks not in sys.path:
        sys.path.append(hooks)
    state = _CACHE_STATE
    submitted = 0
    for session, codes in _sessions(Path(config["docs_dir"])):
        probe = {"text": state["text"], "chains": {}, "reads_source": set()}
        keys = [_next_key(probe, session, code) for code in codes]
        stale = next((i for i, key in enumerate(keys) if _valid_entry(key) is None), None)
        if stale is None:
            continue
        try:
            future = pool.submit(serve_workers.run_session, state["generation"], session, codes,
                                 os.getcwd())
        except RuntimeError as error:  # a broken pool: run everything here from now on
            _POOL["broken"] = True
            log.info("reload hook: worker processes unavailable (%s); blocks run in the server", error)
            return
        submitted += 1
        for index in range(stale, len(keys)):
            state["ahead"][keys[index]] = (future, index)
    if submitted:
        log.info("reload hook: %d sessions sent to %d worker processes", submitted, WORKERS)


def _from_worker(state: dict, key: str, session: str | None, code: str) -> _Entry | None:
    """The output of ``key`` from a worker, waiting for it; None if no worker ran it or it failed
    there (the server then runs it itself, and reports a failure the usual way)."""
    ahead = state["ahead"].pop(key, None)
    if ahead is None:
        return None
    future, index = ahead
    try:
        results = future.result()
    except Exception as error:  # noqa: BLE001 - a crashed worker: fall back to the server
        if not _POOL["broken"]:
            # info, not a warning: strict mode would stop the server, and nothing is lost
            log.info("reload hook: a worker process failed (%s); blocks run in the server", error)
        _POOL["broken"] = True
        return None
    if index >= len(results) or results[index][1] is not None:
        return None
    output, _, calls, seconds = results[index]
    state["worker_runs"] += 1
    state["worker_seconds"] += seconds
    state["slowest"].append((seconds, session or "(no session)", code.strip().splitlines()[0][:60]))
    entry = _Entry(output, calls, _deps_digest(calls))
    runs = _CACHE.setdefault(key, [])
    runs.append(entry)
    del runs[:-_RUNS_KEPT]
    return entry


def _install_block_cache() -> None:
    from markdown_exec._internal.formatters import python as formatter

    run = formatter._run_python
    if getattr(run, "_attention_ref_cached", False):
        return
    setattr(builtins, serve_workers.RECORD, set())  # calls outside any block land here, unused
    sys.meta_path.insert(0, serve_workers.RecordingFinder(PACKAGE_DIR))

    def cached_run(code, returncode=None, session=None, id=None, **extra):  # noqa: A002
        state = _CACHE_STATE
        key = _next_key(state, session, code)
        chain_deps = state["chain_deps"].get(session, frozenset()) if session else frozenset()
        entry = _valid_entry(key)
        if entry is not None:
            state["hits"] += 1
        else:
            entry = _from_worker(state, key, session, code)
        if entry is not None:
            if session is not None:  # not executed: remember it in case a later block misses
                state["pending"].setdefault(session, []).append((code, extra))
                state["chain_deps"][session] = entry.deps
            return entry.output
        if session is not None:  # bring the session's namespace up to date first
            for earlier_code, earlier_extra in state["pending"].pop(session, []):
                run(earlier_code, session=session, **earlier_extra)
        deps: set[tuple[str, str]] = set(chain_deps)
        start = time.perf_counter()
        output = serve_workers.recording(run, deps)(code, returncode, session, id, **extra)
        state["runs"] += 1
        seconds = time.perf_counter() - start
        state["seconds"] += seconds
        state["slowest"].append((seconds, session or "(no session)", code.strip().splitlines()[0][:60]))
        deps_frozen = frozenset(deps)
        runs = _CACHE.setdefault(key, [])
        runs.append(_Entry(output, deps_frozen, _deps_digest(deps_frozen)))
        del runs[:-_RUNS_KEPT]
        if session is not None:
            state["chain_deps"][session] = deps_frozen
        return output

    cached_run._attention_ref_cached = True
    formatter._run_python = cached_run


def on_post_build(config, **kwargs) -> None:
    _build_post(config)
    state = _CACHE_STATE
    for future, _ in state["ahead"].values():  # predicted but never asked for
        future.cancel()
    if state["hits"] or state["runs"] or state["worker_runs"]:
        log.info("reload hook: %d blocks executed in worker processes (%.1f s of work), %d in the "
                 "server (%.1f s), %d served from the serve cache", state["worker_runs"],
                 state["worker_seconds"], state["runs"], state["seconds"], state["hits"])
        for seconds, session, first_line in sorted(_CACHE_STATE["slowest"], reverse=True)[:5]:
            if seconds >= 0.25:
                log.info("reload hook:   %.2f s  session %s: %s", seconds, session, first_line)
    _CACHE_STATE.update(hits=0, runs=0, seconds=0.0, worker_runs=0, worker_seconds=0.0, slowest=[],
                        ahead={})


def on_shutdown(**kwargs) -> None:
    if _POOL["executor"] is not None:
        _POOL["executor"].shutdown(wait=False, cancel_futures=True)
        _POOL["executor"] = None


# ---- `mkdocs build` with worker processes -----------------------------------------------------

_BUILD: dict = {"on": False, "executor": None, "ahead": {}, "pending": {}, "worker_runs": 0,
                "worker_seconds": 0.0, "waited": 0.0, "here": 0}


def on_nav(nav, config, files, **kwargs):
    """Under `mkdocs build` with workers: send the sessions to them, in the navigation's order
    (the order the build reaches them)."""
    if not _BUILD["on"]:
        return nav
    hooks = str(Path(__file__).parent)  # as in _run_ahead: the spawned workers import serve_workers by name
    if hooks not in sys.path:
        sys.path.append(hooks)
    if _BUILD["executor"] is None:
        _BUILD["executor"] = ProcessPoolExecutor(
            BUILD_WORKERS, mp_context=multiprocessing.get_context("spawn"),
            initializer=serve_workers.init_worker, initargs=(None, False))
    order = [Path(page.file.abs_src_path) for page in nav.pages]
    ahead: dict[tuple[str | None, str], list] = {}
    sessions = _sessions(Path(config["docs_dir"]), order, keep_here=("explorer_html",))
    for session, codes in sessions:
        future = _BUILD["executor"].submit(serve_workers.run_session, 0, session, codes, os.getcwd())
        for index, code in enumerate(codes):
            ahead.setdefault((session, code), []).append((future, index))
    _BUILD.update(ahead=ahead, pending={}, worker_runs=0, worker_seconds=0.0, waited=0.0, here=0)
    log.info("reload hook: %d sessions sent to %d worker processes", len(sessions), BUILD_WORKERS)
    return nav


def _install_build_ahead() -> None:
    """Wrap markdown-exec's runner: a block's output from the worker that ran its session, else
    (no worker ran it, or it raised there) run here, after the earlier blocks of its session.
    ``last_seconds`` on the wrapper: how long the block ran, wherever it ran (build_record.py)."""
    from markdown_exec._internal.formatters import python as formatter

    run = formatter._run_python

    def ahead_run(code, returncode=None, session=None, id=None, **extra):  # noqa: A002
        queue = _BUILD["ahead"].get((session or None, code))
        if queue:
            future, index = queue.pop(0)
            start = time.perf_counter()
            try:
                results = future.result()
            except Exception as error:  # noqa: BLE001 - a crashed worker: run it here
                log.info("reload hook: a worker process failed (%s); the block runs here", error)
                results = []
            _BUILD["waited"] += time.perf_counter() - start
            if index < len(results) and results[index][1] is None:
                output, _, _, seconds = results[index]
                if session:  # not run here: remember it in case a later block of the session must be
                    _BUILD["pending"].setdefault(session, []).append((code, extra))
                _BUILD["worker_runs"] += 1
                _BUILD["worker_seconds"] += seconds
                ahead_run.last_seconds = seconds
                return output
        if session:  # bring the session's namespace here up to date first
            for earlier_code, earlier_extra in _BUILD["pending"].pop(session, []):
                run(earlier_code, session=session, **earlier_extra)
        start = time.perf_counter()
        try:
            return run(code, returncode, session, id, **extra)
        finally:
            _BUILD["here"] += 1
            ahead_run.last_seconds = time.perf_counter() - start

    ahead_run.last_seconds = 0.0
    formatter._run_python = ahead_run


def _build_post(config, **kwargs) -> None:
    if not _BUILD["on"]:
        return
    log.info("reload hook: %d blocks ran in %d worker processes (%.1f s of work, %.1f s waited for), "
             "%d here", _BUILD["worker_runs"], BUILD_WORKERS, _BUILD["worker_seconds"], _BUILD["waited"],
             _BUILD["here"])
    if _BUILD["executor"] is not None:
        _BUILD["executor"].shutdown(wait=True, cancel_futures=True)
        _BUILD["executor"] = None
