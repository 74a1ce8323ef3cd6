"""The end of a save: every chunk's records in chunk table order, the metadata, the publication.

Each process reports what writing its chunks gave (:data:`Written`: stored bytes and
CRC32C, with the content hashes of a hashing save); :func:`table_columns` merges every
process's rows into per-chunk columns in the order of the chunk table (each chunk
exactly once), :func:`assemble_metadata` makes the :class:`~gpuckpt.format.metadata.Metadata`
of the plan with them, and :func:`commit_save` writes the chunk table of a large save
and publishes the root document (:meth:`~gpuckpt.storage.base.CheckpointWriter.commit`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gpuckpt.errors import CheckpointCorruptedError, GpuckptError
from gpuckpt.format.chunks import stored_nbytes
from gpuckpt.format.codecs import COMPRESSION_KEY
from gpuckpt.format.documents import chunk_file_key, root_document
from gpuckpt.format.metadata import (
    VERSION_BLOCKS,
    VERSION_COLUMNS,
    VERSION_COMPRESSED,
    VERSION_LISTED,
    VERSION_WITH_TABLE,
    BytesStorageMetadata,
    GridTensorStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from gpuckpt.format.records import (
    COLUMNS,
    TABLE_KEY,
    TABLE_MIN_CHUNKS,
    TablePart,
    encode_table,
    listed_records,
)
from gpuckpt.format.segments import SEGMENTS_KEY, segment_record, segments_entry
from gpuckpt.planning.plan import SavePlan
from gpuckpt.planning.table import TableLayout
from gpuckpt.saving.incremental import (
    ChunkResult,
    content_hash_info,
    hash_columns,
)
from gpuckpt.storage.base import CheckpointWriter, ChunkWrites

__all__ = [
    "COLUMNS_MIN_TENSORS",
    "Written",
    "as_columns",
    "assemble_metadata",
    "columns_of_results",
    "commit_save",
    "compresses",
    "format_version",
    "result_columns",
    "sized_columns",
    "store_table_parts",
    "table_columns",
    "uses_table",
    "write_table",
]

#: what writing one chunk gave: ``(stored bytes, CRC32C)``, with the chunk's hashes when hashing
Written = tuple[int, int] | ChunkResult


def result_columns(results: Sequence[Written]) -> dict[str, np.ndarray]:
    """The per-chunk columns of ``results`` (in their order): ``crc32c``, the content
    hashes when every chunk was hashed (:func:`~gpuckpt.saving.incremental.hash_columns`), and the
    segment records of large chunks where any chunk has them (``segments``: one object per
    chunk, see :func:`~gpuckpt.format.segments.segment_record`)."""
    columns: dict[str, np.ndarray] = {
        "crc32c": np.fromiter((r[1] for r in results), np.uint32, len(results)),
        # kept only by saves that compress (see sized_columns)
        "nbytes": np.fromiter((r[0] for r in results), np.uint64, len(results)),
    }
    columns.update(hash_columns(results))
    records = [segment_record(r[1]) for r in results]
    if any(r is not None for r in records):
        columns[SEGMENTS_KEY] = _objects(records)
    return columns


def _objects(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def table_columns(
    plan: SavePlan, parts: Iterable[tuple[np.ndarray, np.ndarray | Mapping[str, np.ndarray]]]
) -> dict[str, np.ndarray]:
    """Every per-chunk column of ``plan``, in chunk table order, from every process's
    :func:`written_rows` (or ``(rows, CRC32Cs)``); raises unless each chunk was written
    exactly once. A column besides ``crc32c`` is kept only when every process that wrote
    chunks reported it (a save hashes every chunk or none)."""
    n = plan.nchunks
    columns: dict[str, np.ndarray] = {"crc32c": np.zeros(n, np.uint32)}
    every = []
    filled = np.zeros(n, bool)
    total = 0
    complete: set[str] | None = None
    segments: np.ndarray | None = None  # per chunk, where any process reported them
    for rows, reported in parts:
        cols = reported if isinstance(reported, Mapping) else {"crc32c": reported}
        crcs = cols["crc32c"]
        if len(rows) != len(crcs) or (len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= n)):
            raise GpuckptError(f"a process reported chunk rows outside the plan's {n} chunks")
        every.append(rows)
        if not len(rows):
            continue
        columns["crc32c"][rows] = crcs
        filled[rows] = True
        total += len(rows)
        if SEGMENTS_KEY in cols:
            if len(cols[SEGMENTS_KEY]) != len(rows):
                raise GpuckptError(
                    f"a process reported {len(cols[SEGMENTS_KEY])} segment records for {len(rows)} chunks"
                )
            if segments is None:
                segments = _objects([None] * n)
            segments[rows] = cols[SEGMENTS_KEY]
        others = {name for name in cols if name not in ("crc32c", SEGMENTS_KEY)}
        complete = others if complete is None else complete & others
        for name in others:
            col = COLUMNS[name]
            values = cols[name]
            if col.width == 1 and values.ndim == 1:
                values = values.reshape(len(values), 1)
            if values.shape != (len(rows), col.width):
                raise GpuckptError(
                    f"a process reported a {name} column of shape {values.shape}, "
                    f"expected {(len(rows), col.width)}"
                )
            if name not in columns:
                columns[name] = np.zeros((n, col.width) if col.width > 1 else n, col.dtype)
            columns[name][rows] = values if col.width > 1 else values[:, 0]
    # n rows reported and every one of the n filled: each exactly once (counted only to name one that was not)
    if total != n or not filled.all():
        seen = np.bincount(np.concatenate(every) if every else np.zeros(0, np.int64), minlength=n)
        bad = int(np.flatnonzero(seen != 1)[0])
        raise GpuckptError(
            f"chunk {bad} of the save's chunk table was written {int(seen[bad])} times, expected once; "
            "the processes did not run the same plan"
        )
    out = {name: c for name, c in columns.items() if name == "crc32c" or name in (complete or ())}
    if segments is not None:
        out[SEGMENTS_KEY] = segments
    return out


def columns_of_results(
    plan: SavePlan, results: Mapping[tuple[str, tuple[int, ...]], Written]
) -> dict[str, np.ndarray]:
    """:func:`table_columns` from ``(array name, chunk coords) -> result`` (see :data:`Written`)."""
    ordered = [results[(t.name, s.coords)] for t in plan.tensors for s in t.specs]
    return result_columns(ordered)


def compresses(plan: SavePlan) -> bool:
    """Whether any tensor of ``plan`` is compressed (then the checkpoint is format version 4)."""
    return any(t.codec is not None for t in plan.tensors)


def sized_columns(plan: SavePlan, columns: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``columns`` with the stored sizes (``nbytes``) kept only where some tensor is compressed:
    other chunks' sizes follow from their grid, and a checkpoint without compressed tensors
    stays what earlier releases wrote."""
    if compresses(plan):
        return dict(columns)
    return {name: c for name, c in columns.items() if name != "nbytes"}


def write_table(writer: CheckpointWriter, columns: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Write the chunk table of ``columns`` through ``writer``; returns its ``storage_data`` entry."""
    entry, documents, parts = encode_table(columns)
    for name, doc in documents:
        writer.write_array_document(name, doc)
    store_table_parts(writer, parts)
    return entry


def store_table_parts(writer: CheckpointWriter, parts: Sequence[TablePart]) -> None:
    """Store chunks of the chunk table's columns, each checked against the CRC32C encoded with it."""
    if not parts:
        return
    crcs = writer.write_chunks(
        ChunkWrites(
            [p.name for p in parts],
            [p.key for p in parts],
            [np.frombuffer(p.data, np.uint8) for p in parts],
            [0] * len(parts),
        )
    )
    for p, c in zip(parts, crcs, strict=True):
        if p.crc != c:
            raise CheckpointCorruptedError(
                f"chunk table {p.name}/{p.key}: the writer computed CRC32C {c:#010x}, the table "
                f"{p.crc:#010x}; memory or the writer is faulty, nothing was published"
            )


def assemble_metadata(
    plan: SavePlan,
    columns: np.ndarray | Mapping[str, np.ndarray] | Mapping[tuple[str, tuple[int, ...]], Written],
    checkpoint_id: str | None,
    table: Mapping[str, Any] | None = None,
    planner_extra: Mapping[str, Any] | None = None,
    layout: TableLayout | None = None,
) -> Metadata:
    """The checkpoint's Metadata from the plan and every chunk's records: the per-chunk
    columns in chunk table order (:func:`table_columns`; or the CRC32C column alone; or a
    mapping ``(array name, chunk coords) -> (stored bytes, CRC32C)``).

    ``table``: the ``storage_data`` entry of the chunk table written for the save
    (:func:`write_table`; format version 2), or None to list
    every chunk's record in the metadata (then the checkpoint is format version 1, which
    every release reads). Chunk lists are never built here: each tensor's chunks are its grid's
    (:class:`~gpuckpt.format.metadata.GridTensorStorageMetadata`). Content hashes among the columns
    (a hashing save) are listed with the records, or are columns of the table, and
    ``storage_data["content_hash"]`` names their algorithm. Segment records among them
    (``segments``, see :mod:`gpuckpt.format.segments`) go to the tensor's entry when every
    chunk of its regular grid has them. ``planner_extra``: more entries of ``planner_data``
    (besides the state's ``structure``). ``layout``: the table's rows are ordered in blocks
    (:mod:`gpuckpt.saving.table_blocks`; format version 5, ``columns`` then holds only segment
    records, by the plan's chunk order).
    """
    cols = sized_columns(plan, as_columns(plan, columns))
    segments = cols.get(SEGMENTS_KEY)
    cols = {name: c for name, c in cols.items() if name in COLUMNS}
    sizes = cols.get("nbytes")
    state_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    tensors_sd: dict[str, Any] = {}
    listed = table is None
    for index, t in enumerate(plan.tensors):
        state_md[t.fqn] = GridTensorStorageMetadata(t.properties, t.shape, grid=t.grid, listed=listed)
        info: dict[str, Any] = {"name": t.name, "chunk_grid": t.grid.to_zarr_json()}
        if t.codec is not None:
            info["codec"] = t.codec.to_json()
        if listed:
            specs = t.specs
            itemsize = t.dtype.itemsize
            regular = t.grid.kind == "regular"
            if t.codec is not None and sizes is not None:  # as written
                nbytes = [int(n) for n in sizes[t.row : t.row + t.nchunks]]
            else:
                nbytes = [stored_nbytes(t.grid.chunk_shape if regular else s.sizes, itemsize) for s in specs]
            info["chunks"] = listed_records(
                [chunk_file_key(s.coords) for s in specs],
                nbytes,
                {name: c[t.row : t.row + t.nchunks] for name, c in cols.items()},
            )
        else:
            info["rows"] = t.row if layout is None else layout.tensor_row(index)
        # segments of a compressed chunk would be ranges of its compressed bytes: none recorded
        if segments is not None and t.grid.kind == "regular" and t.codec is None:  # one size for every chunk
            entry = segments_entry(segments[t.row : t.row + t.nchunks])
            if entry is not None:
                info[SEGMENTS_KEY] = entry
        tensors_sd[t.fqn] = info
    for fqn in plan.objects:
        state_md[fqn] = BytesStorageMetadata()
    storage_data: dict[str, Any] = {"tensors": tensors_sd, "objects": dict(plan.objects)}
    if table is not None:
        storage_data[TABLE_KEY] = dict(table)
    if "xxh3t" in cols:
        storage_data["content_hash"] = content_hash_info()
    return Metadata(
        state_dict_metadata=state_md,
        planner_data={
            "structure": plan.skeleton,
            **({} if plan.compression_report is None else {COMPRESSION_KEY: plan.compression_report}),
            **(planner_extra or {}),
        },
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, modules=["gpuckpt"]),
        version=VERSION_BLOCKS
        if layout is not None
        else VERSION_COMPRESSED
        if compresses(plan)
        else format_version(plan, table is not None),
    )


#: checkpoints of this many tensors or more (with a chunk table) keep their tensor entries
#: as columns (format version 3): below it the entries of version 2 parse in a few ms
COLUMNS_MIN_TENSORS = 1024


def format_version(plan: SavePlan, table: bool) -> str:
    """The oldest format version that pays for a checkpoint of ``plan``, so that older releases
    read every checkpoint they can: one that lists its chunks is version 1; a chunk table
    needs version 2; columns of many tensors' entries (:mod:`gpuckpt.format.columns`) need 3."""
    if not table:
        return VERSION_LISTED
    return VERSION_COLUMNS if len(plan.tensors) >= COLUMNS_MIN_TENSORS else VERSION_WITH_TABLE


def as_columns(
    plan: SavePlan, columns: np.ndarray | Mapping[str, np.ndarray] | Mapping[tuple[str, tuple[int, ...]], Any]
) -> dict[str, np.ndarray]:
    """The per-chunk columns of ``plan`` in chunk table order from any of the forms
    :func:`assemble_metadata` takes."""
    if isinstance(columns, np.ndarray):
        return {"crc32c": columns}
    if "crc32c" in columns:
        return dict(columns)
    return columns_of_results(plan, columns)  # type: ignore[arg-type]


def uses_table(plan: SavePlan) -> bool:
    """Whether a save of ``plan`` keeps its per-chunk records in a chunk table (large saves)."""
    return plan.nchunks > TABLE_MIN_CHUNKS


def commit_save(
    plan: SavePlan,
    columns: np.ndarray | Mapping[str, np.ndarray],
    writer: CheckpointWriter,
    checkpoint_id: str | None,
    *,
    table: bool | None = None,
    planner_extra: Mapping[str, Any] | None = None,
) -> Metadata:
    """Write the chunk table (large saves), then publish the root document; returns the Metadata.

    ``columns``: every chunk's records in chunk table order (:func:`table_columns`), or
    its CRC32C column alone (or the other forms :func:`assemble_metadata` takes).
    ``table``: whether to write the chunk table; None (the default) decides by the
    number of chunks (:func:`uses_table`). Tests and fixtures force either form.
    ``planner_extra``: see :func:`assemble_metadata`.
    """
    cols = sized_columns(plan, as_columns(plan, columns))
    if table is None:
        table = uses_table(plan)
    entry = write_table(writer, cols) if table and plan.nchunks else None
    metadata = assemble_metadata(plan, cols, checkpoint_id, entry, planner_extra)
    writer.commit(root_document(metadata))
    return metadata
