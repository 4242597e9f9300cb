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
import hashlib
import logging
import os
import sys
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
                        modules={})
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


_CACHE: dict[str, _Entry] = {}  # key (session, code chain) -> the cached run
_CACHE_STATE: dict = {"text": "", "chains": {}, "chain_deps": {}, "pending": {}, "reads_source": set(),
                      "modules": {}, "hits": 0, "runs": 0}


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
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.body = [ast.Pass()]
    return ast.dump(tree), functions


def _dep_digest(path: str, qualname: str) -> str:
    modules = _CACHE_STATE["modules"]  # per build: path -> _module_index of its current text
    if path not in modules:
        try:
            modules[path] = _module_index(Path(path).read_text())
        except OSError:  # a deleted module
            modules[path] = ("", {})
    top_level, functions = modules[path]
    outer = qualname.split(".<locals>.", 1)[0]
    return _digest(path, top_level, functions.get(outer, ""))


def _deps_digest(deps: frozenset[tuple[str, str]]) -> str:
    return _digest(*(f"{path}:{name}:{_dep_digest(path, name)}" for path, name in sorted(deps)))


def _traced(run, deps: set[tuple[str, str]]):
    """``run`` wrapped so that the package functions it calls are added to ``deps``."""
    prefix = str(PACKAGE_DIR) + os.sep

    def trace(frame, event, arg):
        code = frame.f_code
        if code.co_filename.startswith(prefix):
            deps.add((code.co_filename, code.co_qualname))
        return None  # no line events

    def traced_run(*args, **kwargs):
        previous = sys.gettrace()
        sys.settrace(trace)
        try:
            return run(*args, **kwargs)
        finally:
            sys.settrace(previous)

    return traced_run


def _install_block_cache() -> None:
    from markdown_exec._internal.formatters import python as formatter

    run = formatter._run_python
    if getattr(run, "_attention_ref_cached", False):
        return

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
        entry = _CACHE.get(key)
        if entry is not None and _deps_digest(entry.deps) == entry.digest:
            state["hits"] += 1
            if session is not None:  # not executed: remember it in case a later block misses
                state["pending"].setdefault(session, []).append((code, extra))
                state["chain_deps"][session] = entry.deps
            return entry.output
        if session is not None:  # bring the session's namespace up to date first
            for earlier_code, earlier_extra in state["pending"].pop(session, []):
                run(earlier_code, session=session, **earlier_extra)
        deps: set[tuple[str, str]] = set(chain_deps)
        output = _traced(run, deps)(code, returncode, session, id, **extra)
        state["runs"] += 1
        deps_frozen = frozenset(deps)
        _CACHE[key] = _Entry(output, deps_frozen, _deps_digest(deps_frozen))
        if session is not None:
            state["chain_deps"][session] = deps_frozen
        return output

    cached_run._attention_ref_cached = True
    formatter._run_python = cached_run


def on_post_build(config, **kwargs) -> None:
    if _CACHE_STATE["hits"] or _CACHE_STATE["runs"]:
        log.info("reload hook: %d blocks executed, %d served from the serve cache",
                 _CACHE_STATE["runs"], _CACHE_STATE["hits"])
    _CACHE_STATE["hits"] = _CACHE_STATE["runs"] = 0
