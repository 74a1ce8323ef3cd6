"""Large chunk files written with O_DIRECT: same bytes as buffered writes, the defaults
(background saves direct, synchronous ones buffered), and real fallbacks."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.options import SaveOptions
from gpuckpt.storage.local import direct
from gpuckpt.storage.local.direct import DIRECT_MIN_BYTES
from gpuckpt.storage.local.writer import LocalWriter
from gpuckpt.verify import verify_checkpoint
from tests.pagecache import is_cached

MiB = 1 << 20


def _direct_supported(d: Path) -> bool:
    if not getattr(os, "O_DIRECT", 0):
        return False
    try:
        fd = os.open(d / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(d / ".probe")
    return True


def _page_aligned(nbytes: int, dtype: type = np.float32) -> np.ndarray:
    buf = mmap.mmap(-1, nbytes)
    return np.frombuffer(buf, dtype=dtype)


def _unaligned(a: np.ndarray) -> np.ndarray:
    raw = np.empty(a.nbytes + 4096 + 1, np.uint8)
    start = (-raw.ctypes.data) % 4096 + 1  # one byte past a page boundary
    out = raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    aligned = _page_aligned(3 * MiB + 4096)
    aligned[:] = rng.standard_normal(aligned.size, dtype=np.float32)
    return {
        "exact": rng.standard_normal(MiB // 4, dtype=np.float32),  # exactly 1 MiB: all direct
        "one_more": rng.integers(0, 255, MiB + 1, dtype=np.uint8),  # 1 MiB + 1: 1-byte tail
        "odd": _unaligned(rng.standard_normal(3 * MiB // 4 + 1001, dtype=np.float32)),
        "aligned": aligned,  # page-aligned memory: written without the bounce copy
        "padded": rng.standard_normal(655_361, dtype=np.float32),  # edge chunk: data + zero padding
        "image": np.ascontiguousarray(
            rng.standard_normal((4, 64, 32, 40), dtype=np.float32).transpose(0, 2, 3, 1)
        ).transpose(0, 3, 1, 2),  # channels-last
        "small": np.arange(100, dtype=np.int64),
    }


def _chunk_bytes(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            rel = os.fspath(p.relative_to(root))
            if rel != "zarr.json":
                out[rel] = p.read_bytes()
    return out


def _save(state: dict[str, np.ndarray], path: Path, monkeypatch: pytest.MonkeyPatch, direct: str) -> None:
    monkeypatch.setenv("GPUCKPT_DIRECT_IO", direct)
    gpuckpt.save(state, path, chunk_bytes=2 * MiB, sync="file")


def test_direct_and_buffered_writes_store_the_same_bytes(tmp_path, monkeypatch):
    state = _state()
    _save(state, tmp_path / "direct", monkeypatch, "1")
    _save(state, tmp_path / "buffered", monkeypatch, "0")
    a, b = _chunk_bytes(tmp_path / "direct"), _chunk_bytes(tmp_path / "buffered")
    assert a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []
    assert any(len(v) >= DIRECT_MIN_BYTES for v in a.values())
    loaded = gpuckpt.load_state_dict(tmp_path / "direct")
    for k, v in state.items():
        np.testing.assert_array_equal(loaded[k], v)
    assert verify_checkpoint(tmp_path / "direct").ok


def test_async_save_from_the_staging_arena_writes_direct(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUCKPT_DIRECT_IO", "1")
    state = _state()
    gpuckpt.async_save(state, tmp_path / "async", chunk_bytes=2 * MiB).result()
    _save(state, tmp_path / "buffered", monkeypatch, "0")
    assert _chunk_bytes(tmp_path / "async") == _chunk_bytes(tmp_path / "buffered")


def test_direct_writes_bypass_the_page_cache(tmp_path, monkeypatch):
    if not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    state = {"w": np.ones(4 * MiB // 4, np.float32)}
    _save(state, tmp_path / "direct", monkeypatch, "1")
    _save(state, tmp_path / "buffered", monkeypatch, "0")
    chunk = Path("w") / "c.0"
    assert (tmp_path / "direct" / chunk).is_file()
    # a buffered write leaves the bytes cached; a direct one does not
    assert is_cached(tmp_path / "buffered" / chunk)
    assert not is_cached(tmp_path / "direct" / chunk)
    assert not is_cached(tmp_path / "direct" / chunk, MiB)
    np.testing.assert_array_equal(gpuckpt.load_state_dict(tmp_path / "direct")["w"], state["w"])


def test_refused_at_open_falls_back_to_buffered_writes(tmp_path, monkeypatch):
    opened: list[str] = []

    def refuse(path: str) -> int:
        opened.append(path)
        fd = os.open(path, direct._CREATE_FLAGS, 0o644)  # created, as the kernel does before refusing
        os.close(fd)
        raise OSError(errno.EINVAL, "Invalid argument", path)

    monkeypatch.setattr(direct, "_open_direct", refuse)
    state = _state()
    _save(state, tmp_path / "fallback", monkeypatch, "1")
    # refused once per I/O thread at most (others may be opening at the same time), then buffered
    assert 1 <= len(opened) <= 8
    _save(state, tmp_path / "buffered", monkeypatch, "0")
    assert _chunk_bytes(tmp_path / "fallback") == _chunk_bytes(tmp_path / "buffered")


def test_refused_at_write_rewrites_the_piece_buffered(tmp_path, monkeypatch):
    if not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    import fcntl

    real = direct.write_all
    refused: list[int] = []

    def write_all(fd: int, data) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            # a file system that takes the flag at open and refuses the I/O; half of
            # the piece was written before: the fallback must rewrite it from its start
            real(fd, memoryview(data)[: len(memoryview(data)) // 2])
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, data)

    monkeypatch.setattr(direct, "write_all", write_all)
    state = _state()
    _save(state, tmp_path / "fallback", monkeypatch, "1")
    assert 1 <= len(refused) <= 8  # files already open in direct mode on other I/O threads refuse too
    _save(state, tmp_path / "buffered", monkeypatch, "0")
    assert _chunk_bytes(tmp_path / "fallback") == _chunk_bytes(tmp_path / "buffered")
    assert verify_checkpoint(tmp_path / "fallback").ok


def test_other_errors_fail_the_save_and_publish_nothing(tmp_path, monkeypatch):
    def broken(path: str) -> int:
        raise OSError(errno.EIO, "Input/output error", path)

    monkeypatch.setattr(direct, "_open_direct", broken)
    monkeypatch.setenv("GPUCKPT_DIRECT_IO", "1")
    with pytest.raises(OSError, match="Input/output error"):
        gpuckpt.save(_state(), tmp_path / "ck", chunk_bytes=2 * MiB)
    assert not (tmp_path / "ck").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_switches(tmp_path, monkeypatch):
    has = bool(getattr(os, "O_DIRECT", 0))
    assert not LocalWriter(tmp_path / "a").direct_io  # a plain writer is buffered
    assert LocalWriter(tmp_path / "a", direct_io=True).direct_io == has
    assert not LocalWriter(tmp_path / "a", direct_io=True, sync="none").direct_io  # scratch data

    def setting(background: bool) -> bool:
        # what a save asks of its writer, and what the writer then does on this platform
        decided = SaveOptions().use_direct_io(background)
        return LocalWriter(tmp_path / "a", direct_io=decided).direct_io

    monkeypatch.delenv("GPUCKPT_DIRECT_IO", raising=False)
    assert (setting(True), setting(False)) == (has, False)
    monkeypatch.setenv("GPUCKPT_DIRECT_IO", "auto")
    assert (setting(True), setting(False)) == (has, False)
    monkeypatch.setenv("GPUCKPT_DIRECT_IO", "on")
    assert (setting(True), setting(False)) == (has, has)
    monkeypatch.setenv("GPUCKPT_DIRECT_IO", "0")
    assert (setting(True), setting(False)) == (False, False)
    monkeypatch.setenv("GPUCKPT_DIRECT_IO", "sometimes")
    with pytest.raises(ValueError, match="GPUCKPT_DIRECT_IO='sometimes'"):
        SaveOptions()
    with pytest.raises(ValueError, match="GPUCKPT_DIRECT_IO='sometimes'"):
        gpuckpt.save({"w": np.ones(3)}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_by_default_background_saves_bypass_the_cache_and_synchronous_ones_do_not(tmp_path, monkeypatch):
    if not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    monkeypatch.delenv("GPUCKPT_DIRECT_IO", raising=False)
    state = {"w": np.ones(2 * MiB // 4, np.float32)}
    gpuckpt.save(state, tmp_path / "sync")
    gpuckpt.async_save(state, tmp_path / "async").result()
    chunk = Path("w") / "c.0"
    assert is_cached(tmp_path / "sync" / chunk)
    assert not is_cached(tmp_path / "async" / chunk)
    assert (tmp_path / "sync" / chunk).read_bytes() == (tmp_path / "async" / chunk).read_bytes()


def test_direct_files_are_allocated_in_few_extents(tmp_path, monkeypatch):
    # concurrent direct writes allocate as they land; the space reserved up front keeps
    # each file contiguous where the file system can (FIEMAP through filefrag, if present)
    import shutil
    import subprocess

    if not _direct_supported(tmp_path) or shutil.which("filefrag") is None:
        pytest.skip("needs O_DIRECT on the temporary directory and filefrag")
    state = {f"w{i}": np.full(8 * MiB // 4, i, np.float32) for i in range(8)}
    _save(state, tmp_path / "ck", monkeypatch, "1")
    files = [os.fspath(p) for p in (tmp_path / "ck").glob("w*/c.0")]
    out = subprocess.run(["filefrag", *files], capture_output=True, text=True, check=True).stdout
    extents = [int(line.rsplit(":", 1)[1].split()[0]) for line in out.splitlines() if "extent" in line]
    assert len(extents) == 8
    assert max(extents) <= 2, out


def test_a_failed_direct_write_fails_the_async_save_and_keeps_the_old_one(tmp_path, monkeypatch):
    if not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    import fcntl

    monkeypatch.delenv("GPUCKPT_DIRECT_IO", raising=False)
    old = tmp_path / "ck"
    gpuckpt.save({"w": np.zeros(MiB, np.float32)}, old)
    real = direct.write_all
    hits: list[int] = []

    def write_all(fd: int, data) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            hits.append(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(direct, "write_all", write_all)
    exc = gpuckpt.async_save({"w": np.ones(MiB, np.float32)}, old, overwrite=True).exception(timeout=60)
    assert hits, "the direct path was not taken"
    assert isinstance(exc, gpuckpt.CheckpointWriteError) and exc.errno == errno.ENOSPC, exc
    assert "nothing was published" in str(exc)
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary left
    np.testing.assert_array_equal(gpuckpt.load_state_dict(old)["w"], np.zeros(MiB, np.float32))


def test_the_direct_writer_on_its_own(tmp_path):
    """storage.direct writes a whole file, digesting every byte in order, without LocalWriter."""
    if not _direct_supported(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    rng = np.random.default_rng(1)
    aligned = _page_aligned(2 * MiB)
    aligned[:] = rng.standard_normal(aligned.size, dtype=np.float32)
    parts = [aligned, rng.integers(0, 255, MiB + 4097, dtype=np.uint8), b"tail"]
    seen = bytearray()

    class Recorder:
        def update(self, piece):
            seen.extend(memoryview(piece).cast("B"))

        def trailer(self):
            return b"CRC!"

    w = direct.DirectWriter()
    fd = w.create(os.fspath(tmp_path / "f"))
    assert fd is not None
    try:
        w.write(fd, parts, Recorder())
    finally:
        os.close(fd)
    data = b"".join(memoryview(p).cast("B").tobytes() for p in parts)
    assert bytes(seen) == data and (tmp_path / "f").read_bytes() == data + b"CRC!"
    with pytest.raises(FileExistsError):  # a new file, never an existing one
        w.create(os.fspath(tmp_path / "f"))
    assert w.enabled  # only a refusal of O_DIRECT turns it off
