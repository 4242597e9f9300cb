"""MkDocs hook: make `mkdocs serve` show edits to the package without a restart.

`mkdocs serve` rebuilds in the same Python process, so without this hook the executed blocks
would keep using `attention_ref` as it was first imported, and markdown-exec sessions would keep
the variables of the previous build. Before each build (the first one and every rebuild after an
edit; `watch:` in mkdocs.yml makes package edits trigger one) this drops the package's modules
from `sys.modules` and empties markdown-exec's session namespaces.
"""

from __future__ import annotations

import logging
import os
import sys

PACKAGE = "attention_ref"
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
        # re-importing an edited module would write its .pyc into attention_ref/__pycache__,
        # which `watch:` sees as another change: one edit would trigger two rebuilds
        sys.dont_write_bytecode = True


def on_pre_build(config, **kwargs) -> None:
    dropped = [name for name in sys.modules if name == PACKAGE or name.startswith(PACKAGE + ".")]
    for name in dropped:
        del sys.modules[name]
    sessions = _clear_markdown_exec_sessions()
    if dropped or sessions:
        log.info("reload hook: dropped %d %s modules, cleared %d markdown-exec sessions",
                 len(dropped), PACKAGE, sessions)
