"""``mem://`` checkpoints (gpuckpt/storage/memory.py): the files of a checkpoint held as
buffers read through the ordinary load pipeline, with the checks of a load from files.

Every test starts from a real checkpoint saved to disk; its files are read into memory.
The in-memory reader must answer every question as the directory's reader does, and a
load from it must give the same arrays, or the same typed error for the same damage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import (
    CheckpointCorruptedError,
    CheckpointNotFoundError,
    MetadataError,
    UnsupportedValueError,
)
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.documents import MAX_ARRAY_DOCUMENT_BYTES
from gpuckpt.format.segments import SEGMENT_BYTES
from gpuckpt.storage.stores import in_memory, open_reader


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "w": rng.standard_normal((3 * SEGMENT_BYTES // 4096 + 5, 1024)).astype(np.float32),  # segmented
        "small": {"b": np.arange(12, dtype=np.int16).reshape(3, 4), "empty": np.zeros(0)},
        "step": 7,
        "name": "run-1",
    }


def _empty(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "w": np.zeros_like(state["w"]),
        "small": {"b": np.zeros_like(state["small"]["b"]), "empty": np.zeros(0)},
        "step": None,
        "name": None,
    }


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def saved(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    state = _state()
    gpuckpt.save(state, tmp_path / "ck")
    return state, tmp_path / "ck"


def _chunk_file(root: Path, array: str) -> str:
    return next(
        str(p.relative_to(root)) for p in (root / array).iterdir() if p.is_file() and p.name != "zarr.json"
    )


def test_a_load_from_memory_gives_what_a_load_from_the_files_gives(saved: Any) -> None:
    state, root = saved
    target = _empty(state)
    with in_memory(_files(root)) as url:
        assert url.startswith("mem://")
        gpuckpt.load(target, url)
        assert gpuckpt.read_metadata(url) == gpuckpt.read_metadata(root)
    assert np.array_equal(target["w"], state["w"]) and np.array_equal(
        target["small"]["b"], state["small"]["b"]
    )
    assert target["step"] == 7 and target["name"] == "run-1" and target["small"]["empty"].shape == (0,)


def test_the_memory_reader_answers_as_the_directory_reader(saved: Any) -> None:
    _, root = saved
    disk = open_reader(root)
    with in_memory(_files(root)) as url:
        mem = open_reader(url)
        assert bytes(mem.read_root()) == bytes(disk.read_root())
        for name in ("w", "small.b", "small.empty"):
            assert bytes(mem.read_array_document(name)) == bytes(disk.read_array_document(name))
            assert mem.chunk_keys(name) == disk.chunk_keys(name)
            for key in disk.chunk_keys(name):
                size = disk.chunk_nbytes(name, key)
                assert size is not None and mem.chunk_nbytes(name, key) == size
                got = [bytearray(size - CRC_BYTES), bytearray(CRC_BYTES)]
                want = [bytearray(size - CRC_BYTES), bytearray(CRC_BYTES)]
                assert mem.read_chunk_crc(name, key, got) == disk.read_chunk_crc(name, key, want)
                assert got == want
                # ranged reads: from an offset, several buffers, the last one past the end
                at = size // 3
                pieces = [bytearray(1000), bytearray(size)]
                disk_pieces = [bytearray(1000), bytearray(size)]
                n, crcs = mem.read_range_crcs(name, key, at, pieces)
                dn, dcrcs = disk.read_range_crcs(name, key, at, disk_pieces)
                assert (n, pieces[0], pieces[1][: n - 1000]) == (
                    dn,
                    disk_pieces[0],
                    disk_pieces[1][: dn - 1000],
                )
                assert crcs[0] == dcrcs[0]
        assert mem.chunk_nbytes("w", "c.9.9") is None and mem.chunk_keys("nothing") == set()


def test_a_damaged_byte_in_memory_is_found_and_names_the_tensor(saved: Any) -> None:
    state, root = saved
    files = _files(root)
    rel = _chunk_file(root, "w")
    data = bytearray(files[rel])
    data[SEGMENT_BYTES + 17] ^= 0x04
    files[rel] = bytes(data)
    with in_memory(files) as url, pytest.raises(CheckpointCorruptedError, match="'w'"):
        gpuckpt.load(_empty(state), url)


def test_a_truncated_chunk_in_memory_is_refused_before_anything_is_read(saved: Any) -> None:
    state, root = saved
    files = _files(root)
    rel = _chunk_file(root, "small.b")
    files[rel] = files[rel][:-3]
    target = _empty(state)
    with in_memory(files) as url, pytest.raises(CheckpointCorruptedError, match=r"small\.b"):
        gpuckpt.load(target, url)
    assert not target["w"].any()  # the size check ran before any chunk was read


def test_an_oversized_document_is_refused_uncopied(saved: Any) -> None:
    _, root = saved
    files = _files(root)
    files["w/zarr.json"] = bytes(MAX_ARRAY_DOCUMENT_BYTES + 1)
    with in_memory(files) as url, pytest.raises(MetadataError, match="MAX_ARRAY_DOCUMENT_BYTES"):
        open_reader(url).read_array_document("w")


def test_a_name_is_readable_only_inside_its_block_and_never_written(saved: Any) -> None:
    state, root = saved
    files = _files(root)
    with in_memory(files) as url:
        pass
    with pytest.raises(CheckpointNotFoundError, match="in memory"):
        gpuckpt.load(_empty(state), url)
    with pytest.raises(CheckpointNotFoundError, match="mem://"):
        gpuckpt.load(_empty(state), "mem://0123456789abcdef")
    del files["zarr.json"]
    with in_memory(files) as url, pytest.raises(CheckpointNotFoundError, match="no zarr.json|has no"):
        gpuckpt.load(_empty(state), url)
    with pytest.raises(UnsupportedValueError, match="read-only"):
        gpuckpt.save(state, "mem://somewhere")
