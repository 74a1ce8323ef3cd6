"""The device hash kernel (kernels/xxh3_tree.cu), run on the CPU through the emulation header and
compared with the ``xxhash`` library: every XXH3 size class (0, 1-240 byte by byte, long inputs
around the 1 KiB block and the 1 MiB leaf), misaligned inputs, and whole chunks of several MiB
against :func:`gpuckpt.format.contenthash.chunk_hash`."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gpuckpt.device import hashing
from gpuckpt.device.hashing import leaf_plan
from gpuckpt.format.contenthash import LEAF, chunk_hash

xxhash = pytest.importorskip("xxhash")

ROOT = Path(__file__).resolve().parents[2]
U64P = ctypes.POINTER(ctypes.c_uint64)


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found on PATH: the CPU emulation of the kernels cannot be built")
    out = tmp_path_factory.mktemp("xxh3emu") / "libxxh3emu.so"
    subprocess.run(
        [gxx, "-std=c++20", "-O2", "-Wall", "-Werror", "-fPIC", "-shared",
         str(ROOT / "kernels/emu/xxh3_driver.cpp"), "-o", str(out)],
        check=True, timeout=300,
    )  # fmt: skip
    return ctypes.CDLL(str(out))


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def run_tree(lib: ctypes.CDLL, buf: np.ndarray, chunks: list[tuple[int, int]], threads: int = 32):
    """(root digests, leaf digests) of ``chunks`` of ``buf`` from the emulated kernels."""
    plan = leaf_plan(chunks)
    leaves = np.zeros(16 * len(plan.offsets), np.uint8)
    roots = np.zeros(16 * len(plan.first), np.uint8)
    rc = lib.gpuckpt_emu_xxh3_leaves(
        _ptr(buf), _ptr(plan.offsets), _ptr(plan.lengths), ctypes.c_uint64(len(plan.offsets)), _ptr(leaves),
        ctypes.c_uint(threads),
    )  # fmt: skip
    assert rc == 0
    rc = lib.gpuckpt_emu_xxh3_roots(
        _ptr(leaves), _ptr(plan.first), _ptr(plan.counts), ctypes.c_uint64(len(plan.first)), _ptr(roots),
        ctypes.c_uint(threads),
    )  # fmt: skip
    assert rc == 0
    return roots.reshape(-1, 16), leaves.reshape(-1, 16)


def test_device_and_host_agree_on_the_leaf() -> None:
    assert hashing.LEAF == LEAF


def test_every_short_length_and_alignment(lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, 4096, dtype=np.uint8)
    # lengths 0..240 byte by byte (XXH3's short and mid-size classes), each at an odd offset
    chunks = [(1 + (n * 7) % 61, n) for n in range(241)]
    roots, _ = run_tree(lib, buf, chunks)
    for (start, n), got in zip(chunks, roots, strict=True):
        assert got.tobytes() == xxhash.xxh3_128_digest(buf[start : start + n].tobytes()), n


@pytest.mark.parametrize(
    "n",
    [241, 255, 256, 1023, 1024, 1025, 1087, 1088, 4096 + 63, LEAF - 1, LEAF, LEAF + 1],
)
def test_long_lengths_match_xxhash(lib: ctypes.CDLL, n: int) -> None:
    rng = np.random.default_rng(n)
    buf = rng.integers(0, 256, n + 16, dtype=np.uint8)
    for start in (0, 3, 8):
        roots, leaves = run_tree(lib, buf, [(start, n)])
        data = buf[start : start + n].tobytes()
        assert roots[0].tobytes() == chunk_hash([data]), (n, start)
        assert leaves[0].tobytes() == xxhash.xxh3_128_digest(data[:LEAF]), (n, start)
        if n <= LEAF:
            assert roots[0].tobytes() == xxhash.xxh3_128_digest(data)


def test_chunks_of_several_leaves_in_one_launch(lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(7)
    sizes = [5 * LEAF + 3, 0, 2 * LEAF, 17, 3 * LEAF - 1]
    buf = rng.integers(0, 256, sum(sizes) + 64, dtype=np.uint8)
    chunks, pos = [], 5
    for n in sizes:
        chunks.append((pos, n))
        pos += n
    roots, leaves = run_tree(lib, buf, chunks, threads=4)
    plan = leaf_plan(chunks)
    for c, (start, n) in enumerate(chunks):
        data = buf[start : start + n].tobytes()
        assert roots[c].tobytes() == chunk_hash([data]), n
        assert leaves[int(plan.first[c])].tobytes() == xxhash.xxh3_128_digest(data[:LEAF])


def test_nvrtc_compiles_the_hash_kernel() -> None:
    # what hash_device_chunks hands to CuPy's RawModule, for the H100/H200 architecture:
    # the source includes nothing NVRTC lacks, and ptxas spills no registers
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception:
        pytest.skip("NVRTC not found: install CuPy or nvidia-cuda-nvrtc==13.0.*")
    source = (ROOT / "kernels/xxh3_tree.cu").read_text()
    prog = nvrtc.createProgram(source, "xxh3_tree.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90", "-std=c++17", "-Xptxas=-v"])
        log = nvrtc.getProgramLog(prog)
        assert len(nvrtc.getCUBIN(prog)) > 0, log
    finally:
        nvrtc.destroyProgram(prog)
    for entry in ("gpuckpt_xxh3_leaves", "gpuckpt_xxh3_roots"):
        assert entry in log, log
    assert " 0 bytes spill stores" in log and "bytes spill stores" in log
    assert all(" 0 bytes spill" in line for line in log.splitlines() if "spill" in line), log
