"""Chunk files written through kept maps of the files a save reuses (``reuse_files_of`` with
``maps``, what a local tier on tmpfs does): the bytes and checksums equal those of ``write()``,
segment records included; the maps are kept and used again by the next save; a file that
does not fit (another size, pages not allocated, too many maps) and a file cut shorter under
its map during the copy (a real SIGBUS, caught) are written with ``write()`` instead."""

from __future__ import annotations

import dataclasses
import mmap
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.background import async_save_with_options
from gpuckpt.options import SaveOptions
from gpuckpt.storage.base import ChunkWrites
from gpuckpt.storage.local import crccopy
from gpuckpt.storage.local.filemaps import FileMaps
from gpuckpt.storage.local.writer import LocalWriter
from gpuckpt.storage.stores import file_system_type
from gpuckpt.verify import verify_checkpoint

pytestmark = pytest.mark.skipif(not crccopy.available(), reason="needs the native copy-with-CRC loop")

CHUNK = 4 << 20  # chunks over 1 MiB: written one by one, the large ones through maps


def _save(state: dict[str, Any], path: Path, reuse: Path | None, maps: FileMaps | None) -> None:
    options = SaveOptions(sync="none", chunk_bytes=CHUNK)
    async_save_with_options(state, path, options, reuse_files_of=reuse, file_maps=maps).result()


def _chunk_files(root: Path) -> dict[str, os.stat_result]:
    return {
        str(p.relative_to(root)): p.stat()
        for p in root.rglob("*")
        if p.is_file() and p.name != "zarr.json" and p.stat().st_size >= FileMaps.MIN_BYTES
    }


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal(3 << 20).astype(np.float32),  # 12 MiB: three 4 MiB chunks
        "b": rng.standard_normal((700, 1001)).astype(np.float32),  # one chunk of 2.7 MiB
        "small": np.arange(10, dtype=np.int64),
        "step": seed,
    }


def _check(path: Path, state: dict[str, Any]) -> None:
    got = gpuckpt.load_state_dict(path)
    for k, v in state.items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(got[k], v)
        else:
            assert got[k] == v
    assert verify_checkpoint(path).ok


def test_a_reused_file_of_the_same_size_is_written_through_its_kept_map(tmp_path: Path) -> None:
    maps = FileMaps()
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _save(_state(1), a, None, maps)  # new files: written with write()
    assert len(maps) == 0
    inodes = {rel: st.st_ino for rel, st in _chunk_files(a).items()}
    assert len(inodes) == 4
    _save(_state(2), b, a, maps)  # the same sizes: through maps, kept
    assert {rel: st.st_ino for rel, st in _chunk_files(b).items()} == inodes
    assert len(maps) == 4
    _check(b, _state(2))
    kept = {key: k.map for key, k in maps._maps.items()}
    _save(_state(3), c, b, maps)  # the next save uses the same maps again
    assert {key: k.map for key, k in maps._maps.items()} == kept
    _check(c, _state(3))
    maps.close()


@dataclasses.dataclass
class Written:
    crc: int
    segments: Any
    stored: bytes
    mapped: int


def _write_one(
    tmp: Path, reuse: Path | None, maps: FileMaps | None, data: np.ndarray, pad: int, to: str = "new"
) -> Written:
    """One chunk file written by a LocalWriter (reusing ``reuse``'s files with ``maps``), then
    published at ``tmp / to`` (or, for ``to="new"``, abandoned)."""
    w = LocalWriter(tmp / to, sync="none")
    if reuse is not None:
        w.reuse_files_of(reuse, maps)
    w.begin()
    w.write_array_document("x", b"{}")
    (crc,) = w.write_chunks(ChunkWrites(["x"], ["c.0"], [data], [pad], stable=False))
    stored = (w.tmp / "x" / "c.0").read_bytes()
    if to == "new":
        w.abort()
    else:
        w.commit(b"{}")
    return Written(int(crc), getattr(crc, "segments", None), stored, w.mapped_writes)


@pytest.mark.parametrize("nbytes", [(1 << 20) + 3, 2 << 20, (5 << 20) + 777])
@pytest.mark.parametrize("pad", [0, 5])
def test_checksums_and_segment_records_equal_those_of_write(tmp_path: Path, nbytes: int, pad: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    plain = _write_one(tmp_path, None, None, data, pad)
    old = tmp_path / "old" / "x"
    old.mkdir(parents=True)
    (old / "c.0").write_bytes(bytes(nbytes + pad + 4))  # the size the chunk file will have
    maps = FileMaps()
    through = _write_one(tmp_path, tmp_path / "old", maps, data, pad)
    assert through.mapped == 1 and plain.mapped == 0
    assert (through.crc, through.segments, through.stored) == (plain.crc, plain.segments, plain.stored)
    assert through.stored[:nbytes] == data.tobytes() and through.stored[nbytes : nbytes + pad] == bytes(pad)
    maps.close()


def _reused_file(tmp_path: Path, size: int, *, sparse: bool = False) -> Path:
    old = tmp_path / "old" / "x"
    old.mkdir(parents=True)
    if sparse:  # the right size, no page allocated: a write into it could meet a full tmpfs
        with open(old / "c.0", "wb") as f:
            f.truncate(size)
    else:
        (old / "c.0").write_bytes(bytes(size))
    return tmp_path / "old"


@pytest.mark.parametrize("case", ["another size", "not allocated", "no room for its map"])
def test_a_file_that_does_not_fit_is_written_with_write(tmp_path: Path, case: str) -> None:
    data = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8)
    size = data.nbytes + 4
    reuse = _reused_file(
        tmp_path, size + (4096 if case == "another size" else 0), sparse=case == "not allocated"
    )
    maps = FileMaps()
    if case == "no room for its map":
        maps.max_maps = 0
    got = _write_one(tmp_path, reuse, maps, data, 0)
    assert got.mapped == 0 and len(maps) == 0
    assert got.stored[:-4] == data.tobytes() and len(got.stored) == size
    (tmp_path / "plain").mkdir()
    assert got.crc == _write_one(tmp_path / "plain", None, None, data, 0).crc


class _CutsFileUnderItsMap(FileMaps):
    """Once armed, hands out a kept map and then cuts its file to nothing, as ``: > file`` from
    outside would: the copy into the map then faults (SIGBUS) on its first page."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.armed = False

    def get(self, st: os.stat_result, size: int, *, writable: bool) -> Any:
        m = super().get(st, size, writable=writable)
        if m is not None and self.armed:
            (path,) = [p for p in self.root.rglob("*") if p.is_file() and p.stat().st_ino == st.st_ino]
            os.truncate(path, 0)
        return m


def test_a_file_cut_shorter_under_its_map_is_written_again_with_write(tmp_path: Path) -> None:
    data = np.random.default_rng(6).integers(0, 256, 3 << 20, dtype=np.uint8)
    maps = _CutsFileUnderItsMap(tmp_path)
    first = _write_one(tmp_path, _reused_file(tmp_path, data.nbytes + 4), maps, data, 0, to="first")
    assert first.mapped == 1 and len(maps) == 1  # its map kept
    maps.armed = True
    faults = crccopy.faults()
    again = _write_one(tmp_path, tmp_path / "first", maps, data, 0, to="second")
    assert crccopy.faults() == faults + 1  # the fault was caught, not the process killed
    assert again.mapped == 0 and again.stored == first.stored and again.crc == first.crc
    maps.close()


def _tier_run(local_dir: Path, root: Path) -> int:
    """Five steps of a manager with a tier in ``local_dir``; restored bit-exactly from the tier;
    returns how many maps the tier kept."""
    mgr = gpuckpt.CheckpointManager(
        root, local_dir=local_dir, replicas=0, local_max_to_keep=2, persist_interval_steps=100
    )
    try:
        for step in range(1, 6):
            mgr.save(step, _state(step))
            mgr.wait()
        tier = mgr._tiered.tier
        kept = len(tier._file_maps)
    finally:
        mgr.close()
    target = {k: np.zeros_like(v) if isinstance(v, np.ndarray) else None for k, v in _state(0).items()}
    again = gpuckpt.CheckpointManager(root, local_dir=local_dir, replicas=0, persist_interval_steps=100)
    try:
        assert again.restore(target) == 5 and again.last_restore is not None
        assert again.last_restore.source == "tiers"
    finally:
        again.close()
    for k, v in _state(5).items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(target[k], v)
    for part in local_dir.iterdir():
        if part.name.startswith("step_"):
            assert verify_checkpoint(part).ok
    return kept


@pytest.mark.skipif(file_system_type("/dev/shm") != "tmpfs", reason="needs a tmpfs at /dev/shm")
def test_a_tier_on_tmpfs_writes_its_parts_through_kept_maps(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        assert _tier_run(Path(shm) / "tier", tmp_path / "root") == 4  # the chunk files of 1 MiB and more


def test_a_tier_elsewhere_writes_with_write(tmp_path: Path) -> None:
    kept = _tier_run(tmp_path / "tier", tmp_path / "root")
    assert kept == (4 if file_system_type(tmp_path) == "tmpfs" else 0)


def test_a_map_refused_by_the_system_leaves_the_file_to_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the system refuses the map (a limit on maps, a file system without them), the chunk
    is written with ``write()``, whole and checksummed."""

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise OSError(12, "Cannot allocate memory")

    data = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8)
    reuse = _reused_file(tmp_path, data.nbytes + 4)
    monkeypatch.setattr(mmap, "mmap", refuse)
    maps = FileMaps()
    got = _write_one(tmp_path, reuse, maps, data, 0)
    monkeypatch.undo()
    assert got.mapped == 0 and len(maps) == 0 and got.stored[:-4] == data.tobytes()
    (tmp_path / "plain").mkdir()
    assert got.crc == _write_one(tmp_path / "plain", None, None, data, 0).crc
