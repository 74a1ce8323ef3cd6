"""The emulated kernels, both paths, under AddressSanitizer +
UndefinedBehaviorSanitizer (fiber mode) and ThreadSanitizer (one OS thread per
CUDA thread), including tensors over 2**31 elements; broken variants prove
each sanitizer run would catch the bug it is there for.

Sanitizer runtimes must be loaded before Python starts, so each run is a
subprocess (kernel_emu_runner.py) with the runtime in LD_PRELOAD.
"""

from __future__ import annotations

import functools

import kernel_emu
import pytest

from gpuckpt.device import kernels as K

# Tiled path (more than 8 channels, or forced), pixel path (1 to 8 channels:
# 16-byte units, 4-byte units, element-wise planes, partial channels, partial
# slots at the end of lines).
TILED_CASES = [
    {
        "shape": [2, 3, 5, 7],
        "itemsize": 4,
        "to_channels_last": False,
        "order": "random",
        "seed": 1,
        "path": "tiled",
    },
    {"shape": [2, 3, 5, 7], "itemsize": 1, "to_channels_last": True, "order": "reverse", "path": "tiled"},
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
PIXEL_CASES = [
    {"shape": [2, 3, 45, 46], "itemsize": 1, "to_channels_last": False, "order": "random"},
    {"shape": [2, 3, 45, 46], "itemsize": 1, "to_channels_last": True, "order": "reverse", "misalign": 1},
    {"shape": [1, 8, 9, 31], "itemsize": 8, "to_channels_last": True, "order": "random"},
    {"shape": [2, 4, 7, 17], "itemsize": 2, "to_channels_last": False, "misalign": 2},
    {"shape": [1, 1, 70, 70], "itemsize": 4, "to_channels_last": True, "grid_limit": [1, 1, 1]},
    {
        "shape": [2, 6, 4, 9, 10],
        "itemsize": 4,
        "to_channels_last": False,
        "box": [[1, 2, 1, 0, 0], [1, 3, 2, 9, 10]],
        "order": "random",
    },
    {
        "shape": [2, 6, 4, 9, 10],
        "itemsize": 2,
        "to_channels_last": True,
        "box": [[0, 1, 0, 2, 0], [2, 4, 4, 5, 10]],
    },
]
MICRO_CASES = [
    {"shape": [2, 64, 9, 16], "itemsize": 1, "to_channels_last": False, "order": "random"},
    {"shape": [2, 32, 9, 15], "itemsize": 2, "to_channels_last": True, "order": "reverse"},
    {"shape": [1, 48, 5, 7], "itemsize": 4, "to_channels_last": True, "misalign": 1},
    {
        "shape": [2, 8, 4, 6, 5],
        "itemsize": 8,
        "to_channels_last": False,
        "box": [[0, 2, 1, 0, 0], [2, 4, 2, 6, 5]],
        "path": "micro",
    },
]
SMALL_CASES = TILED_CASES + PIXEL_CASES + MICRO_CASES
# One block each (ThreadSanitizer runs one OS thread per CUDA thread): 16-byte
# units, 4-byte units with a partial slot, some channels element by element,
# a micro-tile.
TSAN_PIXEL_CASES = [
    {"shape": [1, 4, 16, 16], "itemsize": 4, "to_channels_last": False, "order": "random"},
    {"shape": [1, 3, 9, 20], "itemsize": 1, "to_channels_last": True, "misalign": 4},
    {"shape": [1, 3, 5, 9], "itemsize": 2, "to_channels_last": True, "box": [[0, 1, 0, 0], [1, 2, 5, 9]]},
    {"shape": [1, 32, 4, 9], "itemsize": 4, "to_channels_last": True},  # the micro-tile path
]

# 64 * 32768 * 1040 = 2_181_038_080 elements > 2**31 (tiled and micro-tile
# paths), and 3 * 32768 * 24000 = 2_359_296_000 (pixel path); 1 byte each,
# reserved but never committed except where the last blocks touch it.
HUGE_SHAPE = [1, 64, 32768, 1040]
HUGE_PIXEL_SHAPE = [1, 3, 32768, 24000]
HUGE_CASES = [
    {
        "huge": True,
        "shape": HUGE_SHAPE,
        "itemsize": 1,
        "to_channels_last": False,
        "nblocks": 3,
        "path": "tiled",
    },
    {
        "huge": True,
        "shape": HUGE_SHAPE,
        "itemsize": 1,
        "to_channels_last": True,
        "nblocks": 3,
        "path": "tiled",
    },
    {"huge": True, "shape": HUGE_PIXEL_SHAPE, "itemsize": 1, "to_channels_last": False, "nblocks": 2},
    {"huge": True, "shape": HUGE_PIXEL_SHAPE, "itemsize": 1, "to_channels_last": True, "nblocks": 2},
    {"huge": True, "shape": HUGE_SHAPE, "itemsize": 1, "to_channels_last": False, "nblocks": 1},
    {"huge": True, "shape": HUGE_SHAPE, "itemsize": 1, "to_channels_last": True, "nblocks": 1},
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
    assert len(tops) == 6 and min(tops) >= 2**31, proc.stdout


# A source read past its end: the buffers the runner allocates for sources
# have no slack, so ASan sees the first element beyond them.
BOUNDS_CASES = {
    "tiled": {"shape": [2, 13, 5, 7], "itemsize": 4, "to_channels_last": False},
    "pixel": {"shape": [2, 3, 5, 7], "itemsize": 4, "to_channels_last": False},
    "micro": {"shape": [2, 16, 5, 7], "itemsize": 4, "to_channels_last": False},
}


@pytest.mark.parametrize("path", sorted(BOUNDS_CASES))
def test_asan_catches_missing_bounds_check(emu_builds, path: str) -> None:
    case = BOUNDS_CASES[path]
    assert K.choose_path(case["shape"], case["shape"], case["itemsize"]) == path
    proc = _run(emu_builds, kernel_emu.ASAN_BROKEN_BOUNDS, [case])
    assert proc.returncode != 0, _explain(proc)
    # heap-buffer-overflow, or heap-use-after-free where the stray access
    # lands past the redzone in a freed block, or SEGV where it lands past the
    # heap's mapped pages (as it did once in 2026-12 runs): in the kernel.
    found = ("SUMMARY: AddressSanitizer: heap-", "SUMMARY: AddressSanitizer: SEGV")
    summary = [line for line in proc.stderr.splitlines() if line.startswith(found)]
    assert summary and "channels_last.cu" in summary[0], _explain(proc)


@pytest.mark.parametrize(
    "case", [HUGE_CASES[0], HUGE_CASES[2], HUGE_CASES[4]], ids=["tiled", "pixel", "micro"]
)
def test_ubsan_catches_32bit_indexing(emu_builds, case: dict) -> None:
    # The huge cases with int offsets: signed overflow (UBSan) before the
    # wild access (ASan) happens.
    proc = _run(emu_builds, kernel_emu.ASAN_BROKEN_INDEX32, [case])
    assert proc.returncode != 0, _explain(proc)
    assert "signed integer overflow" in proc.stderr or "cannot be represented" in proc.stderr, _explain(proc)


ALIGN_CASES = {
    "pixel": {"shape": [1, 3, 16, 16], "itemsize": 2, "to_channels_last": True, "misalign": 1},
    "micro": {"shape": [1, 16, 8, 8], "itemsize": 4, "to_channels_last": False, "misalign": 1},
}


@pytest.mark.parametrize("path", sorted(ALIGN_CASES))
def test_ubsan_catches_misaligned_vector_access(emu_builds, path: str) -> None:
    # The pixel and micro-tile paths assuming 16-byte alignment
    # (the mutant "align") on buffers one element off it: UBSan's alignment
    # check fires on the first vector access, as the GPU would fault.
    case = ALIGN_CASES[path]
    assert K.choose_path(case["shape"], case["shape"], case["itemsize"]) == path
    proc = _run(emu_builds, kernel_emu.ASAN_BROKEN_ALIGN, [case])
    assert proc.returncode != 0, _explain(proc)
    assert "misaligned address" in proc.stderr and "channels_last.cu" in proc.stderr, _explain(proc)
    # The same build on aligned buffers is correct: only the assumption broke.
    proc = _run(emu_builds, kernel_emu.ASAN_BROKEN_ALIGN, [{**case, "misalign": 0}])
    assert proc.returncode == 0, _explain(proc)


# ---- ThreadSanitizer -----------------------------------------------------------


def test_tsan_clean(emu_builds) -> None:
    # One OS thread per CUDA thread: small grids only.
    proc = _run(emu_builds, kernel_emu.TSAN, TILED_CASES[:4] + TSAN_PIXEL_CASES)
    assert proc.returncode == 0, _explain(proc)
    assert "ThreadSanitizer" not in proc.stderr, _explain(proc)


def test_tsan_catches_missing_syncthreads(emu_builds) -> None:
    proc = _run(emu_builds, kernel_emu.TSAN_BROKEN_SYNC, TILED_CASES[:1])
    assert proc.returncode != 0, _explain(proc)
    assert "ThreadSanitizer: data race" in proc.stderr, _explain(proc)


@pytest.mark.parametrize(
    "case",
    [
        {"shape": [1, 3, 16, 16], "itemsize": 4, "to_channels_last": False},
        {"shape": [1, 32, 8, 8], "itemsize": 4, "to_channels_last": False},
    ],
    ids=["pixel", "micro"],
)
def test_tsan_catches_colliding_slots(emu_builds, case: dict) -> None:
    # The pixel and micro-tile paths have no shared memory; their threads must
    # still never write the same element.  Pairs of threads owning the same
    # slots race.
    proc = _run(emu_builds, kernel_emu.TSAN_BROKEN_PX_SLOTS, [case])
    assert proc.returncode != 0, _explain(proc)
    assert "ThreadSanitizer: data race" in proc.stderr, _explain(proc)


def test_os_thread_mode_catches_barrier_divergence(emu_builds) -> None:
    proc = _run(emu_builds, kernel_emu.TSAN_BROKEN_DIVERGENCE, TILED_CASES[:1])
    assert proc.returncode == 11, _explain(proc)  # the runner's "emulator error"
    assert "barrier divergence" in proc.stderr, _explain(proc)
