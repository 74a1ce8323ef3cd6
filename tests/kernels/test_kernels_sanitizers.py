"""The emulated kernels under AddressSanitizer + UndefinedBehaviorSanitizer
(fiber mode) and ThreadSanitizer (one OS thread per CUDA thread), including a
tensor over 2**31 elements; broken variants prove each sanitizer run would
catch the bug it is there for.

Sanitizer runtimes must be loaded before Python starts, so each run is a
subprocess (kernel_emu_runner.py) with the runtime in LD_PRELOAD.
"""

from __future__ import annotations

import functools

import kernel_emu
import pytest

SMALL_CASES = [
    {"shape": [2, 3, 5, 7], "itemsize": 4, "to_channels_last": False, "order": "random", "seed": 1},
    {"shape": [2, 3, 5, 7], "itemsize": 1, "to_channels_last": True, "order": "reverse"},
    {"shape": [1, 70, 3, 9], "itemsize": 2, "to_channels_last": False, "box": [[0, 3, 1, 2], [1, 60, 2, 7]]},
    {
        "shape": [1, 40, 3, 5, 7],
        "itemsize": 8,
        "to_channels_last": True,
        "box": [[0, 3, 1, 0, 2], [1, 30, 2, 5, 4]],
        "grid_limit": [1, 1, 2],
    },
    {"shape": [1, 2048, 2, 3], "itemsize": 4, "to_channels_last": True, "order": "random"},
]

# 64 * 32768 * 1040 = 2_181_038_080 elements > 2**31; 1 byte each, reserved
# but never committed except where the last blocks touch it.
HUGE_SHAPE = [1, 64, 32768, 1040]
HUGE_CASES = [
    {"huge": True, "shape": HUGE_SHAPE, "itemsize": 1, "to_channels_last": False, "nblocks": 3},
    {"huge": True, "shape": HUGE_SHAPE, "itemsize": 1, "to_channels_last": True, "nblocks": 3},
]


@functools.cache
def _runtime_missing(sanitize: str) -> str | None:
    if kernel_emu.gxx() is None:
        return "g++ not found on PATH"
    try:
        kernel_emu.sanitizer_runtime(sanitize)
    except FileNotFoundError as exc:
        return f"sanitizer runtime missing: {exc}"
    return None


def _run(emu_builds, variant: kernel_emu.Variant, cases: list[dict]):
    assert variant.sanitize is not None
    reason = _runtime_missing(variant.sanitize)
    if reason:
        pytest.skip(reason)
    proc = kernel_emu.run_sanitized(emu_builds.path(variant), variant.sanitize, cases)
    # A runtime that cannot start on this kernel's memory layout is a missing
    # tool, not a finding.
    for fatal in _STARTUP_FAILURES:
        if fatal in proc.stderr:
            pytest.skip(f"{variant.sanitize} sanitizer cannot start here: {fatal}")
    return proc


_STARTUP_FAILURES = (
    "ThreadSanitizer: unexpected memory mapping",
    "Shadow memory range interleaves with an existing memory mapping",
    "ASan runtime does not come first in initial library list",
)


def _explain(proc) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"


# ---- AddressSanitizer + UndefinedBehaviorSanitizer ----------------------------


def test_asan_ubsan_clean(emu_builds) -> None:
    proc = _run(emu_builds, kernel_emu.ASAN, SMALL_CASES + HUGE_CASES)
    assert proc.returncode == 0, _explain(proc)
    assert "ERROR: AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr
    tops = [int(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("huge ok")]
    assert len(tops) == 2 and min(tops) >= 2**31, proc.stdout


def test_asan_catches_missing_bounds_check(emu_builds) -> None:
    proc = _run(emu_builds, kernel_emu.ASAN_BROKEN_BOUNDS, SMALL_CASES[:1])
    assert proc.returncode != 0, _explain(proc)
    assert "AddressSanitizer: heap-buffer-overflow" in proc.stderr, _explain(proc)


def test_ubsan_catches_32bit_indexing(emu_builds) -> None:
    # The same huge case with int offsets: signed overflow (UBSan) before the
    # wild access (ASan) happens.
    proc = _run(emu_builds, kernel_emu.ASAN_BROKEN_INDEX32, HUGE_CASES[:1])
    assert proc.returncode != 0, _explain(proc)
    assert "signed integer overflow" in proc.stderr or "cannot be represented" in proc.stderr, _explain(proc)


# ---- ThreadSanitizer -----------------------------------------------------------


def test_tsan_clean(emu_builds) -> None:
    proc = _run(emu_builds, kernel_emu.TSAN, SMALL_CASES[:4])
    assert proc.returncode == 0, _explain(proc)
    assert "ThreadSanitizer" not in proc.stderr, _explain(proc)


def test_tsan_catches_missing_syncthreads(emu_builds) -> None:
    proc = _run(emu_builds, kernel_emu.TSAN_BROKEN_SYNC, SMALL_CASES[:1])
    assert proc.returncode != 0, _explain(proc)
    assert "ThreadSanitizer: data race" in proc.stderr, _explain(proc)


def test_os_thread_mode_catches_barrier_divergence(emu_builds) -> None:
    proc = _run(emu_builds, kernel_emu.TSAN_BROKEN_DIVERGENCE, SMALL_CASES[:1])
    assert proc.returncode == 11, _explain(proc)  # the runner's "emulator error"
    assert "barrier divergence" in proc.stderr, _explain(proc)
