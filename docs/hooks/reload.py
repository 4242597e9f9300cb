"""MkDocs hook: make `mkdocs serve` show edits to the package without a restart.

`mkdocs serve` rebuilds in the same Python process, so without this hook the executed blocks
would keep using `attention_ref` as it was first imported, and markdown-exec sessions would keep
the variables of the previous build. Before each build (the first one and every rebuild after an
edit; `watch:` in mkdocs.yml makes package edits trigger one) this drops the package's modules
from `sys.modules` and empties markdown-exec's session namespaces.

Under `mkdocs serve` only, it also keeps the output of every executed block from the previous
builds, keyed by a fingerprint of the package's source, the block's session and the code of that
session's blocks up to and including this one. A rebuild after editing one page then executes
only that page's changed blocks (replaying the earlier blocks of their session first, silently,
so the namespace is right); an edit to the package's code changes the fingerprint and re-executes
everything. The fingerprint covers the package's code, not its text: it is taken from the syntax
tree with the docstrings removed (comments and layout are not in the tree), so editing a
docstring or a comment re-renders the API pages (mkdocstrings reads the source anew) but re-runs
no block, except in the sessions that read source text themselves (`inspect`, `__doc__`, `help(`):
those are keyed by the text. `mkdocs build` (CI, the tests, publishing) never uses the cache.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import sys
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
    _CACHE_STATE["code"], _CACHE_STATE["text"] = _package_fingerprints()
    _CACHE_STATE["chains"] = {}
    _CACHE_STATE["pending"] = {}
    _CACHE_STATE["reads_source"] = set()
    log.debug("reload hook: package code %s, text %s", _CACHE_STATE["code"][:12], _CACHE_STATE["text"][:12])
    if dropped or sessions:
        log.info("reload hook: dropped %d %s modules, cleared %d markdown-exec sessions",
                 len(dropped), PACKAGE, sessions)


# ---- serve-only cache of executed block outputs --------------------------------------------

_CACHE: dict[str, str] = {}  # key -> the block's printed output
_CACHE_STATE: dict = {"code": "", "text": "", "chains": {}, "pending": {}, "reads_source": set(), "hits": 0,
                      "runs": 0}
#: A block whose code contains one of these may print the package's source or docstrings.
_READS_SOURCE = ("inspect", "__doc__", "help(")


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _package_fingerprints() -> tuple[str, str]:
    """Digests of the package's code (syntax trees without docstrings) and of its text as written."""
    sources = [(str(f.relative_to(PACKAGE_DIR)), f.read_text()) for f in sorted(PACKAGE_DIR.rglob("*.py"))]
    code = _digest(*(f"{name}\n{_code_of(text)}" for name, text in sources))
    text = _digest(*(f"{name}\n{text}" for name, text in sources))
    return code, text


def _code_of(source: str) -> str:
    """The syntax tree of ``source`` without its string statements (docstrings), as text."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a file in the middle of an edit: its text is all there is
        return source
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                            and isinstance(s.value.value, str))]
            node.body = kept or [ast.Pass()]
    return ast.dump(tree)


def _install_block_cache() -> None:
    from markdown_exec._internal.formatters import python as formatter

    run = formatter._run_python
    if getattr(run, "_attention_ref_cached", False):
        return

    def cached_run(code, returncode=None, session=None, id=None, **extra):  # noqa: A002
        state = _CACHE_STATE
        reads_source = any(token in code for token in _READS_SOURCE)
        if session is None:
            key = _digest(state["text" if reads_source else "code"], "", code)
        else:
            if reads_source:  # from here on the session's namespace may hold source text
                state["reads_source"].add(session)
            chain = _digest(state["chains"].get(session, ""), code)
            state["chains"][session] = chain
            key = _digest(state["text" if session in state["reads_source"] else "code"], session, chain)
        if key in _CACHE:
            state["hits"] += 1
            if session is not None:  # not executed: remember it in case a later block misses
                state["pending"].setdefault(session, []).append((code, extra))
            return _CACHE[key]
        if session is not None:  # bring the session's namespace up to date first
            for earlier_code, earlier_extra in state["pending"].pop(session, []):
                run(earlier_code, session=session, **earlier_extra)
        output = run(code, returncode, session, id, **extra)
        state["runs"] += 1
        _CACHE[key] = output
        return output

    cached_run._attention_ref_cached = True
    formatter._run_python = cached_run


def on_post_build(config, **kwargs) -> None:
    if _CACHE_STATE["hits"] or _CACHE_STATE["runs"]:
        log.info("reload hook: %d blocks executed, %d served from the serve cache",
                 _CACHE_STATE["runs"], _CACHE_STATE["hits"])
    _CACHE_STATE["hits"] = _CACHE_STATE["runs"] = 0
