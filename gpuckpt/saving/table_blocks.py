"""The chunk table of a distributed save ordered in blocks: each rank stores its own rows.

Where a save's chunks split into one run per rank of every tensor
(:func:`gpuckpt.planning.table.table_layout`), each rank, after writing its chunks,
encodes its block of the chunk table (the records of its chunks: CRC32C, and the
stored size where the save compresses) and stores its block's chunks of the column
arrays itself (:func:`write_block`). It reports to the rank that commits only the
CRC32C of each of those stored chunks, its rows of the tail (chunks of tensors
outside the blocks: the small ones stored whole), and the segment records of its
large chunks (:class:`BlockReport`): what rank 0 receives per save grows with the
ranks and the tail, not with ranks x tensors. :func:`commit_blocks` checks that
every block came once and every tail row once, stores the tail, and publishes the
root document (format version 5, :mod:`gpuckpt.format.blocks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.errors import GpuckptError
from gpuckpt.format.blocks import BLOCKS_KEY, TableBlocks
from gpuckpt.format.documents import root_document
from gpuckpt.format.metadata import Metadata
from gpuckpt.format.records import COLUMNS, TablePart, column_array_name, encode_rows, table_documents
from gpuckpt.format.segments import SEGMENTS_KEY
from gpuckpt.planning.plan import SavePlan
from gpuckpt.planning.table import TableLayout
from gpuckpt.saving.commit import assemble_metadata, store_table_parts
from gpuckpt.storage.base import CheckpointWriter

__all__ = [
    "BlockReport",
    "commit_blocks",
    "encode_block",
    "merge_blocks",
    "write_block",
    "write_table_documents",
]


@dataclass(frozen=True)
class BlockReport:
    """What one rank of a save ordered in blocks sends the rank that commits.

    It crosses the transport pickled, with no tail rows and no segment records (the usual
    rank's) sent as nothing rather than as empty arrays: about 92 bytes for such a rank
    instead of about 450 (bench_planning, 1,024 ranks: 0.09 MiB at rank 0)."""

    block: int | None  # the block it stored (None: it writes none)
    crcs: dict[str, list[int]]  # per column: the CRC32C of each stored chunk of its block
    tail_rows: np.ndarray  # the table rows of its chunks in the tail
    tail: dict[str, np.ndarray]  # per column: those rows' records (empty: none, or {})
    segment_rows: np.ndarray  # the plan's rows of its chunks that have segment records
    segments: np.ndarray  # those records (objects)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        tail = (self.tail_rows, self.tail) if len(self.tail_rows) else None
        segments = (self.segment_rows, self.segments) if len(self.segment_rows) else None
        return _unpacked_report, (self.block, self.crcs, tail, segments)


def _unpacked_report(block: int | None, crcs: dict[str, list[int]], tail: Any, segments: Any) -> BlockReport:
    tail_rows, tail_records = tail if tail is not None else (np.zeros(0, np.int64), {})
    segment_rows, records = segments if segments is not None else (np.zeros(0, np.int64), np.empty(0, object))
    return BlockReport(block, crcs, tail_rows, tail_records, segment_rows, records)


def write_table_documents(writer: CheckpointWriter, layout: TableLayout) -> None:
    """Write the array documents of the table's columns (before any rank stores a chunk in
    them, where the store makes an array's directory with its document)."""
    for name, doc in table_documents(layout.columns, layout.rows, layout.chunk_rows):
        writer.write_array_document(name, doc)


def _mismatch(what: str) -> GpuckptError:
    return GpuckptError(f"{what}; the processes did not run the same plan")


def write_block(
    writer: CheckpointWriter,
    layout: TableLayout,
    rank: int,
    rows: np.ndarray,
    columns: Mapping[str, np.ndarray],
) -> BlockReport:
    """Store ``rank``'s block of the table from the records of the chunks it wrote (``rows``
    of the plan's order, ``columns`` as :func:`~gpuckpt.saving.writing.written_rows`
    gives them); returns what it reports to the rank that commits."""
    parts, report = encode_block(layout, rank, rows, columns)
    store_table_parts(writer, parts)
    return report


def encode_block(
    layout: TableLayout, rank: int, rows: np.ndarray, columns: Mapping[str, np.ndarray]
) -> tuple[list[TablePart], BlockReport]:
    """:func:`write_block` without the store: the stored chunks of ``rank``'s block, and its report."""
    parts: list[TablePart] = []
    table_rows = layout.table_rows(rows) if len(rows) else np.zeros(0, np.int64)
    tail_start = layout.blocks * layout.block_rows
    in_tail = table_rows >= tail_start
    block = layout.block_of(rank)
    crcs: dict[str, list[int]] = {}
    mine = table_rows[~in_tail]
    if block is None:
        if len(mine):
            raise _mismatch(f"rank {rank} wrote {len(mine)} chunks of the table's blocks but holds no block")
    else:
        first = block * layout.block_rows
        at = mine - first
        if len(at) != layout.used or (len(at) and (int(np.min(at)) < 0 or int(np.max(at)) >= layout.used)):
            raise _mismatch(f"rank {rank} wrote {len(at)} chunks of block {block}, which has {layout.used}")
        if len(np.unique(at)) != layout.used:
            raise _mismatch(f"rank {rank} wrote a chunk of block {block} twice")
        values: dict[str, np.ndarray] = {}
        for name in layout.columns:
            col = COLUMNS[name]
            filled = np.zeros(
                (layout.block_rows, col.width) if col.width > 1 else layout.block_rows, col.dtype
            )
            filled[at] = columns[name][~in_tail]
            values[name] = filled
        encoded = encode_rows(values, first, layout.chunk_rows)
        parts = [p for name in layout.columns for p in encoded[name]]
        crcs = {name: [p.crc for p in encoded[name]] for name in layout.columns}
    segs = columns.get(SEGMENTS_KEY)
    held = np.zeros(0, np.int64) if segs is None else np.flatnonzero([s is not None for s in segs])
    return parts, BlockReport(
        block,
        crcs,
        table_rows[in_tail],
        {name: columns[name][in_tail] for name in layout.columns},
        np.asarray(rows, np.int64)[held],
        np.empty(0, object) if segs is None else segs[held],
    )


def merge_blocks(
    plan: SavePlan, layout: TableLayout, reports: Sequence[BlockReport]
) -> tuple[dict[str, Any], list[TablePart], dict[str, Any]]:
    """Check every rank's report (each block once, each tail row once) and encode the tail:
    the table's ``storage_data`` entry, the tail's stored chunks, and the columns argument of
    :func:`~gpuckpt.saving.commit.assemble_metadata` (the segment records, by the plan's order)."""
    names = layout.columns
    by_block: dict[int, BlockReport] = {}
    for r in reports:
        if r.block is not None:
            if r.block in by_block or not 0 <= r.block < layout.blocks:
                raise _mismatch(f"block {r.block} of the chunk table was reported twice or is not one")
            by_block[r.block] = r
    if len(by_block) != layout.blocks:
        missing = sorted(set(range(layout.blocks)) - set(by_block))
        raise _mismatch(f"blocks {missing[:5]} of the chunk table were not stored")
    tail_start = layout.blocks * layout.block_rows
    tail: dict[str, np.ndarray] = {}
    for name in names:
        col = COLUMNS[name]
        tail[name] = np.zeros((layout.tail, col.width) if col.width > 1 else layout.tail, col.dtype)
    seen = np.zeros(layout.tail, np.int64)
    for r in reports:
        at = r.tail_rows - tail_start
        if not len(at):
            continue
        if int(np.min(at)) < 0 or int(np.max(at)) >= layout.tail:
            raise _mismatch("a process reported chunk table rows outside the tail")
        np.add.at(seen, at, 1)
        for name in names:
            if name not in r.tail:
                raise _mismatch(f"a process reported tail rows without their {name!r} records")
            tail[name][at] = r.tail[name]
    if layout.tail and not (seen == 1).all():
        bad = int(np.flatnonzero(seen != 1)[0])
        raise _mismatch(
            f"row {tail_start + bad} of the chunk table was written {int(seen[bad])} times, not once"
        )
    parts = encode_rows(tail, tail_start, layout.chunk_rows) if layout.tail else {n: [] for n in names}
    entry: dict[str, Any] = {
        "rows": layout.rows,
        "rows_per_chunk": layout.chunk_rows,
        BLOCKS_KEY: TableBlocks(layout.blocks, layout.block_rows, layout.used).to_json(),
        "columns": {
            name: {
                "name": column_array_name(name),
                "chunk_crc32c": [c for b in range(layout.blocks) for c in by_block[b].crcs[name]]
                + [p.crc for p in parts[name]],
            }
            for name in names
        },
    }
    columns: dict[str, Any] = {"crc32c": np.zeros(0, np.uint32)}
    if any(len(r.segment_rows) for r in reports):
        segments = np.empty(plan.nchunks, object)
        for r in reports:
            segments[r.segment_rows] = r.segments
        columns[SEGMENTS_KEY] = segments
    return entry, [p for name in names for p in parts[name]], columns


def commit_blocks(
    plan: SavePlan,
    layout: TableLayout,
    reports: Sequence[BlockReport],
    writer: CheckpointWriter,
    checkpoint_id: str | None,
    *,
    documents: bool,
    planner_extra: Mapping[str, Any] | None = None,
) -> Metadata:
    """Check every rank's report, store the tail of the table (and its column documents when
    ``documents``), publish the root document; returns the checkpoint's Metadata."""
    entry, parts, columns = merge_blocks(plan, layout, reports)
    if documents:
        write_table_documents(writer, layout)
    store_table_parts(writer, parts)
    metadata = assemble_metadata(plan, columns, checkpoint_id, entry, planner_extra, layout=layout)
    writer.commit(root_document(metadata))
    return metadata
