"""MPICoordinator's exchanges and duplicates in real jobs (``mpiexec -n 4``; the checks of ``scripts/exchange_checks.py``).

The ``run_mpi`` fixture skips a test when mpiexec or mpi4py is missing.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.mark.parametrize("n", [1, 4])
def test_exchanges_on_comm_world(run_mpi: Any, load_script: Any, n: int) -> None:
    expected = load_script("exchange_checks").expected
    results = run_mpi(n, "exchange_checks.py", "mpi", timeout=90).check(n)
    for rank in range(n):
        assert results[rank] == expected(rank, n)


def test_exchanges_on_a_split_communicator(run_mpi: Any, load_script: Any) -> None:
    """Ranks are those of the given communicator (even and odd world ranks: two groups of 2)."""
    expected = load_script("exchange_checks").expected
    results = run_mpi(4, "exchange_checks.py", "mpi-split", timeout=90).check(4)
    for world_rank in range(4):
        assert results[world_rank] == expected(world_rank // 2, 2)


def test_duplicate_needs_thread_multiple_on_every_rank(run_mpi: Any) -> None:
    """Rank 1 initialises MPI with MPI_THREAD_SERIALIZED: every rank refuses, and stays usable."""
    results = run_mpi(3, "exchange_checks.py", "mpi-thread-level", timeout=60).check(3)
    for rank in range(3):
        refused = results[rank]["refused"]
        assert refused.startswith("CoordinatorError: MPICoordinator.duplicate: "), refused
        assert "rank 1: MPI_THREAD_SERIALIZED" in refused and "rank 0" not in refused
        assert 'mpi4py.rc.thread_level = "multiple"' in refused and "two threads call MPI at once" in refused
        assert results[rank]["after"] == [0, 1, 2]


@pytest.mark.parametrize("n", [1, 4])
def test_exchange_waits_spin_or_sleep_by_whether_the_ranks_share_cores(
    run_mpi: Any, load_script: Any, n: int
) -> None:
    """Both kinds of waits deliver every byte of ``exchange_buffers``, every object of
    ``exchange_objects`` and every rank's error of ``all_reduce_errors``; the coordinator sleeps between tests
    exactly where the node runs more ranks than a rank may use CPUs (MPI_LOCALNRANKS, from
    mpiexec), and spins (``Waitall``) elsewhere."""
    import os

    script = load_script("exchange_checks")
    results = run_mpi(n, "exchange_checks.py", "mpi-waits", timeout=90).check(n)
    cpus = len(os.sched_getaffinity(0))
    for rank in range(n):
        got = results[rank]
        assert got["chosen"] == got["expected_choice"] == (n > cpus), got["chosen"]
        assert {k: got[k] for k in ("agrees", "idle=False", "idle=True")} == script.expected_waits(rank, n)
