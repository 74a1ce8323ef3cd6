"""Executing a load: validate the metadata, check the chunk files, then read.

Nothing in a checkpoint is trusted. Before a single array is allocated, every
tensor's grid, chunk list, keys and byte sizes are checked against each
other and against the sizes of the files on disk, so a checkpoint that
claims a huge shape fails fast instead of allocating it. Chunks are then read
by a thread pool, straight into the destination array where the layout
allows, and each one's CRC32C is checked against the chunk file and against
the metadata.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import hashlib
import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, HostArray, StagedIn
from gpuckpt.device.backend import Staging
from gpuckpt.device.upload import CopyQueue
from gpuckpt.errors import (
    CheckpointCorruptedError,
    CheckpointTooLargeError,
    ChecksumError,
    MetadataError,
    MissingChunkError,
)
from gpuckpt.metadata import BytesStorageMetadata, GridTensorStorageMetadata, Metadata, TensorStorageMetadata
from gpuckpt.options import LoadOptions
from gpuckpt.planning import ChunkGrid, ChunkSpec
from gpuckpt.planning.boxes import axis_starts
from gpuckpt.progress import ProgressCounter
from gpuckpt.runner import IO_BATCH_JOBS, batches, default_threads, run_all
from gpuckpt.storage.base import CheckpointReader, ChunkReads
from gpuckpt.storage.checksum import CRC_BYTES
from gpuckpt.storage.chunk_table import TABLE_KEY, ChunkTable, parse_listed
from gpuckpt.storage.chunks import is_prefix_box, stored_nbytes
from gpuckpt.storage.layout import chunk_file_key, metadata_from_root_document
from gpuckpt.storage.names import is_safe_name
from gpuckpt.storage.segments import SEGMENTS_KEY

__all__ = [
    "ChunkRead",
    "TensorEntry",
    "check_chunk_files",
    "check_chunk_table",
    "checksum_verified",
    "chunk_column",
    "fetch_verified",
    "load_chunk_records",
    "paused_gc",
    "read_chunk_into",
    "read_tensors",
    "scratch",
    "upload_chunk",
    "validate_metadata",
    "validated_metadata",
    "vanished",
]


@dataclass(slots=True)
class ChunkRead:
    spec: ChunkSpec
    key: str
    nbytes: int
    crc: int
    stored: tuple[int, ...]


class TensorEntry:
    """A tensor of a validated checkpoint: its array, grid and the records of its chunks.

    ``crcs`` holds the CRC32C of every chunk (C order of grid coordinates); for a
    checkpoint that keeps its records in a chunk table it is None until
    :func:`load_chunk_records` reads the rows of this tensor (``table``, ``row``).
    ``listed``: the other per-chunk columns its listed records hold (content hashes;
    :func:`chunk_column` reads them from either form). ``chunks`` (every chunk's
    :class:`ChunkRead`) is built when first asked for; :meth:`chunk` makes one.
    """

    __slots__ = (
        "_chunks",
        "crcs",
        "dtype",
        "fqn",
        "grid",
        "listed",
        "metadata",
        "name",
        "nbytes",
        "nchunks",
        "row",
        "segments",
        "shape",
        "table",
    )

    def __init__(
        self,
        fqn: str,
        name: str,
        metadata: TensorStorageMetadata,
        grid: ChunkGrid,
        crcs: np.ndarray | None,
        table: ChunkTable | None = None,
        row: int = 0,
        listed: Mapping[str, np.ndarray] | None = None,
        segments: Any = None,
        *,
        nchunks: int | None = None,
    ) -> None:
        self.fqn, self.name, self.metadata, self.grid = fqn, name, metadata, grid
        self.crcs, self.table, self.row = crcs, table, row
        self.listed = listed
        #: the segment records of its chunks as stored (untrusted; see :mod:`gpuckpt.ranged`)
        self.segments = segments
        self._chunks: list[ChunkRead] | None = None
        # asked for per chunk by every load: worked out once (the metadata of a validated
        # checkpoint is never changed, see validated_metadata)
        #: the tensor's shape
        self.shape: tuple[int, ...] = tuple(metadata.size)
        #: the tensor's dtype
        self.dtype: np.dtype[Any] = np.dtype(metadata.properties.dtype)
        #: the tensor's size in bytes
        self.nbytes: int = math.prod(self.shape) * self.dtype.itemsize
        #: how many chunks it has (none when it is empty); ``nchunks``: that number, worked out
        #: by the caller (as :func:`validate_metadata` does)
        self.nchunks: int = (
            nchunks if nchunks is not None else 0 if 0 in self.shape else 1 if self._whole() else grid.nchunks
        )

    def _whole(self) -> bool:
        """Whether the tensor's only chunk is the whole tensor (a regular grid of its own shape)."""
        return self.grid.kind == "regular" and self.grid.chunk_shape == self.shape

    def _crcs(self) -> np.ndarray:
        if self.crcs is None:
            raise MetadataError(
                f"the chunk records of tensor {self.fqn!r} were not read from the chunk table; "
                "call gpuckpt.reading.load_chunk_records first"
            )
        return self.crcs

    def _read(self, spec: ChunkSpec, crc: int) -> ChunkRead:
        stored = self.grid.stored_chunk_shape(spec)
        return ChunkRead(
            spec, chunk_file_key(spec.coords), stored_nbytes(stored, self.dtype.itemsize), crc, stored
        )

    @property
    def chunks(self) -> list[ChunkRead]:
        if self._chunks is None:
            crcs = self._crcs()
            if len(crcs) == 1 and self.nchunks == 1 and self._whole():
                # the one chunk of a small tensor: what chunk_list and _read make, made directly
                zero = (0,) * len(self.shape)
                shape = self.shape
                self._chunks = [
                    ChunkRead(
                        ChunkSpec(zero, zero, shape),
                        chunk_file_key(zero),
                        self.nbytes + CRC_BYTES,
                        int(crcs[0]),
                        shape,
                    )
                ]
            else:
                values = crcs.tolist()
                self._chunks = [self._read(s, c) for s, c in zip(self.grid.chunk_list(), values, strict=True)]
        return self._chunks

    def chunk(self, coords: tuple[int, ...]) -> ChunkRead:
        """The chunk at grid coordinates ``coords`` (made without listing the others)."""
        if self._chunks is not None:
            flat = _flat(coords, self.grid.grid_shape)
            return self._chunks[flat]
        grid = self.grid
        if grid.kind == "regular":
            offsets = tuple(c * k for c, k in zip(coords, grid.chunk_shape, strict=True))
            sizes = tuple(
                min(k, n - o) for k, n, o in zip(grid.chunk_shape, grid.shape, offsets, strict=True)
            )
        else:
            starts = axis_starts(grid)
            offsets = tuple(st[c] for st, c in zip(starts, coords, strict=True))
            sizes = tuple(e[c] for e, c in zip(grid.edges, coords, strict=True))
        spec = ChunkSpec(tuple(coords), offsets, sizes)
        return self._read(spec, int(self._crcs()[_flat(coords, grid.grid_shape)]))


def _flat(coords: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for c, g in zip(coords, shape, strict=True):
        flat = flat * g + c
    return flat


_MAX_EXTENT = 2**62


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
        if math.prod(size) * itemsize >= _MAX_EXTENT or (size and max(size) >= _MAX_EXTENT):
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
    md = metadata_from_root_document(root, where)
    tensors, objects = validate_metadata(md)
    with _validated_lock:
        _validated[key] = (md, tensors, objects)
        while len(_validated) > _VALIDATED_KEEP:
            _validated.popitem(last=False)
    return md, tensors, objects


def check_chunk_files(reader: CheckpointReader, entries: Iterable[TensorEntry]) -> None:
    """Check that every chunk file exists with the size the metadata gives, before allocating
    (the chunk records a chunk table holds are read first, see :func:`load_chunk_records`)."""
    entries = list(entries)
    load_chunk_records(reader, entries)
    chunks = [(t, c) for t in entries for c in t.chunks]
    sizes = reader.chunk_sizes([t.name for t, _ in chunks], [c.key for _, c in chunks])
    if sizes == [c.nbytes for _, c in chunks]:
        return  # all as expected: compared as whole lists, not chunk by chunk
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


def _check_crc(t: TensorEntry, c: ChunkRead, value: int, stored_crc: int) -> None:
    if value != stored_crc or value != c.crc:
        what = (
            "its bytes do not match their checksum"
            if value != stored_crc
            else "it is a valid chunk but not the one the metadata lists"
        )
        raise ChecksumError(
            f"chunk {c.key} of tensor {t.fqn!r} failed its CRC32C check ({what}: computed {value:#010x}, "
            f"chunk file {stored_crc:#010x}, metadata {c.crc:#010x}); the checkpoint is damaged, or was "
            "replaced by a concurrent save while loading (then load again): restore it from a copy or load "
            "an earlier checkpoint (arrays loaded in place may be partly overwritten)",
            fqn=t.fqn,
            key=c.key,
            computed=value,
            stored=stored_crc,
            expected=c.crc,
        )


def vanished(t: TensorEntry, c: ChunkRead, exc: FileNotFoundError) -> MissingChunkError:
    what = f"file {t.name}/{c.key} {exc.strerror}" if exc.strerror else "it disappeared"
    return MissingChunkError(
        f"chunk {c.key} of tensor {t.fqn!r} cannot be read while loading ({what}); the checkpoint "
        "was deleted or replaced by a concurrent save (load again), or is damaged"
    )


def scratch(shape: tuple[int, ...], dtype: np.dtype[Any], t: TensorEntry) -> np.ndarray:
    """Scratch memory for a chunk of ``t`` (validation keeps it within the tensor's own size)."""
    try:
        return np.empty(shape, dtype)
    except MemoryError:
        raise CheckpointTooLargeError(
            f"tensor {t.fqn!r}: a scratch buffer of shape {shape} ({math.prod(shape) * dtype.itemsize} "
            "bytes) for reading one of its chunks cannot be allocated; free memory and load again"
        ) from None


def checksum_verified(reader: CheckpointReader, t: TensorEntry, c: ChunkRead, piece: int) -> None:
    """Read chunk ``c`` through buffers of at most ``piece`` bytes and check its size and CRC32C.

    Nothing of the chunk is kept; ``c.nbytes`` must have been checked against the file first.
    """
    try:
        got, value, stored_crc = reader.read_chunk_checksum(t.name, c.key, c.nbytes, piece)
    except FileNotFoundError as exc:
        raise vanished(t, c, exc) from None
    if got != c.nbytes:
        raise CheckpointCorruptedError(
            f"chunk {c.key} of tensor {t.fqn!r}: read {got} bytes, expected {c.nbytes}; the file is truncated"
        )
    _check_crc(t, c, value, stored_crc)


def fetch_verified(reader: CheckpointReader, t: TensorEntry, c: ChunkRead, parts: list[Any]) -> None:
    """Read chunk ``c`` into the buffers ``parts`` (its stored bytes) and check its size and CRC32C."""
    crc_buf = bytearray(CRC_BYTES)
    try:
        got, value = reader.read_chunk_crc(t.name, c.key, [*parts, crc_buf])
    except FileNotFoundError as exc:
        raise vanished(t, c, exc) from None
    if got != c.nbytes:
        raise CheckpointCorruptedError(
            f"chunk {c.key} of tensor {t.fqn!r}: read {got} bytes, expected {c.nbytes}; the file is truncated"
        )
    _check_crc(t, c, value, int.from_bytes(crc_buf, "little"))


def read_chunk_into(
    reader: CheckpointReader,
    t: TensorEntry,
    c: ChunkRead,
    dest: ArrayAdapter,
    offsets: tuple[int, ...],
    staging: Staging,
    counter: ProgressCounter,
) -> None:
    """Read and verify chunk ``c`` into the box of ``dest`` at ``offsets`` (the chunk's extent).

    Straight into the box's memory where its layout allows (host boxes, or the
    staging buffer of a device box), else through scratch memory.
    """
    incoming = dest.stage_in(offsets, c.spec.sizes, staging)
    try:
        box = incoming.box
        _fill_box(reader, t, c, box)
        incoming.finish()
    finally:
        incoming.release()
    counter.add(box.nbytes)


def upload_chunk(
    reader: CheckpointReader,
    t: TensorEntry,
    c: ChunkRead,
    dest: ArrayAdapter,
    offsets: tuple[int, ...],
    staging: Staging,
    copies: CopyQueue,
    counter: ProgressCounter,
) -> None:
    """Read and verify chunk ``c`` into a staging buffer, then hand it to ``copies``, which
    moves it into the box of ``dest`` at ``offsets`` while this thread reads on.

    The buffer comes from the run's bounded pool (blocking while all are in flight:
    the pipeline's depth). A chunk that fails its check is never handed over.
    """
    incoming = dest.stage_in(offsets, c.spec.sizes, staging)
    try:
        box = incoming.box
        _fill_box(reader, t, c, box)
    except BaseException:
        incoming.release()
        raise
    copies.put(incoming)  # gives the buffer back itself, also when it fails
    counter.add(box.nbytes)


def _fill_box(reader: CheckpointReader, t: TensorEntry, c: ChunkRead, box: np.ndarray) -> None:
    """Read and verify chunk ``c`` into ``box``: straight into its memory where the layout
    allows (the stored bytes are the box's), else through scratch memory."""
    if box.flags.c_contiguous and box.dtype.byteorder != ">" and is_prefix_box(c.spec.sizes, c.stored):
        # straight into the box; padding of an edge chunk goes to scratch
        data = box.reshape(-1).view(np.uint8)
        pad = c.nbytes - CRC_BYTES - data.nbytes
        fetch_verified(reader, t, c, [data, scratch((pad,), np.dtype(np.uint8), t)] if pad else [data])
    else:
        stored = scratch(c.stored, t.dtype.newbyteorder("<"), t)
        fetch_verified(reader, t, c, [stored.reshape(-1).view(np.uint8)])
        box[...] = stored[tuple(slice(0, s) for s in c.spec.sizes)]


def _read_chunks(
    reader: CheckpointReader,
    reads: list[tuple[TensorEntry, ChunkRead, ArrayAdapter]],
    staging: Staging,
    copies: CopyQueue | None,
    counter: ProgressCounter,
) -> None:
    """Chunks of host targets as one batch of the reader's (native code for the small
    chunk files of a local checkpoint); chunks of device targets one by one, each
    read into a staging buffer and moved in by ``copies`` while the next is read."""
    host = [r for r in reads if r[2].backend is None]
    if host:
        _read_host_batch(reader, host, staging, counter)
    for t, c, dest in reads:
        if dest.backend is not None:
            assert copies is not None, "device targets need the run's copy queue"
            upload_chunk(reader, t, c, dest, c.spec.offsets, staging, copies, counter)


def _read_host_batch(
    reader: CheckpointReader,
    reads: list[tuple[TensorEntry, ChunkRead, ArrayAdapter]],
    staging: Staging,
    counter: ProgressCounter,
) -> None:
    """Read and verify chunks into their boxes of host arrays with one
    :meth:`~gpuckpt.storage.base.CheckpointReader.read_chunks`: straight into the box
    where the layout allows, else into scratch copied into place afterwards. Raises
    what :func:`fetch_verified` raises, for the first chunk that fails."""
    # a chunk that is the whole of a host array is read into the array itself, with no
    # box to stage (the common case of small tensors: one chunk each)
    incoming: list[StagedIn | None] = []
    boxes: list[np.ndarray] = []
    for t, c, dest in reads:
        if isinstance(dest, HostArray) and c.spec.sizes == t.shape:
            incoming.append(None)
            boxes.append(dest.array)
        else:
            into = dest.stage_in(c.spec.offsets, c.spec.sizes, staging)
            incoming.append(into)
            boxes.append(into.box)
    try:
        buffers: list[np.ndarray] = []
        pads: list[int] = []
        copies: list[tuple[int, np.ndarray]] = []
        for i, ((t, c, _dest), box) in enumerate(zip(reads, boxes, strict=True)):
            sizes = c.spec.sizes
            if (
                box.flags.c_contiguous
                and box.dtype.byteorder != ">"
                and (sizes == c.stored or is_prefix_box(sizes, c.stored))
            ):
                data = box.reshape(-1).view(np.uint8)
                buffers.append(data)
                pads.append(c.nbytes - CRC_BYTES - data.nbytes)
            else:
                stored = scratch(c.stored, t.dtype.newbyteorder("<"), t)
                buffers.append(stored.reshape(-1).view(np.uint8))
                pads.append(0)
                copies.append((i, stored))
        batch = ChunkReads(
            [t.name for t, _, _ in reads],
            [c.key for _, c, _ in reads],
            buffers,
            pads,
            [c.crc for _, c, _ in reads],
        )
        stop = reader.read_chunks(batch)
        done = len(reads) if stop is None else stop.index
        for i, stored in copies:
            if i < done:
                c = reads[i][1]
                boxes[i][...] = stored[tuple(slice(0, s) for s in c.spec.sizes)]
        for (t, c, _dest), staged in zip(reads[:done], incoming, strict=False):
            if staged is not None:
                staged.finish()
            counter.add(c.spec.nelem * t.dtype.itemsize)
    finally:
        for staged in incoming:
            if staged is not None:
                staged.release()
    if stop is None:
        return
    t, c, _ = reads[stop.index]
    if stop.error is not None:
        if isinstance(stop.error, FileNotFoundError):
            raise vanished(t, c, stop.error) from None
        raise stop.error
    if stop.got != c.nbytes:
        raise CheckpointCorruptedError(
            f"chunk {c.key} of tensor {t.fqn!r}: read {stop.got} bytes, expected {c.nbytes}; "
            "the file is truncated"
        )
    _check_crc(t, c, stop.crc, stop.stored)


#: a load of at least this many chunks averaging at most :data:`SMALL_CHUNK_BYTES` is "many small"
MANY_CHUNKS = 512
SMALL_CHUNK_BYTES = 1 << 20
#: I/O threads of a load of many small chunks that are not in the page cache: each thread
#: waits for one file at a time, so more of them keep more reads queued at the device
COLD_SMALL_THREADS = 16
_PROBES = 8


def cold_small_threads(reader: CheckpointReader, targets: list[tuple[TensorEntry, Any]]) -> int | None:
    """:data:`COLD_SMALL_THREADS` for a load of many small chunks of which a sample (a few
    spread over the load) is not in the page cache, else None (the default thread count).

    Measured here: 10,000 chunks of 4-64 KiB, cold, load in 0.54 s on 16 threads against
    0.75 s on 4; warm, 16 threads are slower (0.25 against 0.23 s), hence the probe.
    """
    chunks = [(t, c) for t, _ in targets for c in t.chunks]
    if len(chunks) < MANY_CHUNKS or sum(c.nbytes for _, c in chunks) > SMALL_CHUNK_BYTES * len(chunks):
        return None
    step = len(chunks) // _PROBES
    for t, c in chunks[step // 2 :: step][:_PROBES]:
        if reader.chunk_cached(t.name, c.key) is False:
            return max(COLD_SMALL_THREADS, default_threads())
    return None


def read_tensors(
    reader: CheckpointReader,
    targets: list[tuple[TensorEntry, ArrayAdapter]],
    options: LoadOptions,
) -> None:
    """Fill each target array (an adapter of any kind of memory) with its tensor's chunks, in parallel.

    Of ``options``, ``threads``, ``progress`` and ``staging_bytes`` (the
    staging budget of device targets) apply. Chunks go to the I/O threads in
    batches (small ones together). Host targets are read straight into their
    memory where the layout allows.
    Device targets go through a bounded pool of (page-locked) staging buffers:
    I/O threads read and verify chunks into buffers and queue their copies to
    the device on the back end's own stream without waiting for them
    (:class:`~gpuckpt.device.upload.CopyQueue`), so reads of the next chunks
    overlap the copies of earlier ones. When this returns or raises, no copy
    is in flight any more and every buffer is back in its pool.
    """
    threads, progress, staging_bytes = options.threads, options.progress, options.staging_bytes
    if threads is None:
        threads = cold_small_threads(reader, targets)
    counter = ProgressCounter(progress, sum(t.nbytes for t, _ in targets))
    staging = Staging(
        # host targets need no staging: only the boxes of device targets are listed
        (
            (dest.backend, c.spec.nelem * t.dtype.itemsize)
            for t, dest in targets
            if dest.backend is not None
            for c in t.chunks
        ),
        staging_bytes,
    )
    reads = (((t, c, dest), c.nbytes) for t, dest in targets for c in t.chunks)
    copies = CopyQueue() if staging.backends else None
    jobs = [
        functools.partial(_read_chunks, reader, batch, staging, copies, counter)
        for batch in batches(reads, max_items=IO_BATCH_JOBS if reader.batches_chunks else 1)
    ]
    try:
        run_all(jobs, threads=threads, name="gpuckpt-read")
    except BaseException:
        if copies is not None:
            # no copy may still write into the targets once the load has failed
            with contextlib.suppress(Exception):
                copies.close()
        raise
    if copies is not None:
        copies.close()
