"""Ranks that break the job, to check that the harness reports it instead of hanging.

``crash``: rank 1 raises before a barrier the others wait in (exit status 1).
``hang``: rank 1 sleeps far past any timeout while the others wait in a barrier.
"""

from __future__ import annotations

import sys
import time

from _rank_io import make_coordinator, process_rank, run_rank


def main(mode: str) -> None:
    rank = process_rank("mpi")

    def work() -> dict[str, str]:
        c = make_coordinator("mpi")
        if c.rank == 1:
            if mode == "crash":
                raise RuntimeError("rank 1 crashes on purpose")
            time.sleep(3600)
        c.barrier()
        return {"mode": mode}

    run_rank(rank, work)


if __name__ == "__main__":
    main(sys.argv[1])
