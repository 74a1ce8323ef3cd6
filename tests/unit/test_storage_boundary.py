"""Outside gpuckpt.storage, code reaches the stores through the writer/reader interface only.

Read from the same import graph as test_import_graph.py (function-level imports
included): no module outside the storage package imports a back end, and no
back end imports the registry (:mod:`gpuckpt.storage.stores`) that knows them.
"""

from __future__ import annotations

from test_import_graph import import_graph

#: the back ends and their internals; the rest of gpuckpt goes through storage.stores and storage.base
BACK_ENDS = frozenset(
    (
        "gpuckpt.storage.local.writer",
        "gpuckpt.storage.local.reader",
        "gpuckpt.storage.local.leftovers",
        "gpuckpt.storage.local.direct",
        "gpuckpt.storage.s3.writer",
        "gpuckpt.storage.s3.client",
        "gpuckpt.storage.s3.root",
        "gpuckpt.storage.local.root",
    )
)
#: fault injection and crash tracing wrap the local back end's functions on purpose
MAY_REACH_IN = ("gpuckpt.testing.",)


def _outside_storage(module: str) -> bool:
    return not module.startswith(("gpuckpt.storage.", *MAY_REACH_IN)) and module != "gpuckpt.storage"


def test_no_module_outside_storage_imports_a_back_end() -> None:
    graph = import_graph()
    assert set(BACK_ENDS) <= set(graph), "a back end module is missing: update BACK_ENDS"
    found = sorted(
        f"{m} imports {t}" for m, targets in graph.items() if _outside_storage(m) for t in targets & BACK_ENDS
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
    assert "gpuckpt.storage.stores" in graph["gpuckpt.loading.open"]
    assert "gpuckpt.storage.local.writer" in graph["gpuckpt.testing.crash"]
