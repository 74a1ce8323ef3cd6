"""Bandwidth of the channels-last kernels on a GPU.

Usage::

    python bench/bench_kernels.py --out DIR [--quick] [--repeat N] [--budget-s S] [--strict]

The table is the issue's target matrix: C = 3, 4, 64 and 256 channels,
element sizes 1, 2, 4 and 8 bytes (uint8, float16, float32, float64), 4-D
``(N, C, H, W)`` and 5-D ``(N, C, D, H, W)`` tensors of 1, 16 and 256 MiB, in
both directions.  Main rows have planes (H*W or D*H*W) that are multiples of
16 positions, as image and video sizes usually are; a group of odd-sized rows
(every plane size odd) shows the fallbacks, and box rows show chunk
extraction (the middle half of H and W; a channel slab; a slab of rows).

For each row it measures

* the kernels' bandwidth, counting the bytes read plus the bytes written, as a
  fraction of a device-to-device copy measured in the same run;
* the speed-up over CuPy on the same view: ``cupy.ascontiguousarray`` of the
  channels-last view (to logical order), and CuPy's copy into the
  channels-last view (``view[...] = block``) for the other direction.

Each row records the kernel path the planner chose (pixel for C <= 8, micro
for whole 16-byte groups of channels, tiled otherwise).

Targets (issue 23): every row of 16 MiB or more at >= 80 % of the copy
bandwidth, and every row of 1 MiB or more no slower than CuPy.  Data is drawn
at random (never zeros) and every result is checked against CuPy before it
is timed.  The figures are printed as a table and written to
``DIR/bench_kernels.json``; ``--strict`` makes a missed target exit with
status 1.  ``--budget-s`` stops adding rows when the time is spent (the rows
left out are listed).  Without CuPy or a GPU the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]

MIB = 1 << 20
CHANNELS = (3, 4, 64, 256)
SIZES_MIB = (1, 16, 256)
QUICK_SIZES_MIB = (1, 16)
DTYPES = ("uint8", "float16", "float32", "float64")
QUICK_DTYPES = ("uint8", "float32")
TARGET_FRACTION = 0.80
TARGET_MIN_BYTES = 16 * MIB
CUPY_MIN_BYTES = 1 * MIB


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
    so that short kernels are not lost in event resolution; a launch-bound
    call is then timed at the rate a loop of such calls reaches.
    """
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def span(iters: int) -> float:
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return float(cupy.cuda.get_elapsed_time(start, end)) / 1e3

    for _ in range(3):  # warm-up: compilation, memory pool
        fn()
    iters = 1
    while (elapsed := span(iters)) < min_span_s and iters < 1 << 16:
        iters = max(iters * 2, int(iters * min_span_s / max(elapsed, 1e-7)))
    return statistics.median(span(iters) / iters for _ in range(repeat))


def copy_bandwidth(cupy: Any, nbytes: int, repeat: int) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    src = cupy.random.randint(0, 256, size=nbytes // 8, dtype=cupy.int64)
    dst = cupy.empty_like(src)
    seconds = gpu_time(cupy, lambda: dst.data.copy_from_device_async(src.data, src.nbytes), repeat)
    return 2 * src.nbytes / seconds


def shape_for(channels: int, itemsize: int, nbytes: int, ndim: int, *, odd: bool = False) -> tuple[int, ...]:
    """A logical shape of at least ``nbytes`` (and close to it): near-square
    H x W, a batch of 8 (2 with a depth of 8 for 5-D) when there are enough
    positions.  Planes (the spatial sizes' product) are multiples of 16
    positions, as image and video sizes usually are, or odd with ``odd``."""
    positions = -(-nbytes // (channels * itemsize))
    n = 8 if positions >= 8 * 256 else 1
    depth = 1
    if ndim == 5:
        n, depth = (2, 8) if positions >= 16 * 256 else (1, 1)
    hw = -(-positions // (n * depth))
    h = max(1, math.isqrt(hw))
    w = -(-hw // h)
    if odd:
        h, w, depth = h | 1, w | 1, depth | 1
    elif hw >= 16:
        w = -(-w // 16) * 16
    return (n, channels, h, w) if ndim == 4 else (n, channels, depth, h, w)


def random_channels_last(cupy: Any, pool: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """A channels-last view over the start of ``pool`` (random bytes)."""
    n, c, *spatial = shape
    nbytes = math.prod(shape) * cupy.dtype(dtype).itemsize
    physical = pool[:nbytes].view(dtype).reshape(n, *spatial, c)
    return physical.transpose(0, len(shape) - 1, *range(1, len(shape) - 1))


def _same_bytes(cupy: Any, a: Any, b: Any) -> bool:
    a = cupy.ascontiguousarray(a)
    b = cupy.ascontiguousarray(b)
    return a.shape == b.shape and bool(cupy.array_equal(a.view(cupy.uint8), b.view(cupy.uint8)))


def bench_case(
    cupy: Any,
    kernels: Any,
    pool: Any,
    shape: tuple[int, ...],
    dtype: str,
    box: Any,
    repeat: int,
    copy_bw: float,
    group: str,
) -> list[dict[str, Any]]:
    """Both directions of one shape, dtype and box; checked, then timed."""
    src = random_channels_last(cupy, pool, shape, dtype)
    offsets, sizes = kernels.normalize_box(box, shape)
    sl = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    view = src[sl]
    out = cupy.empty(sizes, dtype=dtype)

    # Correctness first: a benchmark of a wrong result is worthless.
    kernels.channels_last_to_contiguous(src, out, box=box)
    if not _same_bytes(cupy, out, view):
        raise AssertionError(f"channels_last_to_contiguous gave a wrong result for {shape} {dtype} box {box}")
    physical = cupy.zeros((shape[0], *shape[2:], shape[1]), dtype=dtype)
    target = physical.transpose(0, len(shape) - 1, *range(1, len(shape) - 1))
    kernels.contiguous_to_channels_last(out, target, box=box)
    tview = target[sl]
    if not _same_bytes(cupy, tview, view):
        raise AssertionError(f"contiguous_to_channels_last gave a wrong result for {shape} {dtype} box {box}")

    plan = kernels.plan_box_copy(shape, offsets, sizes, cupy.dtype(dtype).itemsize)
    moved = 2 * out.nbytes  # bytes read + bytes written
    rows = []
    for direction, ours, theirs, baseline in (
        (
            "to_contiguous",
            lambda: kernels.channels_last_to_contiguous(src, out, box=box),
            lambda: cupy.ascontiguousarray(view),
            "cupy.ascontiguousarray(view)",
        ),
        (
            "to_channels_last",
            lambda: kernels.contiguous_to_channels_last(out, target, box=box),
            lambda: tview.__setitem__(Ellipsis, out),
            "view[...] = block",
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
                "group": group,
                "path": plan.path,
                "bytes": out.nbytes,
                "MiB": out.nbytes / MIB,
                "ours_s": t_ours,
                "cupy_s": t_cupy,
                "GBps": bw / 1e9,
                "cupy_GBps": moved / t_cupy / 1e9,
                "cupy_baseline": baseline,
                "fraction_of_copy": bw / copy_bw,
                "percent_of_copy": 100 * bw / copy_bw,
                "speedup_vs_cupy": t_cupy / t_ours,
            }
        )
    return rows


def check_targets(row: dict[str, Any]) -> list[str]:
    """The issue's targets a row misses (empty when it meets them)."""
    missed = []
    if row["bytes"] >= TARGET_MIN_BYTES and row["fraction_of_copy"] < TARGET_FRACTION:
        missed.append(f"<{TARGET_FRACTION:.0%} of copy")
    if row["bytes"] >= CUPY_MIN_BYTES and row["speedup_vs_cupy"] < 1.0:
        missed.append("slower than CuPy")
    return missed


def cases(quick: bool) -> Iterator[tuple[tuple[int, ...], str, Any, str]]:
    """(shape, dtype, box, group) of every row, main matrix first."""
    sizes = QUICK_SIZES_MIB if quick else SIZES_MIB
    dtypes = QUICK_DTYPES if quick else DTYPES
    itemsize = {"uint8": 1, "float16": 2, "float32": 4, "float64": 8}
    for mib in sizes:
        for channels in CHANNELS:
            for dtype in dtypes:
                for ndim in (4, 5):
                    yield shape_for(channels, itemsize[dtype], mib * MIB, ndim), dtype, None, "main"
    # Odd plane sizes: the narrower access units and element-wise fallbacks.
    for channels in (3, 4, 64):
        for dtype in dtypes:
            yield shape_for(channels, itemsize[dtype], 64 * MIB, 4, odd=True), dtype, None, "odd"
    # Chunk extraction.
    for channels in (3, 64):
        n, c, h, w = shape_for(channels, 4, 256 * MIB, 4)
        yield (n, c, h, w), "float32", ((0, 0, h // 4, w // 4), (n, c, max(1, h // 2), max(1, w // 2))), "box"
    n, c, h, w = shape_for(3, 2, 256 * MIB, 4)
    yield (n, c, h, w), "float16", ((0, 1, 0, 0), (n, 1, h, w)), "box"  # a channel slab
    yield (n, c, h, w), "float16", ((0, 0, h // 3, 0), (n, c, h // 3, w)), "box"  # a slab of rows


def print_table(rows: list[dict[str, Any]], copy_bw: float) -> None:
    print(f"device-to-device copy: {copy_bw / 1e9:8.1f} GB/s (read + write)")
    header = (
        f"{'direction':<17}{'dtype':<9}{'shape':<24}{'box':<5}{'path':<7}{'MiB':>8}"
        f"{'GB/s':>9}{'%copy':>7}{'CuPy GB/s':>11}{'speedup':>9}  missed"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['direction']:<17}{r['dtype']:<9}{'x'.join(map(str, r['shape'])):<24}"
            f"{'yes' if r['box'] else '':<5}{r['path']:<7}{r['MiB']:>8.1f}{r['GBps']:>9.1f}"
            f"{r['fraction_of_copy']:>7.0%}{r['cupy_GBps']:>11.1f}{r['speedup_vs_cupy']:>9.2f}"
            f"  {', '.join(r['missed'])}"
        )


def hash_vs_d2h(cupy: Any, nbytes: int, chunk: int, repeat: int) -> dict[str, Any]:
    """Content hashing on the device (``kernels/xxh3_tree.cu``, what an incremental save does
    before staging) against copying the same bytes to pinned host memory (what it avoids for
    an unchanged chunk); the first chunk's digest is checked against the host library's."""
    from gpuckpt.device.hashing import hash_device_chunks
    from gpuckpt.format import contenthash

    src = cupy.random.randint(0, 256, size=nbytes, dtype=cupy.uint8)
    chunks = [(o, min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)]
    hash_device_chunks(src, chunks)  # compile, warm
    hash_s = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        digests = hash_device_chunks(src, chunks)  # returns once the digests are on the host
        hash_s.append(time.perf_counter() - t0)
    host = cupy.cuda.alloc_pinned_memory(nbytes)
    dest = np.frombuffer(host, np.uint8, nbytes)
    stream = cupy.cuda.Stream(non_blocking=True)
    d2h_s = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        src.data.copy_to_host_async(dest.ctypes.data, nbytes, stream)
        stream.synchronize()
        d2h_s.append(time.perf_counter() - t0)
    first = bytes(dest[: chunks[0][1]])
    matches = contenthash.available() and digests[0][0] == contenthash.chunk_hash([first])
    hs, ds = statistics.median(hash_s), statistics.median(d2h_s)
    return {
        "bytes": nbytes,
        "chunk_bytes": chunk,
        "hash_s": hs,
        "d2h_pinned_s": ds,
        "hash_GBps": nbytes / hs / 1e9,
        "d2h_GBps": nbytes / ds / 1e9,
        "hash_over_d2h_time": hs / ds,
        "first_digest_matches_host": bool(matches),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for bench_kernels.json")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and dtypes")
    parser.add_argument("--repeat", type=int, default=5, help="timed batches per measurement")
    parser.add_argument("--budget-s", type=float, default=None, help="stop adding rows after this long")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)

    cupy, reason = _gpu_or_reason()
    if cupy is None:
        print(f"bench_kernels: nothing to measure: {reason}")
        return 0
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from gpuckpt.device import kernels

    t_start = time.perf_counter()
    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    compile_s = {}
    for part in ("tiled", "micro", "px1", "px2", "px4", "px8"):
        t0 = time.perf_counter()
        kernels.load_module(part=part)
        compile_s[part] = time.perf_counter() - t0

    copy_bw = copy_bandwidth(cupy, 1 << 30, args.repeat)
    # the same copy of a row's size, timed the same way: where a loop of launches, not the
    # device's bandwidth, bounds a row (a row moves its bytes in and out, as the copy does)
    copy_by_mib = {mib: copy_bandwidth(cupy, mib * MIB, args.repeat) / 1e9 for mib in (1, 16)}
    all_cases = list(cases(args.quick))
    largest = max(math.prod(s) * cupy.dtype(d).itemsize for s, d, _, _ in all_cases)
    pool = cupy.random.randint(0, 256, size=largest, dtype=cupy.uint8)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for shape, dtype, box, group in all_cases:
        if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            skipped.append({"shape": list(shape), "dtype": dtype, "box": box, "group": group})
            continue
        rows += bench_case(cupy, kernels, pool, shape, dtype, box, args.repeat, copy_bw, group)
        cupy.get_default_memory_pool().free_all_blocks()  # keep the footprint flat
    for row in rows:
        row["missed"] = check_targets(row)

    print_table(rows, copy_bw)
    try:  # never costs the kernel table above
        hashing: dict[str, Any] = hash_vs_d2h(cupy, 1 << 30, 64 << 20, args.repeat)
        print(
            f"\ncontent hash on the device: {hashing['hash_GBps']:.1f} GB/s, D2H to pinned memory "
            f"{hashing['d2h_GBps']:.1f} GB/s (hash time / copy time {hashing['hash_over_d2h_time']:.2f}); "
            f"digest equals the host library's: {hashing['first_digest_matches_host']}"
        )
    except Exception as exc:
        hashing = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"\ncontent hash on the device: not measured ({hashing['error']})")
    missed = [r for r in rows if r["missed"]]
    print(
        f"\ntargets met on {len(rows) - len(missed)} of {len(rows)} rows"
        f" ({len(skipped)} rows left out by the time budget); "
        f"compile took {sum(compile_s.values()):.2f} s"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "cupy": cupy.__version__,
        "copy_GBps": copy_bw / 1e9,
        "copy_GBps_by_MiB": copy_by_mib,
        "compile_s": compile_s,
        "targets": {
            "fraction_of_copy": TARGET_FRACTION,
            "from_bytes": TARGET_MIN_BYTES,
            "not_slower_than_cupy_from_bytes": CUPY_MIN_BYTES,
        },
        "rows": rows,
        "hash_vs_d2h": hashing,
        "rows_missing_targets": len(missed),
        "rows_skipped": skipped,
        "wall_s": time.perf_counter() - t_start,
    }
    path = args.out / "bench_kernels.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
