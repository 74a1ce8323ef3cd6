"""Ctrl-C (SIGINT) that reaches rank 0 while it waits, with idle waits, in an ``all_gather`` that
rank 1 joins later.

``held``: rank 1 joins 1 s later, within the grace: rank 0's collective completes, then its
``KeyboardInterrupt`` is raised, and a second ``all_gather`` pairs the right messages on both.
``stranded``: rank 1 never joins: rank 0 raises ``KeyboardInterrupt`` at the grace, and its
coordinator refuses the next collective with a ``CoordinatorError`` instead of posting it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from _rank_io import mpi_rank, run_rank


def main(mode: str) -> None:
    import gpuckpt.distributed.mpi as mpi
    from gpuckpt.distributed import CoordinatorError, MPICoordinator

    mpi.INTERRUPT_GRACE_S = 5.0 if mode == "held" else 0.5

    def work() -> dict[str, Any]:
        c = MPICoordinator()
        c._waits_idle = True  # (two ranks on two cores would wait MPI's own way)
        out: dict[str, Any] = {}
        if c.rank == 0:
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            start = time.monotonic()
            try:
                out["first"] = c.all_gather(("first", 0))
            except KeyboardInterrupt:
                out["interrupted_after_s"] = time.monotonic() - start
            try:
                out["second"] = c.all_gather(("second", 0))
            except CoordinatorError as exc:
                out["refused"] = str(exc)
        elif mode == "held":
            time.sleep(1.0)
            out["first"] = c.all_gather(("first", 1))
            out["second"] = c.all_gather(("second", 1))
        else:
            time.sleep(2.0)  # and never joins
        return out

    run_rank(mpi_rank(), work)
    if mode == "stranded":
        os._exit(0)  # (a job out of step ends: MPI_Finalize would wait for the collective left open)


if __name__ == "__main__":
    main(sys.argv[1])
