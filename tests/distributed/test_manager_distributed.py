"""A CheckpointManager on every rank of a job: threads, mpiexec and gloo processes.

Every rank must see the same steps, raise the same errors (a value one rank cannot
store fails the save on every rank, and the next save goes on), keep what retention
keeps, and restore bit-exact; a step saved by N ranks restores on M.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.distributed import run_ranks

SCRIPT = "manager_ranks.py"


def test_every_thread_rank_sees_the_same_steps_and_errors(load_script: Any, tmp_path: Path) -> None:
    module = load_script("manager_ranks")
    results = run_ranks(4, lambda c: module.cycle(c, str(tmp_path)), timeout=60)
    for rank, seen in enumerate(results):
        assert seen == module.EXPECTED, f"rank {rank}"


def test_a_step_saved_by_four_ranks_restores_on_three_and_in_one_process(
    load_script: Any, tmp_path: Path
) -> None:
    module = load_script("manager_ranks")

    def save(c: Any) -> None:
        with gpuckpt.CheckpointManager(tmp_path, coordinator=c) as mgr:
            mgr.save(7, module.state(7, c.rank, c.world_size))

    run_ranks(4, save)

    def restore(c: Any) -> bool:
        target = module.empty(c.rank, c.world_size)
        with gpuckpt.CheckpointManager(tmp_path, coordinator=c) as mgr:
            assert mgr.restore(target) == 7
        return bool(module.exact(target, 7, c.rank, c.world_size))

    assert run_ranks(3, restore) == [True, True, True]
    whole = gpuckpt.CheckpointManager(tmp_path).restore_state_dict()
    assert np.array_equal(whole["w"], module.full(7)["w"]) and whole["step"] == 7


def test_a_failure_listing_the_root_on_rank_0_is_raised_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()

    def work(c: Any) -> str:
        mgr = gpuckpt.CheckpointManager(tmp_path / "root", coordinator=c)
        if c.rank == 0:  # rank 0 alone lists the root: make its listing fail
            mgr._store.children = lambda: (_ for _ in ()).throw(PermissionError("listing refused"))
        try:
            mgr.all_steps()
        except gpuckpt.DistributedError as exc:
            return f"{sorted(exc.failures)} {exc.failures[0]}"
        return "no error"

    assert run_ranks(3, work) == ["[0] PermissionError: listing refused"] * 3


def test_mpi_ranks_share_one_manager_view(run_mpi: Any, load_script: Any, tmp_path: Path) -> None:
    module = load_script("manager_ranks")
    results = run_mpi(4, SCRIPT, "mpi", tmp_path, timeout=120).check(4)
    for rank in range(4):
        assert results[rank] == module.EXPECTED, f"rank {rank}"


@pytest.mark.torch
def test_gloo_ranks_share_one_manager_view(run_torch: Any, load_script: Any, tmp_path: Path) -> None:
    module = load_script("manager_ranks")
    results = run_torch(4, SCRIPT, "torch", tmp_path, timeout=120).check(4)
    for rank in range(4):
        assert results[rank] == module.EXPECTED, f"rank {rank}"
