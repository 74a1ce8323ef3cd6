"""Format version 2: large checkpoints keep their per-chunk records in a checksummed chunk table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import gpuckpt
from gpuckpt.errors import CheckpointCorruptedError, MetadataError, MissingChunkError
from gpuckpt.format.checksum import crc32c
from gpuckpt.format.documents import _canonical
from gpuckpt.format.records import (
    ROWS_PER_CHUNK,
    TABLE_MIN_CHUNKS,
    ChunkTable,
    column_array_name,
)
from gpuckpt.metadata import GridTensorStorageMetadata, TensorStorageMetadata
from gpuckpt.options import SaveOptions
from gpuckpt.planning.plan import plan_save
from gpuckpt.saving.commit import write_table
from gpuckpt.saving.session import execute_save
from gpuckpt.saving.sources import describe_state
from gpuckpt.saving.writing import open_save_writer
from gpuckpt.storage.stores import open_reader
from gpuckpt.verify import verify_checkpoint

TABLE = column_array_name("crc32c")


def _root(path: Path) -> dict[str, Any]:
    return json.loads((path / "zarr.json").read_bytes())["attributes"]["gpuckpt"]["metadata"]  # type: ignore[no-any-return]


def _rewrite(path: Path, change: Any) -> None:
    doc = json.loads((path / "zarr.json").read_bytes())
    md = doc["attributes"]["gpuckpt"]["metadata"]
    change(md)
    doc["attributes"]["gpuckpt"]["metadata_crc32c"] = crc32c(_canonical(md))
    (path / "zarr.json").write_text(json.dumps(doc))


def save_with_table(state: dict[str, Any], path: Path, chunk_bytes: int = 64) -> gpuckpt.Metadata:
    """A save whose chunk records go to the chunk table whatever its size (the fixtures' switch)."""
    options = SaveOptions(chunk_bytes=chunk_bytes)
    local, sources = describe_state(state, allow_pickle=False)
    plan = plan_save([local], chunk_bytes=chunk_bytes)
    writer = open_save_writer(path, options, expected_files=plan.nfiles, direct_io=False)
    return execute_save(plan, sources, writer, options, checkpoint_id="t", table=True)


def test_a_large_checkpoint_lists_no_chunk_and_reads_back(tmp_path: Path) -> None:
    w = np.arange(4200 * 4, dtype=np.float32).reshape(4200, 4)
    b = np.arange(7, dtype=np.int64)
    md = gpuckpt.save({"w": w, "b": b, "step": 3}, tmp_path / "c", chunk_bytes=16)
    assert len(md.state_dict_metadata["w"].chunks) == 4200 > TABLE_MIN_CHUNKS
    raw = _root(tmp_path / "c")
    assert raw["version"] == "2"
    assert "chunks" not in raw["state_dict_metadata"]["w"]
    assert raw["storage_data"]["tensors"]["w"] == {
        "name": "w",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, 4]}},
        "rows": raw["storage_data"]["tensors"]["w"]["rows"],
    }
    assert raw["storage_data"]["chunk_table"]["rows"] == 4200 + len(md.state_dict_metadata["b"].chunks)
    assert (tmp_path / "c" / "zarr.json").stat().st_size < 2000  # not 100 bytes per chunk
    # the metadata keeps its behaviour: chunk lists are built from the grid when asked for
    got = gpuckpt.read_metadata(tmp_path / "c")
    entry = got.state_dict_metadata["w"]
    assert isinstance(entry, TensorStorageMetadata) and "chunks" not in vars(entry)
    assert entry.chunks[7].offsets == (7, 0) and entry.chunks[7].sizes == (1, 4)
    assert got.state_dict_metadata == md.state_dict_metadata
    loaded = gpuckpt.load_state_dict(tmp_path / "c")
    assert np.array_equal(loaded["w"], w) and np.array_equal(loaded["b"], b) and loaded["step"] == 3
    assert verify_checkpoint(tmp_path / "c").ok
    g = zarr.open_group(tmp_path / "c", mode="r")
    assert np.array_equal(g["w"][...], w) and np.array_equal(g["b"][...], b)
    table = g[TABLE][...]
    rows = raw["storage_data"]["tensors"]["w"]["rows"]
    assert table[rows + 5] == crc32c(w[5].tobytes())


def test_tensorstore_reads_a_large_checkpoint_if_installed(tmp_path: Path) -> None:
    ts = pytest.importorskip("tensorstore")
    w = np.arange(4200 * 4, dtype=np.float32).reshape(4200, 4)
    gpuckpt.save({"w": w}, tmp_path / "c", chunk_bytes=16)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "c" / "w")}}
    assert np.array_equal(ts.open(spec).result().read().result(), w)


def test_lazy_chunk_lists_compare_pickle_and_print_as_plain_ones() -> None:
    from gpuckpt.format.grid import ChunkGrid

    props = gpuckpt.TensorProperties(np.dtype("float32"))
    lazy = GridTensorStorageMetadata(props, (10, 4), grid=ChunkGrid.regular((10, 4), (3, 4)), listed=False)
    plain = TensorStorageMetadata(
        props,
        (10, 4),
        [gpuckpt.ChunkStorageMetadata((i, 0), (min(3, 10 - i), 4)) for i in range(0, 10, 3)],
    )
    assert plain == lazy and lazy == plain and repr(lazy) == repr(plain)
    import pickle

    again = pickle.loads(pickle.dumps(lazy))
    assert type(again) is TensorStorageMetadata and again == plain
    import copy
    import dataclasses

    fresh = GridTensorStorageMetadata(props, (10, 4), grid=ChunkGrid.regular((10, 4), (3, 4)), listed=False)
    assert copy.deepcopy(fresh) == plain
    bigger = dataclasses.replace(fresh, size=(10, 5))
    assert bigger.size == (10, 5) and bigger.chunks == plain.chunks and fresh == plain


def test_a_damaged_chunk_table_fails_the_load_and_verify(tmp_path: Path) -> None:
    w = np.arange(40.0).reshape(10, 4)
    save_with_table({"w": w}, tmp_path / "c")
    chunk = tmp_path / "c" / TABLE / "c.0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptedError, match="chunk table"):
        gpuckpt.load_state_dict(tmp_path / "c")
    report = verify_checkpoint(tmp_path / "c")
    assert not report.ok and "chunk table" in report.damage[0].where
    chunk.unlink()
    with pytest.raises(MissingChunkError, match="is missing"):
        gpuckpt.load({"w": np.zeros_like(w)}, tmp_path / "c")


def test_table_rows_that_overlap_are_refused(tmp_path: Path) -> None:
    save_with_table({"a": np.ones(6), "b": np.zeros(6)}, tmp_path / "c", chunk_bytes=16)

    def overlap(md: dict[str, Any]) -> None:
        t = md["storage_data"]["tensors"]
        t["b"]["rows"] = t["a"]["rows"]

    _rewrite(tmp_path / "c", overlap)
    with pytest.raises(MetadataError, match="rows overlap or are left out"):
        gpuckpt.read_metadata(tmp_path / "c")

    def huge(md: dict[str, Any]) -> None:
        md["storage_data"]["chunk_table"]["rows"] = 1 << 40

    _rewrite(tmp_path / "c", huge)
    with pytest.raises(MetadataError, match="rows is"):
        gpuckpt.read_metadata(tmp_path / "c")


def test_a_load_reads_only_the_table_chunks_of_its_rows(tmp_path: Path) -> None:
    rows = ROWS_PER_CHUNK + 100
    column = (np.arange(rows, dtype=np.uint64) * 2654435761 % 2**32).astype(np.uint32)
    writer = open_save_writer(tmp_path / "c", SaveOptions(), expected_files=4, direct_io=False)
    writer.begin()
    entry = write_table(writer, {"crc32c": column})
    writer.commit(b'{"zarr_format":3,"node_type":"group","attributes":{}}')
    table = ChunkTable.parse(entry)
    assert len(entry["columns"]["crc32c"]["chunk_crc32c"]) == 2
    (tmp_path / "c" / TABLE / "c.0").unlink()  # rows of the first table chunk are gone
    reader = open_reader(tmp_path / "c")
    assert np.array_equal(
        table.read(reader, "crc32c", ROWS_PER_CHUNK + 3, 50), column[ROWS_PER_CHUNK + 3 :][:50]
    )
    with pytest.raises(MissingChunkError):
        table.read(reader, "crc32c", ROWS_PER_CHUNK - 1, 2)


def test_a_table_is_believed_only_as_far_as_its_files_hold_its_rows(tmp_path: Path) -> None:
    save_with_table({"w": np.arange(40.0).reshape(10, 4)}, tmp_path / "c")
    chunk = tmp_path / "c" / TABLE / "c.0"
    chunk.write_bytes(chunk.read_bytes()[:-8])  # the root document claims rows the file lacks
    with pytest.raises(CheckpointCorruptedError, match="bytes, expected"):
        gpuckpt.read_metadata(tmp_path / "c")
    assert not verify_checkpoint(tmp_path / "c").ok
