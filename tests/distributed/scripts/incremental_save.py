"""Incremental distributed saves: every rank decides reuse for the chunks it writes.

Modes (``mpiexec -n N python incremental_save.py MODE PATH [BASE]``):

``first``  step 0 of ``state``, hashes recorded (``content_hash=True``);
``next``   step 1 (only ``adapter`` changed) with ``base=BASE``;
``full``   step 1 without a base, hashes recorded (what ``next`` must equal).

Each rank holds a band of rows of every tensor (``ShardedArray`` boxes).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from _rank_io import make_coordinator, process_rank, run_rank

import gpuckpt

ROWS = 12


def global_state(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    frozen = rng.standard_normal((ROWS, 2048)).astype(np.float32)
    adapter = np.full((ROWS, 64), float(step), np.float32)
    return {"frozen": frozen, "adapter": adapter}


def rank_state(rank: int, n: int, step: int) -> dict[str, Any]:
    per = -(-ROWS // n)
    a, b = min(rank * per, ROWS), min((rank + 1) * per, ROWS)
    out: dict[str, Any] = {
        k: gpuckpt.ShardedArray(np.ascontiguousarray(v[a:b]), (a, 0), v.shape)
        for k, v in global_state(step).items()
    }
    out["step"] = step
    return out


def main(mode: str, path: str, base: str | None) -> None:
    rank = process_rank("mpi")

    def work() -> dict[str, Any]:
        c = make_coordinator("mpi")
        kw: dict[str, Any] = {"chunk_bytes": 16 << 10, "coordinator": c, "sync": "none"}
        if mode == "first":
            gpuckpt.save(rank_state(c.rank, c.world_size, 0), path, content_hash=True, **kw)
        elif mode == "next":
            gpuckpt.save(rank_state(c.rank, c.world_size, 1), path, base=base, **kw)
        elif mode == "full":
            gpuckpt.save(rank_state(c.rank, c.world_size, 1), path, content_hash=True, **kw)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        return {"saved": True}

    run_rank(rank, work, "mpi")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
