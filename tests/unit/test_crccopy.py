"""The native copy-with-CRC32C loop (gpuckpt/storage/local/crccopy.c), built here from its source.

Each instruction-set path (AVX-512 + VPCLMULQDQ, SSE PCLMULQDQ) is checked against
the crc32c package on lengths around every threshold of the vector loops, with
misaligned sources and destinations; the page-cache read is checked on cached,
uncached and short files.
"""

from __future__ import annotations

import mmap
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import crc32c as crc32c_package
import numpy as np
import pytest

from gpuckpt.errors import InvalidOptionError
from gpuckpt.storage.local import crccopy, fsutil
from gpuckpt.storage.local.crccopy import CrcCopy, load_library
from tests.pagecache import evict

SOURCE = Path(crccopy.__file__).with_name("crccopy.c")
X86 = platform.machine() in ("x86_64", "AMD64")


def _reference(data: bytes, value: int = 0) -> int:
    return int(crc32c_package.crc32c(data, value))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler: crccopy.c cannot be built here")
    out = tmp_path_factory.mktemp("crccopy") / "_crccopy.so"
    subprocess.run(
        [cc, "-O2", "-std=gnu11", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(out), str(SOURCE)],
        check=True,
    )
    return out


def _levels(built: Path) -> list[str]:
    best = CrcCopy(built).isa
    return {"avx512": ["avx512", "pclmul"], "pclmul": ["pclmul"]}.get(best, [])


@pytest.fixture(params=["avx512", "pclmul"])
def lib(request: pytest.FixtureRequest, built: Path, tmp_path: Path) -> CrcCopy:
    if request.param not in _levels(built):
        pytest.skip(f"this CPU has no {request.param} path")
    # a copy under another name loads as a separate library with its own state
    path = tmp_path / f"_crccopy_{request.param}.so"
    shutil.copy(built, path)
    loaded = CrcCopy(path)
    assert loaded.limit(request.param) == request.param
    return loaded


def test_the_source_builds_with_a_vector_path_on_x86(built: Path) -> None:
    if not X86:
        assert CrcCopy(built).isa == "none"  # other CPUs: a stub, the reader uses pread
        assert load_library(built) is None
        return
    assert CrcCopy(built).isa in ("avx512", "pclmul")
    assert load_library(built) is not None


LENGTHS = [
    *range(0, 70),
    127,
    128,
    129,
    255,
    256,
    257,
    511,
    512,
    513,
    575,
    576,
    1023,
    1024,
    4095,
    65537,
    1 << 20,
]


@pytest.mark.parametrize("n", LENGTHS)
def test_crc_and_copy_match_the_reference(lib: CrcCopy, n: int) -> None:
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n, dtype=np.uint8)
    for start in (0, 0xFFFFFFFF, 0x1234ABCD):
        assert lib.crc_copy(data, None, start) == _reference(data.tobytes(), start)
        out = np.full(n, 0xA5, np.uint8)
        assert lib.crc_copy(data, out, start) == _reference(data.tobytes(), start)
        np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("src_shift", [0, 1, 3, 8, 17, 63])
@pytest.mark.parametrize("dst_shift", [0, 1, 5, 16, 33, 64])
def test_misaligned_source_and_destination_leave_neighbours_alone(
    lib: CrcCopy, src_shift: int, dst_shift: int
) -> None:
    n = 3000 + src_shift * 7
    rng = np.random.default_rng(src_shift * 100 + dst_shift)
    src_buf = rng.integers(0, 256, n + 128, dtype=np.uint8)
    dst_buf = np.full(n + 256, 0x5A, np.uint8)
    src = src_buf[src_shift : src_shift + n]
    dst = dst_buf[dst_shift : dst_shift + n]
    assert lib.crc_copy(src, dst, 7) == _reference(src.tobytes(), 7)
    np.testing.assert_array_equal(dst, src)
    assert (dst_buf[:dst_shift] == 0x5A).all() and (dst_buf[dst_shift + n :] == 0x5A).all()


def test_continuing_a_crc_across_calls_equals_one_call(lib: CrcCopy) -> None:
    data = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    value = 0
    for a, b in [(0, 3), (3, 700), (700, 701), (701, 9000), (9000, 10_000)]:
        value = lib.crc_copy(data[a:b], None, value)
    assert value == _reference(data.tobytes())


def test_crc_copy_refuses_a_destination_of_another_size_or_read_only(lib: CrcCopy) -> None:
    with pytest.raises(ValueError, match="destination is 9 bytes, source 10"):
        lib.crc_copy(bytes(10), bytearray(9))
    with pytest.raises(ValueError, match="destination is read-only"):
        lib.crc_copy(bytes(10), bytes(10))
    with pytest.raises(ValueError, match="destination is read-only"):
        lib.cached_copy_crc(0, 0, memoryview(bytes(10)))


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 4095, 4097, (1 << 20) + 3])
def test_a_guarded_copy_into_a_file_map_matches_the_reference(lib: CrcCopy, tmp_path: Path, n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    path = tmp_path / "chunk"
    path.write_bytes(bytes(n + 3))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), n + 3) as m, memoryview(m) as view:
        assert lib.guarded_copy_crc(data, view[1 : n + 1], 7) == _reference(data.tobytes(), 7)
    assert path.read_bytes() == b"\0" + data.tobytes() + b"\0\0"
    with pytest.raises(ValueError, match="destination is 9 bytes, source 10"):
        lib.guarded_copy_crc(bytes(10), bytearray(9))
    with pytest.raises(ValueError, match="destination is read-only"):
        lib.guarded_copy_crc(bytes(10), bytes(10))


@pytest.mark.parametrize(
    "sizes", [[1], [4096], [4095, 1, 4096], [10000, 3, (1 << 14) + 5], [(1 << 14) * 3], [0, 5000, 0]]
)
def test_a_guarded_copy_of_segments_gives_each_segments_crc(
    lib: CrcCopy, tmp_path: Path, sizes: list[int]
) -> None:
    """Sources one after the other into a file's map, segment boundaries inside and between them:
    the bytes, and the CRC32C of every segment of the destination (the last one shorter)."""
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    data = b"".join(s.tobytes() for s in srcs)
    total, seg = len(data), 1 << 12
    path = tmp_path / "chunk"
    path.write_bytes(bytes(total + 2))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), total + 2) as m, memoryview(m) as view:
        got = lib.guarded_copy_segments(srcs, view[1 : total + 1], seg)
    assert got == [_reference(data[i : i + seg]) for i in range(0, total, seg)]
    assert path.read_bytes() == b"\0" + data + b"\0"
    with pytest.raises(ValueError, match="destination is 9 bytes, sources 10"):
        lib.guarded_copy_segments([bytes(4), bytes(6)], bytearray(9), seg)
    with pytest.raises(ValueError, match="destination is read-only"):
        lib.guarded_copy_segments([bytes(10)], bytes(10), seg)
    with pytest.raises(ValueError, match="segment_bytes must be positive"):
        lib.guarded_copy_segments([bytes(10)], bytearray(10), 0)


_CUT_UNDER_THE_MAP = """
import mmap, os, sys
from gpuckpt.storage.local.crccopy import CrcCopy
lib = CrcCopy(sys.argv[1]); assert lib.limit(sys.argv[2]) == sys.argv[2]
path = sys.argv[3]
with open(path, "wb") as f:
    f.write(bytes(2 << 20))
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, 2 << 20)
os.truncate(path, 4096)  # cut shorter from outside: pages past it fault (SIGBUS) when written
got = lib.guarded_copy_crc(b"x" * (2 << 20), m)
segments = lib.guarded_copy_segments([b"y" * 4096, b"z" * ((2 << 20) - 4096)], m, 1 << 20)
print(got, segments, lib.faults, os.path.getsize(path))
"""


def test_a_guarded_copy_into_a_map_of_a_file_cut_shorter_reports_it(lib: CrcCopy, tmp_path: Path) -> None:
    """The SIGBUS of a write past the file's new end is caught: None, the process lives (a
    copy of one source, and one of a chunk's segments from several)."""
    run = subprocess.run(
        [sys.executable, "-c", _CUT_UNDER_THE_MAP, str(lib.path), lib.isa, str(tmp_path / "f")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["None", "None", "2", "4096"]


def _write(path: Path, data: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())


def test_cached_copy_of_a_tmpfs_file_copies_out_of_a_populated_map(lib: CrcCopy) -> None:
    """A tmpfs file (a local tier's) is copied whatever mincore would say: its pages are in
    memory, and the map is made populated; past the end of the file, nothing is copied."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not fsutil.memory_backed(shm):
        pytest.skip("no tmpfs at /dev/shm")
    data = np.random.default_rng(4).integers(0, 256, (5 << 20) + 7, dtype=np.uint8)
    d = Path(tempfile.mkdtemp(prefix="gpuckpt-test-", dir=shm))
    try:
        path = d / "chunk"
        _write(path, data)
        fd = os.open(path, os.O_RDONLY)
        try:
            out = np.zeros(data.nbytes - 100, np.uint8)
            assert lib.cached_copy_crc(fd, 100, memoryview(out), 7) == _reference(data[100:].tobytes(), 7)
            np.testing.assert_array_equal(out, data[100:])
            assert lib.cached_copy_crc(fd, 200, memoryview(out)) is None  # past the end
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_cached_copy_reads_a_cached_file(lib: CrcCopy, tmp_path: Path) -> None:
    data = np.random.default_rng(2).integers(0, 256, (3 << 20) + 12345, dtype=np.uint8)
    path = tmp_path / "chunk"
    _write(path, data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(data.nbytes)], 0)  # into the page cache
        for offset, n in [(0, data.nbytes), (4097, 2 << 20), (data.nbytes - 5, 5), (100, 0)]:
            out = np.zeros(n, np.uint8)
            got = lib.cached_copy_crc(fd, offset, memoryview(out), 11)
            assert got == _reference(data[offset : offset + n].tobytes(), 11)
            np.testing.assert_array_equal(out, data[offset : offset + n])
        # past the end of the file: nothing copied, the caller reads another way
        out = np.zeros(10, np.uint8)
        assert lib.cached_copy_crc(fd, data.nbytes - 5, memoryview(out)) is None
        assert not out.any()
    finally:
        os.close(fd)


def test_cached_copy_declines_a_file_not_in_the_page_cache(lib: CrcCopy, tmp_path: Path) -> None:
    data = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
    path = tmp_path / "chunk"
    _write(path, data)
    if evict([path]):
        pytest.skip("this file system keeps the file cached after POSIX_FADV_DONTNEED")
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.zeros(data.nbytes, np.uint8)
        assert lib.cached_copy_crc(fd, 0, memoryview(out)) is None
        assert not out.any()
    finally:
        os.close(fd)


def test_cached_copy_reports_a_bad_descriptor(lib: CrcCopy) -> None:
    with pytest.raises(OSError, match="Bad file descriptor"):
        lib.cached_copy_crc(-1, 0, memoryview(bytearray(10)))


def test_a_library_from_another_source_version_is_refused(tmp_path: Path, built: Path) -> None:
    source = re.sub(r"#define GCK_ABI \d+", "#define GCK_ABI 999", SOURCE.read_text())
    assert "#define GCK_ABI 999" in source
    (tmp_path / "old.c").write_text(source)
    out = tmp_path / "old.so"
    subprocess.run(
        [
            shutil.which(os.environ.get("CC", "cc")) or "cc",
            "-O2",
            "-shared",
            "-fPIC",
            f"-I{SOURCE.parent}",  # the shared CRC kernels (crc32c_simd.h)
            "-o",
            str(out),
            str(tmp_path / "old.c"),
        ],
        check=True,
    )
    with pytest.raises(ImportError, match="another version of crccopy.c"):
        CrcCopy(out)
    assert load_library(out) is None
    assert load_library(tmp_path / "missing.so") is None


def test_the_installed_package_has_the_library_where_it_can(built: Path) -> None:
    """The build hook compiled it at install time wherever this test can compile it."""
    if os.environ.get("GPUCKPT_CRCCOPY", "auto") == "off":
        pytest.skip("GPUCKPT_CRCCOPY=off in this environment")
    if not X86:
        assert not crccopy.available()
        return
    assert crccopy.LIBRARY.exists(), (
        f"{crccopy.LIBRARY} missing: reinstall (pip install -e .) with a C compiler"
    )
    assert crccopy.available()
    assert crccopy.instruction_set() == CrcCopy(built).isa


def test_the_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv("GPUCKPT_CRCCOPY", "off")
        crccopy._instance.cache_clear()
        assert not crccopy.available()
        assert crccopy.instruction_set() == "none"
        assert crccopy.cached_copy_crc(0, 0, memoryview(bytearray(1))) is None
        with pytest.raises(RuntimeError, match="not available"):
            crccopy.crc_copy(b"x")
        monkeypatch.setenv("GPUCKPT_CRCCOPY", "fast")
        crccopy._instance.cache_clear()
        with pytest.raises(
            InvalidOptionError,
            match="GPUCKPT_CRCCOPY='fast' is not understood; set it to auto, 1/on or 0/off",
        ):
            crccopy.available()
        monkeypatch.setattr(crccopy, "LIBRARY", Path("/nonexistent/_crccopy.so"))
        monkeypatch.setenv("GPUCKPT_CRCCOPY", "on")
        crccopy._instance.cache_clear()
        with pytest.raises(ImportError, match="GPUCKPT_CRCCOPY=on but"):
            crccopy.available()
    finally:
        monkeypatch.undo()
        crccopy._instance.cache_clear()
