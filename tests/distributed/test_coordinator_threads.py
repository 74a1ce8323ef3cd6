"""ThreadCoordinator (N threads as N ranks) and SingleProcessCoordinator, in-process."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuckpt.distributed import (
    Coordinator,
    CoordinatorError,
    DistributedError,
    SingleProcessCoordinator,
    ThreadCoordinator,
    ThreadGroup,
    run_ranks,
)
from gpuckpt.errors import GpuckptError


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_every_collective_matches_the_mpi_expectations(load_script: Any, tmp_path: Path, n: int) -> None:
    checks = load_script("coordinator_checks")
    results = run_ranks(n, lambda c: checks.run_checks(c, tmp_path))
    assert results == [checks.expected(rank, n) for rank in range(n)]


def test_single_process_coordinator_matches_the_mpi_expectations(load_script: Any, tmp_path: Path) -> None:
    checks = load_script("coordinator_checks")
    c = SingleProcessCoordinator()
    assert (c.rank, c.world_size) == (0, 1)
    assert checks.run_checks(c, tmp_path) == checks.expected(0, 1)


def test_single_process_all_reduce_errors_chains_the_cause() -> None:
    own = ValueError("bad shard")
    with pytest.raises(DistributedError, match=r"rank 0 \(of 1\) failed: ValueError: bad shard") as info:
        SingleProcessCoordinator().all_reduce_errors(own)
    assert info.value.failures == {0: "ValueError: bad shard"}
    assert info.value.__cause__ is own
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, GpuckptError)


def test_distributed_error_pickles_and_names_every_rank() -> None:
    e = DistributedError({2: "OSError: disk full", 0: "KeyError: 'w'"}, world_size=4)
    assert str(e) == "2 ranks (of 4) failed: rank 0: KeyError: 'w'; rank 2: OSError: disk full"
    back = pickle.loads(pickle.dumps(e))
    assert (back.failures, str(back)) == (e.failures, str(e))


@pytest.mark.parametrize("c", [SingleProcessCoordinator(), ThreadGroup(1).coordinators[0]])
@pytest.mark.parametrize("root", [-1, 1, True, "0"])
def test_a_root_outside_the_group_is_rejected(c: Coordinator, root: Any) -> None:
    for call in (
        lambda: c.gather(1, root=root),
        lambda: c.broadcast(1, root=root),
        lambda: c.scatter([1], root),
    ):
        with pytest.raises(CoordinatorError, match="not a rank of this group"):
            call()


def test_all_reduce_errors_rejects_a_non_exception() -> None:
    with pytest.raises(TypeError, match="exception or None"):
        SingleProcessCoordinator().all_reduce_errors("failed")  # type: ignore[arg-type]


def test_received_objects_are_copies() -> None:
    shared = {"boxes": [np.zeros(3)]}

    def rank_main(c: ThreadCoordinator) -> tuple[bool, bool]:
        got = c.broadcast(shared if c.rank == 0 else None, root=0)
        gathered = c.gather(shared, root=0)
        return got is not shared, gathered is None or all(g is not shared for g in gathered)

    assert run_ranks(3, rank_main) == [(True, True)] * 3


def test_an_unpicklable_object_fails_on_its_rank_and_does_not_hang() -> None:
    def rank_main(c: ThreadCoordinator) -> None:
        c.all_gather(threading.Lock() if c.rank == 1 else "fine")

    with pytest.raises(TypeError, match="pickle") as info:
        run_ranks(3, rank_main, timeout=10)
    assert "raised on rank 1 of 3" in "\n".join(info.value.__notes__)


def test_different_collectives_in_one_round_raise_on_every_rank() -> None:
    def rank_main(c: ThreadCoordinator) -> str:
        try:
            if c.rank == 0:
                c.gather("x", root=0)
            else:
                c.broadcast("x", root=0)
        except CoordinatorError as exc:
            return str(exc)
        return "no error"

    messages = run_ranks(2, rank_main)
    assert all("different collectives" in m and "rank 0: gather(root=0)" in m for m in messages), messages


def test_different_roots_in_one_round_raise_on_every_rank() -> None:
    def rank_main(c: ThreadCoordinator) -> bool:
        with pytest.raises(CoordinatorError, match="different collectives"):
            c.broadcast("x", root=c.rank)
        return True

    assert run_ranks(3, rank_main) == [True] * 3


def test_a_rank_that_left_fails_the_others_at_once() -> None:
    def rank_main(c: ThreadCoordinator) -> None:
        if c.rank == 0:
            c.barrier()

    with pytest.raises(CoordinatorError, match="rank 1 returned without calling it") as info:
        run_ranks(2, rank_main, timeout=30)
    assert "raised on rank 0 of 2" in "\n".join(info.value.__notes__)


def test_run_ranks_reraises_the_first_failure_with_its_rank() -> None:
    def rank_main(c: ThreadCoordinator) -> None:
        if c.rank == 2:
            raise KeyError("no such shard")
        c.barrier()

    with pytest.raises(KeyError, match="no such shard") as info:
        run_ranks(4, rank_main)
    notes = "\n".join(info.value.__notes__)
    assert "raised on rank 2 of 4" in notes
    assert "other ranks also raised" in notes and "rank 0: CoordinatorError" in notes


def test_a_rank_that_never_arrives_times_out() -> None:
    group = ThreadGroup(2, timeout=0.2)
    with pytest.raises(CoordinatorError, match=r"ranks \[1\] did not reach barrier within 0.2 s"):
        group.coordinators[0].barrier()
    with pytest.raises(CoordinatorError, match="did not reach"):  # the group stays broken
        group.coordinators[1].barrier()


def test_run_ranks_returns_results_by_rank() -> None:
    assert run_ranks(4, lambda c: (c.rank, c.world_size)) == [(r, 4) for r in range(4)]


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_thread_group_needs_a_positive_size(n: Any) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        ThreadGroup(n)


_ops = st.lists(
    st.tuples(
        st.sampled_from(["gather", "scatter", "broadcast", "all_gather", "barrier", "errors"]),
        st.integers(0, 4),
    ),
    max_size=12,
)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5), ops=_ops, failing=st.sets(st.integers(0, 4)))
def test_random_sequences_of_collectives(n: int, ops: list[tuple[str, int]], failing: set[int]) -> None:
    """Any sequence of collectives, called by every rank in order, gives each rank the MPI result."""

    def value(step: int, rank: int) -> tuple[int, int, str]:
        return (step, rank, "v" * (rank % 3))

    def rank_main(c: ThreadCoordinator) -> list[Any]:
        seen: list[Any] = []
        for step, (op, root_pick) in enumerate(ops):
            root = root_pick % n
            if op == "gather":
                seen.append(c.gather(value(step, c.rank), root=root))
            elif op == "scatter":
                objs = [value(step, r) for r in range(n)] if c.rank == root else None
                seen.append(c.scatter(objs, root=root))
            elif op == "broadcast":
                seen.append(c.broadcast(value(step, c.rank), root=root))
            elif op == "all_gather":
                seen.append(c.all_gather(value(step, c.rank)))
            elif op == "barrier":
                seen.append(c.barrier())
            else:
                own = RuntimeError(f"step {step}") if c.rank in failing else None
                try:
                    c.all_reduce_errors(own)
                    seen.append(None)
                except DistributedError as exc:
                    seen.append(exc.failures)
        return seen

    def model(rank: int) -> list[Any]:
        out: list[Any] = []
        for step, (op, root_pick) in enumerate(ops):
            root = root_pick % n
            everyone = [value(step, r) for r in range(n)]
            out.append(
                {
                    "gather": everyone if rank == root else None,
                    "scatter": value(step, rank),
                    "broadcast": value(step, root),
                    "all_gather": everyone,
                    "barrier": None,
                    "errors": {r: f"RuntimeError: step {step}" for r in sorted(failing) if r < n} or None,
                }[op]
            )
        return out

    assert run_ranks(n, rank_main, timeout=30) == [model(r) for r in range(n)]
