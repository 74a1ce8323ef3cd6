"""Format version 5: each rank of a distributed save stores its own block of the chunk table.

Thread ranks (the collectives and stores are real; the MPI run of the same code is
tests/distributed/test_plan_cache.py's ``big`` save): what rank 0 receives per save does not
grow with the tensors, the checkpoint reads back bit-exactly through gpuckpt (whole,
resharded on another number of ranks, verified) and zarr-python, damage to a block is
found, and readers of version 4 refuse it as newer.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import zarr
from test_grouped_planning import Recording

import gpuckpt
import gpuckpt.format.metadata as fmt
from gpuckpt.distributed import Coordinator, run_ranks
from gpuckpt.errors import CheckpointCorruptedError, ChecksumError, MetadataError, UnsupportedVersionError
from gpuckpt.format.reader import read_index
from gpuckpt.saving.table_blocks import BlockReport
from gpuckpt.verify import verify_checkpoint

RANKS, ROWS, COLS = 4, 64, 4


def full(i: int, rows: int = ROWS) -> np.ndarray:
    return (np.arange(rows * COLS, dtype=np.float32).reshape(rows, COLS) * (i + 1)).astype(np.float32)


def rank_state(rank: int, tensors: int, ranks: int = RANKS) -> dict[str, Any]:
    per = ROWS // ranks
    state: dict[str, Any] = {
        f"layer{i:03d}": gpuckpt.ShardedArray(
            full(i)[rank * per : (rank + 1) * per].copy(), (rank * per, 0), (ROWS, COLS)
        )
        for i in range(tensors)
    }
    state["norm"] = np.full(COLS, 0.5, np.float32)  # replicated: one rank writes it (the table's tail)
    state["step"] = 11
    return state


def save(path: str, tensors: int, **options: Any) -> dict[int, Recording]:
    recorders: dict[int, Recording] = {}

    def one(c: Coordinator) -> None:
        rec = recorders[c.rank] = Recording(c)
        # a chunk per row: ROWS chunks per tensor, more than a chunk table's threshold in all
        gpuckpt.save(rank_state(c.rank, tensors), path, coordinator=rec, chunk_bytes=COLS * 4, **options)

    run_ranks(RANKS, one)
    return recorders


def root(path: str) -> dict[str, Any]:
    doc = json.loads(Path(path, "zarr.json").read_text())
    return doc["attributes"]["gpuckpt"]["metadata"]


def reports(rec: Recording) -> list[BlockReport]:
    (batch,) = [b for b in rec.gathered if b and isinstance(b[0], BlockReport)]
    return batch


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, Recording]]:
    path = str(tmp_path_factory.mktemp("blocks") / "ckpt")
    return path, save(path, 280)


def test_each_rank_stores_its_block_and_rank_0_receives_no_row_of_it(saved: Any) -> None:
    path, recorders = saved
    md = root(path)
    assert md["version"] == "5"
    table = md["storage_data"]["chunk_table"]
    assert table["blocks"] == {"count": RANKS, "rows": 280 * ROWS // RANKS, "used": 280 * ROWS // RANKS}
    got = reports(recorders[0])
    assert sorted(r.block for r in got) == list(range(RANKS))
    # per rank: the CRC32C of its block's one stored chunk; rows only of the tail (the norm, on one rank)
    assert all(len(r.crcs["crc32c"]) == 1 for r in got)
    assert sum(len(r.tail_rows) for r in got) == 1
    # the block's rows are stored by their rank: chunk b of the column is block b's
    arr = zarr.open_array(str(Path(path, "_gpuckpt.table.crc32c")), mode="r")
    assert arr.shape == (table["rows"],) and arr.chunks == (table["rows_per_chunk"],)


def test_what_rank_0_receives_does_not_grow_with_the_tensors(tmp_path: Path, saved: Any) -> None:
    _, big = saved
    small = save(str(tmp_path / "small"), 70)
    sizes = [max(len(pickle.dumps(r)) for r in reports(rec[0])) for rec in (small, big)]
    # 4x the tensors (and chunks): the same reports, give or take the encoding of larger numbers
    assert sizes[1] < sizes[0] * 1.2, sizes


def test_it_reads_back_whole_resharded_verified_and_through_zarr(saved: Any) -> None:
    path, _ = saved
    loaded = gpuckpt.load_state_dict(path)
    for i in range(280):
        np.testing.assert_array_equal(loaded[f"layer{i:03d}"], full(i))
    assert loaded["step"] == 11
    assert verify_checkpoint(path).ok

    def load(c: Coordinator) -> bool:  # 3 ranks, uneven row shards of another split
        cuts = [0, 20, 44, ROWS]
        a, b = cuts[c.rank], cuts[c.rank + 1]
        state = {
            f"layer{i:03d}": gpuckpt.ShardedArray(np.zeros((b - a, COLS), np.float32), (a, 0), (ROWS, COLS))
            for i in range(280)
        }
        gpuckpt.load(state, path, coordinator=c)
        return all(np.array_equal(state[f"layer{i:03d}"].local, full(i)[a:b]) for i in range(280))

    assert run_ranks(3, load) == [True] * 3
    for i in (0, 41, 79):
        np.testing.assert_array_equal(zarr.open_array(str(Path(path, f"layer{i:03d}")), mode="r")[:], full(i))


def test_a_compressed_save_in_blocks_reads_back(tmp_path: Path) -> None:
    path = str(tmp_path / "z")
    save(path, 70, compression="zstd")
    md = root(path)
    assert md["version"] == "5" and set(md["storage_data"]["chunk_table"]["columns"]) == {"crc32c", "nbytes"}
    loaded = gpuckpt.load_state_dict(path)
    for i in range(70):
        np.testing.assert_array_equal(loaded[f"layer{i:03d}"], full(i))


def test_a_damaged_block_of_the_table_is_found(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    save(path, 70)
    block = Path(path, "_gpuckpt.table.crc32c", "c.2")
    data = bytearray(block.read_bytes())
    data[5] ^= 0x10
    block.write_bytes(bytes(data))
    with pytest.raises((ChecksumError, CheckpointCorruptedError), match=r"c\.2"):
        gpuckpt.load_state_dict(path)
    with pytest.raises((ChecksumError, CheckpointCorruptedError)):
        assert verify_checkpoint(path).ok


def test_readers_of_version_4_refuse_it_and_blocks_in_version_4_are_refused(
    tmp_path: Path, saved: Any
) -> None:
    path, _ = saved
    older = mock.patch.multiple(fmt, FORMAT_VERSION="4", READABLE_VERSIONS=("1", "2", "3", "4"))
    with older, pytest.raises(UnsupportedVersionError, match="version 5 is newer"):
        gpuckpt.read_metadata(path)
    md = root(path)
    md["version"] = "4"
    with pytest.raises(MetadataError, match="blocks"):
        read_index(md)


def test_a_tensor_placed_outside_its_block_rows_is_refused(saved: Any) -> None:
    path, _ = saved
    md = root(path)
    md = json.loads(json.dumps(md))
    cols = md.get("tensor_columns")
    entries = md["storage_data"]["tensors"]
    if cols is not None:
        cols["rows"][3] = cols["rows"][2]  # two tensors' runs overlap in every block
    else:
        names = sorted(n for n in entries if n.startswith("layer"))
        entries[names[3]]["rows"] = entries[names[2]]["rows"]
    with pytest.raises(MetadataError, match="rows"):
        read_index(md)


def test_segment_records_of_large_chunks_reach_their_tensor(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    big_rows = RANKS * 600  # 600 rows of 1,024 float32 per rank: one chunk of 2.3 MiB each, 3 segments
    big = np.arange(big_rows * 1024, dtype=np.float32).reshape(big_rows, 1024)

    def one(c: Coordinator) -> None:
        # 1,100 small tensors of one chunk per rank: more chunks than a table's threshold
        state: dict[str, Any] = {
            f"t{i:04d}": gpuckpt.ShardedArray(np.full((1, 4), i, np.float32), (c.rank, 0), (RANKS, 4))
            for i in range(1100)
        }
        state["big"] = gpuckpt.ShardedArray(
            big[c.rank * 600 : (c.rank + 1) * 600].copy(), (c.rank * 600, 0), big.shape
        )
        gpuckpt.save(state, path, coordinator=c, chunk_bytes=4 << 20)

    run_ranks(RANKS, one)
    md = root(path)
    assert md["version"] == "5"
    assert "segments" in md["storage_data"]["tensors"]["big"]
    assert verify_checkpoint(path).ok

    def load(c: Coordinator) -> bool:  # 3 ranks: each reads parts of the stored chunks (their segments)
        cuts = [0, 700, 1500, big_rows]
        a, b = cuts[c.rank], cuts[c.rank + 1]
        state = {"big": gpuckpt.ShardedArray(np.zeros((b - a, 1024), np.float32), (a, 0), big.shape)}
        gpuckpt.load(state, path, coordinator=c)
        return bool(np.array_equal(state["big"].local, big[a:b]))

    assert run_ranks(3, load) == [True] * 3
