"""Outside gpuckpt.storage, code reaches the stores through the writer/reader interface only.

Read from the same import graph as test_import_graph.py (function-level imports
included): no module outside the storage package imports a back end, and no
back end imports the registry (:mod:`gpuckpt.storage.stores`) that knows them.
"""

from __future__ import annotations

from test_import_graph import import_graph

#: the packages of the back ends: every module in them is the back end's own
BACK_END_PACKAGES = ("gpuckpt.storage.local", "gpuckpt.storage.s3")
#: back ends of one module
BACK_END_MODULES = ("gpuckpt.storage.memory",)
#: modules of the local back end that the rest of gpuckpt may use, each for a reason: file
#: primitives (durable publication, error hints, whole reads and writes) that convert uses to write
#: single files and saves use to explain an errno; which copy-with-CRC loop this machine runs
#: (reported by the demo and the device benchmark); the maps a local tier keeps of its files,
#: for its exchanges and for the local writer that writes its parts through them; the native
#: batches of file system calls, with which a local tier reads the small files of the parts it
#: sends
SHARED_HELPERS = frozenset(
    (
        "gpuckpt.storage.local.fsutil",
        "gpuckpt.storage.local.fileio",
        "gpuckpt.storage.local.crccopy",
        "gpuckpt.storage.local.filemaps",
        "gpuckpt.storage.local.batchio",
    )
)


def _back_ends(graph: dict[str, set[str]]) -> set[str]:
    # the packages themselves hold only a docstring: ``from gpuckpt.storage.local import fsutil``
    # names the package on the way to the module
    return {
        m for m in graph if m in BACK_END_MODULES or m.startswith(tuple(f"{p}." for p in BACK_END_PACKAGES))
    } - SHARED_HELPERS


#: fault injection and crash tracing wrap the local back end's functions on purpose
MAY_REACH_IN = ("gpuckpt.testing.",)


def _outside_storage(module: str) -> bool:
    return not module.startswith(("gpuckpt.storage.", *MAY_REACH_IN)) and module != "gpuckpt.storage"


def test_no_module_outside_storage_imports_a_back_end() -> None:
    graph = import_graph()
    back_ends = _back_ends(graph)
    assert {
        "gpuckpt.storage.local.writer",
        "gpuckpt.storage.s3.writer",
        "gpuckpt.storage.s3.claim",
    } <= back_ends
    found = sorted(
        f"{m} imports {t}" for m, targets in graph.items() if _outside_storage(m) for t in targets & back_ends
    )
    assert found == [], "; ".join(found) + ": go through gpuckpt.storage.stores instead"


def test_back_ends_do_not_import_the_registry() -> None:
    graph = import_graph()
    found = sorted(
        m for m in graph if m.startswith("gpuckpt.storage.") and "gpuckpt.storage.stores" in graph[m]
    )
    assert found == [], f"{found} import gpuckpt.storage.stores, which imports them"


def test_the_check_sees_an_import() -> None:
    # the graph has the edges this test relies on
    graph = import_graph()
    assert "gpuckpt.storage.local.writer" in graph["gpuckpt.storage.stores"]
    assert "gpuckpt.storage.memory" in graph["gpuckpt.storage.stores"]
    assert "gpuckpt.storage.stores" in graph["gpuckpt.loading.open"]
    assert "gpuckpt.storage.local.writer" in graph["gpuckpt.testing.crash"]
