"""Ranks that break the job, to check that the harness reports it instead of hanging.

``crash``: rank 1 raises before a barrier the others wait in (exit status 1).
``hang``: rank 1 sleeps far past any timeout while the others wait in a barrier.
``torch-dies``: over gloo, rank 1 dies (``os._exit``) in the middle of a save while the others
wait in a collective of it: they report what they raised (a gpuckpt error, not torch's bare one).
"""

from __future__ import annotations

import sys
import time

from _rank_io import make_coordinator, process_rank, run_rank


def torch_dies() -> None:
    import os
    from pathlib import Path

    import numpy as np

    import gpuckpt

    rank = process_rank("torch")

    def work() -> dict[str, str]:
        c = make_coordinator("torch")

        class Dies:
            @property
            def __array_interface__(self) -> dict[str, object]:
                os._exit(9)  # killed while the state is described: the others wait for it

        value = Dies() if c.rank == 1 else np.arange(4.0)
        out = Path(os.environ["GPUCKPT_TEST_OUT"]) / "ckpt"
        try:
            gpuckpt.save({"w": np.ones(4), f"r{c.rank}": value}, out, coordinator=c)
        except Exception as exc:
            return {
                "raised": type(exc).__name__,
                "gpuckpt": str(isinstance(exc, gpuckpt.GpuckptError)),
                "message": str(exc),
            }
        return {"raised": ""}

    run_rank(rank, work, backend="torch")


def main(mode: str) -> None:
    if mode == "torch-dies":
        torch_dies()
        return
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
