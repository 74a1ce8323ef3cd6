"""The batched device-to-device copy (``kernels/batched_copy.cu``) run on the CPU.

Built with the CUDA emulation header (``kernels/emu/cuda_emu.h``), once plain and
once with AddressSanitizer and UBSan (which checks the 16-byte vector accesses'
alignment), and launched over tables from :meth:`gpuckpt.device.packing.Packing.pieces`
with real host addresses: every byte arrives, nothing outside the pieces is written,
in every block order and with fewer blocks than pieces.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import kernel_emu
import numpy as np
import pytest

from gpuckpt.device.batched_copy import THREADS
from gpuckpt.device.kernel_source import kernel_source_dir
from gpuckpt.device.packing import plan_packing

GUARD = 256


def _build(tmp_path_factory: pytest.TempPathFactory, sanitize: str | None) -> Path:
    compiler = kernel_emu.gxx()
    if compiler is None:
        pytest.skip("g++ not found")
    out = tmp_path_factory.mktemp("bc") / f"libbc{'_' + sanitize.replace(',', '_') if sanitize else ''}.so"
    cmd = [compiler, "-std=c++20", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas"]
    if sanitize:
        cmd += ["-O0", "-g", f"-fsanitize={sanitize}", "-fno-sanitize-recover=all"]
    else:
        cmd.append("-O2")
    cmd += [str(kernel_source_dir() / "emu" / "emu_batched_copy.cpp"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def plain_lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_build(tmp_path_factory, None)))
    lib.gpuckpt_emu_batched_copy.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_longlong]
    lib.gpuckpt_emu_set_order.argtypes = [ctypes.c_int, ctypes.c_ulonglong]
    return lib


def _run(lib: ctypes.CDLL, sizes: list[int], offsets: list[int], blocks: int, order: int) -> None:
    """Arrays of ``sizes`` bytes at ``offsets`` within separate buffers, packed and copied."""
    rng = np.random.default_rng(sum(sizes) + order)
    sources = []
    for size, off in zip(sizes, offsets, strict=True):
        buf = rng.integers(0, 256, size + off + GUARD, dtype=np.uint8)
        sources.append((buf, off, size))
    plan = plan_packing([(buf.ctypes.data + off, size) for buf, off, size in sources])
    arena = np.zeros(plan.total + 2 * GUARD + 16, np.uint8)
    base = arena.ctypes.data + GUARD
    base += -base % 256  # the device arena is 256-byte aligned
    lead = base - arena.ctypes.data
    pieces = plan.pieces(base, piece_bytes=4096, runs=plan.runs)  # every run, batched or not
    table = np.asarray(pieces, dtype=np.uint64).reshape(-1)
    assert lib.gpuckpt_emu_set_order(order, 7) == 0
    rc = lib.gpuckpt_emu_batched_copy(blocks or len(pieces), THREADS, table.ctypes.data, len(pieces))
    assert rc == 0
    for (buf, off, size), place in zip(sources, plan.places, strict=True):
        got = arena[lead + place : lead + place + size]
        assert got.tobytes() == buf[off : off + size].tobytes(), (size, off)
    written = np.zeros(arena.size, bool)
    for r in plan.runs:
        written[lead + r.offset : lead + r.offset + r.nbytes] = True
    assert not arena[~written].any()  # nothing outside the runs


CASES = [
    ([4096 * 3, 16, 48, 10_000], [0, 0, 0, 0]),  # aligned: 16-byte vectors
    ([1, 7, 4097, 65_537], [3, 1, 5, 9]),  # odd sizes and starts: bytes
    ([100_000, 32, 4096], [16, 32, 8]),  # mixed
]


@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("blocks", [0, 3])  # one block per piece; fewer: blocks loop over pieces
@pytest.mark.parametrize(("sizes", "offsets"), CASES)
def test_batched_copy_emulated(
    plain_lib: ctypes.CDLL, sizes: list[int], offsets: list[int], blocks: int, order: int
) -> None:
    _run(plain_lib, sizes, offsets, blocks, order)


def test_batched_copy_under_sanitizers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """ASan and UBSan: no access outside the buffers, every vector access aligned.
    Run in a child process (the sanitizer runtime must be loaded first)."""
    lib = _build(tmp_path_factory, "address,undefined")
    libasan = subprocess.run(
        [kernel_emu.gxx() or "g++", "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isfile(libasan):
        pytest.skip("libasan not found")
    code = (
        "import ctypes, sys; sys.path[:0] = sys.argv[2:]\n"
        "import test_batched_copy_emu as t\n"
        "lib = ctypes.CDLL(sys.argv[1])\n"
        "lib.gpuckpt_emu_batched_copy.argtypes = "
        "[ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_longlong]\n"
        "lib.gpuckpt_emu_set_order.argtypes = [ctypes.c_int, ctypes.c_ulonglong]\n"
        "for sizes, offsets in t.CASES: t._run(lib, sizes, offsets, 2, 2)\n"
        "print('ok')\n"
    )
    here = Path(__file__).resolve().parent
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS="detect_leaks=0")
    proc = subprocess.run(
        [
            os.environ.get("PYTHON", __import__("sys").executable),
            "-c",
            code,
            str(lib),
            str(here),
            str(here.parents[1]),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_batched_copy_source_includes_nothing() -> None:
    # NVRTC compiles it without standard headers, as it does channels_last.cu
    from gpuckpt.device.batched_copy import batched_copy_source

    source = batched_copy_source()
    assert "gpuckpt_batched_copy" in source
    assert not any(line.lstrip().startswith("#include") for line in source.splitlines())
