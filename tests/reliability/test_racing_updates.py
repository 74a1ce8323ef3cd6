"""A save that races a thread updating its arrays publishes a checkpoint that matches its own
checksums and hashes: the values may be torn (the caller's race), the checkpoint never is.

A trainer thread adds to every array in place, over and over, while synchronous saves
run: small chunks (the native batches), large ones (piece by piece, with segment CRCs),
forced ``O_DIRECT`` writes from page-aligned memory, incremental saves that hash their
chunks, saves to S3, and a manager that retires the previous step.
"""

from __future__ import annotations

import contextlib
import mmap
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.format import contenthash
from gpuckpt.saving.incremental import open_base
from gpuckpt.verify import verify_checkpoint

ROUNDS = 6


def _aligned(n: int) -> np.ndarray:
    """A float32 array of ``n`` elements in page-aligned memory (as a staging arena is)."""
    return np.frombuffer(mmap.mmap(-1, n * 4), np.float32)


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    big = _aligned(3 << 20)  # 12 MiB: several pieces and segments, written direct where forced
    big[:] = rng.standard_normal(big.size)
    return {
        "big": big,
        "mid": rng.standard_normal(600_000).astype(np.float32),  # 2.3 MiB: the per-file path
        **{f"small{i}": rng.standard_normal(20_000).astype(np.float32) for i in range(24)},  # native batches
        "step": 0,
    }


@contextlib.contextmanager
def _trainer(state: dict[str, Any]) -> Iterator[None]:
    """A thread updating every array of ``state`` in place until the block ends."""
    arrays = [v for v in state.values() if isinstance(v, np.ndarray)]
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            for a in arrays:
                np.add(a, 1.0, out=a)  # releases the GIL: runs while the save's threads read

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def _check_consistent(path: Any, **options: Any) -> None:
    report = verify_checkpoint(path, **options)
    assert report.ok, report.damage
    gpuckpt.load_state_dict(path, **options)  # checksums checked again on the load path


def _check_hashes(path: Path) -> int:
    """Every recorded content hash is that of the stored chunk's bytes; returns how many."""
    index = open_base(str(path))
    assert index is not None
    hashed = 0
    for chunks in index._chunks.values():
        for c in chunks.values():
            if c.xxh3t is None:
                continue
            data = Path(c.ref.location, c.ref.name, c.ref.key).read_bytes()[:-4]
            h = contenthash.ChunkHasher()
            h.update(memoryview(data))
            assert h.digests() == (c.xxh3t, c.head), (c.ref.name, c.ref.key)
            hashed += 1
    return hashed


@pytest.mark.parametrize("direct", ["0", "1"], ids=["buffered", "direct"])
def test_saves_racing_updates_publish_consistent_checkpoints(
    tmp_path: Path, direct: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUCKPT_DIRECT_IO", direct)
    state = _state()
    with _trainer(state):
        for i in range(ROUNDS):
            gpuckpt.save(state, tmp_path / f"c{i}", sync="none" if direct == "0" else "auto")
    for i in range(ROUNDS):
        _check_consistent(tmp_path / f"c{i}")


def test_the_manager_never_retires_a_good_step_for_an_unloadable_one(tmp_path: Path) -> None:
    state = _state()
    with gpuckpt.CheckpointManager(tmp_path, max_to_keep=1, async_save=False) as mgr:
        mgr.save(0, state)
        with _trainer(state):
            for step in range(1, ROUNDS + 1):
                mgr.save(step, state)
        steps = mgr.all_steps()
    assert steps == [ROUNDS]
    _check_consistent(mgr.step_path(ROUNDS))


@pytest.mark.skipif(not contenthash.available(), reason="xxhash is not installed")
def test_incremental_saves_racing_updates_record_the_hashes_of_the_bytes_stored(tmp_path: Path) -> None:
    state = _state()
    gpuckpt.save(state, tmp_path / "c0", content_hash=True)
    with _trainer(state):
        for i in range(1, ROUNDS + 1):
            gpuckpt.save(state, tmp_path / f"c{i}", base=tmp_path / f"c{i - 1}", sync="none")
    for i in range(ROUNDS + 1):
        _check_consistent(tmp_path / f"c{i}")
        assert _check_hashes(tmp_path / f"c{i}") > 0


def test_saves_to_s3_racing_updates_publish_consistent_checkpoints() -> None:
    pytest.importorskip("obstore")
    pytest.importorskip("moto.server")
    from gpuckpt.testing.s3server import loopback_s3, s3_options

    state = _state()
    with loopback_s3("race") as endpoint:
        # parts of 5 MiB: the 12 MiB chunk goes up as a multipart upload, the others in one put
        opts = s3_options(endpoint, part_bytes=5 << 20)
        with _trainer(state):
            for i in range(ROUNDS // 2):
                gpuckpt.save(state, f"s3://race/c{i}", storage_options=opts)
        for i in range(ROUNDS // 2):
            _check_consistent(f"s3://race/c{i}", storage_options=opts)


def test_a_checkpoint_removed_as_its_load_begins_is_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # another process's retention deleting the step between the open and the check of its chunk
    # files (found 1-6 times in 40 s of restores racing a manager): a bare FileNotFoundError
    from gpuckpt.storage.local import reader

    state = {"w": np.ones(1000, np.float32), "v": np.ones(1000, np.float32)}
    gpuckpt.save(state, tmp_path / "step_1")
    sizes = reader.LocalReader.chunk_sizes

    def removed_first(self: Any, names: Any, keys: Any) -> Any:
        shutil.rmtree(tmp_path / "step_1")
        return sizes(self, names, keys)

    monkeypatch.setattr(reader.LocalReader, "chunk_sizes", removed_first)
    target = {"w": np.zeros(1000, np.float32), "v": np.zeros(1000, np.float32)}
    with pytest.raises(gpuckpt.CheckpointNotFoundError, match="was removed while it was read"):
        gpuckpt.load(target, tmp_path / "step_1")
    assert not target["w"].any()
