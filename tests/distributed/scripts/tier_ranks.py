"""A CheckpointManager with a local tier on every rank: 4 ranks as 2 simulated nodes.

Rank r is on node ``n{r // 2}``, whose tier is ``BASE/n{r // 2}``; the root is ``BASE/root``.
Modes (``mpiexec -n 4 python tier_ranks.py BACKEND MODE BASE [ARGS]``):

``train LAST KILL_AT``
    Save steps 1..LAST (persisting every 2nd), waiting for step KILL_AT - 2 to be written
    everywhere; at step KILL_AT, the ranks of node n1 kill themselves with SIGKILL right
    after ``save`` returns (their part's write, the replication or the drain in flight).
    KILL_AT 0: no kill, and a final ``wait``.
``restore``
    Restore the newest complete step; report the step, whether it is bit-exact, and
    ``last_restore``.
``full``
    Save step 1, then step 2, whose replication fails on node n1 (the test makes its tier
    refuse space); report the error each rank raised, then restore.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
from _rank_io import finish, make_coordinator, process_rank, run_rank
from manager_ranks import empty, exact, state

import gpuckpt
from gpuckpt.distributed import Coordinator


def manager(c: Coordinator, base: str | Path, **kw: Any) -> gpuckpt.CheckpointManager:
    node = f"n{c.rank // 2}"
    kw.setdefault("persist_interval_steps", 2)
    return gpuckpt.CheckpointManager(
        Path(base) / "root", local_dir=Path(base) / node, node=node, coordinator=c, **kw
    )


def train(c: Coordinator, base: str, last: int, kill_at: int = 0, settle: bool = False) -> dict[str, Any]:
    """Save steps 1..last; ``settle``: wait for each (so that no persist step is skipped)."""
    r, n = c.rank, c.world_size
    mgr = manager(c, base)
    for step in range(1, last + 1):
        mgr.save(step, state(step, r, n))
        if settle or step == kill_at - 2:
            mgr.wait()
        if step == kill_at and r // 2 == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.wait()
    out = {"local": mgr.local_steps(), "root": mgr.all_steps()}
    mgr.close()
    return out


def train_until_killed(c: Coordinator, base: str, settled: int, event: str) -> dict[str, Any]:
    """Save steps 1..``settled`` waiting for each, then go on without waiting; the ranks of node
    n1 are killed with SIGKILL at ``event`` (``EVENT:N`` of gpuckpt.testing.crash: the N-th
    chunk written, root document, publication... of a part, a replica or a drain)."""
    from gpuckpt.testing.crash import kill_points

    r, n = c.rank, c.world_size
    mgr = manager(c, base)
    for step in range(1, settled + 1):
        mgr.save(step, state(step, r, n))
        mgr.wait()
    with kill_points(event if r // 2 == 1 else None):
        for step in range(settled + 1, settled + 50):
            mgr.save(step, state(step, r, n))
    mgr.wait()
    return {"survived": True}


def restore(
    c: Coordinator, base: str, step: int | None = None, *, fortran: bool = False, then: int = 0
) -> dict[str, Any]:
    """Restore (``step``: that one); ``fortran``: into Fortran-ordered arrays (no fetched byte
    can be received into them in place); ``then``: save that many more steps after it."""
    r, n = c.rank, c.world_size
    mgr = manager(c, base)
    target = empty(r, n)
    if fortran:
        w = target["w"]
        target["w"] = gpuckpt.ShardedArray(np.asfortranarray(w.local), w.offsets, w.global_shape)
        target["rep"] = np.asfortranarray(target["rep"])
    got = mgr.restore(target, step=step)
    report = mgr.last_restore
    assert report is not None
    out = {
        "step": got,
        "exact": exact(target, got, r, n),
        "source": report.source,
        "parts": {str(k): [p.where, p.holder] for k, p in sorted(report.parts.items())},
        "skipped": len(report.skipped),
        "counted": {str(k): [p.nbytes, p.seconds] for k, p in sorted(report.parts.items())},
    }
    for more in range(got + 1, got + 1 + then):
        mgr.save(more, state(more, r, n))
        mgr.wait()
    mgr.close()
    return out


#: rows of 1,024 float32 of ``big`` per rank in :func:`full_state`: a chunk file of 64 KiB
#: or more, which a replica receives into a map of its file (its pages allocated first)
BIG_ROWS = 17


def full_state(step: int, rank: int, n: int) -> dict[str, Any]:
    """:func:`state` with ``big``, a row box per rank whose chunk file is large enough to be
    received into a map (the small files of a part are written after the transfer)."""
    out = state(step, rank, n)
    box = np.full((BIG_ROWS, 1024), step * 10 + rank, np.float32)
    out["big"] = gpuckpt.ShardedArray(box, (BIG_ROWS * rank, 0), (BIG_ROWS * n, 1024))
    return out


def save_full(c: Coordinator, base: str) -> dict[str, Any]:
    """Step 1 of :func:`full_state` saved and written everywhere (a part's layout)."""
    mgr = manager(c, base, persist_interval_steps=100)
    mgr.save(1, full_state(1, c.rank, c.world_size))
    mgr.wait()
    mgr.close()
    return {}


def full_tier(c: Coordinator, base: str) -> dict[str, Any]:
    """Step 1 saved everywhere; step 2's replicas cannot be received on node n1 (its tier
    refuses space): the step fails on every rank, step 1 restores."""
    r, n = c.rank, c.world_size
    mgr = manager(c, base, persist_interval_steps=100)
    mgr.save(1, full_state(1, r, n))
    mgr.wait()
    mgr.save(2, full_state(2, r, n))
    out: dict[str, Any] = {}
    try:
        mgr.wait()
        mgr.save(3, full_state(3, r, n))
    except gpuckpt.DistributedError as exc:
        out["failed"] = {str(k): v for k, v in sorted(exc.failures.items())}
    target = empty(r, n)
    target["big"] = gpuckpt.ShardedArray(
        np.zeros((BIG_ROWS, 1024), np.float32), (BIG_ROWS * r, 0), (BIG_ROWS * n, 1024)
    )
    got = mgr.restore(target)
    big_exact = bool(np.array_equal(target["big"].local, full_state(got, r, n)["big"].local))
    out.update(restored=got, exact=exact(target, got, r, n) and big_exact, local=mgr.local_steps())
    mgr.close()
    return out


def main(backend: str, mode: str, base: str, *args: str) -> None:
    rank = process_rank(backend)

    def work() -> dict[str, Any]:
        c = make_coordinator(backend)
        try:
            if mode == "train":
                return train(c, base, int(args[0]), int(args[1]))
            if mode == "killed":
                return train_until_killed(c, base, int(args[0]), args[1])
            if mode == "restore":
                return restore(c, base)
            if mode == "full":
                return full_tier(c, base)
            raise ValueError(f"unknown mode {mode!r}")
        finally:
            finish(backend)

    run_rank(rank, work, backend)


if __name__ == "__main__":
    main(*sys.argv[1:])
