"""The serve hook's helpers that also run in its worker processes (docs/hooks/reload.py).

- Recording: under `mkdocs serve` the package is imported through `RecordingFinder`, which
  compiles every function and method with one first statement that adds ``(file, qualified
  name)`` to the set in ``builtins.__attention_ref_calls__``; `recording(run, calls)` points
  that set at ``calls`` while a block runs. The hook keys each cached block output by the code
  of the functions it recorded.
- Workers: `mkdocs serve` starts a pool of worker processes (spawned, so they share nothing
  with the server's threads) that run the sessions whose cached outputs are stale, ahead of
  the build and in parallel with it, through markdown-exec's own runner (`run_session`). The
  build then takes their outputs from the cache as it reaches each block.

This file is imported by name (``serve_workers``: reload.py puts docs/hooks on ``sys.path``,
which the spawned workers inherit), never by MkDocs as a hook.
"""

from __future__ import annotations

import ast
import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

PACKAGE = "attention_ref"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE


#: The name the instrumented package code records its calls into (found through builtins).
RECORD = "__attention_ref_calls__"


def is_jit(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Triton kernel (``@triton.jit``): Triton reads its source, so it is left as written."""
    return any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)


def instrument(tree: ast.Module, path: str) -> ast.Module:
    """Make every function and method of a module add ``(path, qualified name)`` to the set in
    ``builtins.__attention_ref_calls__`` when it is called (one statement after the docstring,
    on the line of the body's first statement, so tracebacks and line numbers are unchanged)."""

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_jit(node):
                record = ast.parse(f"{RECORD}.add(({path!r}, {prefix + node.name!r}))").body[0]
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


class RecordingLoader(importlib.machinery.SourceFileLoader):
    """Loads a module of the package from its source, instrumented by `instrument`, never from
    a cached .pyc (which would be the uninstrumented code)."""

    def get_code(self, fullname: str):
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)

    def source_to_code(self, data, path, *, _optimize=-1):
        try:
            tree = ast.parse(data, filename=path)
        except SyntaxError:  # compile it as it is, so the import raises the real error
            return super().source_to_code(data, path)
        return compile(instrument(tree, str(path)), path, "exec", dont_inherit=True)


class RecordingFinder(importlib.abc.MetaPathFinder):
    """Finds the package's modules in PACKAGE_DIR and loads them with `RecordingLoader`."""

    def __init__(self, package_dir: Path = PACKAGE_DIR) -> None:
        self.package_dir = package_dir

    def find_spec(self, fullname, path=None, target=None):
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        parts = fullname.split(".")[1:]
        folder = self.package_dir.joinpath(*parts)
        if (folder / "__init__.py").is_file():
            file, locations = folder / "__init__.py", [str(folder)]
        elif folder.with_suffix(".py").is_file():
            file, locations = folder.with_suffix(".py"), None
        else:
            return None
        return importlib.util.spec_from_file_location(
            fullname, file, loader=RecordingLoader(fullname, str(file)),
            submodule_search_locations=locations)


def recording(run, calls: set[tuple[str, str]]):
    """``run`` wrapped so that the package functions it calls are added to ``calls``."""

    def recording_run(*args, **kwargs):
        previous = getattr(builtins, RECORD)
        setattr(builtins, RECORD, calls)
        try:
            return run(*args, **kwargs)
        finally:
            setattr(builtins, RECORD, previous)

    return recording_run


def fences():
    """docs/hooks/fences.py, the executed-block parser (loaded once, by path)."""
    name = "attention_ref_docs_fences"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("fences.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# ---- worker processes -----------------------------------------------------------------------

_WORKER = {"generation": None}


def init_worker(threads: int | None = None, record: bool = True) -> None:
    """Run once in each worker: record the package's calls (unless ``record`` is False: `mkdocs
    build`'s workers only run the pages); with ``threads``, let torch use that many threads (None
    keeps its default, the number `mkdocs build` uses: with another number its sums may add in
    another order, and a page's last printed digit could differ)."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    setattr(builtins, RECORD, set())
    if record:
        sys.meta_path.insert(0, RecordingFinder())


def forget_package() -> None:
    """Drop the package's modules (so the next import reads the edited files) and every
    markdown-exec session of this process."""
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    from markdown_exec._internal.formatters import python as formatter

    formatter._sessions_globals.clear()
    formatter._sessions_counter.clear()
    formatter._code_blocks.clear()


def run_session(generation: int, session: str | None, codes: list[str], cwd: str):
    """Run the blocks of one session in order, as markdown-exec would, in a fresh namespace.

    Returns one ``(output, error, calls, seconds)`` per block run: ``error`` is None or the
    text of the exception (then the run stops: later blocks depend on it), ``calls`` the
    package functions recorded by this block and the earlier ones.
    """
    import time

    from markdown_exec._internal.formatters import python as formatter

    if _WORKER["generation"] != generation:  # a new build: the package may have changed
        forget_package()
        _WORKER["generation"] = generation
    if session is not None:
        formatter._sessions_globals.pop(session, None)
    os.chdir(cwd)
    torch = sys.modules.get("torch")
    if torch is not None:  # as docs/hooks/isolation.py before each page: a session is one page's
        torch.set_printoptions(profile="default")
    calls: set[tuple[str, str]] = set()
    results = []
    for code in codes:
        start = time.perf_counter()
        try:
            output = recording(formatter._run_python, calls)(code, session=session)
        except Exception as error:  # noqa: BLE001 - the server runs this block itself and reports it
            results.append((None, f"{type(error).__name__}: {error}", frozenset(calls),
                            time.perf_counter() - start))
            break
        results.append((output, None, frozenset(calls), time.perf_counter() - start))
    return results
