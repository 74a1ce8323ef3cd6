"""GPU figures of gpuckpt against ceilings measured in the same run (``gpuckpt bench --device``).

Ceilings: pinned device-to-host and host-to-device copies, a device-to-device
copy, the disk's write+fsync, and reads of one large file warm (page cache)
and cold (evicted first). Figures, on a device state of ``gib`` GiB:

* ``save`` vs min(D2H, disk write);
* ``load`` into device arrays through the load pipeline, warm vs min(H2D, warm
  read) and cold (chunk files evicted from the page cache) vs min(H2D, cold read);
* ``async_save`` blocking time vs one D2H copy of the state (pinned staging)
  and, with ``staging="device"``, vs one D2D copy;
* a few channels-last kernel rows (16 MiB, both directions) vs the D2D copy
  and ``cupy.ascontiguousarray``;
* (``tiers=True``) a ``CheckpointManager`` with a local tier on tmpfs (one
  process, ``replicas=0``): its ``save`` blocking time vs one D2H copy of the
  state, and a restore from the tier into device arrays (a new manager, as a
  restarted job's) vs min(H2D, warm read), checked bit-exact.

Timing: one warm-up, then medians; the stream or device is synchronised before
every clock read; random data, never zeros. :func:`report` is what
``gpuckpt bench --device`` prints: the figures and their ratios to the ceilings,
no targets. ``bench/bench_gpu.py`` and ``bench/gpu_check.sh`` run the same
:func:`measure` for the runs of record, whose summary and targets are
``bench/gpu_summary.py``'s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["evict", "kernel_rows", "measure", "median_time", "report"]


def median_time(fn: Callable[[], object], rounds: int, before: Callable[[], object] | None = None) -> float:
    """Median seconds of ``rounds`` calls of ``fn`` after one warm-up; ``before`` runs untimed before each."""
    if before is not None:
        before()
    fn()
    times = []
    for _ in range(rounds):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def evict(root: Path) -> bool:
    """Drop the files under ``root`` from the page cache (fsync, then POSIX_FADV_DONTNEED).

    Returns whether they left it (a file system that keeps files in memory, such
    as tmpfs, keeps them): the cold figures are meaningful only then.
    """
    from gpuckpt.storage.local import crccopy

    left = True
    paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            size = os.fstat(fd).st_size
            if size >= 1 << 20 and crccopy.available():
                probe = np.empty(4096, np.uint8)
                left = left and crccopy.cached_copy_crc(fd, size // 2, memoryview(probe)) is None
        finally:
            os.close(fd)
    return left


def _event_time(cp: Any, fn: Callable[[], object], rounds: int) -> float:
    """Median seconds of ``fn`` on the current stream, timed with CUDA events."""
    fn()
    times = []
    for _ in range(rounds):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(cp.cuda.get_elapsed_time(start, end)) / 1e3)
    return float(statistics.median(times))


def _kernel_times(
    cp: Any, kernels: Any, cl: Any, block: Any, direction: str, rounds: int
) -> tuple[float, float]:
    """Seconds of our kernel and of CuPy's copy for the same transpose."""
    if direction == "to_contiguous":
        ours = _event_time(cp, lambda: kernels.channels_last_to_contiguous(cl, block), rounds)
        return ours, _event_time(cp, lambda: cp.ascontiguousarray(cl), rounds)

    def cupy_copy() -> None:
        cl[...] = block

    ours = _event_time(cp, lambda: kernels.contiguous_to_channels_last(block, cl), rounds)
    return ours, _event_time(cp, cupy_copy, rounds)


def kernel_rows(cp: Any, copy_gbps: float, mib: int = 16, rounds: int = 5) -> list[dict[str, Any]]:
    """Channels-last kernel rows at about ``mib`` MiB: C = 3, 4, 64; float16 and float32; both directions."""
    from gpuckpt.device import kernels

    rows = []
    rng = cp.random.default_rng(1)
    for dtype in ("float16", "float32"):
        itemsize = np.dtype(dtype).itemsize
        for channels in (3, 4, 64):
            pixels = (mib << 20) // (itemsize * channels)
            h = 256
            w = max(16, pixels // (8 * h) // 16 * 16)
            shape = (8, channels, h, w)
            nbytes = int(np.prod(shape)) * itemsize
            nhwc = rng.standard_normal((8, h, w, channels), dtype=cp.float32).astype(dtype)
            cl = nhwc.transpose(0, 3, 1, 2)
            block = cp.empty(shape, dtype=dtype)
            for direction in ("to_contiguous", "to_channels_last"):
                ours, theirs = _kernel_times(cp, kernels, cl, block, direction, rounds)
                gbps = 2 * nbytes / ours / 1e9  # read + write, as the copy ceiling
                rows.append(
                    {
                        "direction": direction,
                        "dtype": dtype,
                        "shape": list(shape),
                        "box": None,
                        "group": "main",
                        "path": kernels.choose_path(shape, shape, itemsize),
                        "bytes": nbytes,
                        "GBps": gbps,
                        "cupy_GBps": 2 * nbytes / theirs / 1e9,
                        "fraction_of_copy": gbps / copy_gbps,
                        "speedup_vs_cupy": theirs / ours,
                    }
                )
    return rows


def measure(
    gib: float, rounds: int, base: Path, *, cold: bool = True, kernels: bool = False, tiers: bool = False
) -> dict[str, Any]:
    """The figures of a ``gib`` GiB device state on device 0, with files under ``base``."""
    import cupy as cp

    import gpuckpt
    import gpuckpt.cli.rawio as rawio
    from gpuckpt.device.cuda import allocation_bases
    from gpuckpt.device.cuda import backend_for_device as cuda_backend_for_device
    from gpuckpt.device.packing import plan_packing

    res: dict[str, Any] = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "gib": gib}
    per = 256 << 20
    n = max(1, int(gib * 2**30) // per)
    rng = cp.random.default_rng(0)
    state = {"layers": [{"w": rng.standard_normal(per // 4, dtype=cp.float32)} for _ in range(n)]}
    total = n * per
    stream = cp.cuda.Stream(non_blocking=True)

    # ceilings -------------------------------------------------------------------------
    big = state["layers"][0]["w"]
    pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(big.nbytes), np.uint8, big.nbytes)
    pinned[:] = np.random.default_rng(2).integers(0, 256, big.nbytes, dtype=np.uint8)
    d2 = cp.empty_like(big)

    def memcpy(kind: int, dst: int, src: int) -> None:
        cp.cuda.runtime.memcpyAsync(dst, src, big.nbytes, kind, stream.ptr)
        stream.synchronize()

    d2h = big.nbytes / median_time(lambda: memcpy(2, pinned.ctypes.data, big.data.ptr), 5) / 1e9
    h2d = big.nbytes / median_time(lambda: memcpy(1, big.data.ptr, pinned.ctypes.data), 5) / 1e9
    d2d = 2 * big.nbytes / median_time(lambda: memcpy(3, d2.data.ptr, big.data.ptr), 5) / 1e9
    host_arrays = [pinned.view(np.float32)] * min(n, 8)
    host_bytes = sum(a.nbytes for a in host_arrays)

    def disk_write() -> None:
        p = base / "raw"
        shutil.rmtree(p, ignore_errors=True)
        rawio.raw_single_save(host_arrays, p)

    disk_w = host_bytes / median_time(disk_write, rounds) / 1e9
    scratch = [np.empty_like(a) for a in host_arrays]

    def read_1() -> None:
        rawio.raw_single_load(scratch, base / "raw")

    def read_n() -> None:
        rawio.raw_single_load_parallel(scratch, base / "raw")

    warm_1 = host_bytes / median_time(read_1, rounds) / 1e9
    warm_n = host_bytes / median_time(read_n, rounds) / 1e9
    ceilings = {
        "d2h_pinned": d2h,
        "h2d_pinned": h2d,
        "d2d_read_plus_write": d2d,
        "disk_write_fsync": disk_w,
        "disk_read_warm": max(warm_1, warm_n),
        "disk_read_warm_1_thread": warm_1,
        "disk_read_warm_8_threads": warm_n,
    }
    evicted = True
    if cold:
        evicted = evict(base / "raw")
        cold_1 = host_bytes / median_time(read_1, rounds, before=lambda: evict(base / "raw")) / 1e9
        cold_n = host_bytes / median_time(read_n, rounds, before=lambda: evict(base / "raw")) / 1e9
        ceilings.update(
            disk_read_cold=max(cold_1, cold_n),
            disk_read_cold_1_thread=cold_1,
            disk_read_cold_8_threads=cold_n,
        )
    shutil.rmtree(base / "raw", ignore_errors=True)
    res["ceilings_GBps"] = ceilings

    # gpuckpt --------------------------------------------------------------------------
    count = [0]

    def save() -> None:
        count[0] += 1
        gpuckpt.save(state, base / f"s{count[0]}")
        shutil.rmtree(base / f"s{count[0] - 1}", ignore_errors=True)

    t_save = median_time(save, rounds)
    last = base / f"s{count[0]}"
    targets = {"layers": [{"w": cp.empty_like(x["w"])} for x in state["layers"]]}

    def load() -> None:
        gpuckpt.load(targets, last)
        cp.cuda.Device().synchronize()

    t_load = median_time(load, rounds)
    if not all(
        bool((a["w"] == b["w"]).all()) for a, b in zip(targets["layers"], state["layers"], strict=True)
    ):
        raise AssertionError("the device load returned other bytes than were saved")
    g: dict[str, Any] = {
        "state_bytes": total,
        "save_GBps": total / t_save / 1e9,
        "save_ratio_to_min_d2h_disk": (total / t_save / 1e9) / min(d2h, disk_w),
        "load_GBps": total / t_load / 1e9,
        "load_ratio_to_min_h2d_warm_read": (total / t_load / 1e9) / min(h2d, ceilings["disk_read_warm"]),
    }
    if cold:
        t_cold = median_time(load, rounds, before=lambda: evict(last))
        g["load_cold_GBps"] = total / t_cold / 1e9
        g["load_ratio_to_min_h2d_cold_read"] = g["load_cold_GBps"] / min(h2d, ceilings["disk_read_cold"])
        g["cold_files_left_page_cache"] = evicted

    def blocking(staging: str) -> float:
        times = []
        for i in range(rounds + 1):
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            fut = gpuckpt.async_save(state, base / f"a-{staging}-{i}", staging=staging)
            times.append(time.perf_counter() - t)
            fut.result()
            shutil.rmtree(base / f"a-{staging}-{i}", ignore_errors=True)
        return statistics.median(times[1:])  # the first call allocates the staging memory

    errors: dict[str, str] = {}

    def part(name: str, figures: Callable[[], dict[str, Any]]) -> None:
        """One group of figures; a failure is recorded and the others still run (a device
        machine's time is scarce: one broken path must not cost the rest of the run)."""
        try:
            g.update(figures())
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()

    def async_host() -> dict[str, Any]:
        t_async = blocking("host")
        return {"async_block_s": t_async, "async_block_ratio_to_one_d2h": t_async / (total / (d2h * 1e9))}

    def async_device() -> dict[str, Any]:
        t_async_dev = blocking("device")
        arrays = [x["w"] for x in state["layers"]]
        backend = cuda_backend_for_device(0)

        def snapshot_copy() -> None:  # the snapshot's copy alone: what the rest of the blocking adds
            backend.wait_for_producers()
            backend.copy_many_on_device(arrays)
            backend.synchronize()

        return {
            "async_device_block_s": t_async_dev,
            "async_device_block_ratio_to_one_d2d": t_async_dev / (2 * total / (d2d * 1e9)),
            "async_device_snapshot_copy_s": median_time(snapshot_copy, rounds),
            "async_device_copies": plan_packing(
                [(int(a.data.ptr), int(a.nbytes)) for a in arrays],
                allocations=allocation_bases([int(a.data.ptr) for a in arrays]),
            ).copies,
        }

    part("async_save", async_host)
    part("async_save_device", async_device)
    if tiers:
        read_ceiling = min(h2d, ceilings["disk_read_warm"])
        part("tiers", lambda: _tier_figures(state, targets, base, rounds, d2h, read_ceiling))
    if errors:
        res["errors"] = errors
    res["gpuckpt"] = g
    if kernels:
        res["kernels"] = {"device": res["device"], "copy_GBps": d2d, "rows": kernel_rows(cp, d2d)}
    with contextlib.suppress(OSError):
        shutil.rmtree(base)
    return res


def _tier_figures(
    state: dict[str, Any], targets: dict[str, Any], base: Path, rounds: int, d2h: float, read_ceiling: float
) -> dict[str, Any]:
    """A local tier's figures on a device state (see :func:`measure`): steps 1.. saved to a tier
    on ``/dev/shm`` (a temp dir beside ``base`` where there is none), the root never written
    (``persist_interval_steps`` past the last step); the first save (it allocates the staging
    memory) left out of the median."""
    import cupy as cp

    import gpuckpt

    shm = Path("/dev/shm")
    local = Path(tempfile.mkdtemp(prefix="gpuckpt-gpubench-tier-", dir=shm if shm.is_dir() else base))
    root = base / "tier-root"
    total = sum(int(x.nbytes) for x in _device_arrays(state))
    opts: dict[str, Any] = {
        "local_dir": local,
        "replicas": 0,
        "persist_interval_steps": 1 << 30,
        "local_max_to_keep": 2,
    }
    try:
        blocks = []
        with gpuckpt.CheckpointManager(root, **opts) as mgr:
            for step in range(1, rounds + 2):
                cp.cuda.Device().synchronize()
                t = time.perf_counter()
                mgr.save(step, state)
                blocks.append(time.perf_counter() - t)
                mgr.wait()
        for x in _device_arrays(targets):
            x.fill(0)
        restores = []
        for _ in range(rounds):
            with gpuckpt.CheckpointManager(root, **opts) as mgr:
                cp.cuda.Device().synchronize()
                t = time.perf_counter()
                got = mgr.restore(targets)
                cp.cuda.Device().synchronize()
                restores.append(time.perf_counter() - t)
                came_from = mgr.last_restore
        same = all(
            bool((a == b).all()) for a, b in zip(_device_arrays(targets), _device_arrays(state), strict=True)
        )
        source = getattr(came_from, "source", None)
        if got != rounds + 1 or not same or source != "tiers":
            raise AssertionError(
                f"the tier restore returned step {got} from {source!r}, or other bytes than were saved"
            )
        t_block = statistics.median(blocks[1:])
        t_restore = statistics.median(restores)
        return {
            "tier_dir": str(local.parent),
            "tier_save_block_s": t_block,
            "tier_save_block_ratio_to_one_d2h": t_block / (total / (d2h * 1e9)),
            "tier_restore_GBps": total / t_restore / 1e9,
            "tier_restore_ratio_to_min_h2d_warm_read": (total / t_restore / 1e9) / read_ceiling,
        }
    finally:
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def _device_arrays(state: dict[str, Any]) -> list[Any]:
    return [x["w"] for x in state["layers"]]


def _num(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def report(res: dict[str, Any]) -> str:
    """The figures of :func:`measure` as text: the ceilings of the run, then each gpuckpt figure
    with its ratio to the ceiling it is measured against (1.00: as fast as that ceiling)."""
    c = res.get("ceilings_GBps", {})
    g = res.get("gpuckpt", {})
    lines = [
        f"{res.get('device', 'unknown device')}: a device state of {res.get('gib', '?')} GiB, "
        "medians after one warm-up",
        f"ceilings GB/s: D2D {_num(c.get('d2d_read_plus_write'), '.0f')} (read+write)  "
        f"D2H {_num(c.get('d2h_pinned'), '.1f')}  H2D {_num(c.get('h2d_pinned'), '.1f')}  "
        f"disk write+fsync {_num(c.get('disk_write_fsync'))}  warm read {_num(c.get('disk_read_warm'))}  "
        f"cold read {_num(c.get('disk_read_cold'))}",
        f"save          {_num(g.get('save_GBps'))} GB/s = "
        f"{_num(g.get('save_ratio_to_min_d2h_disk'))} x min(D2H, disk write)",
        f"load (warm)   {_num(g.get('load_GBps'))} GB/s = "
        f"{_num(g.get('load_ratio_to_min_h2d_warm_read'))} x min(H2D, warm read)",
        f"load (cold)   {_num(g.get('load_cold_GBps'))} GB/s = "
        f"{_num(g.get('load_ratio_to_min_h2d_cold_read'))} x min(H2D, cold read)",
        f"async_save    blocks {_num(g.get('async_block_s'), '.4f')} s = "
        f"{_num(g.get('async_block_ratio_to_one_d2h'))} x one D2H copy of the state",
        f"async device  blocks {_num(g.get('async_device_block_s'), '.4f')} s = "
        f"{_num(g.get('async_device_block_ratio_to_one_d2d'))} x one D2D copy (staging='device')",
    ]
    if g.get("cold_files_left_page_cache") is False:
        lines.append("cold figures: the files stayed in the page cache (tmpfs?); they are warm reads")
    rows = (res.get("kernels") or {}).get("rows") or []
    if rows:
        pct = [100 * r["fraction_of_copy"] for r in rows]
        lines.append(
            f"channels-last kernels: {len(rows)} rows at {min(pct):.0f}-{max(pct):.0f}% of the D2D copy, "
            f"{min(r['speedup_vs_cupy'] for r in rows):.2f}-{max(r['speedup_vs_cupy'] for r in rows):.2f}x "
            "cupy.ascontiguousarray"
        )
    for name, error in (res.get("errors") or {}).items():
        lines.append(f"FAILED {name}: {error}")
    return "\n".join(lines)
