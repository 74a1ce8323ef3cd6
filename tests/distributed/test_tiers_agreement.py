"""The ranks of a tiered manager agree, or every rank raises a typed error: never a restore of
mixed steps, a job of two roots, a save over another job's tier steps, a silent fall back to
an older step, or a job that hangs because one rank made another call.

4 ranks as 2 simulated nodes under mpiexec (``scripts/tier_agreement.py``); the steps a job
starts from are saved by thread ranks (``ThreadCoordinator``), which costs no process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuckpt.distributed import run_ranks

SCRIPT = "tier_agreement.py"


@pytest.fixture
def agreement(load_script: Any) -> Any:
    return load_script("tier_agreement")


@pytest.fixture
def tiers(load_script: Any) -> Any:
    return load_script("tier_ranks")


def test_mpi_ranks_asking_restore_for_different_steps_raise_before_anything_is_read(
    run_mpi: Any, agreement: Any, tmp_path: Path
) -> None:
    """Rank 0 asks step 6, the others step 7 (both in the tiers): each had restored its own step
    and node n0 deleted step 7; rank 0 asks the root-only step 4, the others the newest: every
    rank hung. Both are a StepOrderError on every rank naming the steps and ranks, nothing is
    deleted, and the ranks then restore one step together."""
    run_ranks(4, lambda c: agreement.save(c, str(tmp_path), 7, 2, local_max_to_keep=3), timeout=120)
    job = run_mpi(4, SCRIPT, "mpi", "steps", tmp_path, timeout=90).check(4)
    for rank, r in job.items():
        assert r["tiers"][0] == "StepOrderError", (rank, r)
        assert "6 on rank 0, 7 on ranks [1, 2, 3]" in r["tiers"][1], (rank, r)
        assert r["root"][0] == "StepOrderError", (rank, r)
        assert "4 on rank 0, None on ranks [1, 2, 3]" in r["root"][1], (rank, r)
        assert r["tiers local"] == r["root local"] == [5, 6, 7], (rank, r)
        assert r["agreed"] == [6, True], (rank, r)


def test_mpi_a_rank_of_another_root_is_refused_on_every_rank(run_mpi: Any, tmp_path: Path) -> None:
    """Rank 3 names another root: accepted, its restore mixed in the other run's part. With a
    local tier and without, every rank raises InvalidOptionError naming both roots and ranks."""
    job = run_mpi(4, SCRIPT, "mpi", "roots", tmp_path, timeout=90).check(4)
    for rank, r in job.items():
        for kind in ("tiered", "plain"):
            kind_, message = r[kind]
            assert kind_ == "InvalidOptionError", (rank, kind, r)
            assert (
                f"root: '{tmp_path / 'root'}' on ranks [0, 1, 2], '{tmp_path / 'other'}' on rank 3" in message
            )
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").iterdir())


def test_mpi_fewer_ranks_never_save_over_the_tier_steps_of_another_job(
    run_mpi: Any, agreement: Any, tiers: Any, tmp_path: Path
) -> None:
    """4 ranks saved steps 1-3 to the tiers (none persisted); 3 ranks follow the guide's loop.
    Their restore names the 4-rank steps and the fix (it said "save one first"), and their
    saves of steps 0-3 are refused on every rank (they wrote over the 4-rank parts); step 4
    goes on. 4 ranks then restore step 3 bit-exact from the tiers."""
    run_ranks(4, lambda c: agreement.save(c, str(tmp_path), 3, 100), timeout=120)
    job = run_mpi(3, SCRIPT, "mpi", "fewer", tmp_path, 100, timeout=120).check(3)
    for rank, r in job.items():
        assert "step(s) [2, 3] saved by a job of 4 ranks (this job has 3)" in r["restore"], (rank, r)
        assert "restart with 4 ranks" in r["restore"], (rank, r)
        saves = r["saves"]
        assert saves["0"][0] == saves["1"][0] == "StepOrderError", (rank, saves)
        assert saves["2"][0] == saves["3"][0] == "CheckpointExistsError", (rank, saves)
        for s in "0123":
            assert "held step(s) [2, 3] in " in saves[s][1] and "delete them" in saves[s][1], (rank, saves)
        assert saves["4"] == ["saved"], (rank, saves)
    restored = run_ranks(4, lambda c: tiers.restore(c, str(tmp_path)), timeout=120)
    assert all(r["step"] == 3 and r["exact"] and r["source"] == "tiers" for r in restored), restored


def test_mpi_a_state_that_is_a_subset_of_a_step_restores_it_from_the_tiers(
    run_mpi: Any, agreement: Any, tmp_path: Path
) -> None:
    """The tiers hold steps 2-3, the root step 2; a target without ``rep`` (on rank 1, then on
    every rank) took the root's step 2 and deleted step 3 from every node. It restores step 3
    from the tiers, as a load of the root's step takes a subset, and nothing is deleted."""
    run_ranks(4, lambda c: agreement.save(c, str(tmp_path), 3, 2), timeout=120)
    job = run_mpi(4, SCRIPT, "mpi", "subset", tmp_path, timeout=90).check(4)
    for rank, r in job.items():
        assert r["one"] == [3, "tiers", True, [2, 3]], (rank, r)
        assert r["all"] == [3, "tiers", True, [2, 3]], (rank, r)


@pytest.mark.parametrize(
    ("call", "calls"),
    [
        ("restore", "restore on rank 0, save on ranks [1, 2, 3]"),
        ("delete", "delete on rank 0, save on ranks [1, 2, 3]"),
        ("close", "restore on rank 0, wait() or close() on ranks [1, 2, 3]"),
    ],
)
def test_mpi_one_rank_in_another_call_is_a_coordinator_error_not_a_hang(
    run_mpi: Any, tmp_path: Path, call: str, calls: str
) -> None:
    """At step 3 rank 0 alone calls restore (or delete) while the others save, or restores while
    they close: every rank hung. Every rank raises CoordinatorError naming the calls."""
    job = run_mpi(4, SCRIPT, "mpi", "alone", tmp_path, call, timeout=90).check(4)
    for rank, r in job.items():
        kind, message = r["raised"]
        assert kind == "CoordinatorError", (rank, r)
        assert calls in message, (rank, r)


def test_mpi_one_rank_may_list_the_steps_alone(run_mpi: Any, tmp_path: Path) -> None:
    """all_steps() and latest_step() on rank 0 alone (for logging) hung every rank: they are no
    collective, and the job goes on."""
    job = run_mpi(4, SCRIPT, "mpi", "alone", tmp_path, "all_steps", timeout=90).check(4)
    assert job[0]["seen"][0] in ([], [2]) and job[0]["seen"][1] in (None, 2), job[0]
    assert all(r["done"] == [2, 4] for r in job.values()), job
