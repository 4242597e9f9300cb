"""The serve hook (docs/hooks/reload.py): what its cache of executed blocks is keyed by.

The hook wraps markdown-exec's runner; here the runner underneath is replaced by a
recorder, so the tests see which blocks the hook lets through to execution.
"""

from __future__ import annotations

import builtins
import importlib.util
import sys
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


MODULE = '''"""A stand-in for a module of the package."""

LIMIT = 3


def f(x):
    """Used by session s1."""
    return x + LIMIT


def g(x):
    return 2 * x


def h(x):
    return -x
'''


def test_blocks_rerun_when_the_package_code_they_ran_changes(hook, monkeypatch, tmp_path):
    from markdown_exec._internal.formatters import python as formatter

    package = tmp_path / "pkg"
    package.mkdir()
    module_file = package / "mod.py"
    monkeypatch.setattr(hook, "PACKAGE_DIR", package)
    executed: list[str] = []

    def recorder(code, returncode=None, session=None, id=None, **extra):  # noqa: A002
        executed.append(code)
        if code.startswith("use "):  # a block that calls a function of the package
            spec = importlib.util.spec_from_file_location(  # as the hook's finder loads it
                "pkg_mod", module_file, loader=hook.serve_workers.RecordingLoader("pkg_mod", str(module_file)))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return f"{code} -> {getattr(module, code[4:])(1)}"
        return f"output of {code!r}"

    monkeypatch.setattr(formatter, "_run_python", recorder)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # undo the hook's finder after
    monkeypatch.setattr(builtins, hook.serve_workers.RECORD, set(), raising=False)
    hook._install_block_cache()
    blocks = [("use f", "s1"), ("print(1)", "s1"), ("use g", "s2"),
              ("import inspect", "src"), ("print(2)", "src")]

    def build(source: str) -> list[str]:
        module_file.write_text(source)
        hook._CACHE_STATE.update(text=hook._package_text(), chains={}, chain_deps={}, pending={},
                                 reads_source=set(), modules={}, digests={}, ahead={})
        executed.clear()
        outputs = [formatter._run_python(code, session=session) for code, session in blocks]
        assert outputs[0] == f"use f -> {1 + int(source.split('LIMIT = ')[1].split()[0])}"
        return list(executed)

    everything = [code for code, _ in blocks]
    source_readers = ["import inspect", "print(2)"]
    assert build(MODULE) == everything  # first build: everything runs
    assert build(MODULE) == []  # nothing changed
    # docstrings, comments and layout are not code: only the session that reads source runs
    assert build(MODULE.replace("Used by session s1.", "Edited.")) == source_readers
    assert build(MODULE.replace("return x + LIMIT", "return x + LIMIT  # edited")) == source_readers
    # a function that ran changed: its session runs again, all of it; the others do not
    assert build(MODULE.replace("x + LIMIT", "LIMIT + x")) == ["use f", "print(1)", *source_readers]
    assert build(MODULE.replace("x + LIMIT", "LIMIT + x").replace("-x", "-2 * x")) == source_readers
    # top-level code (a constant) changed: every block that ran the module's code runs again
    edited = MODULE.replace("x + LIMIT", "LIMIT + x").replace("-x", "-2 * x").replace("= 3", "= 4")
    assert build(edited) == ["use f", "print(1)", "use g", *source_readers]
    # undoing an edit finds the runs from before it (the package text was seen before too)
    assert build(MODULE.replace("x + LIMIT", "LIMIT + x")) == []
    # editing the second block of a session replays the first (its namespace), then runs it
    blocks[1] = ("print(1 + 1)", "s1")
    assert build(edited) == ["use f", "print(1 + 1)"]


def test_instrumented_code_keeps_docstrings_and_line_numbers(hook, tmp_path):
    source = 'def f(x):\n    """Doc."""\n    y = x + 1\n    raise ValueError(y)\n\n\ndef g():\n    return 1\n'
    path = tmp_path / "m.py"
    path.write_text(source)
    loader = hook.serve_workers.RecordingLoader("m_under_test", str(path))
    namespace: dict = {}
    calls: set = set()
    builtins_before = getattr(builtins, hook.serve_workers.RECORD, None)
    setattr(builtins, hook.serve_workers.RECORD, calls)
    try:
        exec(loader.get_code("m_under_test"), namespace)
        assert namespace["f"].__doc__ == "Doc."
        assert namespace["g"]() == 1
        with pytest.raises(ValueError) as error:
            namespace["f"](1)
        assert error.traceback[-1].lineno + 1 == 4  # the raise is still on line 4
    finally:
        setattr(builtins, hook.serve_workers.RECORD, builtins_before)
    assert calls == {(str(path), "f"), (str(path), "g")}


def test_a_worker_process_runs_a_session_and_records_the_package_calls(hook):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    codes = ["import attention_ref\nx = 2", "print(x * int(attention_ref.causal_mask(2).sum()))"]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=hook.serve_workers.init_worker) as pool:
        results = pool.submit(hook.serve_workers.run_session, 1, "s", codes, str(ROOT)).result()
        failing = pool.submit(hook.serve_workers.run_session, 1, "t", ["1 / 0", "print(1)"],
                              str(ROOT)).result()
    (first, error1, calls1, _), (second, error2, calls2, _) = results
    assert (first, second, error1, error2) == ("", "6\n", None, None)
    masks = str(hook.PACKAGE_DIR / "masks.py")
    assert (masks, "causal_mask") in calls2 and (masks, "causal_mask") not in calls1
    assert len(failing) == 1 and failing[0][0] is None and "ZeroDivisionError" in failing[0][1]


def test_the_sessions_sent_to_workers_are_the_pages_blocks_as_markdown_exec_gets_them(hook, tmp_path):
    (tmp_path / "a.md").write_text('```python exec="on" session="s"\nx = 1\n```\n\n'
                                   '```python exec="on"\nprint(2)\n```\n\n'
                                   '```python exec="on" session="s"\nprint(x)\n```\n')
    (tmp_path / "b.md").write_text('```python exec="on" session="shared"\ny = 1\n```\n')
    (tmp_path / "c.md").write_text('```python exec="on" session="shared"\nprint(y)\n```\n')
    assert sorted(hook._sessions(tmp_path), key=str) == sorted(
        [("s", ["x = 1", "print(x)"]), (None, ["print(2)"])], key=str)  # a session over two pages: not sent


@pytest.mark.parametrize("name", ["ATTENTION_REF_BUILD_WORKERS", "ATTENTION_REF_SERVE_WORKERS"])
@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_a_worker_count_that_is_not_a_whole_number_is_refused_by_name(name, value, monkeypatch):
    monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("reload_hook_bad_count", ROOT / "docs" / "hooks" / "reload.py")
    with pytest.raises(ValueError, match=rf"{name} must be a whole number of worker processes >= 0, "
                                         rf"got '{value}'"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def test_an_empty_worker_count_means_the_default(monkeypatch, hook):
    monkeypatch.setenv("ATTENTION_REF_BUILD_WORKERS", "")
    assert hook._count("ATTENTION_REF_BUILD_WORKERS", "0") == 0
    monkeypatch.setenv("ATTENTION_REF_BUILD_WORKERS", "3")
    assert hook._count("ATTENTION_REF_BUILD_WORKERS", "0") == 3
