"""Distributed save and resharded load of ShardedArray boxes, one rank per process (or thread).

Modes (``mpiexec -n N python sharded_save_load.py MODE PATH``):

``save`` / ``async_save``
    Each rank saves its boxes of the global tensors (``global_tensors``),
    the replicated tensor and the plain values, with ``save_layout``.
``load``
    Each rank loads into ShardedArray targets of ``load_layout`` (another
    split, meant for another number of ranks) and checks every value.
``save_fail``
    Rank 1 (of N >= 2) has an unsupported value: every rank must get
    DistributedError naming rank 1, and nothing may be published at PATH.

The rank functions take any Coordinator, so the same code runs in-process
with ThreadCoordinator ranks.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from typing import Any

import numpy as np
from _rank_io import make_coordinator, process_rank, run_rank

import gpuckpt
from gpuckpt.distributed import Coordinator, DistributedError

ROWS_3_4_3 = [(0, 3), (3, 7), (7, 10)]  # the uneven row split of "u"
PLAIN = {"step": 7, "name": "run-a", "cfg": {"lr": 0.001, "betas": [0.9, 0.999]}}


def global_tensors() -> dict[str, np.ndarray]:
    """The full tensors every layout cuts into boxes (flat keys)."""
    return {
        "w": np.arange(60, dtype=np.float32).reshape(10, 6),
        "u": np.arange(80, dtype=np.int64).reshape(10, 8) * 3 - 7,
        "opt.m": np.linspace(0.0, 1.0, 13),
        "rep": np.arange(12, dtype=np.float64).reshape(3, 4) * 0.5,
    }


def _box(full: np.ndarray, offsets: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    """A ShardedArray holding ``full``'s box at ``offsets`` (a copy, as a rank would own it)."""
    index = tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))
    return gpuckpt.ShardedArray(np.ascontiguousarray(full[index]), offsets, full.shape)


def _target(full: np.ndarray, offsets: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    """An empty ShardedArray for ``full``'s box at ``offsets``, to be filled by a load."""
    return gpuckpt.ShardedArray(np.empty(shape, full.dtype), offsets, full.shape)


def _even_rows(nrows: int, rank: int, n: int) -> tuple[int, int]:
    """Rows of ``rank`` when ``nrows`` are cut into ceil(nrows / n) rows per rank (the last box smaller)."""
    per = math.ceil(nrows / n)
    return min(rank * per, nrows), min((rank + 1) * per, nrows)


def save_layout(rank: int, n: int, *, bad_rank: int | None = None) -> dict[str, Any]:
    """The state ``rank`` of ``n`` saves.

    ``w``: rows cut evenly (the last box smaller); ``u``: a 3/4/3 row split by
    two column halves, six boxes dealt round-robin (a rank with several boxes
    passes a list); ``opt.m``: np.array_split; ``rep``: the whole tensor on
    every rank; plain values on every rank.
    """
    g = global_tensors()
    a, b = _even_rows(10, rank, n)
    u_boxes = [_box(g["u"], (r0, c0), (r1 - r0, 4)) for r0, r1 in ROWS_3_4_3 for c0 in (0, 4)][rank::n]
    m_part = np.array_split(np.arange(13), n)[rank]
    state: dict[str, Any] = {
        "w": _box(g["w"], (a, 0), (b - a, 6)),
        "u": u_boxes[0] if len(u_boxes) == 1 else u_boxes,
        "opt": {"m": _box(g["opt.m"], (int(m_part[0]),), (len(m_part),))},
        "rep": g["rep"].copy(),
        **copy.deepcopy(PLAIN),
    }
    state["extra"] = object() if rank == bad_rank else {"k": 1}
    return state


def load_layout(rank: int, m: int) -> dict[str, Any]:
    """Targets of ``rank`` of ``m``: splits unlike ``save_layout``'s, so every load reshards.

    ``w``: columns (np.array_split); ``u``: rows cut evenly, each rank's rows
    as two boxes cut at column 5 (a list); ``opt.m``: np.array_split in
    reverse rank order; ``rep``: a plain array; plain values: placeholders.
    """
    g = global_tensors()
    cols = np.array_split(np.arange(6), m)[rank]
    a, b = _even_rows(10, rank, m)
    m_part = np.array_split(np.arange(13), m)[m - 1 - rank]
    return {
        "w": _target(g["w"], (0, int(cols[0])), (10, len(cols))),
        "u": [_target(g["u"], (a, 0), (b - a, 5)), _target(g["u"], (a, 5), (b - a, 3))],
        "opt": {"m": _target(g["opt.m"], (int(m_part[0]),), (len(m_part),))},
        "rep": np.zeros((3, 4)),
        "step": 0,
        "name": "",
        "cfg": {"lr": 0.0, "betas": [0.0, 0.0]},
    }


def _matches(target: Any, full: np.ndarray) -> bool:
    index = tuple(slice(o, o + s) for o, s in zip(target.offsets, target.local.shape, strict=True))
    return bool(
        tuple(target.global_shape) == full.shape
        and target.local.dtype == full.dtype
        and np.array_equal(target.local, full[index])
    )


def check_loaded(state: dict[str, Any]) -> dict[str, Any]:
    """For each key, whether the loaded values equal the global tensors' (and the plain values)."""
    g = global_tensors()
    return {
        "w": _matches(state["w"], g["w"]),
        "u": all(_matches(t, g["u"]) for t in state["u"]),
        "opt.m": _matches(state["opt"]["m"], g["opt.m"]),
        "rep": bool(np.array_equal(state["rep"], g["rep"])),
        "plain": {k: state[k] for k in PLAIN},
    }


def expected_loaded() -> dict[str, Any]:
    return {"w": True, "u": True, "opt.m": True, "rep": True, "plain": PLAIN}


def save_rank(
    c: Coordinator, path: str, *, use_async: bool = False, compression: str | None = None
) -> dict[str, Any]:
    state = save_layout(c.rank, c.world_size)
    if use_async:
        gpuckpt.async_save(state, path, coordinator=c, compression=compression).result()
    else:
        gpuckpt.save(state, path, coordinator=c, compression=compression)
    return {"saved": True}


def load_rank(c: Coordinator, path: str) -> dict[str, Any]:
    state = load_layout(c.rank, c.world_size)
    gpuckpt.load(state, path, coordinator=c)
    return check_loaded(state)


def save_fail_rank(c: Coordinator, path: str) -> dict[str, Any]:
    state = save_layout(c.rank, c.world_size, bad_rank=1)
    outcome: dict[str, Any] = {"raised": None}
    try:
        gpuckpt.save(state, path, coordinator=c)
    except DistributedError as exc:
        outcome = {
            "raised": type(exc).__name__,
            "failing_ranks": sorted(exc.failures),
            "rank_1_reports": exc.failures.get(1, "").split(":")[0],
            "message_names_rank_1": "rank 1" in str(exc),
        }
    c.barrier()  # every rank has returned from save before the path is inspected
    outcome["published"] = os.path.exists(path)
    return outcome


def main(mode: str, path: str) -> None:
    rank = process_rank("mpi")

    def work() -> dict[str, Any]:
        c = make_coordinator("mpi")
        if mode == "save":
            return save_rank(c, path)
        if mode == "async_save":
            return save_rank(c, path, use_async=True)
        if mode == "save_compressed":
            return save_rank(c, path, compression="zstd")
        if mode == "load":
            return load_rank(c, path)
        if mode == "save_fail":
            return save_fail_rank(c, path)
        raise ValueError(f"unknown mode {mode!r}")

    run_rank(rank, work, "mpi")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
