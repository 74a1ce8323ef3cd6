"""The general path of reading a root document, as it was before the one reader: a test oracle.

:func:`metadata_from_json_dict` parsed the metadata model entry by entry and
:func:`validate_metadata` cross-checked it with the storage entries; loads,
``read_metadata``, verify and the rest now use :func:`gpuckpt.format.reader.read_index`
instead. The property tests of ``test_reader.py`` hold the reader to this: every
document accepted by both or refused by both, and read alike. Nothing in the
package imports this module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from gpuckpt.errors import MetadataError
from gpuckpt.format import columns as tensor_columns
from gpuckpt.format import memory_format as mf
from gpuckpt.format.chunks import stored_nbytes
from gpuckpt.format.documents import chunk_file_key
from gpuckpt.format.entries import StoredProperties, TensorEntry
from gpuckpt.format.metadata import (
    VERSION_COLUMNS,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    GridTensorStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
    parse_storage_meta,
    parse_version,
)
from gpuckpt.format.names import is_safe_name
from gpuckpt.format.reader import beyond_any_array
from gpuckpt.format.records import TABLE_KEY, ChunkTable, parse_listed
from gpuckpt.format.segments import SEGMENTS_KEY
from gpuckpt.planning import ChunkGrid


def metadata_from_json_dict(data: Any) -> Metadata:
    d = _expect_dict(data, "metadata")
    version = parse_version(d)
    if version == VERSION_COLUMNS:
        d = tensor_columns.expand(d)
    raw_entries = _expect_dict(d.get("state_dict_metadata"), "metadata.state_dict_metadata")
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage_data = d.get("storage_data")
    fast = _GridEntries(storage_data) if version != "1" else None
    for fqn, raw in raw_entries.items():
        if fast is not None:
            # format version 2's usual tensor entry, in one pass (see _GridEntries)
            made = fast.entry(fqn, raw)
            if made is not None:
                entries[fqn] = made
                continue
        where = f"state_dict_metadata[{fqn!r}]"
        e = _expect_dict(raw, where)
        kind = e.get("type")
        if kind == "bytes":
            entries[fqn] = BytesStorageMetadata()
        elif kind == "tensor":
            size = _int_tuple(e.get("size"), f"{where}.size")
            if version != "1" and "chunks" not in e:
                # format version 2: the chunks are those of the tensor's chunk grid
                entries[fqn] = GridTensorStorageMetadata(
                    TensorProperties.from_json(e.get("properties"), f"{where}.properties"),
                    size,
                    grid=_grid_of(storage_data, fqn, size),
                    listed=False,
                )
                continue
            chunks_raw = e.get("chunks")
            if not isinstance(chunks_raw, list):
                raise MetadataError(f"{where}.chunks must be a list, found {type(chunks_raw).__name__}")
            chunks = []
            for i, c in enumerate(chunks_raw):
                cd = _expect_dict(c, f"{where}.chunks[{i}]")
                offsets = _int_tuple(cd.get("offsets"), f"{where}.chunks[{i}].offsets")
                sizes = _int_tuple(cd.get("sizes"), f"{where}.chunks[{i}].sizes")
                if len(offsets) != len(size) or len(sizes) != len(size):
                    raise MetadataError(f"{where}.chunks[{i}] has the wrong number of dimensions")
                if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
                    raise MetadataError(f"{where}.chunks[{i}] lies outside the tensor of size {size}")
                chunks.append(ChunkStorageMetadata(offsets, sizes))
            entries[fqn] = TensorStorageMetadata(
                properties=TensorProperties.from_json(e.get("properties"), f"{where}.properties"),
                size=size,
                chunks=chunks,
            )
        else:
            raise MetadataError(f"{where}.type is {kind!r}; expected 'tensor' or 'bytes'")
    return Metadata(
        state_dict_metadata=entries,
        planner_data=d.get("planner_data"),
        storage_data=d.get("storage_data"),
        storage_meta=parse_storage_meta(d.get("storage_meta")),
        version=version,
    )


#: most chunks one tensor's grid may have when its chunks are not listed (2**32)
MAX_GRID_CHUNKS = 1 << 32


def _regular_grid(size: tuple[int, ...], chunk_shape: tuple[int, ...]) -> Any:
    """``ChunkGrid.regular(size, chunk_shape)``."""
    # at call time: the grid is planning's type, and planning builds on this module
    from gpuckpt.format.grid import ChunkGrid

    return ChunkGrid(size, "regular", chunk_shape)


def _grid_of(storage_data: Any, fqn: str, size: tuple[int, ...]) -> Any:
    """The chunk grid of tensor ``fqn`` from ``storage_data.tensors[fqn].chunk_grid``."""
    # at call time: the grid is planning's type, and planning builds on this module
    from gpuckpt.format.grid import ChunkGrid

    where = f"storage_data.tensors[{fqn!r}]"
    tensors = storage_data.get("tensors") if isinstance(storage_data, dict) else None
    info = tensors.get(fqn) if isinstance(tensors, dict) else None
    if not isinstance(info, dict):
        raise MetadataError(
            f"state_dict_metadata[{fqn!r}] lists no chunks and {where} is missing; a format version 2 "
            "tensor without a chunk list needs its chunk grid in storage_data"
        )
    try:
        grid = ChunkGrid.from_zarr_json(size, info.get("chunk_grid"))
    except ValueError as exc:
        raise MetadataError(f"{where}.chunk_grid: {exc}") from None
    if grid.nchunks > MAX_GRID_CHUNKS:
        raise MetadataError(
            f"{where}.chunk_grid has {grid.nchunks} chunks, more than the {MAX_GRID_CHUNKS} gpuckpt reads"
        )
    return grid


class _GridEntries:
    """The tensor entries of a format version 2 document that leave their chunks to a regular
    grid, parsed without the general path's per-entry steps: what many tensors share (their
    properties, their grid) is parsed and checked once.

    :meth:`entry` accepts only an entry that the general path of
    :meth:`Metadata.from_json_dict` accepts, and makes the equal object (a
    :class:`GridTensorStorageMetadata` with its own :class:`TensorProperties`; equal grids are
    one shared :class:`~gpuckpt.format.grid.ChunkGrid`, which is immutable). For anything
    else (another grid kind, a value of an unexpected type, a defect) it returns None, and
    the general path parses the entry and raises its error.
    """

    __slots__ = ("_grids", "_properties", "_tensors")

    def __init__(self, storage_data: Any) -> None:
        tensors = storage_data.get("tensors") if isinstance(storage_data, dict) else None
        self._tensors: dict[str, Any] | None = tensors if isinstance(tensors, dict) else None
        #: (layout, dtype, memory format, requires_grad, pin_memory) as stored -> (dtype, format)
        self._properties: dict[tuple[str, str, str, bool, bool], tuple[Any, mf.MemoryFormat]] = {}
        #: (size, chunk shape) -> the checked grid
        self._grids: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}

    def entry(self, fqn: str, raw: Any) -> GridTensorStorageMetadata | None:
        tensors = self._tensors
        parts = None if tensors is None else self.parts(raw, tensors.get(fqn))
        if parts is None:
            return None
        size, (_layout, _dtype, _fmt, grad, pin), (dtype, fmt), grid = parts
        return GridTensorStorageMetadata(
            TensorProperties(
                dtype=dtype, layout=mf.strided, requires_grad=grad, memory_format=fmt, pin_memory=pin
            ),
            size,
            grid=_regular_grid(size, size) if grid is None else grid,
            listed=False,
        )

    def parts(
        self, raw: Any, info: Any
    ) -> tuple[tuple[int, ...], tuple[str, str, str, bool, bool], tuple[Any, mf.MemoryFormat], Any] | None:
        """``(size, properties as stored, (dtype, memory format), grid)`` of a tensor entry ``raw``
        whose storage entry ``info`` gives it a regular grid, checked as the general path checks
        them; ``grid`` is None when the tensor is stored whole (its one chunk its own shape, none
        of its axes empty). None for anything else."""
        if type(raw) is not dict or raw.get("type") != "tensor" or "chunks" in raw:
            return None
        props = self.checked_properties(raw.get("properties"))
        if props is None:
            return None
        grid_raw = info.get("chunk_grid") if type(info) is dict else None
        conf = grid_raw.get("configuration") if type(grid_raw) is dict else None
        if type(conf) is not dict or grid_raw.get("name") != "regular":  # type: ignore[union-attr]
            return None
        sized = self.regular_grid(raw.get("size"), conf.get("chunk_shape"))
        if sized is None:
            return None
        return sized[0], props[0], props[1], sized[1]

    def regular_grid(self, size_raw: Any, shape_raw: Any) -> tuple[tuple[int, ...], Any] | None:
        """``(size, grid)`` of a tensor of size ``size_raw`` on a regular grid of chunk shape
        ``shape_raw`` (both as stored), checked as the general path checks them; ``grid`` is
        None when the tensor is stored whole (its one chunk its own shape, none of its axes
        empty). None for anything else."""
        if type(size_raw) is not list or len(size_raw) > 32:
            return None
        for n in size_raw:
            if type(n) is not int or n < 0:
                return None
        if type(shape_raw) is not list:
            return None
        for c in shape_raw:
            if type(c) is not int:
                return None
        size = tuple(size_raw)
        if shape_raw == size_raw and 0 not in size:
            return size, None  # the usual grid of a small tensor
        chunk_shape = tuple(shape_raw)
        key = (size, chunk_shape)
        grid = self._grids.get(key)
        if grid is None:
            # what ChunkGrid.regular and _grid_of check, here without their per-call steps
            if len(chunk_shape) != len(size):
                return None
            nchunks = 1
            for n, c in zip(size, chunk_shape, strict=True):
                if c < 1:
                    return None
                nchunks *= -(-n // c)
            if nchunks > MAX_GRID_CHUNKS:
                return None
            grid = self._grids[key] = _regular_grid(size, chunk_shape)
        return size, grid

    def checked_properties(
        self, raw: Any
    ) -> tuple[tuple[str, str, str, bool, bool], tuple[Any, mf.MemoryFormat]] | None:
        """The properties ``raw`` as stored and their parsed dtype and memory format, or None."""
        if type(raw) is not dict:
            return None
        get = raw.get
        key: Any = (
            get("layout"),
            get("dtype"),
            get("memory_format"),
            get("requires_grad"),
            get("pin_memory"),
        )
        layout, dtype, fmt, grad, pin = key
        # the JSON booleans are the two singletons: no 1 or 0 passes for True or False (equal
        # keys: a key of the cache is one of strings and booleans, so only these need a look)
        try:
            known = self._properties.get(key)
        except TypeError:
            return None  # an unhashable value (a list, an object): no valid property is one
        if known is not None and (grad is True or grad is False) and (pin is True or pin is False):
            return key, known
        if (
            type(layout) is not str
            or type(dtype) is not str
            or type(fmt) is not str
            or (grad is not True and grad is not False)
            or (pin is not True and pin is not False)
        ):
            return None
        try:
            parsed = TensorProperties.from_json(raw)
        except MetadataError:
            return None
        known = self._properties[key] = (parsed.dtype, parsed.memory_format)
        return key, known


def _expect_dict(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise MetadataError(f"{where} must be a JSON object, found {type(value).__name__}")
    return value


def _expect(d: Mapping[str, Any], key: str, typ: type, where: str) -> Any:
    v = d.get(key)
    # bool is an int subclass; keep the two apart in both directions
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise MetadataError(f"{where}.{key} must be {typ.__name__}, found {v!r}")
    return v


def _int_tuple(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise MetadataError(f"{where} must be a list of non-negative integers, found {value!r}")
    if len(value) > 32:
        raise MetadataError(f"{where} has {len(value)} dimensions; at most 32 are supported")
    return tuple(value)


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
            tensors[fqn] = _entry(
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
        tensors[fqn] = _entry(
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


def _entry(
    fqn: str,
    name: str,
    md: TensorStorageMetadata,
    grid: ChunkGrid,
    crcs: np.ndarray | None,
    table: ChunkTable | None = None,
    row: int = 0,
    listed: Mapping[str, np.ndarray] | None = None,
    segments: Any = None,
    *,
    nchunks: int,
) -> TensorEntry:
    """A tensor entry from parsed metadata, as the general path made them."""
    p = md.properties
    stored = StoredProperties(np.dtype(p.dtype), p.requires_grad, p.memory_format, p.pin_memory)
    size = tuple(md.size)
    own = grid.kind == "regular" and grid.chunk_shape == size and nchunks == 1
    listed_boxes = not isinstance(md, GridTensorStorageMetadata) or "chunks" in md.__dict__
    return TensorEntry(
        fqn,
        name,
        stored,
        size,
        math.prod(size) * stored.dtype.itemsize,
        nchunks,
        None if own else grid,
        table,
        row,
        segments,
        crcs=crcs,
        listed=listed,
        metadata=md if listed_boxes else None,
    )
