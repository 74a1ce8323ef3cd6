"""What the local writer makes durable, and how it batches many small chunks."""

from __future__ import annotations

import os

import numpy as np
import pytest

import gpuckpt
from gpuckpt.storage.local import batchio, fsutil
from gpuckpt.verify import verify_checkpoint


def _inodes_under(root: str) -> set[tuple[int, int]]:
    out = set()
    for dirpath, _dirs, files in os.walk(root):
        st = os.stat(dirpath)
        out.add((st.st_dev, st.st_ino))
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            out.add((st.st_dev, st.st_ino))
    return out


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> set[tuple[int, int]]:
    synced: set[tuple[int, int]] = set()
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.mark.parametrize("sync", ["fs", "file"])
def test_every_file_and_directory_is_fsynced_without_syncfs(tmp_path, monkeypatch, sync):
    # where syncfs(2) is missing, the "fs" mode falls back to fsyncing every
    # file and directory of the checkpoint one by one, as "file" mode does.
    # Python's fsyncs are recorded here, so the native small-file batches (whose
    # fsyncs libc sees: tests/integration/test_small_batches.py) are off
    monkeypatch.setattr(batchio, "instance", lambda: None)
    monkeypatch.setattr(fsutil, "syncfs", lambda path: False)
    synced = _record_fsyncs(monkeypatch)
    state = {f"layer{i}": {"w": np.full((3, 5), i, np.float32), "b": np.arange(i + 1)} for i in range(40)}
    state["big"] = np.arange(100_000, dtype=np.float64)  # several chunks
    gpuckpt.save(state, tmp_path / "ck", sync=sync, chunk_bytes=1 << 16)
    missing = _inodes_under(str(tmp_path / "ck")) - synced
    assert not missing, f"{len(missing)} files or directories of the checkpoint were never fsynced"


def test_writeback_is_started_early_only_for_large_chunk_files(tmp_path, monkeypatch):
    sizes: list[int] = []
    monkeypatch.setattr(fsutil, "start_writeback", lambda fd: sizes.append(os.fstat(fd).st_size))
    state = {f"small{i}": np.ones(256, np.float32) for i in range(100)}
    state["large"] = np.ones(1 << 19, np.float32)  # 2 MiB: two chunks of 1 MiB
    gpuckpt.save(state, tmp_path / "ck", sync="fs", chunk_bytes=1 << 20)
    assert sorted(sizes) == [(1 << 20) + 4, (1 << 20) + 4]  # data + CRC32C trailer


def test_batched_small_chunks_keep_their_order_among_large_ones(tmp_path):
    # small host chunks reach the I/O threads in batches; interleaving them with
    # multi-chunk tensors must still pair every chunk with its own checksum
    rng = np.random.default_rng(7)
    state: dict[str, np.ndarray] = {}
    for i in range(300):
        state[f"s{i:03d}"] = rng.standard_normal(int(rng.integers(1, 3000))).astype(np.float32)
        if i % 50 == 0:
            state[f"m{i:03d}"] = rng.standard_normal((97, 1031))
    md = gpuckpt.save(state, tmp_path / "ck", chunk_bytes=64 << 10, threads=3)
    assert max(len(md.state_dict_metadata[k].chunks) for k in state) > 10
    back = gpuckpt.load_state_dict(tmp_path / "ck")
    for k, v in state.items():
        np.testing.assert_array_equal(back[k], v)


@pytest.mark.parametrize("content_hash", [False, True])
def test_large_chunks_between_small_ones_keep_their_own_results(tmp_path, content_hash):
    # a large chunk is a job of its own while the small chunks around it share batches: every
    # chunk must still get its own checksum (and hashes), whatever order the jobs end in
    rng = np.random.default_rng(8)
    state: dict[str, np.ndarray] = {}
    for i in range(120):
        state[f"b{i:03d}"] = rng.standard_normal(int(rng.integers(1, 3000))).astype(np.float32)
        if i % 7 == 0:
            state[f"w{i:03d}"] = rng.standard_normal(int(rng.integers(1 << 18, 3 << 19))).astype(np.float32)
    path = tmp_path / "ck"
    gpuckpt.save(state, path, chunk_bytes=4 << 20, threads=3, content_hash=content_hash)
    back = gpuckpt.load_state_dict(path)
    for k, v in state.items():
        np.testing.assert_array_equal(back[k], v)
    assert verify_checkpoint(path).ok
