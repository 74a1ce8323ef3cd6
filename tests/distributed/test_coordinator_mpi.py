"""MPICoordinator in real jobs: ``mpiexec -n 2, 3, 4`` (the mpich wheel's mpiexec and mpi4py).

The ``run_mpi`` fixture skips a test when mpiexec or mpi4py is missing.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from gpuckpt.distributed import MissingDependencyError, MPICoordinator
from gpuckpt.errors import GpuckptError


def _expected(load_script: Any) -> Any:
    return load_script("coordinator_checks").expected


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_on_comm_world(run_mpi: Any, load_script: Any, n: int) -> None:
    expected = _expected(load_script)
    results = run_mpi(n, "coordinator_checks.py", "mpi", timeout=60).check(n)
    for rank in range(n):
        assert results[rank] == expected(rank, n)


@pytest.mark.parametrize("n", [3, 4])
def test_collectives_on_a_split_communicator(run_mpi: Any, load_script: Any, n: int) -> None:
    """Ranks and roots are those of the given communicator, not of COMM_WORLD."""
    expected = _expected(load_script)
    results = run_mpi(n, "coordinator_checks.py", "mpi-split", timeout=60).check(n)
    for world_rank in range(n):
        color = world_rank % 2
        size = len(range(color, n, 2))
        assert results[world_rank] == expected(world_rank // 2, size)


def test_a_crashing_rank_fails_the_job(run_mpi: Any) -> None:
    job = run_mpi(2, "misbehave.py", "crash", timeout=30)
    assert job.returncode != 0
    assert "rank 1 crashes on purpose" in job.results[1]["error"]


def test_a_hanging_job_is_killed_at_the_timeout(run_mpi: Any) -> None:
    with pytest.raises(pytest.fail.Exception, match="ran past 2"):
        run_mpi(2, "misbehave.py", "hang", timeout=2)


def test_missing_mpi4py_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(MissingDependencyError, match="pip install mpich mpi4py") as info:
        MPICoordinator()
    assert isinstance(info.value, ImportError) and isinstance(info.value, GpuckptError)


def test_importing_the_package_imports_no_mpi_or_torch() -> None:
    code = (
        "import sys, gpuckpt, gpuckpt.distributed as d; "
        "d.MPICoordinator, d.TorchCoordinator; "
        "bad = [m for m in ('mpi4py', 'torch') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ctrl_c_in_an_idle_collective_waits_for_it_to_end_then_interrupts(run_mpi: Any) -> None:
    # the collective's two steps both complete before KeyboardInterrupt: the next collective
    # pairs the right messages (it had been a hang, an MPICH abort or another's pickle)
    job = run_mpi(2, "interrupted.py", "held", timeout=60)
    assert job.returncode == 0, job.output[-3000:]
    r0, r1 = job.results[0], job.results[1]
    assert "first" not in r0 and 0.6 < r0["interrupted_after_s"] < 4, r0  # rank 1 came 1 s in
    assert r1["first"] == [["first", 0], ["first", 1]], r1
    assert r0["second"] == r1["second"] == [["second", 0], ["second", 1]], (r0, r1)


def test_ctrl_c_in_a_collective_the_others_never_finish_interrupts_at_the_grace(run_mpi: Any) -> None:
    job = run_mpi(2, "interrupted.py", "stranded", timeout=60)
    r0 = job.results[0]
    assert 0.5 < r0["interrupted_after_s"] < 1.5, r0  # the grace, not rank 1's 2 s
    assert "did not finish within 0.5 s" in r0["refused"] and "end the job" in r0["refused"], r0
