"""A CheckpointManager on every rank: saves, retention, restore, errors, one view of the steps.

``mpiexec -n N python manager_ranks.py BACKEND ROOT`` (or N torch processes) runs
:func:`cycle` on every rank; the same function runs in-process with ThreadCoordinator
ranks. The state at step s is a pure function of (s, rank, N), so every restore is
checked bit-exact.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from _rank_io import finish, make_coordinator, process_rank, run_rank

import gpuckpt
from gpuckpt.distributed import Coordinator, DistributedError
from gpuckpt.errors import CheckpointExistsError, StepOrderError

ROWS, COLS = 12, 5


def full(step: int) -> dict[str, np.ndarray]:
    """The global tensors at ``step``."""
    return {
        "w": (np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + step),
        "rep": np.full((3, 2), step, np.int64),
    }


def _rows(rank: int, n: int) -> tuple[int, int]:
    cut = np.array_split(np.arange(ROWS), n)[rank]
    return int(cut[0]), int(cut[-1]) + 1


def state(step: int, rank: int, n: int, *, bad: bool = False) -> dict[str, Any]:
    """What ``rank`` of ``n`` holds at ``step``: a row box of ``w``, all of ``rep``, plain values."""
    g = full(step)
    a, b = _rows(rank, n)
    out: dict[str, Any] = {
        "w": gpuckpt.ShardedArray(g["w"][a:b].copy(), (a, 0), g["w"].shape),
        "rep": g["rep"].copy(),
        "step": step,
    }
    if bad:
        out["extra"] = object()  # not storable without allow_pickle
    return out


def empty(rank: int, n: int) -> dict[str, Any]:
    a, b = _rows(rank, n)
    return {
        "w": gpuckpt.ShardedArray(np.zeros((b - a, COLS), np.float32), (a, 0), (ROWS, COLS)),
        "rep": np.zeros((3, 2), np.int64),
        "step": -1,
    }


def exact(target: dict[str, Any], step: int, rank: int, n: int) -> bool:
    want = state(step, rank, n)
    return bool(
        np.array_equal(target["w"].local, want["w"].local)
        and np.array_equal(target["rep"], want["rep"])
        and target["step"] == step
    )


def _raised(fn: Any) -> str | None:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__
    return None


def cycle(c: Coordinator, root: str) -> dict[str, Any]:
    """Save, keep two, restore, fail on one rank, go on, delete, sync saves; what each rank saw."""
    r, n = c.rank, c.world_size
    out: dict[str, Any] = {}
    mgr = gpuckpt.CheckpointManager(f"{root}/async", max_to_keep=2, coordinator=c)
    for step in (10, 20, 30, 40):
        assert mgr.save(step, state(step, r, n))
    mgr.wait()
    out["steps"] = mgr.all_steps()
    out["latest"] = mgr.latest_step()
    target = empty(r, n)
    out["restored"] = mgr.restore(target)
    out["exact_40"] = exact(target, 40, r, n)
    target = empty(r, n)
    mgr.restore(target, step=30)
    out["exact_30"] = exact(target, 30, r, n)
    whole = mgr.restore_state_dict()
    out["whole"] = bool(np.array_equal(whole["w"], full(40)["w"]) and whole["step"] == 40)
    out["exists"] = _raised(lambda: mgr.save(40, state(40, r, n)))
    out["older"] = _raised(lambda: mgr.save(35, state(35, r, n)))
    # rank 1 cannot store one of its values: the save fails on every rank, later saves go on
    mgr.save(50, state(50, r, n, bad=(r == 1)))
    try:
        mgr.wait()
        out["failed"] = None
    except DistributedError as exc:
        out["failed"] = sorted(exc.failures)
    out["after_failure"] = mgr.all_steps()
    mgr.save(60, state(60, r, n))
    mgr.wait()
    out["steps_60"] = mgr.all_steps()
    target = empty(r, n)
    out["restored_60"] = mgr.restore(target)
    out["exact_60"] = exact(target, 60, r, n)
    mgr.delete(40)
    out["after_delete"] = mgr.all_steps()
    mgr.close()
    with gpuckpt.CheckpointManager(f"{root}/sync", max_to_keep=1, async_save=False, coordinator=c) as sync:
        for step in (1, 2, 3):
            sync.save(step, state(step, r, n))
        out["sync_steps"] = sync.all_steps()
        target = empty(r, n)
        sync.restore(target)
        out["sync_exact"] = exact(target, 3, r, n)
    return out


EXPECTED = {
    "steps": [30, 40],
    "latest": 40,
    "restored": 40,
    "exact_40": True,
    "exact_30": True,
    "whole": True,
    "exists": CheckpointExistsError.__name__,
    "older": StepOrderError.__name__,
    "failed": [1],
    "after_failure": [30, 40],
    "steps_60": [40, 60],
    "restored_60": 60,
    "exact_60": True,
    "after_delete": [60],
    "sync_steps": [3],
    "sync_exact": True,
}


def main(backend: str, root: str) -> None:
    rank = process_rank(backend)

    def work() -> dict[str, Any]:
        c = make_coordinator(backend)
        try:
            return cycle(c, root)
        finally:
            finish(backend)

    run_rank(rank, work, backend)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
