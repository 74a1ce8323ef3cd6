"""One measurement process: build the state, run the operations of one system, print JSON lines.

Usage (the driver calls it; each call is a fresh interpreter)::

    python -m bench.compare.runner SYSTEM --state gpt --ops save,load_warm,load_cold \
        --dir DIR --round 3 [--quick] [--seed 0]

Operations:

* ``save``: the system's save, made durable (its own fsync, or an explicit
  fsync of every file, timed, where it has none);
* ``load_warm`` / ``load_cold``: load what ``save`` wrote, with the page cache
  warm (every file read once first, untimed: a save may bypass the cache; the
  fraction the save left resident is recorded), and after ``os.sync`` +
  ``posix_fadvise(DONTNEED)`` on every file (the fraction still resident is
  recorded); the loaded bytes are checked
  against the source (outside the timed region);
* ``async``: the system's asynchronous save variants (time to return, to
  durable, extra memory);
* ``ceiling``: ``dd`` write with ``oflag=direct`` and ``conv=fdatasync`` and a
  cold ``iflag=direct`` read of the state's size.

Every record carries the seconds, the state's bytes, the number of files and
the peak RSS above the process's resident size before the operation (minus
the result's own size where the load allocates it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import resource
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.compare.common import (
    OP_SETTLE_S,
    build_state,
    drop_cache,
    emit,
    fingerprint,
    fsync_tree,
    peak_rss,
    reset_peak,
    rss,
    set_aside,
    state_bytes,
    tree_files,
    warm_cache,
)

# system name -> "module:Class"; the module is imported only when that system runs
ADAPTERS = {
    "raw-files": "bench.compare.sys_native:RawFiles",
    "raw-single": "bench.compare.sys_native:RawSingle",
    "gpuckpt": "bench.compare.sys_native:Gpuckpt",
    "gpuckpt-async": "bench.compare.sys_native:Gpuckpt",
    "gpuckpt-direct": "bench.compare.sys_native:GpuckptDirect",
    "gpuckpt-async-buffered": "bench.compare.sys_native:GpuckptBuffered",
    "gpuckpt-pread": "bench.compare.sys_native:GpuckptPread",
    "tensorstore": "bench.compare.sys_native:TensorStoreZarr3",
    "torch-save": "bench.compare.sys_torch:TorchSave",
    "safetensors": "bench.compare.sys_torch:Safetensors",
    "dcp-t1": "bench.compare.sys_torch:DCP1",
    "dcp-t2": "bench.compare.sys_torch:DCP2",
    "dcp-async": "bench.compare.sys_torch:DCP2",
    "dcp-gpuckpt": "bench.compare.sys_torch:DCPGpuckpt",
    "dcp-gpuckpt-async": "bench.compare.sys_torch:DCPGpuckpt",
    "orbax": "bench.compare.sys_orbax:Orbax",
}


def adapter_class(system: str) -> Any:
    """The adapter class of ``system`` (imports its module)."""
    mod, _, cls = ADAPTERS[system].partition(":")
    return getattr(importlib.import_module(mod), cls)


def _disk_bytes(path: str) -> tuple[int, int]:
    files = [path] if os.path.isfile(path) else tree_files(path)
    return len(files), sum(os.path.getsize(f) for f in files)


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _cpu_since(c0: tuple[float, float]) -> dict[str, float]:
    """The process's user and system CPU seconds (all threads) since ``c0``: unlike the wall
    time, hardly changed by other processes competing for the CPUs, and the system time shows
    the kernel's share (page cache, page faults)."""
    u, s = _cpu()
    return {"cpu_user_s": u - c0[0], "cpu_sys_s": s - c0[1]}


def op_save(ad: Any, path: str, base: dict[str, Any]) -> dict[str, Any]:
    r0 = rss()
    reset_peak()
    c0 = _cpu()
    t0 = time.perf_counter()
    ad.save(path)
    t1 = time.perf_counter()
    if not ad.durable:
        fsync_tree(path)
    t2 = time.perf_counter()
    cpu = _cpu_since(c0)
    nfiles, nbytes = _disk_bytes(path)
    return {
        **base,
        **cpu,
        "seconds": t2 - t0,
        "sync_seconds": t2 - t1,
        "durability": "own" if ad.durable else "explicit fsync (timed)",
        "files": nfiles,
        "disk_bytes": nbytes,
        "extra_peak": peak_rss() - r0,
    }


def op_load(ad: Any, path: str, base: dict[str, Any], expected: str, cold: bool) -> dict[str, Any]:
    ad.prepare_load()
    # warm: every byte in the page cache first (the save may have bypassed it)
    resident = drop_cache(path) if cold else warm_cache(path)
    r0 = rss()
    reset_peak()
    c0 = _cpu()
    t0 = time.perf_counter()
    ad.load(path)
    t1 = time.perf_counter()
    cpu = _cpu_since(c0)
    extra = peak_rss() - r0 - (base["bytes"] if ad.fresh else 0)
    got = fingerprint(ad.loaded())
    ad.clear()
    rec = {**base, **cpu, "seconds": t1 - t0, "extra_peak": extra, "verified": got == expected}
    rec["resident_before" if cold else "resident_after_save"] = resident
    return rec


_DD_RE = re.compile(r"(\d+) bytes .* copied, ([0-9.eE+-]+) s")


def _dd(args: list[str]) -> tuple[int, float]:
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = _DD_RE.search(out)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {out!r}")
    return int(m.group(1)), float(m.group(2))


def op_ceiling(d: str, nbytes: int, base: dict[str, Any]) -> list[dict[str, Any]]:
    """The disk's own ceiling for ``nbytes``: dd direct write, dd + fdatasync, dd direct read (cold)."""
    bs = 64 << 20 if nbytes >= 256 << 20 else 1 << 20
    count = max(1, -(-nbytes // bs))
    f = os.path.join(d, "dd.bin")
    out = []
    try:
        for name, args in (
            ("dd-direct", [f"of={f}", "oflag=direct"]),
            ("dd-fdatasync", [f"of={f}", "conv=fdatasync"]),
        ):
            if os.path.exists(f):
                os.unlink(f)
            n, s = _dd(["if=/dev/zero", f"bs={bs}", f"count={count}", *args])
            out.append({**base, "system": name, "op": "save", "seconds": s, "bytes": n, "files": 1})
        drop_cache(f)
        n, s = _dd([f"if={f}", "of=/dev/null", f"bs={bs}", "iflag=direct"])
        out.append({**base, "system": "dd-direct", "op": "load_cold", "seconds": s, "bytes": n, "files": 1})
    finally:
        if os.path.exists(f):
            os.unlink(f)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("system", choices=[*ADAPTERS, "dd"])
    ap.add_argument("--state", required=True)
    ap.add_argument("--ops", default="save,load_warm,load_cold")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trash", help="move outputs with many files here instead of deleting them")
    ap.add_argument(
        "--settle-op",
        type=float,
        default=OP_SETTLE_S,
        help="seconds to wait, idle, before every timed operation (see common.OP_SETTLE_S)",
    )
    args = ap.parse_args(argv)
    if args.settle_op < 0:
        ap.error(f"--settle-op must be >= 0 seconds, got {args.settle_op}")
    ops = [o for o in args.ops.split(",") if o]
    state = build_state(args.state, quick=args.quick, seed=args.seed)
    nbytes = state_bytes(state)
    base = {
        "system": args.system,
        "state": args.state,
        "round": args.round,
        "bytes": nbytes,
        "tensors": len(state),
        "python": sys.version.split()[0],
        "settle_s": args.settle_op,
    }
    work = os.path.join(args.dir, f"{args.system}-{args.state}-r{args.round}-{os.getpid()}")
    os.makedirs(work)
    try:
        if args.system == "dd":
            time.sleep(args.settle_op)
            for rec in op_ceiling(work, nbytes, base):
                emit(rec)
            return 0
        expected = fingerprint(state)
        ad = adapter_class(args.system)(state)
        base["version"] = ad.version()
        path = os.path.join(work, "ckpt")
        for op in ops:
            rec: dict[str, Any]
            # the same memory state before every system's operation, whatever its start-up time
            time.sleep(args.settle_op)
            try:
                if op == "save":
                    rec = op_save(ad, path, {**base, "op": op})
                elif op in ("load_warm", "load_cold"):
                    rec = op_load(ad, path, {**base, "op": op}, expected, cold=op == "load_cold")
                elif op == "async":
                    for variant, fn in ad.async_variants().items():
                        emit({**base, "op": op, "system": variant, **fn(os.path.join(work, variant))})
                    continue
                else:
                    raise ValueError(f"unknown op {op!r}")
            except Exception as exc:  # one failed op is reported, the others still run
                rec = {**base, "op": op, "error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            emit(rec)
    finally:
        set_aside(Path(work), Path(args.trash) if args.trash else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
