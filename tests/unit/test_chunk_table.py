"""Per-chunk records in both forms (listed JSON, chunk table), fixed-width columns included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuckpt.errors import MetadataError
from gpuckpt.format import records as ct
from gpuckpt.options import SaveOptions
from gpuckpt.saving.commit import write_table
from gpuckpt.saving.writing import open_save_writer
from gpuckpt.storage.stores import open_reader

KEYS = ["c.0", "c.1", "c.2"]
NBYTES = [44, 44, 24]


@pytest.fixture
def digest_column(monkeypatch: pytest.MonkeyPatch) -> ct.Column:
    """A 16-byte per-chunk field registered next to crc32c, as an optional digest would be."""
    col = ct.Column("digest", np.dtype("u1"), 16)
    monkeypatch.setitem(ct.COLUMNS, "digest", col)
    return col


def test_listed_records_round_trip_with_a_fixed_width_column(digest_column: ct.Column) -> None:
    crcs = np.array([1, 2**32 - 1, 7], np.uint32)
    digests = np.arange(48, dtype=np.uint8).reshape(3, 16)
    records = ct.listed_records(KEYS, NBYTES, {"crc32c": crcs, "digest": digests})
    assert records[1] == {
        "key": "c.1",
        "nbytes": 44,
        "crc32c": 2**32 - 1,
        "digest": bytes(range(16, 32)).hex(),
    }
    cols = ct.parse_listed(records, KEYS, NBYTES, MetadataError)
    assert np.array_equal(cols["crc32c"], crcs) and np.array_equal(cols["digest"], digests)
    # a record without a valid digest leaves the column out: never an error
    records[2]["digest"] = "XYZ"
    assert set(ct.parse_listed(records, KEYS, NBYTES, MetadataError)) == {"crc32c"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r.__setitem__(1, []), "chunk 1 storage entry is not an object"),
        (lambda r: r[1].__setitem__("key", "c.9"), "chunk 1 key 'c.9' is not 'c.1'"),
        (lambda r: r[1].__setitem__("nbytes", 45), "chunk c.1 claims 45 bytes, its shape needs 44"),
        (lambda r: r[1].__setitem__("crc32c", True), "chunk c.1 checksum True is not a 32-bit value"),
        (lambda r: r[1].__setitem__("crc32c", 2**32), "is not a 32-bit value"),
    ],
)
def test_listed_records_are_checked(change: object, message: str) -> None:
    records = ct.listed_records(KEYS, NBYTES, {"crc32c": np.zeros(3, np.uint32)})
    change(records)  # type: ignore[operator]
    with pytest.raises(MetadataError, match=message):
        ct.parse_listed(records, KEYS, NBYTES, MetadataError)


def test_a_table_with_a_fixed_width_column_reads_back_range_by_range(
    digest_column: ct.Column, tmp_path: Path
) -> None:
    rows = ct.ROWS_PER_CHUNK + 5
    crcs = (np.arange(rows, dtype=np.uint64) * 40503 % 2**32).astype(np.uint32)
    digests = (np.arange(rows * 16, dtype=np.uint64) % 251).astype(np.uint8).reshape(rows, 16)
    writer = open_save_writer(tmp_path / "c", SaveOptions(), expected_files=8, direct_io=False)
    writer.begin()
    entry = write_table(writer, {"crc32c": crcs, "digest": digests})
    writer.commit(b'{"zarr_format":3,"node_type":"group","attributes":{}}')
    assert (tmp_path / "c" / ct.column_array_name("digest") / "c.1.0").is_file()
    table = ct.ChunkTable.parse(entry)
    reader = open_reader(tmp_path / "c")
    table.check_files(reader)
    start = ct.ROWS_PER_CHUNK - 2
    assert np.array_equal(table.read(reader, "digest", start, 6), digests[start : start + 6])
    assert np.array_equal(table.read(reader, "crc32c", 0, rows), crcs)
    assert table.read(reader, "crc32c", 3, 0).shape == (0,)
    with pytest.raises(MetadataError, match="outside the table"):
        table.read(reader, "crc32c", rows - 1, 2)


def test_a_reader_ignores_columns_it_does_not_know() -> None:
    entry, _, _ = ct.encode_table({"crc32c": np.ones(3, np.uint32)})
    entry["columns"]["later"] = {"name": "_gpuckpt.table.later", "chunk_crc32c": [0]}
    assert set(ct.ChunkTable.parse(entry).columns) == {"crc32c"}
    del entry["columns"]["crc32c"]
    with pytest.raises(MetadataError, match="'crc32c' column"):
        ct.ChunkTable.parse(entry)


def test_a_table_chunked_otherwise_by_its_writer_is_read(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ct, "ROWS_PER_CHUNK", 7)  # a writer that chunks the table by 7 rows
    crcs = np.arange(20, dtype=np.uint32) * 3
    writer = open_save_writer(tmp_path / "c", SaveOptions(), expected_files=8, direct_io=False)
    writer.begin()
    entry = write_table(writer, {"crc32c": crcs})
    writer.commit(b'{"zarr_format":3,"node_type":"group","attributes":{}}')
    monkeypatch.undo()
    assert entry["rows_per_chunk"] == 7 and len(entry["columns"]["crc32c"]["chunk_crc32c"]) == 3
    table = ct.ChunkTable.parse(entry)
    reader = open_reader(tmp_path / "c")
    table.check_files(reader)
    assert np.array_equal(table.read(reader, "crc32c", 5, 10), crcs[5:15])
    entry["rows_per_chunk"] = ct.MAX_ROWS_PER_CHUNK + 1
    with pytest.raises(MetadataError, match="rows_per_chunk"):
        ct.ChunkTable.parse(entry)
