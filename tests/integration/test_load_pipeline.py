"""Loads to a device through the pipeline (issue 23), with host memory standing in for the device.

Readers read and check chunks into staging buffers and queue each copy on the back
end's stream without waiting (:class:`gpuckpt.device.upload.CopyQueue`); cold chunks are
read with O_DIRECT into the page-aligned staging where the file system allows it.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import gpuckpt
from gpuckpt.device import _kernel_ref
from gpuckpt.device.arrays import ArrayAdapter, DeviceArray
from gpuckpt.device.backend import buffer_pool, staging_buffer_bytes
from gpuckpt.device.host_backend import HostBackend
from gpuckpt.loading.checks import TensorEntry, check_chunk_files
from gpuckpt.loading.chunk_reads import read_tensors
from gpuckpt.loading.open import open_checkpoint
from gpuckpt.options import LoadOptions
from gpuckpt.storage.local import crccopy, direct
from gpuckpt.storage.local.reader import LocalReader
from gpuckpt.testing.fakedevice import EmulatedDeviceArray
from tests.pagecache import evict

CASES: list[tuple[str, tuple[int, ...], Any, int]] = [
    # (name, shape, dtype, chunk_bytes): edge chunks, tiny and large chunks, every element size
    ("f32-2d-edges", (37, 53), np.float32, 1000),
    ("f64-1d-one-chunk", (4099,), np.float64, 1 << 20),
    ("i8-3d", (5, 17, 31), np.int8, 512),
    ("u16-4d", (3, 4, 5, 6), np.uint16, 256),
    ("c64", (33, 9), np.complex64, 700),
    ("bool", (1000,), np.bool_, 128),
    ("bf16", (50, 33), ml_dtypes.bfloat16, 600),
    ("f8", (64, 64), ml_dtypes.float8_e4m3fn, 900),
    ("u64-scalar", (), np.uint64, 4096),
    ("big-endian", (40, 40), np.dtype(">i4"), 1500),
    ("empty", (0, 7), np.float32, 4096),
]


def _random(shape: tuple[int, ...], dtype: Any, rng: np.random.Generator) -> np.ndarray:
    dt = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        raw = raw & 1
    return raw.view(dt).reshape(shape)


def _chunk_files(root: Path, md: gpuckpt.Metadata, fqn: str) -> list[Path]:
    info = md.storage_data["tensors"][fqn]
    return [root / info["name"] / c["key"] for c in info["chunks"]]


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize(("name", "shape", "dtype", "chunk_bytes"), CASES, ids=[c[0] for c in CASES])
def test_loads_are_bit_exact(
    tmp_path: Path, name: str, shape: tuple[int, ...], dtype: Any, chunk_bytes: int, threads: int
) -> None:
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    value = _random(shape, dtype, rng)
    md = gpuckpt.save({"x": value}, tmp_path / "c", chunk_bytes=chunk_bytes)
    nchunks = len(md.state_dict_metadata["x"].chunks)
    backend = HostBackend()
    # a state allocated by the back end
    got = gpuckpt.load_state_dict(tmp_path / "c", device=backend, threads=threads, staging_bytes=64 << 10)
    assert got["x"].shape == value.shape
    # the same values, bit for bit (random bytes: NaNs included); big-endian comes back native
    assert got["x"].astype(value.dtype).tobytes() == value.tobytes()
    assert backend.copies == nchunks  # one host-to-device copy per chunk
    assert backend.in_flight == 0
    # into an existing "device" array
    target = EmulatedDeviceArray(np.zeros_like(value), backend)
    gpuckpt.load({"x": target}, tmp_path / "c", threads=threads, staging_bytes=64 << 10)
    assert target.data.tobytes() == value.tobytes()


@pytest.mark.parametrize("shape", [(2, 3, 17, 9), (1, 64, 5, 6), (2, 5, 3, 4, 6)])
def test_channels_last_targets_are_bit_exact(tmp_path: Path, shape: tuple[int, ...]) -> None:
    value = _kernel_ref.as_channels_last(_random(shape, np.float16, np.random.default_rng(1)))
    gpuckpt.save({"x": value}, tmp_path / "c", chunk_bytes=700)
    backend = HostBackend()
    got = gpuckpt.load_state_dict(tmp_path / "c", device=backend, threads=3)["x"]
    assert got.strides == value.strides and got.tobytes() == value.tobytes()
    target = EmulatedDeviceArray(_kernel_ref.empty_channels_last(shape, np.float16), backend)
    gpuckpt.load({"x": target}, tmp_path / "c")
    assert target.data.tobytes() == value.tobytes()


def _wait_until(condition: Any, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.005)


def test_readers_run_ahead_of_the_copies_within_the_staging_budget(tmp_path: Path) -> None:
    """One reader thread, a copy stream held still: the reader fills every staging buffer
    the budget allows, queues their copies without waiting for them, then blocks; when the
    stream runs, buffers come back and are reused for the remaining chunks."""
    value = _random((64, 1024), np.float32, np.random.default_rng(3))  # 16 chunks of 16 KiB
    gpuckpt.save({"x": value}, tmp_path / "c", chunk_bytes=16 << 10)
    gate = threading.Event()
    backend = HostBackend(gate=gate)
    result: dict[str, Any] = {}

    def load() -> None:
        try:
            result["x"] = gpuckpt.load_state_dict(
                tmp_path / "c", device=backend, threads=1, staging_bytes=64 << 10
            )["x"]
        except BaseException as exc:
            result["error"] = exc

    loader = threading.Thread(target=load)
    loader.start()
    try:
        # 64 KiB of 16 KiB buffers: four copies queued while none has run
        _wait_until(lambda: backend.in_flight == 4, "four copies queued ahead of the stream")
        pool = buffer_pool(backend, staging_buffer_bytes(16 << 10), 64 << 10)
        assert pool.allocated == 4 and pool.peak_in_use == 4
    finally:
        gate.set()
        loader.join(60)
    assert not loader.is_alive()
    assert "error" not in result
    assert result["x"].tobytes() == value.tobytes()
    assert backend.copies == 16 and backend.max_in_flight == 4
    assert pool.allocated == 4  # four buffers served sixteen chunks
    assert pool._in_use == 0


def test_resharding_loads_run_ahead_of_the_copies_too(tmp_path: Path) -> None:
    """Loads into boxes of a tensor (ShardedArray targets): whole chunks and the parts of a
    chunk that straddles two boxes are queued on the copy stream without waiting."""
    value = _random((64, 1024), np.float32, np.random.default_rng(10))  # chunks of 4 rows
    gpuckpt.save({"x": value}, tmp_path / "c", chunk_bytes=16 << 10)
    gate = threading.Event()
    backend = HostBackend(gate=gate)
    parts = [np.zeros((30, 1024), np.float32), np.zeros((34, 1024), np.float32)]
    targets = {
        "x": [
            gpuckpt.ShardedArray(EmulatedDeviceArray(parts[0], backend), (0, 0), value.shape),
            gpuckpt.ShardedArray(EmulatedDeviceArray(parts[1], backend), (30, 0), value.shape),
        ]
    }
    result: dict[str, BaseException] = {}

    def load() -> None:
        try:
            gpuckpt.load(targets, tmp_path / "c", threads=1, staging_bytes=64 << 10)
        except BaseException as exc:
            result["error"] = exc

    loader = threading.Thread(target=load)
    loader.start()
    try:
        _wait_until(lambda: backend.in_flight == 4, "four copies queued ahead of the stream")
    finally:
        gate.set()
        loader.join(60)
    assert not loader.is_alive() and not result
    assert parts[0].tobytes() == value[:30].tobytes() and parts[1].tobytes() == value[30:].tobytes()
    assert backend.in_flight == 0


def test_corrupted_chunk_raises_and_never_reaches_the_device(tmp_path: Path) -> None:
    value = _random((64, 1024), np.float32, np.random.default_rng(4))
    md = gpuckpt.save({"x": value}, tmp_path / "c", chunk_bytes=16 << 10)
    bad = _chunk_files(tmp_path / "c", md, "x")[5]
    raw = bytearray(bad.read_bytes())
    raw[100] ^= 0xFF
    bad.write_bytes(raw)
    backend = HostBackend()
    with pytest.raises(gpuckpt.ChecksumError) as info:
        gpuckpt.load_state_dict(tmp_path / "c", device=backend, threads=4, staging_bytes=64 << 10)
    assert info.value.fqn == "x"
    assert backend.in_flight == 0  # no copy runs on after the error
    assert buffer_pool(backend, staging_buffer_bytes(16 << 10), 64 << 10)._in_use == 0
    # into an existing array: the damaged chunk's rows are never written
    sentinel = np.full_like(value, 7.0)
    target = EmulatedDeviceArray(sentinel, backend)
    with pytest.raises(gpuckpt.ChecksumError):
        gpuckpt.load({"x": target}, tmp_path / "c", threads=1, staging_bytes=64 << 10)
    assert backend.in_flight == 0
    assert np.all(sentinel[20:24] == 7.0)  # chunk 5 holds rows 20..23


def test_reader_thread_error_propagates(tmp_path: Path) -> None:
    """A chunk cut short while the load runs: the reader thread's error reaches the caller,
    after every queued copy has ended and every buffer is back."""
    value = _random((64, 1024), np.float32, np.random.default_rng(5))
    md = gpuckpt.save({"x": value}, tmp_path / "c", chunk_bytes=16 << 10)
    cut = _chunk_files(tmp_path / "c", md, "x")[9]
    gate = threading.Event()
    backend = HostBackend(gate=gate)
    result: dict[str, BaseException] = {}

    def load() -> None:
        try:
            gpuckpt.load_state_dict(tmp_path / "c", device=backend, threads=1, staging_bytes=64 << 10)
        except BaseException as exc:
            result["error"] = exc

    loader = threading.Thread(target=load)
    loader.start()
    try:
        # the sizes were checked, four chunks are read, the reader waits for a buffer
        _wait_until(lambda: backend.in_flight == 4, "four copies queued ahead of the stream")
        os.truncate(cut, 1000)
    finally:
        gate.set()
        loader.join(60)
    assert not loader.is_alive()
    assert isinstance(result.get("error"), gpuckpt.CheckpointCorruptedError), result
    assert "truncated" in str(result["error"])
    assert backend.in_flight == 0
    assert buffer_pool(backend, staging_buffer_bytes(16 << 10), 64 << 10)._in_use == 0


def test_copy_error_stops_the_readers(tmp_path: Path) -> None:
    gpuckpt.save({"x": np.ones((64, 1024), np.float32)}, tmp_path / "c", chunk_bytes=16 << 10)
    backend = HostBackend(fail_after=1)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        gpuckpt.load_state_dict(tmp_path / "c", device=backend, threads=1, staging_bytes=32 << 10)
    assert backend.in_flight == 0
    assert backend.copies < 16  # the reader stopped once a copy had failed


# ---- cold loads: O_DIRECT into aligned staging ------------------------------------


def _load_with_reader(
    root: Path, backend: Any, options: LoadOptions | None = None
) -> tuple[LocalReader, dict[str, Any]]:
    """The load pipeline on a reader of our own (opened as a load with ``options`` opens it),
    to see which read path served each chunk."""
    options = options or LoadOptions()
    ck = open_checkpoint(root, direct_io=options.reads_direct(), shared=False)
    reader = ck.reader
    assert isinstance(reader, LocalReader)
    tensors = ck.index.tensors
    entries: list[TensorEntry] = list(tensors.values())
    check_chunk_files(reader, entries)
    out: dict[str, Any] = {}
    targets: list[tuple[TensorEntry, ArrayAdapter]] = []
    for t in entries:
        dest = backend.allocate(t.shape, t.dtype, t.metadata.properties.memory_format)
        out[t.fqn] = dest
        targets.append((t, DeviceArray(dest, backend, t.dtype)))
    read_tensors(reader, targets, LoadOptions(threads=2, staging_bytes=16 << 20))
    return reader, out


def _save_cold(root: Path) -> np.ndarray:
    """A state of 2 MiB chunks on disk, evicted from the page cache; with one more chunk
    of an odd size (1.5 MB: its unaligned tail is read buffered after the O_DIRECT head)."""
    value = _random((8, 1 << 19), np.float32, np.random.default_rng(6))
    odd = _random((1_500_001,), np.uint8, np.random.default_rng(6))
    md = gpuckpt.save({"x": value, "odd": odd}, root, chunk_bytes=2 << 20)
    kept = evict(_chunk_files(root, md, "x") + _chunk_files(root, md, "odd"))
    if kept:
        pytest.skip(f"{kept[0]} stays in the page cache after POSIX_FADV_DONTNEED")
    return value


def _direct_allowed(folder: Path) -> bool:
    try:
        fd = os.open(folder / ".probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(folder / ".probe")
    return bool(getattr(os, "O_DIRECT", 0))


@pytest.fixture
def cold_needs_crccopy() -> None:
    if not crccopy.available():
        pytest.skip("the native copy-with-CRC loop (page cache residency check) is not built")


def _assert_read_around_direct_io(reader: LocalReader) -> None:
    """Every large chunk part (8 of ``x``, 1 of ``odd``) read without O_DIRECT: buffered, or from
    the page cache where the kernel brought a chunk in by the time the load reached it (the
    buffered reads of the others ran meanwhile; seen for 1-2 of the 9 in about one load of four
    on a 2-vCPU VM, never an O_DIRECT read)."""
    paths = reader.read_paths
    assert paths["direct"] == 0 and paths["buffered"] + paths["cached"] == 9, paths
    assert paths["buffered"] >= 1, paths  # the files were cold: not all of them came from the cache


@pytest.mark.usefixtures("cold_needs_crccopy")
def test_cold_load_reads_with_o_direct(tmp_path: Path) -> None:
    if not _direct_allowed(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    value = _save_cold(tmp_path / "c")
    reader, out = _load_with_reader(tmp_path / "c", HostBackend())
    assert out["x"].tobytes() == value.tobytes()
    assert out["odd"].tobytes() == _random((1_500_001,), np.uint8, np.random.default_rng(6)).tobytes()
    assert reader.read_paths["direct"] == 9 and reader.read_paths["buffered"] == 0
    # O_DIRECT left the page cache alone; once the files are cached (read through it),
    # the one-pass copy-and-checksum loop serves the same load
    for path in (tmp_path / "c").rglob("*"):
        if path.is_file():
            path.read_bytes()
    reader, out = _load_with_reader(tmp_path / "c", HostBackend())
    assert out["x"].tobytes() == value.tobytes()
    assert reader.read_paths["cached"] == 9 and reader.read_paths["direct"] == 0


def test_without_the_native_loop_cached_chunks_are_read_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An install without a C compiler has no native loop to probe the page cache; mincore
    # tells a cached chunk from a cold one instead. Before, every large chunk was read with
    # O_DIRECT there, cached or not: warm device loads ran at the disk's speed (2.1 GB/s
    # against 30 GB/s from the page cache on the H200 machine).
    if not _direct_allowed(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    value = _save_cold(tmp_path / "c")
    monkeypatch.setenv("GPUCKPT_CRCCOPY", "off")
    crccopy._instance.cache_clear()
    try:
        assert not crccopy.available()
        reader, out = _load_with_reader(tmp_path / "c", HostBackend())
        assert out["x"].tobytes() == value.tobytes()
        assert reader.read_paths == {
            "cached": 0,
            "direct": 9,
            "buffered": 0,
            "memory": 0,
        }  # cold: around the cache
        for path in (tmp_path / "c").rglob("*"):
            if path.is_file():
                path.read_bytes()  # now cached
        reader, out = _load_with_reader(tmp_path / "c", HostBackend())
        assert out["x"].tobytes() == value.tobytes()
        assert reader.read_paths == {"cached": 0, "direct": 0, "buffered": 9, "memory": 0}
    finally:
        monkeypatch.delenv("GPUCKPT_CRCCOPY")
        crccopy._instance.cache_clear()


@pytest.mark.usefixtures("cold_needs_crccopy")
def test_cold_load_falls_back_where_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = _save_cold(tmp_path / "c")
    calls = []

    def refuse(fd: int) -> None:
        calls.append(fd)
        raise OSError(errno.EINVAL, "Invalid argument")  # what a file system without O_DIRECT says

    monkeypatch.setattr(direct, "_set_direct", refuse)
    reader, out = _load_with_reader(tmp_path / "c", HostBackend())
    assert out["x"].tobytes() == value.tobytes()
    _assert_read_around_direct_io(reader)
    assert len(calls) <= 2  # refused once per reader thread at most, then not asked again


@pytest.mark.usefixtures("cold_needs_crccopy")
@pytest.mark.parametrize("how", ["environment", "option"])
def test_cold_load_without_direct_io_reads_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Load options carry direct I/O as save options do: ``LoadOptions(direct_io="off")``, or
    ``GPUCKPT_DIRECT_IO=off`` read once when the options are made."""
    value = _save_cold(tmp_path / "c")
    if how == "environment":
        monkeypatch.setenv("GPUCKPT_DIRECT_IO", "off")
        options = LoadOptions()
        monkeypatch.delenv("GPUCKPT_DIRECT_IO")  # read when the options were made, not later
    else:
        options = LoadOptions(direct_io="off")
    assert options.direct_io == "off" and not options.reads_direct()
    reader, out = _load_with_reader(tmp_path / "c", HostBackend(), options)
    assert out["x"].tobytes() == value.tobytes()
    _assert_read_around_direct_io(reader)


def test_load_options_refuse_an_unknown_direct_io_mode() -> None:
    with pytest.raises(gpuckpt.InvalidOptionError, match="direct_io"):
        LoadOptions(direct_io="sometimes")


def test_tmpfs_loads_copy_out_of_populated_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm (tmpfs): its pages are in memory, so large chunks are copied with their
    checksum in one pass out of a populated map (pread copies a base page at a time, at half
    the speed), never read whole with O_DIRECT and then read again for the checksum; without
    the native loop, read with pread in pieces, each checksummed while it is in the CPU's
    cache. Bit-exact either way."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("needs /dev/shm")
    root = Path(tempfile.mkdtemp(prefix="gpuckpt-test-", dir=shm))
    try:
        value = _random((4, 1 << 19), np.float32, np.random.default_rng(8))
        gpuckpt.save({"x": value}, root / "c", chunk_bytes=2 << 20)
        reader, out = _load_with_reader(root / "c", HostBackend())
        assert out["x"].tobytes() == value.tobytes()
        # (into device memory: staged chunk by chunk; host arrays take them natively, see below)
        if crccopy.available():
            assert reader.read_paths == {"cached": 4, "direct": 0, "buffered": 0, "memory": 0}
        monkeypatch.setenv("GPUCKPT_CRCCOPY", "off")
        crccopy._instance.cache_clear()
        try:
            reader, out = _load_with_reader(root / "c", HostBackend())
        finally:
            monkeypatch.delenv("GPUCKPT_CRCCOPY")
            crccopy._instance.cache_clear()
        assert out["x"].tobytes() == value.tobytes()
        assert reader.read_paths == {"cached": 0, "direct": 0, "buffered": 4, "memory": 0}
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---- on a GPU ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("cold", [False, True])
def test_cupy_loads_through_pinned_staging(tmp_path: Path, cold: bool) -> None:
    """Warm and cold loads onto a real device: several readers, pinned staging, the copy
    stream; cold chunks read with O_DIRECT straight into the pinned buffers."""
    cupy = pytest.importorskip("cupy")
    from gpuckpt.device.cuda import backend_for_device

    rng = np.random.default_rng(9)
    state = {
        "big": _random((8, 1 << 19), np.float32, rng),  # 2 MiB chunks
        "edges": _random((37, 53), np.float16, rng),
        "cl": _kernel_ref.as_channels_last(_random((2, 3, 17, 9), np.float32, rng)),
        "bf16": _random((50, 33), ml_dtypes.bfloat16, rng),
    }
    gpuckpt.save(state, tmp_path / "c", chunk_bytes=2 << 20)
    if cold:
        from gpuckpt.cli.device_bench import evict

        if not evict(tmp_path / "c"):
            pytest.skip("the chunk files stay in the page cache here")
    backend = backend_for_device(0)
    reader, out = _load_with_reader(tmp_path / "c", backend)
    backend.synchronize()
    for k, v in state.items():
        assert out[k].strides == v.strides, k  # channels-last stays channels-last
        got = cupy.asnumpy(out[k]).view(v.dtype)  # CuPy holds bfloat16 as uint16: same bytes
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(v).tobytes(), k
    if cold and _direct_allowed(tmp_path):
        assert reader.read_paths["direct"] >= 1
    # and through the public function, into CuPy arrays allocated for the load
    loaded = gpuckpt.load_state_dict(tmp_path / "c", device="cuda", threads=4)
    assert cupy.asnumpy(loaded["big"]).tobytes() == state["big"].tobytes()


# ---- a store that keeps its files in memory (tmpfs) ------------------------------------------


def _mounts() -> dict[str, str]:
    """Mount point -> file system type, from /proc/mounts."""
    out: dict[str, str] = {}
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 3:
                out[fields[1]] = fields[2]
    return out


def _fs_type(path: Path) -> str:
    mounts = _mounts()
    p = path.resolve()
    for candidate in [p, *p.parents]:
        if str(candidate) in mounts:
            return mounts[str(candidate)]
    return ""


@pytest.fixture
def shm_dir() -> Any:
    if not Path("/dev/shm").is_dir() or _fs_type(Path("/dev/shm")) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="gpuckpt-test-", dir="/dev/shm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_memory_backed_tells_tmpfs_from_a_disk(shm_dir: Path, tmp_path: Path) -> None:
    from gpuckpt.storage.local import fsutil

    assert fsutil.memory_backed(shm_dir)
    assert fsutil.memory_backed(tmp_path) == (_fs_type(tmp_path) in ("tmpfs", "ramfs"))
    assert not fsutil.memory_backed(tmp_path / "missing")


@pytest.mark.parametrize("copy_loop", ["built", "off"])
def test_on_tmpfs_chunk_files_of_a_few_mib_are_read_natively_and_checked(
    shm_dir: Path, copy_loop: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """On a file system that keeps its files in memory, chunk files of 1 MiB and more are
    copied out of populated maps with their checksum (``"cached"``); where that loop is not
    built, those under 8 MiB go to the native batches (no page cache to probe, no disk to read
    around), counted as ``"memory"``, and larger ones are read with pread in pieces. Bit-exact
    either way. A flipped byte in such a file is a ChecksumError naming the tensor and the
    chunk; a file cut short is an error naming it too, never a short array."""
    from gpuckpt.storage.local import batchio

    if batchio.instance() is None or not crccopy.available():
        pytest.skip("the native library is not built here")
    if copy_loop == "off":
        monkeypatch.setenv("GPUCKPT_CRCCOPY", "off")
        crccopy._instance.cache_clear()
        request.addfinalizer(crccopy._instance.cache_clear)  # (the loop found again after the test)
        assert not crccopy.available()
    rng = np.random.default_rng(5)
    state = {
        "mid": rng.standard_normal((512, 1024), np.float32),  # 2 MiB: one chunk file
        "big": rng.standard_normal((3, 1 << 20), np.float32),  # 12 MiB: read in pieces
        "small": np.arange(10, dtype=np.float32),
    }
    path = shm_dir / "ck"
    gpuckpt.save(state, path)
    from gpuckpt.device.arrays import adapt

    ck = open_checkpoint(path, direct_io=True, shared=False)
    reader = ck.reader
    assert isinstance(reader, LocalReader)
    entries: list[TensorEntry] = list(ck.index.tensors.values())
    check_chunk_files(reader, entries)
    out = {t.fqn: np.zeros(t.shape, t.dtype) for t in entries}  # host arrays: read straight in
    read_tensors(reader, [(t, adapt(out[t.fqn])) for t in entries], LoadOptions(threads=2))
    for k, v in state.items():
        assert np.array_equal(out[k], v), k
    if copy_loop == "built":
        assert reader.read_paths == {"cached": 2, "direct": 0, "buffered": 0, "memory": 0}
    else:
        assert reader.read_paths == {"cached": 0, "direct": 0, "buffered": 1, "memory": 1}
    target = {k: np.zeros_like(v) for k, v in state.items()}
    gpuckpt.load(target, path)  # the load's own reader: the same paths
    assert all(np.array_equal(target[k], v) for k, v in state.items())
    (chunk,) = [p for p in (path / "mid").iterdir() if p.name != "zarr.json"]
    raw = bytearray(chunk.read_bytes())
    raw[1_000_000] ^= 0x40
    chunk.write_bytes(bytes(raw))
    with pytest.raises(gpuckpt.ChecksumError, match=r"mid.*chunk|chunk.*mid"):
        gpuckpt.load(target, path)
    raw[1_000_000] ^= 0x40
    chunk.write_bytes(bytes(raw[:-100]))
    with pytest.raises(gpuckpt.GpuckptError, match="mid"):
        gpuckpt.load(target, path)
