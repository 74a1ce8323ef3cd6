"""A tiered CheckpointManager's exit, and the root its tier belongs to, in real processes.

Rank r of N is on node ``n{r // (N // 2)}`` (two nodes; one process: node ``n0``), whose tier
is ``BASE/n{k}``; the root is ``ROOT``. ``BACKEND`` is ``mpi`` (under mpiexec) or ``none``
(one process, no coordinator). Modes (``python tier_lifecycle.py BACKEND MODE BASE ROOT [ARGS]``):

``leave LAST``
    Save steps 0..LAST (step 0 is the one persist step: it is drained to the root) and leave
    without ``close`` or ``wait``: exit must finish the tier's work and the drain.
``leave-failing LAST``
    ``leave``, with every save to the root failing once the last save returned (the drain of
    step 0 fails at exit).
``train LAST``
    Save steps 0..LAST, wait, close.
``open``
    Open a manager and restore; report the step, whether it is bit-exact and where it came
    from, or the error the manager raised (type and message).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from _rank_io import finish, make_coordinator, process_rank, run_rank, write_result
from manager_ranks import empty, exact, state

import gpuckpt
from gpuckpt.distributed import Coordinator


def manager(c: Coordinator | None, base: str, root: str) -> gpuckpt.CheckpointManager:
    n = 1 if c is None else c.world_size
    rank = 0 if c is None else c.rank
    node = f"n{rank // max(1, n // 2)}"
    return gpuckpt.CheckpointManager(
        root,
        local_dir=Path(base) / node,
        node=node,
        coordinator=c,
        replicas=0 if n == 1 else 1,
        persist_interval_steps=1000,
    )


def leave(c: Coordinator | None, base: str, root: str, last: int, *, failing: bool) -> dict[str, Any]:
    rank, n = (0, 1) if c is None else (c.rank, c.world_size)
    left = threading.Event()
    if failing:

        def refused(*_args: Any, **_kw: Any) -> Any:
            left.wait()  # (failed earlier, the failure would be raised by the next save)
            raise OSError("injected: the root refuses every save")

        gpuckpt.api.save_with_options = refused  # (what the drain calls)
    mgr = manager(c, base, root)
    for step in range(last + 1):
        mgr.save(step, state(step, rank, n))
    left.set()
    return {"left": last}  # (never closed: the manager is left to the interpreter's exit)


def train(c: Coordinator | None, base: str, root: str, last: int) -> dict[str, Any]:
    rank, n = (0, 1) if c is None else (c.rank, c.world_size)
    mgr = manager(c, base, root)
    for step in range(last + 1):
        mgr.save(step, state(step, rank, n))
    mgr.wait()
    out = {"local": mgr.local_steps(), "root": mgr.all_steps()}
    mgr.close()
    return out


def open_and_restore(c: Coordinator | None, base: str, root: str) -> dict[str, Any]:
    rank, n = (0, 1) if c is None else (c.rank, c.world_size)
    try:
        mgr = manager(c, base, root)
    except Exception as exc:
        return {"refused": type(exc).__name__, "message": str(exc)}
    target = empty(rank, n)
    try:
        got = mgr.restore(target)
    except Exception as exc:
        mgr.close()
        return {"restore_failed": type(exc).__name__, "message": str(exc)}
    report = mgr.last_restore
    assert report is not None
    out = {
        "step": got,
        "exact": exact(target, got, rank, n),
        "source": report.source,
        "parts": {str(k): [p.where, p.holder] for k, p in sorted(report.parts.items())},
        "root": mgr.all_steps(),
    }
    mgr.close()
    return out


def work(c: Coordinator | None, mode: str, base: str, root: str, args: tuple[str, ...]) -> dict[str, Any]:
    if mode in ("leave", "leave-failing"):
        return leave(c, base, root, int(args[0]), failing=mode == "leave-failing")
    if mode == "train":
        return train(c, base, root, int(args[0]))
    if mode == "open":
        return open_and_restore(c, base, root)
    raise ValueError(f"unknown mode {mode!r}")


def main(backend: str, mode: str, base: str, root: str, *args: str) -> None:
    if backend == "none":  # one process: an error is its traceback and exit status 1
        write_result(0, work(None, mode, base, root, args))
        return
    rank = process_rank(backend)

    def ranked() -> dict[str, Any]:
        c = make_coordinator(backend)
        try:
            return work(c, mode, base, root, args)
        finally:
            finish(backend)

    run_rank(rank, ranked, backend)


if __name__ == "__main__":
    main(*sys.argv[1:])
