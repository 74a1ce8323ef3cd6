"""TorchCoordinator over gloo (CPU) process groups of 2, 3 and 4 processes.

The ``run_torch`` fixture skips a test when torch.distributed is not importable.
The tests that need torch carry the ``torch`` marker (run by ``make test`` in
its Python 3.11 venv, where a skip is a failure).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from gpuckpt.distributed import CoordinatorError, MissingDependencyError, TorchCoordinator


@pytest.mark.torch
@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_over_gloo(run_torch: Any, load_script: Any, n: int) -> None:
    expected = load_script("coordinator_checks").expected
    results = run_torch(n, "coordinator_checks.py", "torch", timeout=120).check(n)
    for rank in range(n):
        assert results[rank] == expected(rank, n)


@pytest.mark.torch
@pytest.mark.parametrize("n", [3, 4])
def test_collectives_over_a_subgroup(run_torch: Any, load_script: Any, n: int) -> None:
    """Ranks and roots are those of the given group (torch's src/dst are global ranks)."""
    expected = load_script("coordinator_checks").expected
    results = run_torch(n, "coordinator_checks.py", "torch-split", timeout=120).check(n)
    for rank in range(n):
        assert results[rank] == expected(rank // 2, len(range(rank % 2, n, 2)))


@pytest.mark.torch
def test_an_uninitialised_process_group_is_a_clear_error() -> None:
    dist = pytest.importorskip("torch.distributed", reason="torch is not installed")

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(CoordinatorError, match="init_process_group"):
        TorchCoordinator()


def test_missing_torch_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(MissingDependencyError, match="needs torch") as info:
        TorchCoordinator()
    assert isinstance(info.value, ImportError)


@pytest.mark.torch
def test_a_rank_that_dies_is_a_coordinator_error_on_the_others(run_torch: Any) -> None:
    """gloo's "Connection closed by peer" reached the other ranks as torch's bare RuntimeError;
    it is now a CoordinatorError naming the collective and what it means, and nothing is published."""
    job = run_torch(2, "misbehave.py", "torch-dies", timeout=120)
    got = job.results[0]
    assert got["raised"] == "CoordinatorError" and got["gpuckpt"] == "True", job.describe()
    assert "another rank of the job died or left it" in got["message"], got
    assert 1 not in job.results  # (the dead rank wrote nothing)
