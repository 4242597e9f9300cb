"""The serve hook (docs/hooks/reload.py): what its cache of executed blocks is keyed by.

The hook wraps markdown-exec's runner; here the runner underneath is replaced by a
recorder, so the tests see which blocks the hook lets through to execution.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SOURCE = '''"""Module docstring."""

LIMIT = 3  # a comment


def f(x):
    """Function docstring."""
    # another comment
    return x + LIMIT
'''


@pytest.fixture()
def hook():
    spec = importlib.util.spec_from_file_location("reload_hook_under_test", ROOT / "docs" / "hooks" / "reload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_digest_ignores_docstrings_comments_and_layout(hook):
    same = [
        SOURCE.replace("Function docstring.", "A different docstring."),
        SOURCE.replace("# another comment", "# edited comment"),
        SOURCE.replace("LIMIT = 3  # a comment", "LIMIT = (\n    3\n)"),
        SOURCE.replace('"""Module docstring."""', ""),
    ]
    for edited in same:
        assert hook._code_of(edited) == hook._code_of(SOURCE), edited
    for edited in (SOURCE.replace("LIMIT = 3", "LIMIT = 4"), SOURCE.replace("x + LIMIT", "LIMIT + x")):
        assert hook._code_of(edited) != hook._code_of(SOURCE), edited
    broken = SOURCE.replace("def f(x):", "def f(x:")  # mid-edit: falls back to the text
    assert hook._code_of(broken) == broken


def test_blocks_rerun_when_the_code_changes_and_readers_of_source_when_the_text_does(hook, monkeypatch):
    from markdown_exec._internal.formatters import python as formatter

    executed: list[str] = []

    def recorder(code, returncode=None, session=None, id=None, **extra):  # noqa: A002
        executed.append(code)
        return f"output of {code!r}"

    monkeypatch.setattr(formatter, "_run_python", recorder)
    hook._install_block_cache()
    blocks = [("x = 1", "plain"), ("print(x)", "plain"), ("import inspect", "source"), ("print(2)", "source")]

    def build(code_digest: str, text_digest: str) -> list[str]:
        hook._CACHE_STATE.update(code=code_digest, text=text_digest, chains={}, pending={}, reads_source=set())
        executed.clear()
        outputs = [formatter._run_python(code, session=session) for code, session in blocks]
        assert outputs == [f"output of {code!r}" for code, _ in blocks]  # cached or not, the same output
        return list(executed)

    assert build("code-1", "text-1") == [code for code, _ in blocks]  # first build: everything runs
    assert build("code-1", "text-1") == []  # nothing changed
    # A docstring or comment edit: only the session that reads source runs again (both its blocks).
    assert build("code-1", "text-2") == ["import inspect", "print(2)"]
    assert build("code-2", "text-3") == [code for code, _ in blocks]  # a code edit: everything
    # Editing the second block of a session replays the first (its namespace), then runs it.
    blocks[1] = ("print(x + 1)", "plain")
    assert build("code-2", "text-3") == ["x = 1", "print(x + 1)"]
