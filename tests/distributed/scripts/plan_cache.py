"""Plan caching and both format versions in multi-rank jobs (issue 22), one rank per process (or thread).

Modes (``mpiexec -n N python plan_cache.py MODE PATH``):

``cache``
    Each rank saves five checkpoints under PATH through one coordinator:
    ``a`` and ``b`` with the layout of ``sharded_save_load.save_layout`` (``b``
    with other values: the plan of ``a`` is reused), ``c`` with one more
    tensor (the layout changed: planned again) and ``d`` like ``c`` (reused),
    then ``big``: one tensor split evenly by rows into more chunks than
    :data:`~gpuckpt.format.records.TABLE_MIN_CHUNKS` (planned per
    tensor, stored with a chunk table). Returns the plan cache counters.
``load``
    Each rank loads ``b``, ``d`` and ``big`` under PATH into targets split
    another way (a resharded load) and checks every value.
``load_v1``
    Each rank loads its rows of the format version 1 golden checkpoint at PATH.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from _rank_io import make_coordinator, process_rank, run_rank
from sharded_save_load import PLAIN, check_loaded, global_tensors, load_layout, save_layout

import gpuckpt
from gpuckpt.distributed import Coordinator
from gpuckpt.distributed.save import plan_cache_info

BIG_ROWS, BIG_COLS = 4400, 4  # one chunk per row with chunk_bytes=16: 4400 chunks


def big_tensor() -> np.ndarray:
    return (np.arange(BIG_ROWS * BIG_COLS, dtype=np.float32) * 0.25).reshape(BIG_ROWS, BIG_COLS)


def _rows(n_rows: int, rank: int, n: int) -> tuple[int, int]:
    per = -(-n_rows // n)
    return min(rank * per, n_rows), min((rank + 1) * per, n_rows)


def cache_rank(c: Coordinator, path: str) -> dict[str, Any]:
    r, n = c.rank, c.world_size
    gpuckpt.save(save_layout(r, n), f"{path}/a", coordinator=c)
    later = save_layout(r, n)
    later["step"] = 8
    gpuckpt.save(later, f"{path}/b", coordinator=c)
    after_same = plan_cache_info(c).hits
    grown = save_layout(r, n)
    grown["bias"] = np.arange(5.0)
    gpuckpt.save(grown, f"{path}/c", coordinator=c)
    after_change = (plan_cache_info(c).hits, plan_cache_info(c).misses)
    gpuckpt.save(grown, f"{path}/d", coordinator=c)
    a, b = _rows(BIG_ROWS, r, n)
    big = gpuckpt.ShardedArray(big_tensor()[a:b].copy(), (a, 0), (BIG_ROWS, BIG_COLS))
    md = gpuckpt.save({"big": big}, f"{path}/big", coordinator=c, chunk_bytes=16)
    info = plan_cache_info(c)
    return {
        "hits_after_same_layout": after_same,
        "after_changed_layout": list(after_change),
        "hits": info.hits,
        "misses": info.misses,
        "big_has_chunk_table": "chunk_table" in md.storage_data,
        "big_version": md.version,
    }


def load_rank(c: Coordinator, path: str) -> dict[str, Any]:
    r, n = c.rank, c.world_size
    out: dict[str, Any] = {}
    for name in ("b", "d"):
        state = load_layout(r, n)
        if name == "d":
            state["bias"] = np.zeros(5)
        gpuckpt.load(state, f"{path}/{name}", coordinator=c)
        out[name] = check_loaded(state)
        out[f"{name}_bias"] = bool(np.array_equal(state["bias"], np.arange(5.0))) if name == "d" else None
    # columns, not the rows the save was split by
    cols = np.array_split(np.arange(BIG_COLS), n)[r]
    target = gpuckpt.ShardedArray(
        np.zeros((BIG_ROWS, len(cols)), np.float32), (0, int(cols[0])), (BIG_ROWS, BIG_COLS)
    )
    gpuckpt.load({"big": target}, f"{path}/big", coordinator=c)
    out["big"] = bool(np.array_equal(target.local, big_tensor()[:, int(cols[0]) : int(cols[-1]) + 1]))
    return out


def expected_loaded() -> dict[str, Any]:
    full = {"w": True, "u": True, "opt.m": True, "rep": True}
    return {
        "b": {**full, "plain": {**PLAIN, "step": 8}},
        "d": {**full, "plain": PLAIN},
        "d_bias": True,
        "b_bias": None,
        "big": True,
    }


def load_v1_rank(c: Coordinator, path: str) -> dict[str, Any]:
    r, n = c.rank, c.world_size
    full = np.arange(1000).reshape(100, 10)
    a, b = _rows(100, r, n)
    target = gpuckpt.ShardedArray(np.zeros((b - a, 10), full.dtype), (a, 0), full.shape)
    state = {"layouts": {"chunked": target}}
    gpuckpt.load(state, path, coordinator=c, strict=False)
    md = gpuckpt.read_metadata(path)
    return {"rows_match": bool(np.array_equal(target.local, full[a:b])), "version": md.version}


def main(mode: str, path: str) -> None:
    rank = process_rank("mpi")
    fns = {"cache": cache_rank, "load": load_rank, "load_v1": load_v1_rank}

    def work() -> dict[str, Any]:
        return fns[mode](make_coordinator("mpi"), path)

    run_rank(rank, work, "mpi")


if __name__ == "__main__":
    assert global_tensors  # the layouts of sharded_save_load are shared
    main(sys.argv[1], sys.argv[2])
