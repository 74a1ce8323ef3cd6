"""Content-hash candidates for incremental checkpoints (issue 19), measured on this machine.

Every candidate gives 128 bits or more. Each is timed on random chunks of
4 KiB, 64 KiB, 1 MiB and 64 MiB (never zeros: some hashes have fast paths or
the page allocator hands out shared zero pages) against two baselines
measured in the same run on the same buffer:

* a memcpy (``np.copyto`` into a second buffer of the same size), the cost
  of touching every byte once;
* the CRC32C every save already computes (:func:`gpuckpt.format.checksum.crc32c`).

Columns: ``1T GB/s`` one thread on one buffer; ``2T GB/s`` two threads each
hashing its own buffer at once (what two I/O threads of a save do; meaningful
only where the library releases the GIL), or for BLAKE3 with
``max_threads=2`` one buffer hashed by two threads inside the library;
``/memcpy`` and ``/crc`` are the single-thread time relative to the baseline's
time (1.0 = as costly as a memcpy / as the CRC; larger is slower).

A candidate whose library is not installed is skipped, not an error.
``--out FILE`` appends the run to a Markdown file (date, ``nproc``, CPU model).

Run: ``python bench/bench_hashes.py [--sizes 4K,64K,1M,64M] [--out bench/runs/RESULTS-hashes.md]``
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib.metadata
import os
import platform
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuckpt.format.checksum import crc32c, crc32c_backend

Fn = Callable[[Any], object]

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(text[:-1]) * _UNITS[text[-1]]
    return int(text)


def label(n: int) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}iB"
    return f"{n} B"


def candidates() -> tuple[dict[str, Fn], dict[str, Fn], list[str]]:
    """``(single-thread functions, in-library two-thread functions, skipped notes)``."""
    single: dict[str, Fn] = {}
    multi: dict[str, Fn] = {}
    skipped: list[str] = []
    try:
        import blake3

        single["blake3 (256 bit)"] = lambda b: blake3.blake3(b).digest()
        multi["blake3 (256 bit)"] = lambda b: blake3.blake3(b, max_threads=2).digest()
    except ImportError:
        skipped.append("blake3: not installed (pip install blake3)")
    try:
        import xxhash

        single["xxh3_128"] = xxhash.xxh3_128_digest
    except ImportError:
        skipped.append("xxh3_128: not installed (pip install xxhash)")
    single["blake2b-128 (hashlib)"] = lambda b: hashlib.blake2b(b, digest_size=16).digest()
    single["blake2s-128 (hashlib)"] = lambda b: hashlib.blake2s(b, digest_size=16).digest()
    single["md5 (hashlib)"] = lambda b: hashlib.md5(b).digest()
    single["sha1 (hashlib, 160 bit)"] = lambda b: hashlib.sha1(b).digest()
    single["sha256 (hashlib)"] = lambda b: hashlib.sha256(b).digest()
    single["sha512 (hashlib)"] = lambda b: hashlib.sha512(b).digest()
    single["sha3_256 (hashlib)"] = lambda b: hashlib.sha3_256(b).digest()
    return single, multi, skipped


def best_time(fn: Callable[[], object], nbytes: int, budget_s: float) -> float:
    """Best seconds per call of ``fn``, over repeats that each take >= ~budget_s/5."""
    fn()  # warm: page faults, lazy initialisation, CPU features
    reps = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        dt = time.perf_counter() - t0
        if dt >= budget_s / 5 or reps >= 1 << 20:
            break
        reps *= 4
    best = dt / reps
    for _ in range(4):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def two_threads(fn: Fn, bufs: list[np.ndarray], reps: int) -> float:
    """Seconds for two threads to call ``fn`` ``reps`` times each, each on its own buffer."""
    barrier = threading.Barrier(3)

    def work(b: np.ndarray) -> None:
        barrier.wait()
        for _ in range(reps):
            fn(b)

    ts = [threading.Thread(target=work, args=(b,)) for b in bufs]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def best_two_threads(fn: Fn, bufs: list[np.ndarray], single_s: float, budget_s: float) -> float:
    """Best aggregate seconds per buffer when two threads hash two buffers at once."""
    reps = max(1, int(budget_s / 5 / max(single_s, 1e-9)))
    best = float("inf")
    for _ in range(3):
        best = min(best, two_threads(fn, bufs, reps) / (2 * reps))
    return best


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(sizes: list[int], budget_s: float) -> tuple[list[str], list[str]]:
    """Measure; returns the table lines and notes."""
    single, multi, skipped = candidates()
    rng = np.random.default_rng(19)
    gbs = lambda n, s: n / s / 1e9  # noqa: E731
    lines = [
        "| chunk | hash | 1T GB/s | 2T GB/s | /memcpy | /crc32c |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for n in sizes:
        a = rng.integers(0, 256, n, dtype=np.uint8)
        b = rng.integers(0, 256, n, dtype=np.uint8)
        assert a.any() and b.any()
        dst = np.empty_like(a)
        dst2 = np.empty_like(b)
        t_copy = best_time(lambda: np.copyto(dst, a), n, budget_s)
        t_copy2 = best_two_threads(
            lambda src: np.copyto(dst if src is a else dst2, src), [a, b], t_copy, budget_s
        )
        t_crc = best_time(lambda: crc32c(a), n, budget_s)
        t_crc2 = best_two_threads(crc32c, [a, b], t_crc, budget_s)
        lines.append(
            f"| {label(n)} | memcpy (np.copyto) | {gbs(n, t_copy):.2f} | {gbs(n, t_copy2):.2f} | 1.00 | "
            f"{t_copy / t_crc:.2f} |"
        )
        lines.append(
            f"| {label(n)} | crc32c ({crc32c_backend()}, 32 bit, baseline) | {gbs(n, t_crc):.2f} | "
            f"{gbs(n, t_crc2):.2f} | {t_crc / t_copy:.2f} | 1.00 |"
        )
        for name, fn in single.items():
            t1 = best_time(lambda fn=fn: fn(a), n, budget_s)
            if name in multi:
                t2 = best_time(lambda name=name: multi[name](a), n, budget_s)
                two = f"{gbs(n, t2):.2f} (max_threads=2)"
            else:
                two = f"{gbs(n, best_two_threads(fn, [a, b], t1, budget_s)):.2f}"
            lines.append(
                f"| {label(n)} | {name} | {gbs(n, t1):.2f} | {two} | {t1 / t_copy:.2f} | {t1 / t_crc:.2f} |"
            )
        print("\n".join(lines[-(len(single) + 2) :]), flush=True)
    return lines, skipped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4K,64K,1M,64M", help="chunk sizes, comma-separated (4K, 1M, ...)")
    p.add_argument("--budget", type=float, default=0.5, help="seconds of measurement per cell (about)")
    p.add_argument("--out", help="append the run to this Markdown file")
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(f"{cpu_model()}, nproc {os.cpu_count()}, crc32c backend {crc32c_backend()}", flush=True)
    lines, skipped = run(sizes, args.budget)
    for s in skipped:
        print("skipped:", s)
    if args.out:
        versions = []
        for dist in ("blake3", "xxhash"):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                versions.append(f"{dist} {importlib.metadata.version(dist)}")
        head = [
            f"## {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
            "",
            f"- machine: `nproc` {len(os.sched_getaffinity(0))}, CPU {cpu_model()}, "
            f"Python {platform.python_version()}, numpy {np.__version__}, "
            f"{', '.join(versions) or 'no optional hash libraries'}, CRC32C by {crc32c_backend()}",
            f"- command: `python bench/bench_hashes.py --sizes {args.sizes} --budget {args.budget}`",
            *(f"- skipped: {s}" for s in skipped),
            "",
        ]
        with open(args.out, "a") as f:
            f.write("\n".join(head + lines) + "\n\n")


if __name__ == "__main__":
    main()
