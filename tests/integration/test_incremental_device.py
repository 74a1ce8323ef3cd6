"""Incremental saves of device arrays: chunks are hashed on the device before any of them is staged,
and those equal to the base's are reused without crossing to the host.

The device is host memory standing in for one (:class:`~gpuckpt.device.host_backend.HostBackend`,
arrays presented through :class:`~gpuckpt.testing.fakedevice.EmulatedDeviceArray`): a real back end
whose copies to the host are counted (``copies``, ``bytes_to_host``), so what was staged is observed
on the pipeline itself. Real checkpoints on ``tmp_path``; sharing is observed on the files.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt import background
from gpuckpt.device.host_backend import HostBackend
from gpuckpt.errors import CheckpointWriteError, IncrementalBaseWarning
from gpuckpt.format import contenthash
from gpuckpt.format.checksum import crc32c
from gpuckpt.testing.fakedevice import EmulatedDeviceArray
from tests.integration.test_incremental import (
    CHUNK,
    _crc_forge,
    assert_loads,
    changed,
    chunk_files,
    make_state,
)

pytestmark = [
    pytest.mark.filterwarnings("error::gpuckpt.errors.IncrementalBaseWarning"),
    pytest.mark.skipif(not contenthash.available(), reason="needs xxhash"),
]

#: the chunks ``changed`` alters and their bytes: a, b whole, rows 151-301 of big
CHANGED = {"model.a/c.0", "model.b/c.0", "model.big/c.1.0"}
CHANGED_BYTES = 3000 * 4 + 700 * 8 + 151 * 1001 * 8


def on_device(state: dict[str, Any], backend: HostBackend) -> dict[str, Any]:
    return {
        "model": {k: EmulatedDeviceArray(v, backend) for k, v in state["model"].items()},
        "step": state["step"],
    }


def records(path: Path) -> dict[str, Any]:
    """Each tensor's listed chunk records (key, size, CRC32C, hashes)."""
    tensors = gpuckpt.read_metadata(path).storage_data["tensors"]
    return {fqn: t["chunks"] for fqn, t in tensors.items()}


def test_unchanged_device_chunks_are_reused_without_being_staged(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.save(on_device(s0, HostBackend()), tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    s1 = changed(s0)
    backend = HostBackend()
    gpuckpt.save(on_device(s1, backend), tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    # every chunk hashed on the "device"; only the three changed ones copied to the host
    assert backend.hashed_chunks == 8
    assert backend.copies == len(CHANGED)
    assert backend.bytes_to_host == CHANGED_BYTES
    f0, f1 = chunk_files(tmp_path / "c0"), chunk_files(tmp_path / "c1")
    assert sorted(f0) == sorted(f1) and len(f1) == 8
    new = {k for k in f1 if f1[k].st_ino != f0[k].st_ino}
    assert new == CHANGED
    for k, st in f1.items():
        assert st.st_nlink == (1 if k in new else 2), k
    assert_loads(tmp_path / "c0", s0)
    assert_loads(tmp_path / "c1", s1)
    # the same checkpoint as the host-array path: records (CRC32C from the base, hashes) and bytes
    gpuckpt.save(s1, tmp_path / "h1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    assert records(tmp_path / "c1") == records(tmp_path / "h1")
    for k in f1:
        assert (tmp_path / "c1" / k).read_bytes() == (tmp_path / "h1" / k).read_bytes(), k
    # and the next save compares with the recorded hashes of reused chunks
    backend2 = HostBackend()
    gpuckpt.save(on_device(s1, backend2), tmp_path / "c2", chunk_bytes=CHUNK, base=tmp_path / "c1")
    assert backend2.copies == 0 and backend2.bytes_to_host == 0
    f2 = chunk_files(tmp_path / "c2")
    assert all(f2[k].st_ino == f1[k].st_ino for k in f1)
    assert_loads(tmp_path / "c2", s1)


def test_device_chunk_with_the_base_crc32c_but_other_bytes_is_written(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, 4096, dtype=np.uint8)
    b = a.copy()
    b[0] ^= 0xFF
    b[-4:] = np.frombuffer(_crc_forge(b[:-4].tobytes(), crc32c(a.tobytes())), np.uint8)
    assert b.tobytes() != a.tobytes()
    gpuckpt.save({"x": a, "y": a}, tmp_path / "c0", content_hash=True)
    backend = HostBackend()
    state = {"x": EmulatedDeviceArray(b, backend), "y": EmulatedDeviceArray(a.copy(), backend)}
    gpuckpt.save(state, tmp_path / "c1", base=tmp_path / "c0")
    assert backend.hashed_chunks == 2 and backend.bytes_to_host == b.nbytes  # x staged, y not
    f1 = chunk_files(tmp_path / "c1")
    assert f1["x/c.0"].st_nlink == 1 and f1["y/c.0"].st_nlink == 2
    got = gpuckpt.load_state_dict(tmp_path / "c1")
    assert got["x"].tobytes() == b.tobytes() and got["y"].tobytes() == a.tobytes()


def test_reuse_refused_device_chunks_are_staged_and_written(tmp_path: Path) -> None:
    # a base whose chunk file is gone: the digests match, the writer refuses, the chunk is staged
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    (tmp_path / "c0" / "model.emb" / "c.0.0").unlink()
    backend = HostBackend()
    with pytest.warns(
        IncrementalBaseWarning, match=r"1 of the chunks.*'c\.0\.0' of array 'model\.emb', missing"
    ):
        gpuckpt.save(on_device(s0, backend), tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0")
    assert backend.copies == 1 and backend.bytes_to_host == 256 * 64 * 4
    f1 = chunk_files(tmp_path / "c1")
    assert f1["model.emb/c.0.0"].st_nlink == 1
    assert all(st.st_nlink == 2 for k, st in f1.items() if k != "model.emb/c.0.0")
    assert_loads(tmp_path / "c1", s0)


@pytest.mark.parametrize("staging", ["host", "device"])
def test_async_device_incremental_save_keeps_the_snapshot(tmp_path: Path, staging: str) -> None:
    """The save holds the values of the call: arrays changed right after it returns (unchanged
    chunks overwritten included) change nothing, and unchanged chunks are still shared."""
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    s1 = changed(s0)
    live = {"model": {k: v.copy() for k, v in s1["model"].items()}, "step": s1["step"]}
    backend = HostBackend()
    future = gpuckpt.async_save(
        on_device(live, backend), tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0", staging=staging
    )
    for v in live["model"].values():
        v[...] = 0  # the caller reuses its arrays at once
    future.result(timeout=60)
    assert_loads(tmp_path / "c1", s1)
    f0, f1 = chunk_files(tmp_path / "c0"), chunk_files(tmp_path / "c1")
    assert {k for k in f1 if f1[k].st_ino != f0[k].st_ino} == CHANGED
    if staging == "device":
        # the snapshot stays on the device: unchanged chunks of it never crossed to the host
        assert backend.bytes_to_host == CHANGED_BYTES
    else:
        # hashed before the call returned: emb, unchanged, was not copied into the snapshot;
        # the arrays with a changed chunk were, whole (big: one of its five chunks changed)
        assert backend.hashed_chunks == 8
        assert backend.bytes_to_host == 3000 * 4 + 700 * 8 + 751 * 1001 * 8


def _occupied_writer() -> tuple[threading.Event, Any]:
    """Hold the background writer still: saves queued now start when the event is set."""
    gate = threading.Event()
    return gate, background._writer_executor().submit(gate.wait)


def test_async_shared_array_refused_reuse_reads_the_base_back(tmp_path: Path) -> None:
    """An array not copied into the snapshot (unchanged at the call) whose chunk the writer then
    cannot share: its bytes come back from the base, checked against the snapshot's digests."""
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm is on the same file system as tmp_path")
    shm = Path("/dev/shm") / f"gpuckpt-incr-dev-{os.getpid()}-{tmp_path.name}"
    try:
        s0 = make_state()
        gpuckpt.save(s0, shm / "c0", chunk_bytes=CHUNK, content_hash=True)  # links refused: EXDEV
        live = {"model": {k: v.copy() for k, v in s0["model"].items()}, "step": 0}
        backend = HostBackend()
        future = gpuckpt.async_save(
            on_device(live, backend), tmp_path / "c1", chunk_bytes=CHUNK, base=shm / "c0"
        )
        for v in live["model"].values():
            v[...] = 0
        future.result(timeout=60)
        assert backend.bytes_to_host == 0  # nothing copied: every array was unchanged
        assert all(st.st_nlink == 1 for st in chunk_files(tmp_path / "c1").values())
        assert_loads(tmp_path / "c1", s0)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_async_shared_array_whose_base_chunk_went_away_fails_the_save(tmp_path: Path) -> None:
    s0 = make_state()
    gpuckpt.save(s0, tmp_path / "c0", chunk_bytes=CHUNK, content_hash=True)
    gate, blocker = _occupied_writer()
    try:
        future = gpuckpt.async_save(
            on_device(s0, HostBackend()), tmp_path / "c1", chunk_bytes=CHUNK, base=tmp_path / "c0"
        )
        # the base loses emb's chunk under the queued save: it cannot be shared nor read back
        (tmp_path / "c0" / "model.emb" / "c.0.0").unlink()
    finally:
        gate.set()
        blocker.result(timeout=60)
    with pytest.raises(CheckpointWriteError, match=r"model\.emb/c\.0\.0 of the base held this save's chunk"):
        future.result(timeout=60)
    assert not (tmp_path / "c1").exists()  # nothing published


def test_async_shared_array_whose_base_bytes_changed_is_not_written_from_them(tmp_path: Path) -> None:
    """The base chunk of an array not copied into the snapshot is replaced (its trailer kept) while
    the save is queued, and links are refused: the bytes read back do not match the snapshot's
    digests, so the save fails instead of writing them."""
    if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("/dev/shm is on the same file system as tmp_path")
    shm = Path("/dev/shm") / f"gpuckpt-incr-dev2-{os.getpid()}-{tmp_path.name}"
    try:
        s0 = make_state()
        gpuckpt.save(s0, shm / "c0", chunk_bytes=CHUNK, content_hash=True)
        gate, blocker = _occupied_writer()
        try:
            future = gpuckpt.async_save(
                on_device(s0, HostBackend()), tmp_path / "c1", chunk_bytes=CHUNK, base=shm / "c0"
            )
            emb = shm / "c0" / "model.emb" / "c.0.0"
            data = bytearray(emb.read_bytes())
            data[0] ^= 1  # the body changes, the recorded trailer stays
            emb.unlink()
            emb.write_bytes(bytes(data))
        finally:
            gate.set()
            blocker.result(timeout=60)
        with pytest.raises(CheckpointWriteError, match="its bytes changed since"):
            future.result(timeout=60)
        assert not (tmp_path / "c1").exists()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
