"""The package's imports flow one way: no module imports, directly or through others, itself.

Every ``import attention_ref...`` / ``from attention_ref... import`` in the package's source is
read with ``ast``, including the ones inside functions (a deferred import hides a circle, it
does not remove it). The graph must be acyclic, and the layers of the README's layout must hold:
argument checks at the bottom, the paths above them, the dispatch on top.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attention_ref"


def _module_name(path: Path) -> str:
    """A file's node in the graph: ``functional`` for ``functional.py``, ``distributed.ring`` for a module of a
    subpackage, ``distributed`` for its ``__init__.py`` (the package's own ``__init__.py`` stays ``__init__``)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _imports() -> dict[str, set[str]]:
    """Every module of the package, the subpackages' (``distributed/``, ``testing/``, ``conformance/``) included,
    and the modules of the package it imports, each by its `_module_name` (a copy a test may change)."""
    return {name: set(imported) for name, imported in _parsed_imports().items()}


@functools.cache
def _parsed_imports() -> dict[str, set[str]]:
    """`_imports`, read from the source once per process (each read parses the whole package: 0.5 s)."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}

    def resolve(dotted: str) -> set[str]:
        """``attention_ref.a.b.c`` -> the longest ``a.b...`` that is a module of the package."""
        parts = dotted.split(".")[1:]
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in modules:
                return {".".join(parts[:end])}
        return set()

    graph: dict[str, set[str]] = {}
    for path in paths:
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attention_ref"):
                if node.module != "attention_ref":
                    found |= resolve(node.module)
                # from attention_ref[.sub] import module
                found |= {m for a in node.names if (m := f"{node.module}.{a.name}".split(".", 1)[1]) in modules}
            elif isinstance(node, ast.Import):
                for a in node.names:
                    found |= resolve(a.name) if a.name.startswith("attention_ref.") else set()
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("attention_ref."):
                    found |= resolve(str(arg.value))
        found.discard(_module_name(path))
        graph[_module_name(path)] = found
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
    assert "functional" in graph["testing.attention"] and "_inputs" in graph["tiled"]  # the reader sees them
    assert "distributed.layouts" in graph["distributed.ring"]  # and the subpackages' modules
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
    """A rule for a subpackage holds for each of its modules, and a module it names forbids its modules too."""
    graph = _imports()
    checked = [name for name in graph if name == module or name.startswith(module + ".")]
    assert checked, f"no module {module!r} in the package"
    for name in checked:
        bad = {m for m in graph[name] if any(m == n or m.startswith(n + ".") for n in never)}
        assert not bad, f"{name} imports {sorted(bad)}"


#: The modules whose private names the others share (imported as modules: ``from attention_ref import _inputs``).
SHARED_HELPERS = {"attention_ref._inputs", "attention_ref._validation"}


def _private_imports(source: str, module: str) -> list[str]:
    """``from attention_ref.X import _name`` in ``source`` (the module ``module``): another module's private name,
    unless X is one of `SHARED_HELPERS` or ``module`` itself."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attention_ref"):
            for alias in node.names:
                if alias.name.startswith("_") and node.module not in SHARED_HELPERS | {module}:
                    if f"{node.module}.{alias.name}" in SHARED_HELPERS:  # the shared module itself
                        continue
                    found.append(f"{module} imports {alias.name} from {node.module}")
    return found


def test_no_module_imports_another_modules_private_names():
    """A private name belongs to its module: what another module needs is public there (the shared helper
    modules `SHARED_HELPERS` excepted, which exist to be shared)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        bad += _private_imports(path.read_text(encoding="utf-8"), module)
    assert not bad, "\n".join(bad)
    # the rule itself: a private name of another module is found, a shared helper module is not
    assert _private_imports("from attention_ref.tiled import _tiled", "attention_ref.backends") == [
        "attention_ref.backends imports _tiled from attention_ref.tiled"]
    assert _private_imports("from attention_ref import _inputs, _validation", "attention_ref.tiled") == []
    assert _private_imports("from attention_ref._inputs import _helper", "attention_ref.tiled") == []


#: The modules that teach (draw, train, load the pages' models): a module that computes attention imports none.
TEACHING = {"diagrams", "viz", "lm", "recall", "pretrained"}


def test_computing_modules_import_no_teaching_one():
    graph = _imports()
    assert TEACHING <= set(graph), sorted(TEACHING - set(graph))  # each still a module of the package
    assert "lm" in graph["recall"]  # teaching modules may import each other
    bad = {name: sorted(graph[name] & TEACHING) for name in graph if name not in TEACHING and graph[name] & TEACHING}
    assert not bad, f"computing modules importing teaching ones: {bad}"


def test_import_attention_ref_loads_no_teaching_module():
    """``import attention_ref`` loads what computes attention; `TEACHING` loads on first use (`__getattr__`)."""
    import subprocess
    import sys

    code = ("import sys, attention_ref; print(sorted(m for m in sys.modules if m.split('.')[0] == 'attention_ref'"
            " and m.split('.')[1:2] and m.split('.')[1] in %r)); attention_ref.diagrams; print('diagrams' in "
            "dir(attention_ref) or 'attention_ref.diagrams' in sys.modules)" % sorted(TEACHING))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True"], done.stdout


def test_the_launcher_runs_no_attention_code():
    """`attention_ref.distributed.launch` (`spawn`) runs any importable function in local processes: it imports
    no module of the package, so an edit of the attention code never changes how processes start."""
    assert _imports()["distributed.launch"] == set()


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


def _readme_map() -> list[str]:
    """The lines of the README's layout that describe the package (from ``attention_ref/`` to the next top-level entry)."""
    lines = (PACKAGE.parent / "README.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(next(line for line in lines if line.startswith("attention_ref/ ")))
    end = next(i for i in range(start + 1, len(lines)) if lines[i] and not lines[i].startswith(" "))
    return lines[start + 1:end]


def _readme_layers(lines: list[str]) -> dict[str, int]:
    """Each top-level module of the README's map (``viz``, ``distributed``) -> its layer: 1 to 5 under the headings
    ``computing 1`` .. ``computing 5``, 0 under ``teaching`` (above them all: what teaches may import anything, and
    nothing that computes imports it). ``__init__.py`` stands before the first heading and has none."""
    layers: dict[str, int] = {}
    layer = None
    for line in lines:
        words = line.split()
        if not line.startswith("  ") or line.startswith("   ") or not words:
            continue  # a subpackage's file, a description's continuation or a blank line
        if words[0] == "computing":
            assert words[1] in "12345" and len(words[1]) == 1, f"a heading 'computing {words[1]}': its layer must be 1 to 5"
            layer = int(words[1])
        elif words[0] == "teaching":
            layer = 0
        elif layer is not None and (words[0].endswith(".py") or words[0].endswith("/")):
            name = words[0].removesuffix(".py").removesuffix("/")
            if (PACKAGE / name).is_dir() and not (PACKAGE / name / "__init__.py").is_file():
                continue  # a folder of data (``data/``), not a module
            layers[name] = layer
    return layers


def _imports_against_the_layers(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Each import of a module from a layer above its own (a smaller number), as ``a (layer 3) imports b (layer 2)``."""
    bad = []
    for name, imported in sorted(graph.items()):
        mine = layers.get(name.split(".")[0])
        for other in sorted(imported):
            theirs = layers.get(other.split(".")[0])
            if mine is not None and theirs is not None and theirs < mine:
                bad.append(f"{name} (layer {mine}) imports {other} (layer {theirs})")
    return bad


def test_the_readme_map_gives_every_module_a_layer_and_the_imports_keep_them():
    """The README's map groups the modules: what computes attention in five layers, top (what uses attention) to
    bottom (building blocks and argument checks), and what teaches. Every module of the package stands in one group,
    the teaching group is `TEACHING`, and no module imports from a layer above its own."""
    graph, layers = _imports(), _readme_layers(_readme_map())
    tops = {name.split(".")[0] for name in graph} - {"__init__"}
    assert tops == set(layers), f"in the package, not in the map's groups: {sorted(tops - set(layers))}; " \
                                f"in the map, not in the package: {sorted(set(layers) - tops)}"
    assert {name for name, layer in layers.items() if layer == 0} == TEACHING
    assert sorted(set(layers.values())) == [0, 1, 2, 3, 4, 5]
    bad = _imports_against_the_layers(graph, layers)
    assert not bad, "imports against the README's layers:\n" + "\n".join(bad)
    # the rule itself: an import from a layer above is found, one from the same layer or below is not
    planted = {**graph, "functional": graph["functional"] | {"kv_cache"}, "kv_cache": graph["kv_cache"] | {"quant"}}
    assert _imports_against_the_layers(planted, layers) == [
        f"functional (layer {layers['functional']}) imports kv_cache (layer {layers['kv_cache']})"]
    assert _imports_against_the_layers({"mods": {"viz"}}, layers) == ["mods (layer 5) imports viz (layer 0)"]


def test_the_readme_map_names_every_module():
    """A newcomer finds where a change belongs from the README's layout: every module of the package
    has its line there (issue 48: five were missing), and so has every file of each subpackage
    (``distributed/``, ``testing/``, ``conformance/``), under it."""
    lines = _readme_map()
    listed = {line.split()[0] for line in lines if line.startswith("  ") and line.split()}
    missing = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py" and p.name not in listed)
    assert not missing, f"README.md's layout lists no line for {missing}"
    for package in sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")):
        start = lines.index(next(line for line in lines if line.startswith(f"  {package}/ ")))
        under = set()
        for line in lines[start + 1:]:
            if not line.startswith("    "):  # the next entry of the package: this subpackage's block has ended
                break
            under.add(line.split()[0])
        missing = sorted(p.name for p in (PACKAGE / package).glob("*.py") if p.name not in under)
        assert not missing, f"README.md's layout lists no line under {package}/ for {missing}"


def test_every_checker_is_gathered_in_testing():
    """A reader looking for the checkers finds them all in `attention_ref.testing`, `assert_topk_close`
    (which lives beside the indexer it checks) included, as the same objects."""
    import attention_ref.testing as testing
    from attention_ref import sparse

    assert testing.assert_topk_close is sparse.assert_topk_close
    checkers = {name for name in dir(testing) if name.startswith("assert_")}
    assert checkers == {name for name in testing.__all__ if name.startswith("assert_")}, checkers
    assert "assert_topk_close" in checkers
