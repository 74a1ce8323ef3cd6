"""The block layout of a distributed save's chunk table (pure planning): which rank stores which rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuckpt.format.metadata import TensorProperties
from gpuckpt.planning.boxes import LocalTensor
from gpuckpt.planning.plan import StateDescription, plan_save
from gpuckpt.planning.table import table_layout

PROPS = TensorProperties(np.dtype("float32"))


def _rows(rank: int, ranks: int, n: int) -> tuple[int, int]:
    per = -(-n // ranks)
    a = min(n, rank * per)
    return a, min(n, a + per) - a


def describe(ranks: int, tensors: int, rows: int, cols: int, *, by_columns: int = 0, replicated: bool = True):
    """Each rank holds a row shard of ``tensors`` tensors (the first ``by_columns`` of them split by
    columns instead), and a replicated bias."""
    out = []
    for r in range(ranks):
        held = []
        for i in range(tensors):
            if i < by_columns:
                a, n = _rows(r, ranks, cols)
                box = ((0, a), (rows, n))
            else:
                a, n = _rows(r, ranks, rows)
                box = ((a, 0), (n, cols))
            held.append(LocalTensor(f"t{i:03d}", (rows, cols), "float32", 4, PROPS, (box,)))
        if replicated:
            held.append(LocalTensor("bias", (cols,), "float32", 4, PROPS, (((0,), (cols,)),)))
        out.append(StateDescription(tuple(held), {}, {}))
    return out


def _rank_rows(plan, layout):
    return {
        r: layout.table_rows(np.array([a.row for a in plan.assignments_of(r)], np.int64)) for r in range(4)
    }


def test_row_shards_put_each_ranks_chunks_in_its_own_block() -> None:
    plan = plan_save(describe(4, 8, 64, 16), chunk_bytes=16 * 4)  # one row per chunk: 16 chunks per rank
    layout = table_layout(plan, min_chunks=0)
    assert layout is not None
    assert layout.blocks == 4 and sorted(layout.writers) == [0, 1, 2, 3]
    assert layout.used == 8 * 16 and layout.block_rows % layout.chunk_rows == 0
    assert layout.tail == 1  # the replicated bias: one chunk, written by one rank
    every = np.concatenate(list(_rank_rows(plan, layout).values()))
    assert len(np.unique(every)) == plan.nchunks  # a bijection onto the used rows and the tail
    for r, rows in _rank_rows(plan, layout).items():
        b = layout.block_of(r)
        assert b is not None
        mine = rows[rows < layout.blocks * layout.block_rows]
        assert len(mine) == layout.used
        assert (mine // layout.block_rows == b).all()


def test_tensors_split_another_way_go_to_the_tail() -> None:
    plan = plan_save(describe(4, 6, 64, 16, by_columns=2), chunk_bytes=16 * 4)
    layout = table_layout(plan, min_chunks=0)
    assert layout is not None
    spans = dict(zip((t.fqn for t in plan.tensors), layout.spans.tolist(), strict=True))
    assert spans["bias"] == 0
    assert spans["t000"] == spans["t001"] == 0  # column shards: one rank's chunks are not one run
    assert all(spans[f"t{i:03d}"] > 0 for i in range(2, 6))
    assert layout.tail == 1 + sum(t.nchunks for t in plan.tensors if t.fqn in ("t000", "t001"))
    rows = np.concatenate(list(_rank_rows(plan, layout).values()))
    assert sorted(rows.tolist()) == sorted(
        list(range(layout.blocks * layout.block_rows, layout.rows))
        + [b * layout.block_rows + i for b in range(layout.blocks) for i in range(layout.used)]
    )


@pytest.mark.parametrize(
    ("ranks", "min_chunks", "hashing"),
    [(1, 0, False), (4, 10_000, False), (4, 0, True)],
    ids=["one process", "a small save", "a hashing save"],
)
def test_no_blocks_where_they_do_not_apply(ranks: int, min_chunks: int, hashing: bool) -> None:
    plan = plan_save(describe(ranks, 4, 64, 16), chunk_bytes=16 * 4)
    assert table_layout(plan, min_chunks=min_chunks, hashing=hashing) is None


def test_no_blocks_when_every_tensor_is_replicated() -> None:
    # data parallel: every rank holds every tensor whole, so one rank writes each
    whole = tuple(LocalTensor(f"t{i}", (8, 4), "float32", 4, PROPS, (((0, 0), (8, 4)),)) for i in range(6))
    plan = plan_save([StateDescription(whole, {}, {})] * 4, chunk_bytes=1 << 20)
    assert table_layout(plan, min_chunks=0) is None


def test_many_rows_per_block_are_stored_in_several_chunks_of_the_same_block() -> None:
    plan = plan_save(describe(2, 3, 50_000, 1, replicated=False), chunk_bytes=4)  # 25,000 chunks per rank
    layout = table_layout(plan, min_chunks=0)
    assert layout is not None and layout.used == 75_000
    assert layout.chunk_rows <= 1 << 16 and layout.block_rows % layout.chunk_rows == 0
    assert layout.block_rows - layout.used < layout.block_rows // layout.chunk_rows  # little padding


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.integers(2, 6),
    tensors=st.integers(1, 5),
    rows=st.integers(1, 40),
    cols=st.integers(1, 5),
    by_columns=st.integers(0, 2),
)
def test_the_table_rows_are_a_bijection_and_blocks_belong_to_their_writer(
    ranks: int, tensors: int, rows: int, cols: int, by_columns: int
) -> None:
    plan = plan_save(describe(ranks, tensors, rows, cols, by_columns=by_columns), chunk_bytes=cols * 4)
    layout = table_layout(plan, min_chunks=0)
    if layout is None:
        return
    seen = []
    for r in range(ranks):
        got = layout.table_rows(np.array([a.row for a in plan.assignments_of(r)], np.int64))
        blocked = got[got < layout.blocks * layout.block_rows]
        b = layout.block_of(r)
        if b is None:
            assert len(blocked) == 0
        else:
            assert len(blocked) == layout.used and set((blocked // layout.block_rows).tolist()) == {b}
            assert ((blocked % layout.block_rows) < layout.used).all()
        seen.append(got)
    every = np.concatenate(seen)
    assert len(every) == plan.nchunks == len(np.unique(every))
    assert int(every.max()) < layout.rows


def test_a_block_report_crosses_the_transport_small_and_whole() -> None:
    import pickle

    from gpuckpt.saving.table_blocks import BlockReport

    usual = BlockReport(
        7,
        {"crc32c": [0xDEADBEEF]},
        np.zeros(0, np.int64),
        {"crc32c": np.zeros(0, np.uint32)},
        np.zeros(0, np.int64),
        np.empty(0, object),
    )
    data = pickle.dumps(usual)
    assert len(data) < 120, len(data)  # (its empty arrays pickled as arrays made it 4-5x larger)
    back = pickle.loads(data)
    assert back.block == 7 and back.crcs == {"crc32c": [0xDEADBEEF]}
    assert len(back.tail_rows) == 0 and back.tail == {} and len(back.segment_rows) == 0
    segments = np.empty(2, object)
    segments[:] = [None, (1, 2, 3)]
    full = BlockReport(
        None,
        {},
        np.array([40, 41]),
        {"crc32c": np.array([5, 6], np.uint32)},
        np.array([3, 9]),
        segments,
    )
    back = pickle.loads(pickle.dumps(full))
    assert back.block is None and back.tail_rows.tolist() == [40, 41]
    assert back.tail["crc32c"].tolist() == [5, 6] and back.tail["crc32c"].dtype == np.uint32
    assert back.segment_rows.tolist() == [3, 9] and back.segments.tolist() == [None, (1, 2, 3)]


@settings(max_examples=60, deadline=None)
@given(ranks=st.integers(2, 6), per_rank=st.integers(1, 200_000))
def test_every_block_layout_a_save_writes_is_one_its_readers_take(ranks: int, per_rank: int) -> None:
    """The planner's blocks pass the reader's check, and padding that no record uses does not."""
    from gpuckpt.errors import MetadataError
    from gpuckpt.format.blocks import TableBlocks

    plan = plan_save(describe(ranks, 1, ranks * per_rank, 1, replicated=False), chunk_bytes=4)
    layout = table_layout(plan, min_chunks=0)
    assert layout is not None
    raw = {"count": layout.blocks, "rows": layout.block_rows, "used": layout.used}
    assert TableBlocks.parse(raw, layout.rows, layout.chunk_rows).rows == layout.block_rows
    padded = {**raw, "rows": layout.block_rows + layout.chunk_rows}  # a whole chunk of rows no record uses
    with pytest.raises(MetadataError, match="hold rows that no record uses"):
        TableBlocks.parse(padded, layout.rows + layout.blocks * layout.chunk_rows, layout.chunk_rows)


def test_a_block_of_few_used_rows_in_huge_chunks_is_refused_before_anything_is_read() -> None:
    from gpuckpt.errors import MetadataError
    from gpuckpt.format.blocks import TableBlocks

    # 1,120 records per block in chunks of 2**20 rows: a reader would hold 2**20 rows per block
    with pytest.raises(MetadataError, match="1120 are used, stored 1048576 per chunk"):
        TableBlocks.parse({"count": 4, "rows": 1 << 20, "used": 1120}, 4 << 20, 1 << 20)
