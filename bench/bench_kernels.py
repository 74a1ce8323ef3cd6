"""Bandwidth of the channels-last kernels on a GPU.

Usage::

    python bench/bench_kernels.py --out DIR [--quick] [--repeat N] [--strict]

For each shape (C = 3, 64, 2048; tensors from 1 MiB to 1 GiB; several element
sizes) and each direction it measures

* the kernels' bandwidth, counting the bytes read plus the bytes written, as
  a fraction of a device-to-device copy measured in the same run;
* the speed-up over CuPy's own strided copy of the same view
  (``cupy.ascontiguousarray`` of the channels-last view to logical order; an
  assignment into the channels-last view for the other direction);
* one chunk-extraction row per C (a box of the middle of H and W).

Targets (from the issue): at least 80 % of copy bandwidth for tensors of
64 MiB and more, and faster than CuPy on every shape.  The figures are
printed as a table and written to ``DIR/bench_kernels.json``; ``--strict``
makes a missed target exit with status 1.  Without CuPy or a GPU the script
says so and exits with status 0.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

MIB = 1 << 20
CHANNELS = (3, 64, 2048)
SIZES_MIB = (1, 16, 64, 256, 1024)
QUICK_SIZES_MIB = (1, 64, 256)
DTYPES = ("float32", "float16", "uint8", "float64")
QUICK_DTYPES = ("float32", "float16")
TARGET_FRACTION = 0.80
TARGET_MIN_BYTES = 64 * MIB


def _gpu_or_reason() -> tuple[Any, str | None]:
    try:
        import cupy
    except Exception as exc:
        return None, f"CuPy is not importable ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, f"no usable CUDA device ({exc})"
    if count == 0:
        return None, "no CUDA device"
    return cupy, None


def gpu_time(cupy: Any, fn: Callable[[], object], repeat: int, min_span_s: float = 2e-3) -> float:
    """Median seconds per call of ``fn`` on the current stream.

    Calls are batched between two events until a batch spans ``min_span_s``,
    so that short kernels are not lost in event resolution.
    """
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def span(iters: int) -> float:
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) / 1e3

    for _ in range(3):  # warm-up: compilation, memory pool
        fn()
    iters = 1
    while (elapsed := span(iters)) < min_span_s and iters < 1 << 16:
        iters = max(iters * 2, int(iters * min_span_s / max(elapsed, 1e-7)))
    return statistics.median(span(iters) / iters for _ in range(repeat))


def copy_bandwidth(cupy: Any, nbytes: int, repeat: int) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    src = cupy.ones(nbytes, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    seconds = gpu_time(cupy, lambda: dst.data.copy_from_device_async(src.data, nbytes), repeat)
    return 2 * nbytes / seconds


def shape_for(channels: int, itemsize: int, nbytes: int) -> tuple[int, int, int, int]:
    """An (N, C, H, W) shape of about ``nbytes`` with near-square H x W."""
    positions = max(1, nbytes // (channels * itemsize))
    n = 8 if positions >= 8 * 64 else 1
    hw = max(1, positions // n)
    h = max(1, math.isqrt(hw))
    w = max(1, hw // h)
    return n, channels, h, w


def channels_last(cupy: Any, shape: tuple[int, ...], dtype: str) -> Any:
    n, c, *spatial = shape
    physical = cupy.arange(math.prod(shape), dtype=cupy.uint32).reshape(n, *spatial, c)
    physical = (physical % 251).astype(dtype)
    return physical.transpose(0, len(shape) - 1, *range(1, len(shape) - 1))


def bench_case(
    cupy: Any, kernels: Any, shape: tuple[int, ...], dtype: str, box: Any, repeat: int, copy_bw: float
) -> list[dict[str, Any]]:
    src = channels_last(cupy, shape, dtype)
    offsets, sizes = kernels.normalize_box(box, shape)
    view = src[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
    out = cupy.empty(sizes, dtype=dtype)

    # Correctness first: a benchmark of a wrong result is worthless.
    kernels.channels_last_to_contiguous(src, out, box=box)
    if not bool(cupy.array_equal(out, cupy.ascontiguousarray(view))):
        raise AssertionError(f"channels_last_to_contiguous gave a wrong result for {shape} {dtype} box {box}")
    target = channels_last(cupy, shape, dtype)
    target[...] = 0
    kernels.contiguous_to_channels_last(out, target, box=box)
    tview = target[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
    if not bool(cupy.array_equal(tview, view)):
        raise AssertionError(f"contiguous_to_channels_last gave a wrong result for {shape} {dtype} box {box}")

    moved = 2 * out.nbytes  # bytes read + bytes written
    rows = []
    for direction, ours, theirs in (
        (
            "to_contiguous",
            lambda: kernels.channels_last_to_contiguous(src, out, box=box),
            lambda: cupy.ascontiguousarray(view),
        ),
        (
            "to_channels_last",
            lambda: kernels.contiguous_to_channels_last(out, target, box=box),
            lambda: tview.__setitem__(Ellipsis, out),
        ),
    ):
        t_ours = gpu_time(cupy, ours, repeat)
        t_cupy = gpu_time(cupy, theirs, repeat)
        bw = moved / t_ours
        rows.append(
            {
                "direction": direction,
                "dtype": dtype,
                "shape": list(shape),
                "box": None if box is None else [list(offsets), list(sizes)],
                "bytes": out.nbytes,
                "ours_s": t_ours,
                "cupy_s": t_cupy,
                "ours_GBps": bw / 1e9,
                "cupy_GBps": moved / t_cupy / 1e9,
                "fraction_of_copy": bw / copy_bw,
                "speedup_vs_cupy": t_cupy / t_ours,
            }
        )
    return rows


def check_targets(row: dict[str, Any]) -> list[str]:
    missed = []
    if row["bytes"] >= TARGET_MIN_BYTES and row["fraction_of_copy"] < TARGET_FRACTION:
        missed.append(f"<{TARGET_FRACTION:.0%} of copy")
    if row["speedup_vs_cupy"] <= 1.0:
        missed.append("not faster than CuPy")
    return missed


def print_table(rows: list[dict[str, Any]], copy_bw: float) -> None:
    print(f"device-to-device copy: {copy_bw / 1e9:8.1f} GB/s (read + write)")
    header = (
        f"{'direction':<17}{'dtype':<9}{'shape':<24}{'box':<5}{'MiB':>8}"
        f"{'GB/s':>9}{'%copy':>7}{'CuPy GB/s':>11}{'speedup':>9}  missed"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['direction']:<17}{r['dtype']:<9}{'x'.join(map(str, r['shape'])):<24}"
            f"{'yes' if r['box'] else '':<5}{r['bytes'] / MIB:>8.1f}{r['ours_GBps']:>9.1f}"
            f"{r['fraction_of_copy']:>7.0%}{r['cupy_GBps']:>11.1f}{r['speedup_vs_cupy']:>9.2f}"
            f"  {', '.join(r['missed'])}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_kernels.json")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and dtypes")
    parser.add_argument("--repeat", type=int, default=7, help="timed batches per measurement")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)

    cupy, reason = _gpu_or_reason()
    if cupy is None:
        print(f"bench_kernels: nothing to measure: {reason}")
        return 0
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from gpuckpt.device import kernels

    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    t0 = time.perf_counter()
    kernels.load_module()
    compile_s = time.perf_counter() - t0

    copy_bw = copy_bandwidth(cupy, 1 << 30, args.repeat)
    sizes = QUICK_SIZES_MIB if args.quick else SIZES_MIB
    dtypes = QUICK_DTYPES if args.quick else DTYPES
    rows: list[dict[str, Any]] = []
    for channels in CHANNELS:
        for dtype in dtypes:
            itemsize = cupy.dtype(dtype).itemsize
            for mib in sizes:
                shape = shape_for(channels, itemsize, mib * MIB)
                rows += bench_case(cupy, kernels, shape, dtype, None, args.repeat, copy_bw)
                cupy.get_default_memory_pool().free_all_blocks()  # keep the footprint flat
        # Chunk extraction: the middle half of H and W of a 256 MiB float32 tensor.
        n, c, h, w = shape_for(channels, 4, 256 * MIB)
        box = ((0, 0, h // 4, w // 4), (n, c, max(1, h // 2), max(1, w // 2)))
        rows += bench_case(cupy, kernels, (n, c, h, w), "float32", box, args.repeat, copy_bw)
    for row in rows:
        row["missed"] = check_targets(row)

    print_table(rows, copy_bw)
    missed = [r for r in rows if r["missed"]]
    print(f"\ntargets met on {len(rows) - len(missed)} of {len(rows)} rows; compile took {compile_s:.2f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "cupy": cupy.__version__,
        "copy_GBps": copy_bw / 1e9,
        "compile_s": compile_s,
        "targets": {
            "fraction_of_copy": TARGET_FRACTION,
            "from_bytes": TARGET_MIN_BYTES,
            "faster_than_cupy": True,
        },
        "rows": rows,
        "rows_missing_targets": len(missed),
    }
    path = args.out / "bench_kernels.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
