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
package's text instead. `mkdocs build` (CI, the tests, publishing) never uses the cache.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import time
from typing import NamedTuple
from pathlib import Path

PACKAGE = "attention_ref"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE
log = logging.getLogger(f"mkdocs.hooks.{__name__}")


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
        _install_block_cache()
        # re-importing an edited module would write its .pyc into attention_ref/__pycache__,
        # which `watch:` sees as another change: one edit would trigger two rebuilds
        sys.dont_write_bytecode = True


def on_pre_build(config, **kwargs) -> None:
    dropped = [name for name in sys.modules if name == PACKAGE or name.startswith(PACKAGE + ".")]
    for name in dropped:
        del sys.modules[name]
    sessions = _clear_markdown_exec_sessions()
    _CACHE_STATE.update(text=_package_text(), chains={}, chain_deps={}, pending={}, reads_source=set(),
                        modules={}, digests={})
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
                      "modules": {}, "digests": {}, "hits": 0, "runs": 0, "seconds": 0.0,
                      "slowest": []}


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
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_jit(node):
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


#: The name the instrumented package code records its calls into (found through builtins).
_RECORD = "__attention_ref_calls__"


def _is_jit(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Triton kernel (``@triton.jit``): Triton reads its source, so it is left as written."""
    return any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)


def _instrument(tree: ast.Module, path: str) -> ast.Module:
    """Make every function and method of a module add ``(path, qualified name)`` to the set in
    ``builtins.__attention_ref_calls__`` when it is called (one statement after the docstring,
    on the line of the body's first statement, so tracebacks and line numbers are unchanged)."""

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_jit(node):
                record = ast.parse(f"{_RECORD}.add(({path!r}, {prefix + node.name!r}))").body[0]
                first = node.body[0]
                docstring = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                             and isinstance(first.value.value, str))
                at = 1 if docstring else 0  # after the docstring, which must stay first
                for child in ast.walk(record):
                    ast.copy_location(child, node.body[min(at, len(node.body) - 1)])
                node.body.insert(at, record)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return tree


class _RecordingLoader(importlib.machinery.SourceFileLoader):
    """Loads a module of the package from its source, instrumented by `_instrument`, never from
    a cached .pyc (which would be the uninstrumented code)."""

    def get_code(self, fullname: str):
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)

    def source_to_code(self, data, path, *, _optimize=-1):
        try:
            tree = ast.parse(data, filename=path)
        except SyntaxError:  # compile it as it is, so the import raises the real error
            return super().source_to_code(data, path)
        return compile(_instrument(tree, str(path)), path, "exec", dont_inherit=True)


class _RecordingFinder(importlib.abc.MetaPathFinder):
    """Finds the package's modules in PACKAGE_DIR and loads them with `_RecordingLoader`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        parts = fullname.split(".")[1:]
        folder = PACKAGE_DIR.joinpath(*parts)
        if (folder / "__init__.py").is_file():
            file, locations = folder / "__init__.py", [str(folder)]
        elif folder.with_suffix(".py").is_file():
            file, locations = folder.with_suffix(".py"), None
        else:
            return None
        return importlib.util.spec_from_file_location(
            fullname, file, loader=_RecordingLoader(fullname, str(file)),
            submodule_search_locations=locations)


def _recording(run, calls: set[tuple[str, str]]):
    """``run`` wrapped so that the package functions it calls are added to ``calls``."""

    def recording_run(*args, **kwargs):
        previous = getattr(builtins, _RECORD)
        setattr(builtins, _RECORD, calls)
        try:
            return run(*args, **kwargs)
        finally:
            setattr(builtins, _RECORD, previous)

    return recording_run


def _install_block_cache() -> None:
    from markdown_exec._internal.formatters import python as formatter

    run = formatter._run_python
    if getattr(run, "_attention_ref_cached", False):
        return
    setattr(builtins, _RECORD, set())  # calls outside any block land here, unused
    sys.meta_path.insert(0, _RecordingFinder())

    def cached_run(code, returncode=None, session=None, id=None, **extra):  # noqa: A002
        state = _CACHE_STATE
        reads_source = any(token in code for token in _READS_SOURCE)
        if session is None:
            key = _digest(state["text"] if reads_source else "", "", code)
            chain_deps: frozenset = frozenset()
        else:
            if reads_source:  # from here on the session's namespace may hold source text
                state["reads_source"].add(session)
            chain = _digest(state["chains"].get(session, ""), code)
            state["chains"][session] = chain
            key = _digest(state["text"] if session in state["reads_source"] else "", session, chain)
            chain_deps = state["chain_deps"].get(session, frozenset())
        entry = next((e for e in reversed(_CACHE.get(key, [])) if _deps_digest(e.deps) == e.digest), None)
        if entry is not None:
            state["hits"] += 1
            if session is not None:  # not executed: remember it in case a later block misses
                state["pending"].setdefault(session, []).append((code, extra))
                state["chain_deps"][session] = entry.deps
            return entry.output
        if session is not None:  # bring the session's namespace up to date first
            for earlier_code, earlier_extra in state["pending"].pop(session, []):
                run(earlier_code, session=session, **earlier_extra)
        deps: set[tuple[str, str]] = set(chain_deps)
        start = time.perf_counter()
        output = _recording(run, deps)(code, returncode, session, id, **extra)
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
    if _CACHE_STATE["hits"] or _CACHE_STATE["runs"]:
        log.info("reload hook: %d blocks executed (%.1f s), %d served from the serve cache",
                 _CACHE_STATE["runs"], _CACHE_STATE["seconds"], _CACHE_STATE["hits"])
        for seconds, session, first_line in sorted(_CACHE_STATE["slowest"], reverse=True)[:5]:
            if seconds >= 0.25:
                log.info("reload hook:   %.2f s  session %s: %s", seconds, session, first_line)
    _CACHE_STATE.update(hits=0, runs=0, seconds=0.0, slowest=[])
