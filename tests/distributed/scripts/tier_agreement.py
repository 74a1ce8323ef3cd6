"""A tiered CheckpointManager whose ranks do not agree, in real processes: different steps
asked of ``restore``, different roots, another number of ranks on the tiers of a job, states
that are a subset of a step's, calls of the manager on one rank only.

Rank r of N is on node ``n{r // 2}`` (tier ``BASE/n{k}``, root ``BASE/root``: see
``tier_ranks.manager``), with ``persist_interval_steps=PERSIST``.
Modes (``mpiexec -n N python tier_agreement.py BACKEND MODE BASE [ARGS]``):

``save LAST PERSIST``
    Save steps 1..LAST, waiting for each.
``steps``
    (after ``save 7 2`` with ``local_max_to_keep=3``: the tiers hold 5-7, the root 2-6)
    restore with rank 0 asking step 6, the others step 7; then rank 0 the root-only step 4,
    the others None; report each error and the tiers' steps; then restore step 6 everywhere.
``roots``
    Rank 3 names another root: a manager with a tier, then one without; report each error.
``fewer PERSIST``
    (3 ranks, on the tiers of a 4-rank job) the guide's loop: restore, else save from step 0;
    report the restore's error and each save's.
``subset``
    (after ``save 3 2``) restore into a state without ``rep`` on rank 1, then on every rank.
``alone CALL``
    Save steps 1..4; at step 3 rank 0 alone calls CALL first (``all_steps``, ``delete`` or
    ``restore``; ``close``: rank 0 restores, the others close); report what each rank raised,
    or the steps rank 0 saw.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from _rank_io import finish, make_coordinator, process_rank, run_rank
from manager_ranks import empty, exact, state
from tier_ranks import manager

import gpuckpt
from gpuckpt.distributed import Coordinator


def _error(exc: BaseException) -> list[str]:
    return [type(exc).__name__, str(exc)]


def save(c: Coordinator, base: str, last: int, persist: int, **kw: Any) -> dict[str, Any]:
    mgr = manager(c, base, persist_interval_steps=persist, **kw)
    for step in range(1, last + 1):
        mgr.save(step, state(step, c.rank, c.world_size))
        mgr.wait()
    out = {"local": mgr.local_steps(), "root": mgr.all_steps()}
    mgr.close()
    return out


def steps(c: Coordinator, base: str) -> dict[str, Any]:
    r, n = c.rank, c.world_size
    mgr = manager(c, base, local_max_to_keep=3)
    out: dict[str, Any] = {}
    for name, mine, others in (("tiers", 6, 7), ("root", 4, None)):
        target = empty(r, n)
        try:
            out[name] = ["restored", mgr.restore(target, step=mine if r == 0 else others)]
        except gpuckpt.GpuckptError as exc:
            out[name] = _error(exc)
        out[f"{name} local"] = mgr.local_steps()
    target = empty(r, n)
    got = mgr.restore(target, step=6)
    out["agreed"] = [got, exact(target, got, r, n)]
    mgr.close()
    return out


def roots(c: Coordinator, base: str) -> dict[str, Any]:
    root = Path(base) / ("other" if c.rank == 3 else "root")
    out: dict[str, Any] = {}
    for name, kw in (
        ("tiered", {"local_dir": Path(base) / f"n{c.rank // 2}", "node": f"n{c.rank // 2}"}),
        ("plain", {}),
    ):
        try:
            mgr = gpuckpt.CheckpointManager(root, coordinator=c, **kw)
        except gpuckpt.GpuckptError as exc:
            out[name] = _error(exc)
        else:
            out[name] = ["accepted"]
            mgr.close()
    return out


def fewer(c: Coordinator, base: str, persist: int) -> dict[str, Any]:
    r, n = c.rank, c.world_size
    mgr = manager(c, base, persist_interval_steps=persist)
    out: dict[str, Any] = {"saves": {}}
    try:
        start = mgr.restore(empty(r, n)) + 1
    except gpuckpt.CheckpointNotFoundError as exc:
        out["restore"] = str(exc)
        start = 0
    for step in range(start, 5):
        try:
            mgr.save(step, state(step, r, n))
            mgr.wait()
            out["saves"][step] = ["saved"]
        except gpuckpt.GpuckptError as exc:
            out["saves"][step] = _error(exc)
    mgr.close()
    return out


def subset(c: Coordinator, base: str) -> dict[str, Any]:
    r, n = c.rank, c.world_size
    mgr = manager(c, base)
    out: dict[str, Any] = {}
    for name, lacking in (("one", (1,)), ("all", range(n))):
        target = empty(r, n)
        if r in lacking:
            del target["rep"]
        got = mgr.restore(target)
        report = mgr.last_restore
        assert report is not None
        full = empty(r, n)
        full["rep"] = state(got, r, n)["rep"]
        full.update({k: v for k, v in target.items()})
        out[name] = [got, report.source, exact(full, got, r, n), mgr.local_steps()]
    mgr.close()
    return out


def alone(c: Coordinator, base: str, call: str) -> dict[str, Any]:
    r, n = c.rank, c.world_size
    mgr = manager(c, base)
    out: dict[str, Any] = {}
    try:
        for step in range(1, 5):
            if step == 3 and r == 0:
                if call == "all_steps":
                    out["seen"] = [mgr.all_steps(), mgr.latest_step()]
                elif call == "delete":
                    mgr.delete(2)
                else:
                    mgr.restore(empty(r, n))
            if step == 3 and r != 0 and call == "close":
                mgr.close()
                return out
            mgr.save(step, state(step, r, n))
            mgr.wait()
        out["done"] = mgr.all_steps()
        mgr.close()
    except gpuckpt.GpuckptError as exc:
        out["raised"] = _error(exc)
        mgr.close()  # (alone: the ranks are out of step)
    return out


def main(backend: str, mode: str, base: str, *args: str) -> None:
    rank = process_rank(backend)

    def work() -> dict[str, Any]:
        c = make_coordinator(backend)
        try:
            if mode == "save":
                return save(c, base, int(args[0]), int(args[1]))
            if mode == "steps":
                return steps(c, base)
            if mode == "roots":
                return roots(c, base)
            if mode == "fewer":
                return fewer(c, base, int(args[0]))
            if mode == "subset":
                return subset(c, base)
            if mode == "alone":
                return alone(c, base, args[0])
            raise ValueError(f"unknown mode {mode!r}")
        finally:
            finish(backend)

    run_rank(rank, work, backend)


if __name__ == "__main__":
    main(*sys.argv[1:])
