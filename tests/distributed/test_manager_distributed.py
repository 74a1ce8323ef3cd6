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
    """In a collective (a restore), rank 0 alone lists the root: its failure is raised on every
    rank. all_steps() is no collective (each rank lists the root itself, so one rank may call
    it alone): only the rank whose listing fails raises."""
    (tmp_path / "root").mkdir()

    def work(c: Any) -> list[str]:
        mgr = gpuckpt.CheckpointManager(tmp_path / "root", coordinator=c)
        if c.rank == 0:  # rank 0 alone lists the root: make its listing fail
            mgr._store.children = lambda: (_ for _ in ()).throw(PermissionError("listing refused"))
        out = []
        try:
            out.append(str(mgr.all_steps()))
        except PermissionError as exc:
            out.append(f"own {exc}")
        try:
            mgr.restore_state_dict()
        except gpuckpt.DistributedError as exc:
            out.append(f"{sorted(exc.failures)} {exc.failures[0]}")
        return out

    got = run_ranks(3, work)
    assert got[0] == ["own listing refused", "[0] PermissionError: listing refused"], got
    assert got[1:] == [["[]", "[0] PermissionError: listing refused"]] * 2, got


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


@pytest.mark.parametrize("tier", [False, True], ids=["root", "tier"])
def test_arguments_one_rank_refuses_are_raised_on_every_rank(tmp_path: Path, tier: bool) -> None:
    """Rank 3 alone passes a bad value: it raises its own error, every other rank a
    DistributedError naming it; none waits for it in a collective."""

    def work(c: Any) -> str:
        bad = {"local_max_to_keep": 0} if tier else {"max_to_keep": 0}
        kw: dict[str, Any] = bad if c.rank == 3 else {}
        if tier:
            kw.update(local_dir=tmp_path / f"n{c.rank // 2}", node=f"n{c.rank // 2}")
        try:
            gpuckpt.CheckpointManager(tmp_path / "root", coordinator=c, **kw)
        except gpuckpt.DistributedError as exc:
            return f"job: {exc}"
        except ValueError as exc:  # (InvalidOptionError is one)
            return f"own: {exc}"
        return "made"

    got = run_ranks(4, work, timeout=60)
    name = "local_max_to_keep" if tier else "max_to_keep"
    assert got[3].startswith("own: ") and name in got[3], got
    assert all(g.startswith("job: rank 3 (of 4) failed: ") and f"{name} must be" in g for g in got[:3]), got


@pytest.mark.parametrize(
    ("setting", "value"), [("replicas", 0), ("persist_interval_steps", 2), ("chunk_bytes", 1 << 20)]
)
def test_settings_that_differ_between_ranks_are_refused_on_every_rank(
    tmp_path: Path, setting: str, value: Any
) -> None:
    def work(c: Any) -> str:
        node = f"n{c.rank // 2}"
        kw: dict[str, Any] = {setting: value} if c.rank == 3 else {}
        try:
            gpuckpt.CheckpointManager(
                tmp_path / "root", local_dir=tmp_path / node, node=node, coordinator=c, **kw
            )
        except gpuckpt.InvalidOptionError as exc:
            return str(exc)
        return "made"

    got = run_ranks(4, work, timeout=60)
    assert all(
        f"{setting}: " in g and f"{value!r} on rank 3" in g and "every rank must pass the same" in g
        for g in got
    ), got
    assert not (tmp_path / "n0").exists() or not [p for p in (tmp_path / "n0").iterdir() if p.name != ".lock"]


@pytest.mark.parametrize(
    ("tier", "waited"), [(False, True), (True, True), (True, False)], ids=["root", "tier", "tier-draining"]
)
def test_ranks_that_save_different_steps_in_one_call_are_refused_and_the_next_save_goes_on(
    tmp_path: Path, tier: bool, waited: bool
) -> None:
    # (tier-draining: step 1's drain may still run at the next save, whose check had compared
    # the drain's step in place of the step saved)
    def work(c: Any) -> tuple[str, list[int], float]:
        node = f"n{c.rank // 2}"
        kw: dict[str, Any] = {"local_dir": tmp_path / node, "node": node} if tier else {}
        with gpuckpt.CheckpointManager(tmp_path / "root", coordinator=c, **kw) as mgr:
            mgr.save(1, {"w": np.full(4, 1.0)})
            if waited:
                mgr.wait()
            try:
                mgr.save(3 if c.rank == 3 else 2, {"w": np.full(4, 2.0)})
                refused = "saved"
            except gpuckpt.StepOrderError as exc:
                refused = str(exc)
            mgr.save(2, {"w": np.full(4, 20.0)})
            mgr.wait()
            steps = mgr.local_steps() if tier else mgr.all_steps()
            target = {"w": np.zeros(4)}
            mgr.restore(target)
        return refused, steps, float(target["w"][0])

    got = run_ranks(4, work, timeout=120)
    for rank, (refused, steps, w) in enumerate(got):
        assert "different steps in one call (2 on ranks [0, 1, 2], 3 on rank 3)" in refused, refused
        assert steps == [1, 2] and w == 20.0, (rank, steps, w)
