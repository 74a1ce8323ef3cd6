"""The first half of a load: validate the metadata and check the chunk files.

Nothing in a checkpoint is trusted. Before a single array is allocated, every
tensor's grid, chunk list, keys and byte sizes are checked against each
other and against the sizes of the files on disk, so a checkpoint that
claims a huge shape fails fast instead of allocating it. The chunks are then
read by :mod:`gpuckpt.chunk_reads` (a thread pool, straight into the
destination array where the layout allows, each chunk's CRC32C checked
against the chunk file and against the metadata).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import gc
import hashlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.entries import ChunkRead, TensorEntry, whole_chunk_key
from gpuckpt.errors import (
    CheckpointCorruptedError,
    MetadataError,
    MissingChunkError,
)
from gpuckpt.load_index import beyond_any_array, load_index
from gpuckpt.metadata import BytesStorageMetadata, GridTensorStorageMetadata, Metadata, TensorStorageMetadata
from gpuckpt.planning import ChunkGrid
from gpuckpt.storage.base import CheckpointReader
from gpuckpt.storage.checksum import CRC_BYTES
from gpuckpt.storage.chunk_table import TABLE_KEY, ChunkTable, parse_listed
from gpuckpt.storage.chunks import stored_nbytes
from gpuckpt.storage.layout import chunk_file_key, metadata_from_root_document, metadata_json
from gpuckpt.storage.names import is_safe_name
from gpuckpt.storage.segments import SEGMENTS_KEY
from gpuckpt.workers import Workers

__all__ = [
    "CLAIMS_LISTED_MIN",
    "ChunkRead",
    "Overclaim",
    "TensorEntry",
    "check_chunk_files",
    "check_chunk_table",
    "checking_chunk_files",
    "chunk_column",
    "load_chunk_records",
    "overclaimed",
    "paused_gc",
    "validate_metadata",
    "validated_metadata",
]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a load.

    Parsing the metadata of a checkpoint with many tensors creates millions of
    small objects (the JSON tree, then the metadata objects); each collection
    walks all of them again, for nothing, since none is garbage until the load
    ends (a quarter of the time of a 10,000-tensor load). Reference counting still
    frees everything as usual; the collector resumes, if it was on, when the
    load returns or fails.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _bad(fqn: str, what: str) -> MetadataError:
    return MetadataError(
        f"metadata of tensor {fqn!r} is inconsistent: {what}; "
        "the checkpoint is damaged or was not written by gpuckpt"
    )


def validate_metadata(md: Metadata) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """Cross-check ``state_dict_metadata`` with ``storage_data``; returns tensors and encoded objects."""
    sd = md.storage_data
    if (
        not isinstance(sd, dict)
        or not isinstance(sd.get("tensors"), dict)
        or not isinstance(sd.get("objects"), dict)
    ):
        raise MetadataError("metadata.storage_data must hold 'tensors' and 'objects' objects")
    pd = md.planner_data
    if not isinstance(pd, dict) or "structure" not in pd:
        raise MetadataError("metadata.planner_data must hold the state dict 'structure'")
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, Any] = {}
    names: set[str] = set()
    table: ChunkTable | None = None
    spans: list[tuple[int, int, str]] = []
    stored_tensors, stored_objects = sd["tensors"], sd["objects"]
    tabled = md.version != "1"  # a chunk table is read in format version 2 only
    itemsizes: dict[Any, int] = {}  # dtype as the properties give it -> its item size
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            if fqn not in stored_objects:
                raise MetadataError(f"value {fqn!r} is listed but not stored; the checkpoint is damaged")
            objects[fqn] = stored_objects[fqn]
            continue
        assert isinstance(entry, TensorStorageMetadata)
        info = stored_tensors.get(fqn)
        if not isinstance(info, dict):
            raise _bad(fqn, "no storage entry")
        name = info.get("name")
        if not isinstance(name, str) or name in names or not is_safe_name(name):
            raise _bad(fqn, f"array name {name!r} is not a safe, unique path component")
        names.add(name)
        size = entry.size
        itemsize = itemsizes.get(entry.properties.dtype)
        if itemsize is None:
            itemsize = itemsizes[entry.properties.dtype] = np.dtype(entry.properties.dtype).itemsize
        if beyond_any_array(size, itemsize):
            raise _bad(fqn, f"size {size} is larger than any array can be")
        parsed = entry.__dict__.get("_grid") if isinstance(entry, GridTensorStorageMetadata) else None
        try:
            # a chunk list left to the grid was made from this very grid: parsed once
            grid = parsed if parsed is not None else ChunkGrid.from_zarr_json(size, info.get("chunk_grid"))
        except ValueError as exc:
            raise _bad(fqn, f"chunk grid: {exc}") from None
        empty = 0 in size
        if grid.kind == "regular" and grid.chunk_shape == tuple(size) and not empty:
            expected_n = 1  # one chunk, the whole tensor (the usual grid of a small tensor)
        else:
            if grid.kind == "regular" and any(
                c > max(n, 1) for c, n in zip(grid.chunk_shape, size, strict=True)
            ):
                # gpuckpt never writes one: each chunk would be read through padding (a sparse
                # file costs no disk) that every load has to allocate
                raise _bad(
                    fqn,
                    f"regular chunk shape {list(grid.chunk_shape)} is larger than the tensor's shape "
                    f"{list(size)}; no chunk may exceed the tensor along any axis",
                )
            expected_n = 0 if empty else math.prod(grid.grid_shape)
        lazy = isinstance(entry, GridTensorStorageMetadata) and "chunks" not in entry.__dict__
        if not lazy:
            if len(entry.chunks) != expected_n:
                raise _bad(fqn, f"{len(entry.chunks)} chunks listed, the grid has {expected_n}")
            for i, (spec, cmeta) in enumerate(zip(grid.chunk_list(), entry.chunks, strict=True)):
                if tuple(cmeta.offsets) != spec.offsets or tuple(cmeta.sizes) != spec.sizes:
                    raise _bad(fqn, f"chunk {i} box {cmeta} does not match the grid {spec}")
        if tabled and "rows" in info:
            if table is None:
                table = ChunkTable.parse(sd.get(TABLE_KEY))
            row = info.get("rows")
            if type(row) is not int or not 0 <= row <= table.rows - expected_n:
                raise _bad(
                    fqn,
                    f"its {expected_n} chunk table rows begin at {row!r}, outside the table of {table.rows}",
                )
            spans.append((row, expected_n, fqn))
            tensors[fqn] = TensorEntry(
                fqn, name, entry, grid, None, table, row, segments=info.get(SEGMENTS_KEY), nchunks=expected_n
            )
            continue
        raw_chunks = info.get("chunks")
        if not isinstance(raw_chunks, list) or len(raw_chunks) != expected_n:
            raise _bad(fqn, "storage chunk list does not match the chunk metadata")
        specs = grid.chunk_list()
        columns = parse_listed(
            raw_chunks,
            [chunk_file_key(s.coords) for s in specs],
            [stored_nbytes(grid.stored_chunk_shape(s), itemsize) for s in specs],
            functools.partial(_bad, fqn),
        )
        crcs = columns.pop("crc32c")
        tensors[fqn] = TensorEntry(
            fqn,
            name,
            entry,
            grid,
            crcs,
            listed=columns or None,
            segments=info.get(SEGMENTS_KEY),
            nchunks=expected_n,
        )
    if table is not None:
        # the tensors' rows tile the table: each row belongs to exactly one chunk
        at = 0
        for row, n, fqn in sorted(spans):
            if n and row != at:
                raise _bad(
                    fqn, f"its chunk table rows begin at {row}, expected {at} (rows overlap or are left out)"
                )
            at += n
        if at != table.rows:
            raise MetadataError(
                f"metadata.storage_data.{TABLE_KEY} has {table.rows} rows, the tensors' chunks {at}; "
                "the checkpoint is damaged or was not written by gpuckpt"
            )
    return tensors, objects


def check_chunk_table(reader: CheckpointReader, tensors: dict[str, TensorEntry]) -> None:
    """Check the files of the chunk table the validated ``tensors`` refer to, if any, before
    any chunk list is built (see :meth:`~gpuckpt.storage.chunk_table.ChunkTable.check_files`)."""
    table = next((t.table for t in tensors.values() if t.table is not None), None)
    if table is not None:
        table.check_files(reader)


def load_chunk_records(reader: CheckpointReader, entries: Iterable[TensorEntry]) -> None:
    """Read the chunk records of ``entries`` that a chunk table holds (only the table chunks
    that hold their rows); raises :class:`~gpuckpt.errors.CheckpointCorruptedError` or
    :class:`~gpuckpt.errors.MissingChunkError` when the table is damaged."""
    for t in entries:
        if t.crcs is None and t.table is not None:
            t.crcs = t.table.rows_of(reader, "crc32c", t.row, t.nchunks)


def chunk_column(reader: CheckpointReader, t: TensorEntry, name: str) -> np.ndarray | None:
    """Column ``name`` of the chunk records of ``t`` (one row per chunk, C order of grid
    coordinates) from whichever form holds them, or None when the checkpoint has no such
    column for ``t``; raises as :func:`load_chunk_records` when a chunk table is damaged."""
    if name == "crc32c":
        load_chunk_records(reader, [t])
        return t.crcs
    if t.table is not None:
        return t.table.read(reader, name, t.row, t.nchunks) if name in t.table.columns else None
    return None if t.listed is None else t.listed.get(name)


#: validated root documents kept per process (see :func:`validated_metadata`)
_VALIDATED_KEEP = 2
_validated: collections.OrderedDict[bytes, tuple[Metadata, dict[str, TensorEntry], dict[str, Any]]] = (
    collections.OrderedDict()
)
_validated_lock = threading.Lock()


def validated_metadata(
    root: bytes | bytearray, where: str
) -> tuple[Metadata, dict[str, TensorEntry], dict[str, Any]]:
    """The metadata of a root document, parsed and validated once per document.

    Parsing and cross-checking the metadata of 10,000 tensors takes longer than
    reading their chunks. The last :data:`_VALIDATED_KEEP` results are kept, keyed
    by a 256-bit BLAKE2b digest of the document's bytes: the same bytes always give
    the same result, and no one can make other bytes with the same digest. The
    results are shared: callers must not change them (loads only read them;
    :func:`gpuckpt.read_metadata`, which hands the metadata out, parses its own).
    """
    key = hashlib.blake2b(root, digest_size=32).digest()
    with _validated_lock:
        hit = _validated.get(key)
        if hit is not None:
            _validated.move_to_end(key)
            return hit
    indexed = load_index(metadata_json(root, where))
    md: Metadata
    if indexed is not None:
        md, tensors, objects = indexed
    else:  # the general path: it raises the error of a document the index did not take
        md = metadata_from_root_document(root, where)
        tensors, objects = validate_metadata(md)
    with _validated_lock:
        _validated[key] = (md, tensors, objects)
        while len(_validated) > _VALIDATED_KEEP:
            _validated.popitem(last=False)
    return md, tensors, objects


#: tensors of several chunks that claim more chunks than this, together, have their arrays listed
#: before any record per chunk is made (see :func:`overclaimed`)
CLAIMS_LISTED_MIN = 1 << 16


@dataclass(frozen=True, slots=True)
class Overclaim:
    """A tensor whose array holds fewer chunk files (``held``) than it claims chunks; ``first``:
    the key of its first chunk, in C order of the grid, that has no file."""

    tensor: TensorEntry
    held: int
    first: str

    @property
    def problem(self) -> str:
        t = self.tensor
        return (
            f"tensor {t.fqn!r} claims {t.nchunks} chunks but its array {t.name} holds {self.held} chunk "
            f"files: {t.nchunks - self.held} are missing (the first: {self.first})"
        )

    def error(self) -> MissingChunkError:
        return MissingChunkError(
            f"{self.problem}; the checkpoint is damaged: restore it from a copy or use an earlier checkpoint"
        )


def overclaimed(reader: CheckpointReader, entries: Iterable[TensorEntry]) -> list[Overclaim]:
    """The tensors of ``entries`` whose arrays hold fewer chunk files than they claim chunks.

    A root document can claim any number of chunks (a chunk table of 2**32 rows costs a
    few KiB on a file system that stores it sparse); what a checkpoint pays for is its
    chunk files. So where the tensors of several chunks claim more than
    :data:`CLAIMS_LISTED_MIN` chunks together, each one's array is listed (its cost grows
    with the files there) and compared with its claim before any reader makes a record
    per chunk or reads the table's rows: a hostile claim costs what was written, and
    ends in a typed error (loads) or a line of damage (verify, inspect). Smaller claims
    cost at most that many records and are checked chunk by chunk as before. A store
    that cannot list (:meth:`~gpuckpt.storage.base.CheckpointReader.chunk_keys`) is not
    checked here."""
    many = [t for t in entries if not t.whole and t.nchunks > 1]
    if sum(t.nchunks for t in many) <= CLAIMS_LISTED_MIN:
        return []
    found = []
    for t in many:
        keys = reader.chunk_keys(t.name)
        if keys is not None and len(keys) < t.nchunks:
            found.append(Overclaim(t, len(keys), _first_missing(t, keys)))
    return found


def _first_missing(t: TensorEntry, held: set[str]) -> str:
    """The key of ``t``'s first chunk without a file in ``held`` (at most ``len(held) + 1`` keys made)."""
    shape = t.grid.grid_shape
    for flat in range(t.nchunks):
        key = chunk_file_key(tuple(int(c) for c in np.unravel_index(flat, shape)))
        if key not in held:
            return key
    raise AssertionError("a tensor that holds fewer chunk files than it has chunks misses one")


def check_chunk_files(reader: CheckpointReader, entries: Iterable[TensorEntry]) -> None:
    """Check that every chunk file exists with the size the metadata gives, before allocating
    (the chunk records a chunk table holds are read first, see :func:`load_chunk_records`)."""
    with checking_chunk_files(reader, entries) as check:
        check()


#: a check of at least this many chunk files asks for their sizes on a thread of its own
BACKGROUND_CHECK_MIN = 256
_check_threads = Workers(4, "gpuckpt-check")


@contextlib.contextmanager
def checking_chunk_files(
    reader: CheckpointReader, entries: Iterable[TensorEntry]
) -> Iterator[Callable[[], None]]:
    """:func:`check_chunk_files` begun now: the chunk records are read here, the file sizes
    asked for on another thread (a load of many small tensors prepares its reads meanwhile,
    while the file system answers in native code). Yields the call that waits for the sizes
    and raises what :func:`check_chunk_files` raises; leaving the block waits for the thread,
    whose error is then left to that call (an error of the block's own comes first).

    A large claim is compared with the chunk files there first (:func:`overclaimed`)."""
    entries = list(entries)
    for bad in overclaimed(reader, entries):
        raise bad.error()
    load_chunk_records(reader, entries)
    names: list[str] = []
    keys: list[str] = []
    expected: list[int] = []
    for t in entries:
        if t.whole:
            # a tensor stored whole: its one chunk's key and size without its chunk record
            names.append(t.name)
            keys.append(whole_chunk_key(len(t.shape)))
            expected.append(t.nbytes + CRC_BYTES)
        else:
            for c in t.chunks:
                names.append(t.name)
                keys.append(c.key)
                expected.append(c.nbytes)
    pending = (
        _check_threads.submit(reader.chunk_sizes, names, keys) if len(names) >= BACKGROUND_CHECK_MIN else None
    )

    def check() -> None:
        sizes = reader.chunk_sizes(names, keys) if pending is None else pending.result()
        if sizes != expected:  # compared as whole lists, not chunk by chunk
            _raise_first_mismatch(entries, sizes)

    try:
        yield check
    finally:
        if pending is not None:
            concurrent.futures.wait([pending])


def _raise_first_mismatch(entries: list[TensorEntry], sizes: list[int | None]) -> None:
    """Raise the error of the first chunk of ``entries`` whose file size is not its record's."""
    chunks = [(t, c) for t in entries for c in t.chunks]
    for (t, c), size in zip(chunks, sizes, strict=True):
        if size != c.nbytes:
            if size is None:
                raise MissingChunkError(
                    f"chunk {c.key} of tensor {t.fqn!r} is missing (expected file {t.name}/{c.key}); "
                    "the checkpoint is damaged: restore it from a copy or use an earlier checkpoint"
                )
            raise CheckpointCorruptedError(
                f"chunk {c.key} of tensor {t.fqn!r} is {size} bytes, expected {c.nbytes} "
                f"(file {t.name}/{c.key} is truncated or overwritten); the checkpoint is damaged"
            )
