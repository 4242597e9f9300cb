"""MkDocs hook: an executed block that fails fails the build, whatever the log level.

markdown-exec reports a block that raised as a logged WARNING and renders the traceback into
the page; ``--strict`` turns the warning count into a failed build. But ``mkdocs build
--strict -q`` raises the log level to ERROR, so the warning is never emitted, strict mode
counts nothing and a broken page builds with exit 0. This hook keeps markdown-exec's logger at
WARNING (so the failure is printed even under ``-q``), counts its failures itself and aborts
``mkdocs build`` after the build when there was one. Under ``mkdocs serve`` it reports the
count as an error and keeps serving, so the failing page can be fixed live.
"""

from __future__ import annotations

import logging

# markdown-exec logs through "mkdocs.plugins.<its module>" (checked with markdown-exec 1.12)
LOGGER = "mkdocs.plugins.markdown_exec"
_FAILURE = "Execution of "
log = logging.getLogger(f"mkdocs.hooks.{__name__}")


class _FailureCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.failures: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if _FAILURE in message:
            self.failures.append(message.split("\n", 1)[0])


_counter = _FailureCounter()
_state = {"command": "build"}


def on_startup(command, **kwargs) -> None:
    _state["command"] = command
    logger = logging.getLogger(LOGGER)
    logger.setLevel(logging.WARNING)  # below -q's ERROR: the failure is emitted and printed
    if _counter not in logger.handlers:
        logger.addHandler(_counter)


def on_pre_build(config, **kwargs) -> None:
    _counter.failures.clear()


def on_post_build(config, **kwargs) -> None:
    failures = len(_counter.failures)
    if not failures:
        return
    message = (f"{failures} executed code block(s) failed (markdown-exec): see the warnings "
               "above; the pages show the traceback")
    if _state["command"] == "serve":
        log.error(message)
        return
    from mkdocs.exceptions import Abort

    raise Abort(message)
