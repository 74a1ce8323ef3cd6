"""A local tier's costs per tensor: states of many tensors against ceilings measured in the same run.

One process, ``CheckpointManager(root, local_dir=<tmpfs>, replicas=0, local_max_to_keep=2,
persist_interval_steps=NEVER)``, for each state: ``gpt`` (289 float32 tensors of a GPT-like model: an embedding and 24 layers
of matrices, biases and norms, ``--gpt-mib`` MiB) and ``many`` (``--many`` float32 vectors
of 256 B to 16 KiB, like an optimizer state of many small parameters). Each round, after
``--warmup`` steps (the tier's parts are then written into the files of the parts they retire):

* ``save``: the blocking ``mgr.save(step, state)`` against a host copy of the same arrays
  (``gpuckpt.background.copy_host_arrays``, the snapshot's own copy) into the snapshots' own
  staging memory, between saves (``gpuckpt.background.host_arena_pool``), the ceiling of
  bench_tiers' figure 1 (which says why that memory); the copy into memory of its own,
  allocated once, is shown too;
* ``write``: from ``save`` returning to the part committed in the tier (``wait``; no step is
  drained to the root, which ``wait`` would wait for too: the default persists every step) against one
  file per array written with ``os.write`` into the same tmpfs, the files kept from round to
  round (as a tier writes into the files its step retires): bytes alone, no checksum, no
  document, no commit;
* ``restore`` (after the saves, the saving manager closed): a new manager's ``restore`` (the
  newest step, from the tier) into preallocated arrays against the faster of two plain reads
  of those plain files into preallocated buffers: ``read()``, or a copy out of new populated
  maps of them (bench_tiers' figure 4 says why both).

Ratios are medians over rounds, ``save`` as time / ceiling (at most 1.1 is bench_tiers'
target), ``write`` and ``restore`` as ceiling / time (a fraction of the plain rate).

Settling: the tier is on tmpfs (no file system to settle after deletions); each timed
operation starts after ``--settle`` seconds idle (default 2: this VM hands memory freed for
about 2 s back to its host, and touching it again costs a fault per page). The operations
alternate within each round.

Usage: ``python bench/bench_tier_many.py [--rounds 7] [--warmup 3] [--many 10000] [--gpt-mib 300]
[--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import gpuckpt  # noqa: E402
from bench.tiers_ranks import HostCopies, mapped_read, plain_read, plain_write  # noqa: E402

GPT_SHAPES = [("qkv", 3), ("qkv_b", -3), ("proj", 1), ("proj_b", -1), ("ln1", -1), ("ln1_b", -1)]
GPT_SHAPES += [("ln2", -1), ("ln2_b", -1), ("fc1", 4), ("fc1_b", -4), ("fc2", 4), ("fc2_b", -1)]


def gpt_state(mib: float, rng: np.random.Generator) -> dict[str, Any]:
    """289 tensors: an embedding of 16 rows per column and 24 layers, scaled to about ``mib``."""
    # elements: 16 d^2 (embedding) + 24 (12 d^2 + 13 d) ~= 304 d^2
    d = max(8, int((mib * (1 << 20) / 4 / 304) ** 0.5))
    model: dict[str, np.ndarray] = {"emb": rng.standard_normal((16 * d, d), np.float32)}
    for layer in range(24):
        for name, k in GPT_SHAPES:
            shape = (d, abs(k) * d) if k > 0 else (abs(k) * d,)
            model[f"l{layer:02d}.{name}"] = rng.standard_normal(shape, np.float32)
    return {"model": model, "step": 0}


def many_state(n: int, rng: np.random.Generator) -> dict[str, Any]:
    sizes = rng.integers(64, 4097, n)
    return {
        "model": {f"p{i:05d}": rng.standard_normal(int(s), np.float32) for i, s in enumerate(sizes)},
        "step": 0,
    }


#: no step reaches the root during the run: ``write`` is the tier's part alone
NEVER = 10**9


def _median(v: list[float]) -> float:
    return float(statistics.median(v))


def measure(name: str, state: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    arrays = list(state["model"].values())
    local, root, plain = work / f"{name}-tier", work / f"{name}-root", work / f"{name}-plain"
    mgr = gpuckpt.CheckpointManager(
        root, local_dir=local, replicas=0, local_max_to_keep=2, persist_interval_steps=NEVER
    )
    copies = HostCopies(arrays)
    files = [plain / f"{i}.bin" for i in range(len(arrays))]
    bufs = [np.empty_like(a) for a in arrays]
    target = {"model": {k: np.zeros_like(v) for k, v in state["model"].items()}, "step": -1}
    rec: dict[str, list[float]] = {
        k: []
        for k in ("save", "copy", "copy_own", "write", "plain_write", "restore", "plain_read", "mapped_read")
    }

    def timed(fn: Callable[[], Any]) -> float:
        time.sleep(args.settle)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    step = 0
    for r in range(args.warmup + args.rounds):
        step += 1
        time.sleep(args.settle)
        t0 = time.perf_counter()
        mgr.save(step, state)
        t1 = time.perf_counter()
        mgr.wait()
        t2 = time.perf_counter()
        c = timed(copies.into_pool)
        own = timed(copies.into_own)
        pw = timed(lambda: plain_write(arrays, plain, 4))
        if r < args.warmup:
            continue
        rec["save"].append(t1 - t0)
        rec["write"].append(t2 - t1)
        rec["copy"].append(c)
        rec["copy_own"].append(own)
        rec["plain_write"].append(pw)
    drained = mgr.all_steps()  # (none: each write above is the tier's part alone)
    mgr.close()  # (a restore is a restarted job's: a new manager over the same tier)
    for _ in range(args.rounds):
        restorer = gpuckpt.CheckpointManager(
            root, local_dir=local, replicas=0, local_max_to_keep=2, persist_interval_steps=NEVER
        )
        rec["restore"].append(timed(lambda: restorer.restore(target)))
        restorer.close()
        rec["plain_read"].append(timed(lambda: plain_read(files, bufs, 4)))
        rec["mapped_read"].append(timed(lambda: mapped_read(files, bufs, 4)))
    exact = all(np.array_equal(target["model"][k], v) for k, v in state["model"].items())
    out = {k: _median(v) for k, v in rec.items()}
    out["faster_read"] = _median(
        [min(a, b) for a, b in zip(rec["plain_read"], rec["mapped_read"], strict=True)]
    )
    return {
        "state": name,
        "tensors": len(arrays),
        "mib": sum(a.nbytes for a in arrays) / (1 << 20),
        "times_s": rec,
        "median_s": out,
        "save_ratio": out["save"] / out["copy"],
        "write_ratio": out["plain_write"] / out["write"],
        "restore_ratio": out["faster_read"] / out["restore"],
        "restore_bit_exact": exact,
        "root_steps": drained,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--many", type=int, default=10_000)
    ap.add_argument("--gpt-mib", type=float, default=300)
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    work = Path(tempfile.mkdtemp(prefix="gpuckpt-tier-many-", dir=args.dir))
    try:
        results = [
            measure("gpt", gpt_state(args.gpt_mib, rng), args, work),
            measure("many", many_state(args.many, rng), args, work),
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC  {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; tier on {args.dir or tempfile.gettempdir()}; {args.rounds} rounds after "
        f"{args.warmup} warm-up steps; {args.settle} s settle before each timed operation"
    )
    print(
        f"{'state':<6} {'tensors':>8} {'MiB':>6}  {'save ms':>8} {'copy ms':>8} {'ratio':>6}  "
        f"{'write ms':>9} {'plain ms':>9} {'ratio':>6}  {'restore ms':>10} {'plain ms':>9} {'ratio':>6}"
    )
    for r in results:
        m = r["median_s"]
        print(
            f"{r['state']:<6} {r['tensors']:>8} {r['mib']:>6.0f}  {m['save'] * 1e3:>8.1f} {m['copy'] * 1e3:>8.1f} "
            f"{r['save_ratio']:>6.2f}  {m['write'] * 1e3:>9.1f} {m['plain_write'] * 1e3:>9.1f} "
            f"{r['write_ratio']:>6.2f}  {m['restore'] * 1e3:>10.1f} {m['faster_read'] * 1e3:>9.1f} "
            f"{r['restore_ratio']:>6.2f}"
        )
    print("save ratio: time / host copy (bench_tiers' target: <= 1.1); write, restore: plain rate fraction")
    for r in results:
        print(
            f"{r['state']}: host copy into memory of its own {r['median_s']['copy_own'] * 1e3:.1f} ms "
            f"(save against it: {r['median_s']['save'] / r['median_s']['copy_own']:.2f})"
        )
    for r in results:
        m = r["median_s"]
        print(
            f"{r['state']}: plain reads {m['plain_read'] * 1e3:.1f} ms by read(), {m['mapped_read'] * 1e3:.1f} ms "
            "out of new populated maps (the restore's ceiling: the faster in each round)"
        )
    print("every restore bit-exact:", all(r["restore_bit_exact"] for r in results))
    if args.json is not None:
        args.json.write_text(
            json.dumps({"date": datetime.now(UTC).isoformat(), "results": results}, indent=1)
        )
    return 0 if all(r["restore_bit_exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
