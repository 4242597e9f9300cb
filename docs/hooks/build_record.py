"""MkDocs hook: what every executed block printed, and what each page cost, written to one file.

When ``ATTENTION_REF_BUILD_RECORD`` names a file (``python3 dev.py check`` sets it for its
strict build), ``mkdocs build`` writes there, as JSON:

- ``pages``: per page (its path under ``docs/``), the seconds it took to render (its Markdown, and
  its blocks wherever they ran: with build workers, docs/hooks/reload.py, the seconds a worker
  ran them) and, per executed block in order, the line of its fence, its session, the seconds it
  ran and what it printed (markdown-exec's output, exactly as the page shows it);
- ``seconds``: the whole build; ``threads``: torch's threads while the blocks ran.

The tests read the build's outputs instead of running the pages a second time
(tests/docs/test_shown_code.py compares each page's shown code with them), and ``dev.py check``
prints the slowest pages from them. A block that raises is named by page and line in the log
(markdown-exec's own message names neither), and the build fails (docs/hooks/failures.py).
Unset, the hook records nothing; ``mkdocs serve`` never records.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

ENV = "ATTENTION_REF_BUILD_RECORD"
log = logging.getLogger(f"mkdocs.hooks.{__name__}")

_state: dict = {"on": False, "start": 0.0, "page": None, "page_start": 0.0, "runs": [], "waits": 0.0, "pages": {}}


# docs/hooks/fences.py, loaded once by path: serve_workers.fences, shared with reload.py's workers
if str(Path(__file__).parent) not in sys.path:
    sys.path.append(str(Path(__file__).parent))
from serve_workers import fences as _fences


def _install() -> None:
    """Wrap markdown-exec's Python runner (once): each run's session, code, output and seconds."""
    from markdown_exec._internal.formatters import python as formatter

    run = formatter._run_python
    if getattr(run, "_attention_ref_build_record", False):
        return

    def recording_run(code, returncode=None, session=None, id=None, **extra):  # noqa: A002
        if not _state["on"] or _state["page"] is None:
            return run(code, returncode, session, id, **extra)
        given, session = session, session or None  # markdown-exec passes "" for a block without one
        start = time.perf_counter()
        try:
            output = run(code, returncode, given, id, **extra)
        except Exception:
            page = _state["page"]
            line = _line_of(page, session, code, len(_state["runs"]))
            log.error("build record: a block of docs/%s%s raised (session %r)", page.file.src_uri,
                      f", line {line}," if line else "", session)
            _state["runs"].append((session, code, None, time.perf_counter() - start))
            raise
        wall = time.perf_counter() - start
        # how long it ran: the wall time here, or the worker's seconds when a worker ran it (reload.py)
        ran = getattr(run, "last_seconds", None)
        _state["runs"].append((session, code, output, wall if ran is None else ran))
        _state["waits"] += wall - (wall if ran is None else ran)
        return output

    recording_run._attention_ref_build_record = True
    formatter._run_python = recording_run


def _line_of(page, session, code: str, earlier: int) -> int | None:
    """The fence line of the block run as the page's ``earlier``-th run (matched by its code)."""
    path = Path(page.file.abs_src_path)
    blocks = _fences().find_blocks(path) if path.is_file() else []
    matching = [b.line for b in blocks if b.session == session and b.code.strip() == code.strip()]
    return matching[0] if len(matching) == 1 else None


def on_config(config, **kwargs):
    _state.update(on=bool(os.environ.get(ENV)), start=time.perf_counter(), pages={})
    return config


def on_startup(command, **kwargs) -> None:
    if command == "serve":
        os.environ.pop(ENV, None)  # the served pages are not what a check compares


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if _state["on"]:
        _install()
        _state.update(page=page, page_start=time.perf_counter(), runs=[], waits=0.0)
    return markdown


def on_page_content(html: str, page, **kwargs) -> str:
    if not _state["on"] or _state["page"] is not page:
        return html
    # its Markdown and the seconds its blocks ran (in a worker process, they ran ahead: the wait for
    # them is not the page's cost)
    seconds = time.perf_counter() - _state["page_start"] - _state["waits"]
    path = Path(page.file.abs_src_path)
    blocks = _fences().find_blocks(path) if path.is_file() else []
    pending = list(_state["runs"])
    recorded = []
    for block in blocks:  # the runs in order, matched to the page's fences by session and code
        at = next((i for i, (session, code, _, _) in enumerate(pending)
                   if session == block.session and code.strip() == block.code.strip()), None)
        if at is None:
            continue
        session, _, output, block_seconds = pending[at]
        del pending[:at + 1]
        recorded.append({"line": block.line, "session": session, "seconds": round(block_seconds, 3),
                         "output": output})
    _state["pages"][page.file.src_uri] = {"seconds": round(seconds, 3), "blocks": recorded}
    _state.update(page=None, runs=[])
    return html


def on_post_build(config, **kwargs) -> None:
    target = os.environ.get(ENV)
    if not _state["on"] or not target:
        return
    torch = sys.modules.get("torch")
    record = {"seconds": round(time.perf_counter() - _state["start"], 3),
              "threads": torch.get_num_threads() if torch is not None else None,
              "pages": _state["pages"]}
    Path(target).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    log.info("build record: %d pages written to %s", len(_state["pages"]), target)
