"""exchange_objects, exchange_buffers and duplicate in-process: ThreadCoordinator ranks, one process, the base class.

The checks are those the MPI and torch jobs run (``scripts/exchange_checks.py``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from gpuckpt.distributed import (
    Coordinator,
    CoordinatorError,
    SingleProcessCoordinator,
    ThreadCoordinator,
    ThreadGroup,
    run_ranks,
)
from gpuckpt.distributed import coordinator as coordinator_module


@pytest.fixture
def checks(load_script: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The checks, with pieces of 1 MiB (a few MiB then travel in several)."""
    module = load_script("exchange_checks")
    monkeypatch.setattr(coordinator_module, "PIECE_BYTES", module.SMALL_PIECE)
    return module


class Plain(Coordinator):
    """Only what a subclass must implement: the exchanges are the base class's defaults."""

    def __init__(self, inner: Coordinator) -> None:
        self.inner = inner

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        return self.inner.gather(obj, root)

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        return self.inner.scatter(objs, root)

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return self.inner.broadcast(obj, root)

    def all_gather(self, obj: Any) -> list[Any]:
        return self.inner.all_gather(obj)

    def barrier(self) -> None:
        self.inner.barrier()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_thread_ranks(checks: Any, tmp_path: Path, n: int) -> None:
    results = run_ranks(n, lambda c: checks.run_checks(c, tmp_path), timeout=60)
    assert results == [checks.expected(rank, n) for rank in range(n)]


def test_single_process(checks: Any, tmp_path: Path) -> None:
    assert checks.run_checks(SingleProcessCoordinator(), tmp_path) == checks.expected(0, 1)


@pytest.mark.parametrize("n", [1, 3])
def test_the_base_class_defaults(checks: Any, tmp_path: Path, n: int) -> None:
    """A subclass that implements only the abstract methods gets correct (if costly) exchanges."""
    results = run_ranks(n, lambda c: checks.run_checks(Plain(c), tmp_path, duplicates=False), timeout=60)
    assert results == [checks.expected(rank, n, duplicates=False) for rank in range(n)]


def test_the_base_class_cannot_duplicate() -> None:
    with pytest.raises(CoordinatorError, match="Plain cannot duplicate itself"):
        Plain(SingleProcessCoordinator()).duplicate()


def test_the_kth_duplicate_of_each_rank_is_one_child_group() -> None:
    def rank_main(c: ThreadCoordinator) -> list[ThreadGroup]:
        return [c.duplicate().group for _ in range(3)]

    groups = run_ranks(3, rank_main)
    assert groups[0] == groups[1] == groups[2]
    assert len({id(g) for g in groups[0]}) == 3
    assert all(g.world_size == 3 and g.timeout == 60.0 for g in groups[0])


def test_a_rank_that_left_fails_an_exchange_at_once() -> None:
    def rank_main(c: ThreadCoordinator) -> None:
        if c.rank == 0:
            c.exchange_objects({}, [1])

    with pytest.raises(CoordinatorError, match="rank 1 returned without calling it"):
        run_ranks(2, rank_main, timeout=30)


def test_a_rank_that_left_fails_its_duplicates_at_once() -> None:
    """run_ranks records a departure in the group's duplicates too: no wait for the timeout."""
    started = threading.Event()

    def rank_main(c: ThreadCoordinator) -> None:
        d = c.duplicate()
        if c.rank == 0:
            started.set()
            d.exchange_buffers({1: [b"x"]}, {})

    with pytest.raises(CoordinatorError, match="rank 1 returned without calling it"):
        run_ranks(2, rank_main, timeout=30)
    assert started.is_set()


def test_an_exchange_times_out() -> None:
    group = ThreadGroup(2, timeout=0.2)
    with pytest.raises(CoordinatorError, match=r"ranks \[1\] did not reach exchange_buffers within 0.2 s"):
        group.coordinators[0].exchange_buffers({1: [b"abc"]}, {})


def test_unmatched_pairs_raise_on_the_receiver() -> None:
    """In-process ranks see every rank's sends: a pair one side does not know is an error there."""

    def rank_main(c: ThreadCoordinator) -> list[str]:
        errors = []
        for call in (
            lambda: c.exchange_objects({1: "x"} if c.rank == 0 else {}, []),
            lambda: c.exchange_objects({}, [0] if c.rank == 1 else []),
            lambda: c.exchange_buffers({1: [b"x"]} if c.rank == 0 else {}, {}),
            lambda: c.exchange_buffers({}, {0: []} if c.rank == 1 else {}),
        ):
            try:
                call()
                errors.append("no error")
            except CoordinatorError as exc:
                errors.append(str(exc).split(";")[0])
        return errors

    assert run_ranks(2, rank_main) == [
        ["no error"] * 4,
        [
            "exchange_objects: rank 0 sent to rank 1, which does not receive from it",
            "exchange_objects: rank 0 sent nothing to rank 1, which receives from it",
            "exchange_buffers: rank 0 sent to rank 1, which does not receive from it",
            "exchange_buffers: rank 0 sent nothing to rank 1, which receives from it",
        ],
    ]
