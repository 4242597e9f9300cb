"""docs/hooks/failures.py: a failing executed block fails `mkdocs build`, even with -q.

Without the hook, `mkdocs build --strict -q` exits 0 on a page whose block raises (-q hides the
warning that strict mode counts); the second test shows that this is so, so the first one
checks something that would otherwise pass quietly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "docs" / "hooks" / "failures.py"
PAGE = '# T\n\n```python exec="on" source="above" result="text"\nprint(1)\nraise ValueError("boom")\n```\n'


def build(tmp_path: Path, *flags: str, hook: bool = True) -> subprocess.CompletedProcess:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "index.md").write_text(PAGE)
    config = ["site_name: t", "markdown_extensions:", "  - pymdownx.superfences",
              "plugins:", "  - markdown-exec"]
    if hook:
        config += ["hooks:", f"  - {HOOK}"]
    (tmp_path / "mkdocs.yml").write_text("\n".join(config) + "\n")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", *flags, "-d", str(tmp_path / "site")],
                          cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.mark.parametrize("flags", [("--strict", "-q"), ("-q",), ()])
def test_a_failing_block_fails_the_build(tmp_path: Path, flags: tuple[str, ...]):
    result = build(tmp_path, *flags)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "ValueError: boom" in output  # the failure is printed, -q or not
    assert "1 executed code block(s) failed" in output


def test_without_the_hook_strict_quiet_passes_a_broken_page(tmp_path: Path):
    assert build(tmp_path, "--strict", "-q", hook=False).returncode == 0
