"""The one reader of a root document's metadata, for every format version.

Every reader of a checkpoint (a load, :func:`gpuckpt.read_metadata`, verify,
inspect, convert, the base of an incremental save, the DCP layer) parses the
metadata of the root document here, once, into a :class:`CheckpointIndex`:
each tensor's :class:`~gpuckpt.format.entries.TensorEntry` (its array, grid and
chunk records, checked against each other), the encoded values, the planner
data and the storage identifiers. :class:`~gpuckpt.format.metadata.Metadata`, the
model of the spec, is made from the index when someone asks for it
(:meth:`CheckpointIndex.metadata`).

Nothing in the document is trusted. One pass checks what the format promises:
the version, every entry's type, properties, size and chunk grid (an extent
no array can have is refused before anything is sized by it), listed chunk
boxes against the grid, array names (safe path components, unique), each
tensor's chunk records (listed, each key and byte size the grid's, or rows of
the chunk table, whose row ranges must tile the table exactly), and the
columns of format version 3. The first defect raises
:class:`~gpuckpt.errors.MetadataError` naming the entry and what is wrong
(:class:`~gpuckpt.errors.UnsupportedVersionError` for a newer version).

The work is bounded by the document: per tensor a fixed number of steps, what
many tensors share (their properties, their regular grids) parsed and
checked once, no chunk list made for a tensor whose chunks are its grid's
(:data:`MAX_GRID_CHUNKS` the most it may have), and a listed chunk list no
longer than the document that lists it.
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuckpt.errors import MetadataError
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.chunks import stored_nbytes
from gpuckpt.format.codecs import parse_codec
from gpuckpt.format.columns import COLUMNS_KEY, checked_columns, expand
from gpuckpt.format.documents import chunk_file_key, metadata_json
from gpuckpt.format.entries import StoredProperties, TensorEntry
from gpuckpt.format.grid import ChunkGrid
from gpuckpt.format.metadata import (
    CODEC_VERSIONS,
    COLUMN_VERSIONS,
    VERSION_BLOCKS,
    VERSION_COMPRESSED,
    VERSION_LISTED,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    parse_storage_meta,
    parse_version,
    register_json_reader,
)
from gpuckpt.format.names import is_safe_name
from gpuckpt.format.records import TABLE_KEY, ChunkTable, parse_listed
from gpuckpt.format.segments import SEGMENTS_KEY

__all__ = [
    "MAX_DIMS",
    "MAX_EXTENT",
    "MAX_GRID_CHUNKS",
    "CheckpointIndex",
    "beyond_any_array",
    "metadata_from_json",
    "metadata_of_root",
    "read_index",
]

#: no tensor may have this many bytes, nor an axis this long
MAX_EXTENT = 2**62
#: the most dimensions a tensor may have
MAX_DIMS = 32
#: most chunks one tensor's grid may have when its chunks are not listed (2**32)
MAX_GRID_CHUNKS = 1 << 32

#: held while the metadata of a shared index is made (loads on several threads share one)
_MAKING = threading.Lock()


def beyond_any_array(size: tuple[int, ...], itemsize: int) -> bool:
    """Whether no array of ``itemsize``-byte elements can have shape ``size``: an axis of
    :data:`MAX_EXTENT` or more, or non-empty axes spanning that many bytes together (an empty
    axis makes a tensor hold nothing, but NumPy still sizes an array by the others)."""
    if not size:
        return False
    return max(size) >= MAX_EXTENT or math.prod(n for n in size if n) * itemsize >= MAX_EXTENT


@dataclass(eq=False)
class CheckpointIndex:
    """What the root document of a checkpoint says, checked (see the module docstring).

    ``tensors`` and ``objects`` (the encoded plain values, by FQN) are what a load
    reads; ``order`` is every FQN in the order of the document's
    ``state_dict_metadata`` (values and tensors). An index may be shared by loads on
    several threads: nothing changes it after it is made, and :meth:`metadata` makes
    its :class:`~gpuckpt.format.metadata.Metadata` once, under a lock.
    """

    version: str
    tensors: dict[str, TensorEntry]
    objects: dict[str, Any]
    order: list[str]
    planner_data: Any
    storage_meta: StorageMeta | None
    #: the metadata object as stored (its storage entries; columns still as columns)
    document: Mapping[str, Any]
    _metadata: Metadata | None = field(default=None, repr=False)

    def metadata(self) -> Metadata:
        """The :class:`~gpuckpt.format.metadata.Metadata` of the checkpoint (made on the first call;
        the same object afterwards: do not change it). Its ``storage_data`` is that of format
        version 2 for a version 3 document (its columns expanded)."""
        md = self._metadata
        if md is None:
            with _MAKING:
                md = self._metadata
                if md is None:
                    md = self._metadata = self._make_metadata()
        return md

    def _make_metadata(self) -> Metadata:
        tensors = self.tensors
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
            f: tensors[f].metadata if f in tensors else BytesStorageMetadata() for f in self.order
        }
        doc = self.document
        # version 2 ignores them
        columns = self.version in COLUMN_VERSIONS and COLUMNS_KEY in doc
        storage_data = expand(doc)["storage_data"] if columns else doc.get("storage_data")
        return Metadata(
            state_dict_metadata=entries,
            planner_data=self.planner_data,
            storage_data=storage_data,
            storage_meta=self.storage_meta,
            version=self.version,
        )


def _expect_dict(value: Any, where: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise MetadataError(f"{where} must be a JSON object, found {type(value).__name__}")
    return value


def _bad(fqn: str, what: str) -> MetadataError:
    return MetadataError(
        f"metadata of tensor {fqn!r} is inconsistent: {what}; "
        "the checkpoint is damaged or was not written by gpuckpt"
    )


def _int_tuple(value: Any, where: str) -> tuple[int, ...]:
    if type(value) is not list:
        raise MetadataError(f"{where} must be a list of non-negative integers, found {value!r:.200}")
    for v in value:
        if type(v) is not int or v < 0:
            raise MetadataError(f"{where} must be a list of non-negative integers, found {value!r:.200}")
    if len(value) > MAX_DIMS:
        raise MetadataError(f"{where} has {len(value)} dimensions; at most {MAX_DIMS} are supported")
    return tuple(value)


class _Document:
    """What the tensors of one document share while it is read: checked properties and
    regular grids by their stored form, the array names taken, the chunk table and the row
    ranges of the tensors in it."""

    __slots__ = ("_grids", "_properties", "compressed", "names", "spans", "storage_data", "table", "version")

    def __init__(self, storage_data: dict[str, Any], version: str = VERSION_COMPRESSED) -> None:
        self.storage_data = storage_data
        self.version = version
        #: tensors may name a codec (format version 4)
        self.compressed = version in CODEC_VERSIONS
        self._properties: dict[Any, StoredProperties] = {}
        self._grids: dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkGrid] = {}
        self.names: set[str] = set()
        self.spans: list[tuple[int, int, str]] = []
        self.table: ChunkTable | None = None

    def properties(self, raw: Any, fqn: str) -> StoredProperties:
        """The checked properties ``raw`` of tensor ``fqn`` (parsed once per distinct stored form)."""
        if type(raw) is dict:
            get = raw.get
            key: Any = (
                get("layout"),
                get("dtype"),
                get("memory_format"),
                get("requires_grad"),
                get("pin_memory"),
            )
            grad, pin = key[3], key[4]
            # the JSON booleans are the two singletons: 1 or 0 never passes for True or False
            if (grad is True or grad is False) and (pin is True or pin is False):
                try:
                    known = self._properties.get(key)
                except TypeError:  # an unhashable value (a list, an object): parsed, and refused
                    known = None
                if known is not None:
                    return known
        else:
            key = None
        where = f"state_dict_metadata[{fqn!r}].properties"
        try:
            parsed = TensorProperties.from_json(raw, where)
        except MetadataError as exc:  # every error names the tensor
            if where in str(exc):
                raise
            raise MetadataError(f"{where}: {exc}") from None
        stored = StoredProperties(
            np.dtype(parsed.dtype), parsed.requires_grad, parsed.memory_format, parsed.pin_memory
        )
        if key is not None:
            self._properties[key] = stored
        return stored

    def grid(self, fqn: str, size: tuple[int, ...], raw: Any, listed: bool) -> ChunkGrid | None:
        """The chunk grid ``raw`` (``storage_data.tensors[fqn].chunk_grid``) of a tensor of
        ``size``; None when it is the usual grid of a small tensor (one chunk of its own
        shape, no axis empty: made when first asked for). ``listed``: the entry lists its
        chunks (else a grid of more than :data:`MAX_GRID_CHUNKS` chunks is refused)."""
        conf = raw.get("configuration") if type(raw) is dict and raw.get("name") == "regular" else None
        shape_raw = conf.get("chunk_shape") if type(conf) is dict and len(raw) == 2 else None
        if type(shape_raw) is list and all(type(c) is int for c in shape_raw):
            return self.regular(fqn, size, tuple(shape_raw), listed, raw)
        return self._parse(fqn, size, raw, listed)

    def regular(
        self, fqn: str, size: tuple[int, ...], chunk_shape: tuple[int, ...], listed: bool, raw: Any = None
    ) -> ChunkGrid | None:
        """:meth:`grid` of a regular grid of ``chunk_shape`` (parsed once per size and shape)."""
        if chunk_shape == size and 0 not in size:
            return None
        grid = self._grids.get((size, chunk_shape))
        if grid is not None:
            return grid
        if raw is None:
            raw = {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}}
        return self._parse(fqn, size, raw, listed)

    def _parse(self, fqn: str, size: tuple[int, ...], raw: Any, listed: bool) -> ChunkGrid | None:
        try:
            grid = ChunkGrid.from_zarr_json(size, raw)
        except ValueError as exc:
            raise _bad(fqn, f"chunk grid: {exc}") from None
        if grid.kind == "regular":
            if any(c > max(n, 1) for c, n in zip(grid.chunk_shape, size, strict=True)):
                # gpuckpt never writes one: each chunk would be read through padding (a sparse
                # file costs no disk) that every load has to allocate
                raise _bad(
                    fqn,
                    f"regular chunk shape {list(grid.chunk_shape)} is larger than the tensor's shape "
                    f"{list(size)}; no chunk may exceed the tensor along any axis",
                )
            if grid.chunk_shape == size and 0 not in size:
                return None
        if not listed and grid.nchunks > MAX_GRID_CHUNKS:
            raise _bad(
                fqn,
                f"its chunk grid has {grid.nchunks} chunks, more than the {MAX_GRID_CHUNKS} gpuckpt reads",
            )
        if grid.kind == "regular":
            self._grids[(size, grid.chunk_shape)] = grid
        return grid

    def chunk_table(self) -> ChunkTable:
        table = self.table
        if table is None:
            table = self.table = ChunkTable.parse(
                self.storage_data.get(TABLE_KEY), blocks=self.version == VERSION_BLOCKS
            )
        return table


def _listed_boxes(raw: Any, size: tuple[int, ...], where: str) -> list[ChunkStorageMetadata]:
    """The chunk boxes an entry lists (``state_dict_metadata[fqn].chunks``), each checked to lie
    in the tensor."""
    if type(raw) is not list:
        raise MetadataError(f"{where}.chunks must be a list, found {type(raw).__name__}")
    chunks = []
    for i, c in enumerate(raw):
        cd = _expect_dict(c, f"{where}.chunks[{i}]")
        offsets = _int_tuple(cd.get("offsets"), f"{where}.chunks[{i}].offsets")
        sizes = _int_tuple(cd.get("sizes"), f"{where}.chunks[{i}].sizes")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise MetadataError(f"{where}.chunks[{i}] has the wrong number of dimensions")
        if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
            raise MetadataError(f"{where}.chunks[{i}] lies outside the tensor of size {size}")
        chunks.append(ChunkStorageMetadata(offsets, sizes))
    return chunks


#: ``rows`` of :func:`_tensor` for a tensor whose records are listed, not in a chunk table
_LISTED = -1
#: ``grid_raw`` of :func:`_tensor` for a tensor of format version 3's columns without a chunk
#: shape: one chunk of its own shape
_OWN_SHAPE: Any = object()


def _tensor(
    doc: _Document,
    fqn: str,
    stored: StoredProperties,
    size: tuple[int, ...],
    boxes: list[ChunkStorageMetadata] | None,
    name: Any,
    grid_raw: Any,
    rows: Any,
    info: dict[str, Any] | None,
) -> TensorEntry:
    """The entry of tensor ``fqn`` from its checked properties, size and listed ``boxes`` (None:
    its chunks are its grid's), its array ``name`` and chunk grid ``grid_raw`` as stored
    (:data:`_OWN_SHAPE`: one chunk of the tensor's shape) and its chunk records: its first row
    of the chunk table (``rows``, as stored), or with ``rows`` :data:`_LISTED` the records its
    storage entry ``info`` lists. ``info`` also gives its segment records (None: none)."""
    names = doc.names
    if type(name) is not str or name in names or not is_safe_name(name):
        raise _bad(fqn, f"array name {name!r:.200} is not a safe, unique path component")
    names.add(name)
    itemsize = stored.dtype.itemsize
    nbytes = math.prod(size) * itemsize
    # a tensor with no empty axis and fewer bytes than MAX_EXTENT has no axis that long either
    if (nbytes >= MAX_EXTENT or 0 in size) and beyond_any_array(size, itemsize):
        raise _bad(fqn, f"size {list(size)} is larger than any array can be")
    listed_boxes = boxes is not None
    if grid_raw is _OWN_SHAPE:
        grid = doc.regular(fqn, size, size, listed_boxes)
    else:
        grid = doc.grid(fqn, size, grid_raw, listed_boxes)
    n = 0 if 0 in size else 1 if grid is None else grid.nchunks
    if boxes is not None:
        if len(boxes) != n:
            raise _bad(fqn, f"{len(boxes)} chunks listed, the grid has {n}")
        specs = (grid or ChunkGrid(size, "regular", size)).chunk_list()
        for i, (spec, box) in enumerate(zip(specs, boxes, strict=True)):
            if box.offsets != spec.offsets or box.sizes != spec.sizes:
                raise _bad(fqn, f"chunk {i} box {box} does not match the grid {spec}")
    crcs = listed = table = sizes = codec = None
    raw_codec = None if info is None else info.get("codec")
    if raw_codec is not None:
        if not doc.compressed:
            raise _bad(fqn, f"it names a codec, which format version {doc.version} does not have")
        codec = parse_codec(raw_codec, itemsize, f"metadata of tensor {fqn!r}")
    row = 0
    if rows is not _LISTED:
        table = doc.table or doc.chunk_table()
        if type(rows) is not int:
            raise _bad(fqn, f"its chunk table rows begin at {rows!r:.60}, not an integer row")
        problem = table.span_problem(rows, n)
        if problem is not None:
            raise _bad(fqn, problem)
        row = rows
        doc.spans.append((row, n, fqn))
    else:
        raw_chunks = None if info is None else info.get("chunks")
        if type(raw_chunks) is not list or len(raw_chunks) != n:
            raise _bad(fqn, "storage chunk list does not match the chunk metadata")
        g = grid or ChunkGrid(size, "regular", size)
        specs = g.chunk_list()
        claims = [stored_nbytes(g.stored_chunk_shape(s), itemsize) for s in specs]
        if codec is not None:  # the most each chunk's codec may store
            claims = [codec.max_stored(n - CRC_BYTES) + CRC_BYTES for n in claims]
        columns = parse_listed(
            raw_chunks,
            [chunk_file_key(s.coords) for s in specs],
            claims,
            functools.partial(_bad, fqn),
            compressed=codec is not None,
        )
        crcs = columns.pop("crc32c")
        sizes = columns.pop("nbytes", None)
        listed = columns or None
    metadata = None
    if boxes is not None:
        metadata = TensorStorageMetadata(properties=stored.properties(), size=size, chunks=boxes)
    segments = None if info is None else info.get(SEGMENTS_KEY)
    return TensorEntry(
        fqn,
        name,
        stored,
        size,
        nbytes,
        n,
        grid,
        table,
        row,
        segments,
        crcs=crcs,
        listed=listed,
        metadata=metadata,
        codec=codec,
        sizes=sizes,
    )


def _size(raw: Any, fqn: str) -> tuple[int, ...]:
    """The size ``raw`` (``state_dict_metadata[fqn].size``) checked: at most :data:`MAX_DIMS`
    non-negative integers."""
    if type(raw) is list and len(raw) <= MAX_DIMS:
        for v in raw:
            if type(v) is not int or v < 0:
                break
        else:
            return tuple(raw)
    return _int_tuple(raw, f"state_dict_metadata[{fqn!r}].size")  # raises the error


def read_index(data: Any) -> CheckpointIndex:
    """The :class:`CheckpointIndex` of the metadata object ``data`` (the JSON value of a root
    document's ``attributes.gpuckpt.metadata``); raises :class:`MetadataError` (or
    :class:`~gpuckpt.errors.UnsupportedVersionError`) at its first defect."""
    d = _expect_dict(data, "metadata")
    version = parse_version(d)
    raw_entries = _expect_dict(d.get("state_dict_metadata"), "metadata.state_dict_metadata")
    sd = d.get("storage_data")
    if type(sd) is not dict or type(sd.get("tensors")) is not dict or type(sd.get("objects")) is not dict:
        raise MetadataError("metadata.storage_data must hold 'tensors' and 'objects' objects")
    pd = d.get("planner_data")
    if type(pd) is not dict or "structure" not in pd:
        raise MetadataError("metadata.planner_data must hold the state dict 'structure'")
    storage_meta = parse_storage_meta(d.get("storage_meta"))
    stored_tensors, stored_objects = sd["tensors"], sd["objects"]
    tabled = version != VERSION_LISTED  # a chunk table is read from format version 2 on
    doc = _Document(sd, version)
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, Any] = {}
    for fqn, raw in raw_entries.items():
        if type(raw) is not dict:
            _expect_dict(raw, f"state_dict_metadata[{fqn!r}]")  # raises the error
        kind = raw.get("type")
        if kind == "bytes":
            if fqn not in stored_objects:
                raise MetadataError(f"value {fqn!r} is listed but not stored; the checkpoint is damaged")
            objects[fqn] = stored_objects[fqn]
            continue
        if kind != "tensor":
            raise MetadataError(
                f"state_dict_metadata[{fqn!r}].type is {kind!r:.60}; expected 'tensor' or 'bytes'"
            )
        stored = doc.properties(raw.get("properties"), fqn)
        size = _size(raw.get("size"), fqn)
        # listed chunk boxes: every entry of version 1, an entry that has them in later versions
        listing = "chunks" in raw or not tabled
        boxes = _listed_boxes(raw.get("chunks"), size, f"state_dict_metadata[{fqn!r}]") if listing else None
        info = stored_tensors.get(fqn)
        if type(info) is not dict:
            raise _bad(fqn, "no storage entry")
        rows = info.get("rows", _LISTED) if tabled else _LISTED
        tensors[fqn] = _tensor(
            doc, fqn, stored, size, boxes, info.get("name"), info.get("chunk_grid"), rows, info
        )
    order = list(raw_entries)
    if version in COLUMN_VERSIONS and COLUMNS_KEY in d:
        fqns = _column_tensors(doc, checked_columns(d[COLUMNS_KEY]), raw_entries, stored_tensors, tensors)
        if fqns:
            order = sorted(order + fqns)
    if doc.table is not None:
        _check_tiling(doc.table, doc.spans)
    return CheckpointIndex(version, tensors, objects, order, pd, storage_meta, d)


def _check_tiling(table: ChunkTable, spans: list[tuple[int, int, str]]) -> None:
    """Check that the tensors' rows tile the table: each row belongs to exactly one chunk (in
    a table ordered in blocks, the tensors' runs tile each block's used rows, and the others
    the tail)."""
    blocks = table.blocks
    runs = [] if blocks is None else [(r, n // blocks.count, f) for r, n, f in spans if blocks.holds(r)]
    rest = spans if blocks is None else [s for s in spans if not blocks.holds(s[0])]
    regions = [] if blocks is None else [(runs, 0, blocks.used, "each block's used rows")]
    regions.append((rest, 0 if blocks is None else blocks.tail, table.rows, "the table"))
    for placed, at, end, what in regions:
        for row, n, fqn in sorted(placed):
            if n and row != at:
                raise _bad(
                    fqn, f"its chunk table rows begin at {row}, expected {at} (rows overlap or are left out)"
                )
            at += n
        if at != end:
            raise MetadataError(
                f"metadata.storage_data.{TABLE_KEY}: {what} end at row {end}, the tensors' chunks at "
                f"{at}; the checkpoint is damaged or was not written by gpuckpt"
            )


def _column_tensors(
    doc: _Document,
    lists: tuple[list[Any], ...],
    raw_entries: dict[str, Any],
    stored_tensors: dict[str, Any],
    tensors: dict[str, TensorEntry],
) -> list[str]:
    """Add the tensors of a ``tensor_columns`` object (format version 3; its lists' shape checked
    by :func:`~gpuckpt.format.columns.checked_columns`) to ``tensors``, each checked as its
    version 2 entry would be (:func:`~gpuckpt.format.columns.expand` gives those back); returns
    their FQNs."""
    fqns, names, sizes, properties, prop, shapes, rows = lists
    # each properties object checked once, when a tensor first uses it (an unused one is read by nobody)
    stored_of: dict[int, StoredProperties] = {}
    for i, fqn in enumerate(fqns):
        if fqn in raw_entries or fqn in stored_tensors:
            raise MetadataError(
                f"metadata.{COLUMNS_KEY} lists {fqn!r:.200}, which has an entry of its own too; the "
                "checkpoint is damaged or was not written by gpuckpt"
            )
        size = _size(sizes[i], fqn)
        shape = shapes[i]
        grid_raw = (
            _OWN_SHAPE if shape is None else {"name": "regular", "configuration": {"chunk_shape": shape}}
        )
        at = prop[i]
        stored = stored_of.get(at)
        if stored is None:
            stored = stored_of[at] = doc.properties(properties[at], fqn)
        name = names[i]
        tensors[fqn] = _tensor(
            doc, fqn, stored, size, None, fqn if name is None else name, grid_raw, rows[i], None
        )
    return list(fqns)


def metadata_from_json(data: Any) -> Metadata:
    """The :class:`~gpuckpt.format.metadata.Metadata` of a metadata object (its JSON value, or the text
    :meth:`Metadata.to_json <gpuckpt.format.metadata.Metadata.to_json>` wrote), read and checked by
    :func:`read_index`: what ``to_json`` wrote reads back equal. A metadata object without storage
    data (a ``Metadata`` made by a program, not read from a checkpoint: it lists each tensor's
    chunks and places nothing) is read by :func:`_model_only`."""
    if isinstance(data, (str, bytes, bytearray)):
        try:
            data = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise MetadataError(f"checkpoint metadata is not valid JSON: {exc}") from None
    if type(data) is dict and data.get("storage_data") is None:
        return _model_only(data)
    return read_index(data).metadata()


def _model_only(d: dict[str, Any]) -> Metadata:
    """The Metadata of a metadata object whose ``storage_data`` is null: entries of listed chunks
    and plain values, planner data as it is (nothing of it can be loaded: no chunk is placed)."""
    version = parse_version(d)
    raw_entries = _expect_dict(d.get("state_dict_metadata"), "metadata.state_dict_metadata")
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, raw in raw_entries.items():
        where = f"state_dict_metadata[{fqn!r}]"
        kind = _expect_dict(raw, where).get("type")
        if kind == "bytes":
            entries[fqn] = BytesStorageMetadata()
        elif kind == "tensor":
            size = _size(raw.get("size"), fqn)
            properties = TensorProperties.from_json(raw.get("properties"), f"{where}.properties")
            entries[fqn] = TensorStorageMetadata(
                properties, size, _listed_boxes(raw.get("chunks"), size, where)
            )
        else:
            raise MetadataError(f"{where}.type is {kind!r:.60}; expected 'tensor' or 'bytes'")
    if COLUMNS_KEY in d:
        raise MetadataError(f"metadata.{COLUMNS_KEY} without storage_data: nothing places those tensors")
    return Metadata(entries, d.get("planner_data"), None, parse_storage_meta(d.get("storage_meta")), version)


def metadata_of_root(raw: bytes | bytearray, where: str) -> Metadata:
    """The :class:`~gpuckpt.format.metadata.Metadata` of the root document ``raw`` (named ``where`` in
    errors): its checksum checked, its metadata read by :func:`read_index`."""
    return read_index(metadata_json(raw, where)).metadata()


register_json_reader(metadata_from_json)
