"""docs/hooks/build_record.py: a build writes what each block printed, and each page's seconds.

tests/docs/test_shown_code.py compares the shown code with these outputs instead of running the
page a second time, so they must be exactly markdown-exec's; and a block that raises must be
named by its page and line, since the collector that used to name it no longer runs in a check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOOKS = [ROOT / "docs" / "hooks" / name for name in ("build_record.py", "failures.py")]
RELOAD = ROOT / "docs" / "hooks" / "reload.py"  # with ATTENTION_REF_BUILD_WORKERS: the pages' code in workers
PAGE = ('# T\n\n```python exec="on" session="s" result="text"\nx = 2\nprint("x is", x, end="!")\n```\n\n'
        'Prose.\n\n```python exec="on"\nprint()\n```\n\n```python exec="on" session="s" html="1"\n'
        'print(f"<b>{x * 3}</b>")\n```\n')


def build(tmp_path: Path, page: str, record: Path | None, workers: int = 0) -> subprocess.CompletedProcess:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "index.md").write_text(page)
    (tmp_path / "docs" / "other.md").write_text("# No code\n")
    config = ["site_name: t", "markdown_extensions:", "  - pymdownx.superfences", "plugins:",
              "  - markdown-exec", "hooks:", *(f"  - {hook}" for hook in ([RELOAD] if workers else []) + HOOKS)]
    (tmp_path / "mkdocs.yml").write_text("\n".join(config) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ATTENTION_REF_BUILD_RECORD", "ATTENTION_REF_BUILD_WORKERS")}
    if workers:
        env["ATTENTION_REF_BUILD_WORKERS"] = str(workers)
    if record is not None:
        env["ATTENTION_REF_BUILD_RECORD"] = str(record)
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=tmp_path, capture_output=True, text=True, env={**env, "NO_MKDOCS_2_WARNING": "1"})


def test_the_record_holds_every_block_output_as_printed(tmp_path: Path):
    record = tmp_path / "record.json"
    result = build(tmp_path, PAGE, record)
    assert result.returncode == 0, result.stderr
    data = json.loads(record.read_text())
    page = data["pages"]["index.md"]
    assert [(b["line"], b["session"], b["output"]) for b in page["blocks"]] == [
        (3, "s", "x is 2!"), (10, None, "\n"), (14, "s", "<b>6</b>\n")]
    assert data["pages"]["other.md"]["blocks"] == []
    assert all(b["seconds"] >= 0 for b in page["blocks"]) and page["seconds"] >= 0
    assert data["seconds"] >= page["seconds"]


def test_without_the_variable_nothing_is_written(tmp_path: Path):
    assert build(tmp_path, PAGE, None).returncode == 0
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("line", [10])
def test_a_block_that_raises_is_named_by_page_and_line(tmp_path: Path, line: int):
    broken = PAGE.replace("print()\n", "raise ValueError('boom')\n")
    result = build(tmp_path, broken, tmp_path / "record.json")
    assert result.returncode != 0
    assert f"a block of docs/index.md, line {line}, raised" in result.stdout + result.stderr


def test_worker_processes_print_what_the_build_process_prints(tmp_path: Path):
    """docs/hooks/reload.py under ``mkdocs build`` with ATTENTION_REF_BUILD_WORKERS: the blocks run in a
    worker process (the last block shows where it ran) and print what a build without workers prints."""
    page = PAGE + ('\n```python exec="on" session="s"\nimport multiprocessing\n'
                   'print("in a worker:", multiprocessing.parent_process() is not None)\n```\n')
    outputs = {}
    for workers in (0, 1):
        folder = tmp_path / str(workers)
        folder.mkdir()
        result = build(folder, page, folder / "record.json", workers=workers)
        assert result.returncode == 0, result.stderr
        blocks = json.loads((folder / "record.json").read_text())["pages"]["index.md"]["blocks"]
        outputs[workers] = [b["output"] for b in blocks]
    assert outputs[0][:-1] == outputs[1][:-1] == ["x is 2!", "\n", "<b>6</b>\n"]
    assert (outputs[0][-1], outputs[1][-1]) == ("in a worker: False\n", "in a worker: True\n")


def test_a_block_that_raises_in_a_worker_is_reported_as_without_workers(tmp_path: Path):
    broken = PAGE.replace('print(f"<b>{x * 3}</b>")', 'raise ValueError(f"boom {x}")')
    result = build(tmp_path, broken, tmp_path / "record.json", workers=1)
    assert result.returncode != 0
    log = result.stdout + result.stderr
    assert "a block of docs/index.md, line 14, raised" in log and "ValueError: boom 2" in log  # its session ran first
