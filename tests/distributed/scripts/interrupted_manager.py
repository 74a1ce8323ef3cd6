"""Ctrl-C (SIGINT) reaching ranks of a tiered CheckpointManager at chosen points of a save loop:
4 ranks as 2 simulated nodes, saving steps 1..6 (persisting every 3rd), then ``close()``.

Modes (``mpiexec -n 4 python interrupted_manager.py MODE BASE``):

``gathering``
    Rank 0 alone is interrupted in the collective that opens its save of step 3 (the
    interrupt is held until the collective is over).
``snapshot``
    Rank 0 alone is interrupted as its save of step 3 hands the state to the local tier.
``everyone``
    Rank 0 is interrupted as in ``gathering``, ranks 1-3 as their save of step 4 begins.
``alone``
    Every rank is interrupted as its save of step 3 begins; ranks 1-3 close while the
    interrupt is being handled (without a collective), rank 0 after it (its close's collective
    is one that the others never join).

Each rank reports the error each save raised (type name by step), what ``close()`` raised
(or "ok"), and how long it took. The coordinators wait with sleeps between tests, whatever
the number of cores (the interrupt is held only by such waits).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from _rank_io import mpi_rank, run_rank
from manager_ranks import state

#: the step whose save the interrupt reaches
STEP = 3


def main(mode: str, base: str) -> None:
    import gpuckpt
    import gpuckpt.distributed.mpi as mpi
    from gpuckpt.distributed import MPICoordinator

    mpi.shares_cores = lambda environ=None: True  # (the waits that hold an interrupt)
    mpi.INTERRUPT_GRACE_S = 1.0

    def interrupt() -> None:
        os.kill(os.getpid(), signal.SIGINT)

    def work() -> dict[str, Any]:
        c = MPICoordinator()
        r, n = c.rank, c.world_size
        node = f"n{r // 2}"
        mgr = gpuckpt.CheckpointManager(
            Path(base) / "root",
            local_dir=Path(base) / node,
            node=node,
            coordinator=c,
            persist_interval_steps=3,
        )
        queries, tier = mgr._queries, mgr._tiered.tier  # type: ignore[union-attr]
        if mode in ("gathering", "everyone") and r == 0:
            all_gather = queries.all_gather

            def gather_interrupted(obj: Any) -> Any:
                if isinstance(obj, tuple) and obj[3:] == (STEP, "save"):
                    interrupt()
                return all_gather(obj)

            queries.all_gather = gather_interrupted
        if mode == "snapshot" and r == 0:
            begin = tier.begin

            def begin_interrupted(step: int, *args: Any) -> Any:
                if step == STEP:
                    interrupt()
                return begin(step, *args)

            tier.begin = begin_interrupted
        if mode == "alone" or (mode == "everyone" and r != 0):
            wait_for = tier.wait_for
            before = STEP - 1 if mode == "alone" else STEP  # (the step a save waits for first)

            def wait_interrupted(step: int) -> None:
                if step == before:
                    interrupt()
                wait_for(step)

            tier.wait_for = wait_interrupted
        out: dict[str, Any] = {"raised": {}}

        def close() -> None:
            started = time.monotonic()
            try:
                mgr.close()
                out["close"] = "ok"
            except BaseException as exc:
                out["close"] = f"{type(exc).__name__}: {exc}"
            out["close_s"] = time.monotonic() - started

        for step in range(1, 7):
            try:
                mgr.save(step, state(step, r, n))
            except BaseException as exc:
                out["raised"][step] = type(exc).__name__
                if mode == "alone" and r != 0:
                    close()  # (while the interrupt is being handled)
                break
        if "close" not in out:
            close()
        return out

    rank = mpi_rank()
    run_rank(rank, work)
    if mode == "alone":
        # a job out of step ends without MPI_Finalize (it would wait for the collective left
        # open), and a rank that ends so ends the job: the others wait for rank 0's result first
        done = Path(os.environ["GPUCKPT_TEST_OUT"]) / "rank0.json"
        deadline = time.monotonic() + 120  # (past the harness's timeout: a hang of rank 0 shows)
        while rank != 0 and not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
