"""The package's imports flow one way: no module imports, directly or through others, itself.

Every ``import attention_ref...`` / ``from attention_ref... import`` in the package's source is
read with ``ast``, including the ones inside functions (a deferred import hides a circle, it
does not remove it). The graph must be acyclic, and the layers of the README's layout must hold:
argument checks at the bottom, the paths above them, the dispatch on top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attention_ref"


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    for path in PACKAGE.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attention_ref"):
                if node.module == "attention_ref":
                    found.update(a.name for a in node.names if a.name in modules)
                else:
                    found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("attention_ref."))
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("attention_ref."):
                    found.add(str(arg.value).split(".")[1])
        found.discard(path.stem)
        graph[path.stem] = found
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_circle():
    graph = _imports()
    assert "functional" in graph["testing"] and "_inputs" in graph["tiled"]  # the reader sees them
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize(
    "module,never",
    [
        ("_inputs", {"functional", "backends", "tiled", "triton_flash", "masks", "multihead"}),
        ("mods", {"functional", "backends", "tiled", "masks", "_inputs"}),
        ("masks", {"functional", "backends", "tiled"}),
        ("tiled", {"functional", "backends"}),
        # the block mask sits beside the mods, below every path; the core reads it, not a backend's file
        ("block_mask", {"functional", "backends", "tiled", "triton_flash", "multihead", "kv_cache", "varlen",
                        "distributed", "_inputs"}),
        ("functional", {"tiled", "triton_flash"}),
        ("multihead", {"tiled"}),
        ("kv_cache", {"tiled"}),
        ("varlen", {"tiled"}),
        ("distributed", {"tiled"}),
        ("triton_flash", {"functional", "backends", "tiled"}),
        ("backends", {"functional", "multihead"}),
    ],
)
def test_layers(module, never):
    assert not _imports()[module] & never


def test_the_newest_tier_marker_names_real_files_and_marks_the_rest(request):
    """tests/conftest.py's OWN_TESTS name files that exist; every collected test outside them carries the
    ``upstream`` marker the newest tier selects (``dev.py check --newest``), and none inside them does,
    nor one marked ``own`` with its reason."""
    conftest = request.config.pluginmanager.get_plugin(str(Path(__file__).with_name("conftest.py")))
    root = PACKAGE.parent
    missing = [name for name in conftest.OWN_TESTS if not (root / name).is_file()]
    assert not missing, f"OWN_TESTS names files that do not exist: {missing}"
    wrong = []
    for item in request.session.items:
        own = item.path.resolve().relative_to(root).as_posix() in conftest.OWN_TESTS
        marked = item.get_closest_marker(conftest.OWN)
        if marked is not None and (own or not marked.args or not marked.args[0]):
            wrong.append(f"{item.nodeid}: own() needs its reason, and a file of OWN_TESTS needs no marker")
        own = own or marked is not None
        if own == (item.get_closest_marker(conftest.UPSTREAM) is not None):
            wrong.append(item.nodeid)
    assert not wrong, f"marked against OWN_TESTS: {wrong[:5]}"
    assert request.node.get_closest_marker(conftest.UPSTREAM) is None  # this file is its own


def test_the_readme_map_names_every_module():
    """A newcomer finds where a change belongs from the README's layout: every module of the package
    has its line there (issue 48: five were missing)."""
    readme = (PACKAGE.parent / "README.md").read_text(encoding="utf-8")
    listed = {line.split()[0] for line in readme.splitlines() if line.startswith("  ") and line.split()}
    missing = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py" and p.name not in listed)
    assert not missing, f"README.md's layout lists no line for {missing}"
