"""Whether MPICoordinator's waits sleep: from the launcher's count of ranks on the node and the CPUs
this process may use (no MPI needed)."""

from __future__ import annotations

import os

from gpuckpt.distributed.mpi import LOCAL_RANKS_VARIABLES, shares_cores


def test_ranks_beyond_the_cpus_share_cores() -> None:
    cpus = len(os.sched_getaffinity(0))
    for name in LOCAL_RANKS_VARIABLES:
        assert shares_cores({name: str(cpus + 1)}) is True
        assert shares_cores({name: str(cpus)}) is False
        assert shares_cores({name: "1"}) is False


def test_the_first_launcher_variable_set_to_a_number_decides() -> None:
    cpus = len(os.sched_getaffinity(0))
    first, second = LOCAL_RANKS_VARIABLES[:2]
    assert shares_cores({first: "1", second: str(cpus + 1)}) is False
    assert shares_cores({first: "", second: str(cpus + 1)}) is True
    assert shares_cores({first: "four", second: str(cpus + 1)}) is True


def test_unknown_means_a_core_each() -> None:
    assert shares_cores({}) is False
    assert shares_cores({"UNRELATED": "99999"}) is False
