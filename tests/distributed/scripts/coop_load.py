"""Cooperative loads of one checkpoint by 4 ranks, one rank per process (MPI, gloo) or thread.

Layouts (``layout(kind, rank, n)``):

``replicated``
    every rank loads every tensor whole (plain arrays): R replicas of a replicated state;
``hsdp``
    2 replicas x 2 shards: ranks ``r`` and ``r + 2`` load the same half (rows) of the two
    large tensors as ``ShardedArray`` boxes, and every rank loads the small ones whole;
``uneven``
    a mix: whole tensors on some ranks, boxes across chunk edges on others, a rank with
    no tensor at all.

Each layout together needs every stored chunk at least once, so a load that reads each
byte once reads exactly the chunk files of the checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from _rank_io import finish, make_coordinator, process_rank, run_rank

import gpuckpt
from gpuckpt.distributed import Coordinator
from gpuckpt.testing.reads import count_chunk_reads

CHUNK_BYTES = 32 << 10
PLAIN = {"step": 7}
KINDS = ("replicated", "hsdp", "uneven")


def global_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(35)
    return {
        "model.w": rng.standard_normal((256, 128)).astype(np.float32),
        "model.e": rng.integers(-(2**40), 2**40, (100, 37), dtype=np.int64),
        "model.h": rng.standard_normal(3000).astype(np.float16),
        "opt.m": rng.standard_normal((256, 128)).astype(np.float32),
        "opt.t": np.array(1234567, np.int64),  # a 0-d tensor (an optimizer's step count)
    }


def make_checkpoint(path: str) -> None:
    full = global_tensors()
    state: dict[str, Any] = {"model": {}, "opt": {}}
    for key, value in full.items():
        group, name = key.split(".")
        state[group][name] = value
    state.update(PLAIN)
    gpuckpt.save(state, path, chunk_bytes=CHUNK_BYTES, overwrite=True)


def chunk_file_bytes(path: str) -> int:
    """The bytes of every chunk file of the checkpoint at ``path``."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and p.name != "zarr.json")


def _rows(key: str, start: int, stop: int) -> Any:
    full = global_tensors()[key]
    return gpuckpt.ShardedArray(np.zeros((stop - start, *full.shape[1:]), full.dtype), (start, 0), full.shape)


def _whole(key: str) -> np.ndarray:
    return np.zeros_like(global_tensors()[key])


def layout(kind: str, rank: int, n: int) -> dict[str, Any]:
    """The state dict of targets rank ``rank`` of ``n`` loads into (zeros)."""
    if kind == "replicated":
        return {
            "model": {k: _whole(f"model.{k}") for k in ("w", "e", "h")},
            "opt": {"m": _whole("opt.m"), "t": _whole("opt.t")},
            "step": 0,
        }
    if kind == "hsdp":
        shard = rank % 2
        rows = (shard * 128, shard * 128 + 128)
        return {
            "model": {"w": _rows("model.w", *rows), "e": _whole("model.e"), "h": _whole("model.h")},
            "opt": {"m": _rows("opt.m", *rows), "t": _whole("opt.t")},
        }
    if kind == "uneven":
        return [
            {"model": {"w": _whole("model.w"), "e": _whole("model.e")}},
            {"model": {"w": _rows("model.w", 10, 140)}, "opt": {"m": _whole("opt.m")}},
            {"model": {"h": _whole("model.h")}, "opt": {"m": _rows("opt.m", 100, 200)}},
            {"model": {"e": _rows("model.e", 50, 100)}, "opt": {"t": _whole("opt.t")}, "step": 0},
        ][rank % 4]
    raise ValueError(f"unknown layout {kind!r}")


def _leaves(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check(state: dict[str, Any]) -> dict[str, Any]:
    """Per leaf: the SHA-256 of the loaded bytes, and whether they equal the saved ones exactly."""
    full = global_tensors()
    digests, exact = {}, True
    for key, v in _leaves(state).items():
        if key in PLAIN:
            exact = exact and v == PLAIN[key]
            digests[key] = repr(v)
            continue
        if isinstance(v, gpuckpt.ShardedArray):
            index = tuple(slice(o, o + s) for o, s in zip(v.offsets, v.local.shape, strict=True))
            want, got = full[key][index], v.local
        else:
            want, got = full[key], v
        exact = exact and want.tobytes() == got.tobytes()
        digests[key] = hashlib.sha256(got.tobytes()).hexdigest()
    return {"digests": digests, "exact": exact}


def untouched(state: dict[str, Any]) -> bool:
    """Whether every target still holds zeros (nothing of a failed load reached it)."""
    for v in _leaves(state).values():
        arr = v.local if isinstance(v, gpuckpt.ShardedArray) else v
        if isinstance(arr, np.ndarray) and arr.any():
            return False
    return True


def received_nothing(state: dict[str, Any], path: str, rank: int, plan: Any) -> bool:
    """Whether the targets of rank ``rank`` hold zeros wherever a shared chunk of ``plan`` was to
    reach them from another rank: nothing of a failed round crossed to this rank (its own reads
    go straight into its targets, as in any load)."""
    from gpuckpt.loading.open import open_checkpoint
    from gpuckpt.testing.plans import received_boxes

    leaves = _leaves(state)
    for fqn, boxes in received_boxes(plan, rank, open_checkpoint(path, None).index.tensors).items():
        v = leaves.get(fqn)
        if v is None:
            continue
        arr, base = (v.local, v.offsets) if isinstance(v, gpuckpt.ShardedArray) else (v, (0,) * v.ndim)
        for offsets, sizes in boxes:
            region = tuple(
                slice(max(o, b) - b, max(max(o, b), min(o + n, b + size)) - b)
                for o, n, b, size in zip(offsets, sizes, base, arr.shape, strict=True)
            )
            if np.asarray(arr)[region].any():
                return False
    return True


def load_rank(c: Coordinator, path: str, kind: str, **options: Any) -> dict[str, Any]:
    state = layout(kind, c.rank, c.world_size)
    gpuckpt.load(state, path, coordinator=c, **{"cooperative": True, **options})
    return check(state)


def fail_rank(c: Coordinator, path: str, kind: str, **options: Any) -> dict[str, Any]:
    """A load expected to fail: what it raised on this rank, whether the targets are untouched,
    and whether they received nothing from another rank (``received_nothing``)."""
    from gpuckpt.testing.plans import record_plans

    state = layout(kind, c.rank, c.world_size)
    try:
        with record_plans() as plans:
            gpuckpt.load(state, path, coordinator=c, **{"cooperative": True, **options})
    except Exception as exc:
        plan = plans[0] if plans else None
        cause = exc.__cause__
        return {
            "raised": type(exc).__name__,
            "cause": type(cause).__name__ if cause is not None else None,
            "message": str(exc),
            "cause_fqn": getattr(cause, "fqn", None),
            "cause_key": getattr(cause, "key", None),
            "untouched": untouched(state),
            "planned": plan is not None,
            "received_nothing": plan is not None and received_nothing(state, path, c.rank, plan),
        }
    return {"raised": None, "untouched": untouched(state)}


def damaged_copy(path: str, dest: str, kind: str) -> None:
    """A copy of the checkpoint with chunk ``c.1.0`` of ``model.w`` damaged or deleted (``kind``
    ``"damaged"`` or ``"missing"``; any other kind: an intact copy)."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(path, dest)
    chunk = Path(dest) / "model.w" / "c.1.0"
    if not chunk.exists():  # array directories are named after the FQN by the format's rules
        chunk = next(p for p in Path(dest).rglob("c.1.0") if "w" in p.parent.name)
    if kind == "missing":
        chunk.unlink()
    elif kind == "damaged":
        data = bytearray(chunk.read_bytes())
        data[100] ^= 0xFF
        chunk.write_bytes(bytes(data))


def counted_loads(c: Coordinator, path: str) -> dict[str, Any]:
    """Every layout loaded cooperatively and not: results, and the chunk bytes the job read."""
    out: dict[str, Any] = {"stored": chunk_file_bytes(path)}
    for kind in KINDS:
        for coop in (True, False):
            with count_chunk_reads() as counted:
                result = load_rank(c, path, kind, cooperative=coop)
            name = f"{kind}-{'coop' if coop else 'solo'}"
            out[name] = result
            out[f"{name}-bytes"] = sum(c.all_gather(counted.nbytes))
    return out


def _peak(c: Coordinator, path: str, **options: Any) -> tuple[dict[str, Any], int]:
    """The load's result, and the most memory traced during it beyond what was traced before.

    Tracing starts at the first measure, between loads, and is never stopped: stopping it
    while another thread allocates crashes CPython before 3.12.9 (python/cpython#128679; the
    job's I/O and transport threads do), so each measure resets the peak instead."""
    state = layout("replicated", c.rank, c.world_size)
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    tracemalloc.reset_peak()
    before, _ = tracemalloc.get_traced_memory()
    gpuckpt.load(state, path, coordinator=c, **{"cooperative": True, **options})
    _, peak = tracemalloc.get_traced_memory()
    return check(state), peak - before


def budget_load(c: Coordinator, path: str, budget: int) -> dict[str, Any]:
    """A replicated load with ``staging_bytes=budget`` (the state is larger): the most memory
    this process allocated while loading (targets made before), as tracemalloc saw it, and the
    same for a load that is not cooperative (which reads in place: its peak is the overhead)."""
    result, peak = _peak(c, path, staging_bytes=budget)
    _, solo = _peak(c, path, staging_bytes=budget, cooperative=False)
    state = sum(a.nbytes for a in global_tensors().values())
    return {**result, "peak": peak, "solo_peak": solo, "state": state}


def nccl_like_load(c: Coordinator, path: str) -> dict[str, Any]:
    """A cooperative load on a torch group that says it is NCCL (which carries no CPU tensors):
    the coordinator itself refuses host buffers, and the load goes through a gloo duplicate
    (``host_transport``). The group is real gloo; only the name ``get_backend`` gives is NCCL's,
    since an NCCL group needs a GPU per rank."""
    import torch.distributed as dist

    from gpuckpt.distributed import CoordinatorError

    real, mine = dist.get_backend, c.group  # type: ignore[attr-defined]
    dist.get_backend = lambda group=None: "nccl" if group is mine else real(group)  # type: ignore[assignment]
    try:
        try:
            c.exchange_buffers({}, {})
            refused = None
        except CoordinatorError as exc:
            refused = str(exc)
        host = c.host_transport()
        result = load_rank(c, path, "hsdp")
        result["again_same"] = c.host_transport() is host  # one duplicate, kept
    finally:
        dist.get_backend = real  # type: ignore[assignment]
    return {**result, "refused": refused, "duplicate": host is not c}


def main(mode: str, path: str, backend: str = "mpi") -> None:
    rank = process_rank(backend)

    def work() -> dict[str, Any]:
        c = make_coordinator(backend)
        if rank == 0:
            make_checkpoint(path)
            for kind in ("damaged", "missing"):
                damaged_copy(path, f"{path}-{kind}", kind)
        c.barrier()
        if mode == "all":
            out = counted_loads(c, path)
            out["budget"] = budget_load(c, path, 80 << 10)
            out["damaged"] = fail_rank(c, f"{path}-damaged", "replicated")
            out["missing"] = fail_rank(c, f"{path}-missing", "hsdp")
            if backend == "torch":
                out["nccl"] = nccl_like_load(c, path)
        elif mode == "dead":
            # the reader of the first shared chunk of rank 1 dies before it has read it
            import gpuckpt.distributed.cooperative as coop

            def die(*args: Any) -> None:
                os.kill(os.getpid(), signal.SIGKILL)

            if rank == 1:
                coop._read_shared = die  # type: ignore[assignment]
            out = fail_rank(c, path, "replicated")
            return out  # the group is broken: not torn down
        else:
            raise ValueError(f"unknown mode {mode!r}")
        finish(backend)
        return out

    run_rank(rank, work, backend)


if __name__ == "__main__":
    main(*sys.argv[1:])
