"""GPU save/load throughput of gpuckpt against ceilings measured in the same run.

Ceilings: pinned device-to-host and host-to-device bandwidth of large
``cudaMemcpyAsync`` copies, a device-to-device copy, and the disk's
write+fsync and warm read bandwidth (one large file, read with one thread
and with eight; the faster one counts). Figures:

* ``save``: a multi-GiB device state, durable, vs min(D2H, disk write);
* ``async_save`` blocking time vs state bytes / D2H (target <= 1.1x), with
  warm (reused) staging memory, and with ``staging="device"`` vs a D2D copy;
* ``load`` in place into device arrays (page cache warm) vs min(H2D, warm read).

Usage: ``python bench/bench_gpu.py [--gib 4] [--rounds 3] [--out DIR]``; exits 0 with a
message when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np


def median_time(fn: Any, rounds: int) -> tuple[float, float, float]:
    fn()  # warm-up
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), min(ts), max(ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0, help="size of the device state")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="file system to measure (default: a temp dir)")
    ap.add_argument("--out", help="write bench_gpu.json here")
    args = ap.parse_args(argv)

    from gpuckpt.device import cuda

    if not cuda.gpu_available():
        print("bench_gpu: no CuPy or no CUDA device here; nothing to measure")
        return 0
    import cupy as cp

    import gpuckpt
    from gpuckpt.testing import rawio

    base = Path(tempfile.mkdtemp(prefix="gpuckpt-gpubench-", dir=args.dir))
    res: dict[str, Any] = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "gib": args.gib}
    nbytes = int(args.gib * 2**30)
    per = 256 << 20
    n = max(1, nbytes // per)
    rng = cp.random.default_rng(0)
    state = {"layers": [{"w": rng.standard_normal(per // 4, dtype=cp.float32)} for _ in range(n)]}
    total = n * per
    stream = cp.cuda.Stream(non_blocking=True)

    # ceilings -----------------------------------------------------------
    big = state["layers"][0]["w"]
    pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(big.nbytes), np.uint8, big.nbytes)
    d2 = cp.empty_like(big)

    def memcpy(kind: int, dst: int, src: int) -> None:
        cp.cuda.runtime.memcpyAsync(dst, src, big.nbytes, kind, stream.ptr)
        stream.synchronize()

    d2h = big.nbytes / median_time(lambda: memcpy(2, pinned.ctypes.data, big.data.ptr), 5)[0] / 1e9
    h2d = big.nbytes / median_time(lambda: memcpy(1, big.data.ptr, pinned.ctypes.data), 5)[0] / 1e9
    d2d = 2 * big.nbytes / median_time(lambda: memcpy(3, d2.data.ptr, big.data.ptr), 5)[0] / 1e9
    host_arrays = [pinned.view(np.float32)] * min(n, 8)
    host_bytes = sum(a.nbytes for a in host_arrays)

    def disk_write() -> None:
        p = base / "raw"
        shutil.rmtree(p, ignore_errors=True)
        rawio.raw_single_save(host_arrays, p)

    disk_w = host_bytes / median_time(disk_write, args.rounds)[0] / 1e9
    scratch = [np.empty_like(a) for a in host_arrays]
    disk_r1 = (
        host_bytes / median_time(lambda: rawio.raw_single_load(scratch, base / "raw"), args.rounds)[0] / 1e9
    )
    disk_rn = (
        host_bytes
        / median_time(lambda: rawio.raw_single_load_parallel(scratch, base / "raw"), args.rounds)[0]
        / 1e9
    )
    disk_r = max(disk_r1, disk_rn)
    res["ceilings_GBps"] = {
        "d2h_pinned": d2h,
        "h2d_pinned": h2d,
        "d2d_read_plus_write": d2d,
        "disk_write_fsync": disk_w,
        "disk_read_warm": disk_r,
        "disk_read_warm_1_thread": disk_r1,
        "disk_read_warm_8_threads": disk_rn,
    }

    # gpuckpt ------------------------------------------------------------
    def timed_saves(st: Any, prefix: str) -> tuple[tuple[float, float, float], Path]:
        """Median (min, max) seconds of durable saves of ``st``, each deleting the one before; the last path."""
        n = [0]

        def save() -> None:
            n[0] += 1
            gpuckpt.save(st, base / f"{prefix}{n[0]}")
            shutil.rmtree(base / f"{prefix}{n[0] - 1}", ignore_errors=True)

        return median_time(save, args.rounds), base / f"{prefix}{n[0]}"

    t_save, last = timed_saves(state, "s")
    targets = {"layers": [{"w": cp.empty_like(x["w"])} for x in state["layers"]]}
    t_load = median_time(lambda: gpuckpt.load(targets, last), args.rounds)
    assert all(
        bool((a["w"] == b["w"]).all()) for a, b in zip(targets["layers"], state["layers"], strict=True)
    )

    def blocking(staging: str) -> tuple[float, float, float]:
        times = []
        futs = []
        for i in range(args.rounds + 1):
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            futs.append(gpuckpt.async_save(state, base / f"a-{staging}-{i}", staging=staging))
            times.append(time.perf_counter() - t)
            futs[-1].result()
            shutil.rmtree(base / f"a-{staging}-{i}", ignore_errors=True)
        ts = times[1:]  # the first call allocates the staging memory
        return statistics.median(ts), min(ts), max(ts)

    t_async = blocking("host")
    t_async_dev = blocking("device")

    # channels-last float16 tensors: the transpose kernels on the save and load path
    cl_state = {
        f"conv{i}": rng.standard_normal((32, 128, 128, 256), dtype=cp.float32)
        .astype(cp.float16)
        .transpose(0, 3, 1, 2)
        for i in range(4)
    }
    cl_total = sum(int(v.nbytes) for v in cl_state.values())
    t_cl_save, cl_last = timed_saves(cl_state, "cl")
    cl_targets = {k: cp.empty_like(v) for k, v in cl_state.items()}  # keeps the channels-last strides
    t_cl_load = median_time(lambda: gpuckpt.load(cl_targets, cl_last), args.rounds)
    assert all(
        cl_targets[k].strides == v.strides and bool((cl_targets[k] == v).all()) for k, v in cl_state.items()
    )
    res["gpuckpt"] = {
        "state_bytes": total,
        "save_GBps": total / t_save[0] / 1e9,
        "save_ratio_to_min_d2h_disk": (total / t_save[0] / 1e9) / min(d2h, disk_w),
        "load_GBps": total / t_load[0] / 1e9,
        "load_ratio_to_min_h2d_warm_read": (total / t_load[0] / 1e9) / min(h2d, disk_r),
        "async_block_s": t_async[0],
        "async_block_ratio_to_one_d2h": t_async[0] / (total / (d2h * 1e9)),
        "async_device_block_s": t_async_dev[0],
        "async_device_block_ratio_to_one_d2d": t_async_dev[0] / (2 * total / (d2d * 1e9)),
        "save_s_min_max": t_save[1:],
        "load_s_min_max": t_load[1:],
        "channels_last_bytes": cl_total,
        "channels_last_save_GBps": cl_total / t_cl_save[0] / 1e9,
        "channels_last_load_GBps": cl_total / t_cl_load[0] / 1e9,
    }
    shutil.rmtree(base, ignore_errors=True)
    c, g = res["ceilings_GBps"], res["gpuckpt"]
    print(f"\nGPU benchmark on {res['device']}, state {total / 2**30:.2f} GiB")
    print(
        f"ceilings GB/s: D2H {c['d2h_pinned']:.1f}  H2D {c['h2d_pinned']:.1f}  D2D {c['d2d_read_plus_write']:.1f}  "
        f"disk write+fsync {c['disk_write_fsync']:.2f}  disk read warm {c['disk_read_warm']:.2f} "
        f"(1 thread {c['disk_read_warm_1_thread']:.2f}, 8 threads {c['disk_read_warm_8_threads']:.2f})"
    )
    print(
        f"save          {g['save_GBps']:6.2f} GB/s  ratio to min(D2H, disk)      {g['save_ratio_to_min_d2h_disk']:.2f}  (target >= 0.85)"
    )
    print(
        f"load          {g['load_GBps']:6.2f} GB/s  ratio to min(H2D, warm read) {g['load_ratio_to_min_h2d_warm_read']:.2f}  (target >= 0.80)"
    )
    print(
        f"async_save    blocks {g['async_block_s']:.3f} s = {g['async_block_ratio_to_one_d2h']:.2f} x one D2H copy  (target <= 1.1)"
    )
    print(
        f"async device  blocks {g['async_device_block_s']:.3f} s = {g['async_device_block_ratio_to_one_d2d']:.2f} x one D2D copy"
    )
    print(
        f"channels-last float16 {cl_total / 2**30:.2f} GiB: save {g['channels_last_save_GBps']:.2f} GB/s "
        f"({g['channels_last_save_GBps'] / g['save_GBps']:.2f}x the plain save), load "
        f"{g['channels_last_load_GBps']:.2f} GB/s ({g['channels_last_load_GBps'] / g['load_GBps']:.2f}x the plain load)"
    )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_gpu.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
