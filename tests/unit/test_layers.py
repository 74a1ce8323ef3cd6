"""The layers of ``gpuckpt/`` as CONTRIBUTING.md's map names them, enforced.

The map ("Map of the code") lists the layers from the bottom up, one section
each, and every module of the package once, as a bullet ``- `path`: role``.
A folder (a first-level subpackage) is one node of the layer graph and sits in
one layer; a module at the top of the package is a node of its own. Imports
(function-level ones included, read with ``ast`` by
:func:`test_import_graph.import_graph`) may go down or stay within a layer,
never up, except the ones named in :data:`ALLOWED_UPWARD`; and no two nodes
import each other, directly or around a cycle.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from test_import_graph import cycles, import_graph

import gpuckpt

PACKAGE = Path(gpuckpt.__file__).parent
CONTRIBUTING = PACKAGE.parent / "CONTRIBUTING.md"

#: (importer, imported) module pairs allowed to go up a layer, each with its reason (none now:
#: TensorProperties.create_from_tensor reads arrays through the view device/arrays.py registers)
ALLOWED_UPWARD: set[tuple[str, str]] = set()

_SECTION = re.compile(r"^### (\d+)\. (.+)$")
_BULLET = re.compile(r"^- `([\w/.]+\.py)`: \S")


def read_map(text: str) -> list[tuple[str, list[str]]]:
    """The layers of the map in ``text``, bottom first: (title, module paths relative to gpuckpt/)."""
    body = text.split("\n## Map of the code\n", 1)[1].split("\n## ", 1)[0]
    layers: list[tuple[str, list[str]]] = []
    for line in body.splitlines():
        section = _SECTION.match(line)
        if section:
            assert int(section.group(1)) == len(layers) + 1, f"layers out of order at {line!r}"
            layers.append((section.group(2), []))
            continue
        bullet = _BULLET.match(line)
        if bullet:
            assert layers, f"{line!r} comes before the first layer"
            layers[-1][1].append(bullet.group(1))
    return layers


def node_of(module: str) -> str:
    """The layer-graph node of a module: its first-level folder, or itself at the top."""
    parts = module.split(".")[1:]  # without "gpuckpt"
    if not parts:
        return "__init__"
    return parts[0]


def module_of(path: str) -> str:
    parts = path[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["gpuckpt", *parts])


def layer_of_nodes(layers: list[tuple[str, list[str]]]) -> dict[str, int]:
    """Each node's layer (its index, bottom first); a folder split over two layers is an error."""
    found: dict[str, int] = {}
    for i, (title, paths) in enumerate(layers):
        for path in paths:
            node = node_of(module_of(path)) if path != "__init__.py" else "__init__"
            if found.setdefault(node, i) != i:
                raise AssertionError(
                    f"{path} is listed under layer {i + 1} ({title}) but its folder {node}/ is in layer "
                    f"{found[node] + 1}: a folder is one layer"
                )
    return found


def upward_imports(
    graph: Mapping[str, set[str]], layer: Mapping[str, int], allowed: set[tuple[str, str]]
) -> list[str]:
    """The imports of ``graph`` that go from a lower layer's node to a higher one's."""
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = node_of(module), node_of(target)
            if a != b and layer[b] > layer[a] and (module, target) not in allowed:
                bad.append(f"{module} (layer {layer[a] + 1}) imports {target} (layer {layer[b] + 1})")
    return bad


def node_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The cycles between nodes (strongly connected components of more than one node)."""
    edges: dict[str, set[str]] = {}
    for module, targets in graph.items():
        a = node_of(module)
        edges.setdefault(a, set()).update(b for b in map(node_of, targets) if b != a)
    return cycles(edges)


def _package_graph() -> dict[str, set[str]]:
    # ``import gpuckpt`` (the package itself) is an import of gpuckpt/__init__.py, node "__init__"
    return import_graph()


def test_the_map_names_every_module_once_and_nothing_else() -> None:
    layers = read_map(CONTRIBUTING.read_text())
    assert len(layers) >= 10, [t for t, _ in layers]
    listed = [p for _, paths in layers for p in paths]
    twice = sorted({p for p in listed if listed.count(p) > 1})
    assert not twice, f"named more than once in CONTRIBUTING.md's map: {twice}"
    present = {
        p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts
    }
    assert not sorted(present - set(listed)), (
        f"modules missing from CONTRIBUTING.md's map (add each under its layer): {sorted(present - set(listed))}"
    )
    assert not sorted(set(listed) - present), f"named in the map but absent: {sorted(set(listed) - present)}"
    layer_of_nodes(layers)  # every folder in one layer


def test_imports_go_down_the_layers() -> None:
    layer = layer_of_nodes(read_map(CONTRIBUTING.read_text()))
    graph = _package_graph()
    assert not upward_imports(graph, layer, ALLOWED_UPWARD), "\n".join(
        upward_imports(graph, layer, ALLOWED_UPWARD)
    )
    for module, target in ALLOWED_UPWARD:  # each exception still exists, or it goes from the list
        assert target in graph[module], f"{module} no longer imports {target}: drop it from ALLOWED_UPWARD"


def test_no_two_folders_import_each_other() -> None:
    assert node_cycles(_package_graph()) == []


def test_the_checks_find_an_upward_import_and_a_cycle() -> None:
    """The checks themselves, on a made-up graph: each finds what it is for."""
    graph = {
        "gpuckpt.format.a": {"gpuckpt.storage.b"},  # up: format is below storage
        "gpuckpt.storage.b": {"gpuckpt.format.c"},
        "gpuckpt.format.c": set(),
        "gpuckpt.api": {"gpuckpt.storage.b"},
    }
    layer = {"format": 0, "storage": 1, "api": 2}
    assert upward_imports(graph, layer, set()) == [
        "gpuckpt.format.a (layer 1) imports gpuckpt.storage.b (layer 2)"
    ]
    assert upward_imports(graph, layer, {("gpuckpt.format.a", "gpuckpt.storage.b")}) == []
    assert node_cycles(graph) == [["format", "storage"]]
    assert node_cycles({"gpuckpt.api": {"gpuckpt.storage.b"}, "gpuckpt.storage.b": set()}) == []
    split = [("low", ["format/a.py"]), ("high", ["format/b.py"])]
    try:
        layer_of_nodes(split)
    except AssertionError as exc:
        assert "a folder is one layer" in str(exc)
    else:
        raise AssertionError("a folder split over two layers was not reported")
