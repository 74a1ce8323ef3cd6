"""The usual root document of format version 2, parsed straight into the entries a load reads.

:func:`gpuckpt.reading.validated_metadata` gives a load its
:class:`~gpuckpt.entries.TensorEntry` objects. The general path parses the
document into :class:`~gpuckpt.metadata.Metadata` (a metadata object and a
properties object per tensor) and then cross-checks it
(:func:`~gpuckpt.reading.validate_metadata`): for 10,000 small tensors that
was most of a warm load. :func:`load_index` does both in one pass over the
JSON, per tensor only what the checks need, and makes the metadata objects
when someone asks for them (:class:`IndexedMetadata`).

It accepts exactly what the general path accepts, and gives the same result
(the property tests of ``tests/unit/test_load_index.py`` hold it to that):
it handles tensors stored on a regular grid with their chunk records in the
chunk table, and values; for anything else (format version 1, chunk lists,
another grid kind, any defect) it returns None, and the general path parses
the document and raises its error.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from gpuckpt.entries import StoredProperties, TensorEntry
from gpuckpt.errors import MetadataError
from gpuckpt.metadata import (
    VERSION_COLUMNS,
    VERSION_LISTED,
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
    _GridEntries,
    parse_storage_meta,
    parse_version,
)
from gpuckpt.storage.chunk_table import TABLE_KEY, ChunkTable
from gpuckpt.storage.names import is_safe_name
from gpuckpt.storage.segments import SEGMENTS_KEY
from gpuckpt.tensor_columns import COLUMNS_KEY, checked_columns, expand

__all__ = ["MAX_EXTENT", "IndexedMetadata", "beyond_any_array", "load_index"]

#: no tensor may have this many bytes, nor an axis this long
MAX_EXTENT = 2**62


#: held while the lazily made parts of a shared IndexedMetadata are made
_MAKING = threading.Lock()


class IndexedMetadata(Metadata):
    """:class:`~gpuckpt.metadata.Metadata` whose ``state_dict_metadata`` is made when first
    asked for, from the entries of :func:`load_index` (each tensor's entry is the same
    object as its :attr:`TensorEntry.metadata <gpuckpt.entries.TensorEntry.metadata>`).
    Equal to the :class:`~gpuckpt.metadata.Metadata` the general path parses; it pickles as one.
    """

    @property
    def storage_data(self) -> Any:
        d = self.__dict__
        if "storage_data" not in d:
            # format version 3: the storage entries of the tensors in columns, as version 2 has
            # them; made once, under the lock: loads on several threads share this object
            with _MAKING:
                if "storage_data" not in d:
                    d["storage_data"] = expand(d["_columns_of"])["storage_data"]
                    del d["_columns_of"]
        return d["storage_data"]

    @storage_data.setter
    def storage_data(self, value: Any) -> None:
        self.__dict__["storage_data"] = value

    def __getattr__(self, name: str) -> Any:
        if name != "state_dict_metadata":
            raise AttributeError(name)
        d = self.__dict__
        with _MAKING:  # made once: loads on several threads share this object
            if "state_dict_metadata" in d:
                return d["state_dict_metadata"]
            index = d.get("_index")
            if index is None:
                raise AttributeError(name)
            fqns, tensors = index
            sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
                f: tensors[f].metadata if f in tensors else BytesStorageMetadata() for f in fqns
            }
            d["state_dict_metadata"] = sdm
            del d["_index"]
            return sdm

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Metadata):
            return NotImplemented
        return _fields(self) == _fields(other)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (Metadata, _fields(self))


def _fields(md: Metadata) -> tuple[Any, ...]:
    return (md.state_dict_metadata, md.planner_data, md.storage_data, md.storage_meta, md.version)


def load_index(data: Any) -> tuple[IndexedMetadata, dict[str, TensorEntry], dict[str, Any]] | None:
    """Metadata, tensors and encoded values of the metadata object ``data`` (the JSON of a
    root document's ``attributes.gpuckpt.metadata``), as
    :meth:`Metadata.from_json_dict <gpuckpt.metadata.Metadata.from_json_dict>` followed by
    :func:`~gpuckpt.reading.validate_metadata` make them; None where this pass does not
    handle the document (see the module's description). Never raises for a defect."""
    try:
        return _index(data)
    except (MetadataError, ValueError):
        return None


def _index(data: Any) -> tuple[IndexedMetadata, dict[str, TensorEntry], dict[str, Any]] | None:
    if type(data) is not dict:
        return None
    version = parse_version(data)
    if version == VERSION_LISTED:
        return None
    raw_entries = data.get("state_dict_metadata")
    sd = data.get("storage_data")
    pd = data.get("planner_data")
    if type(raw_entries) is not dict or type(sd) is not dict or type(pd) is not dict or "structure" not in pd:
        return None
    stored_tensors, stored_objects = sd.get("tensors"), sd.get("objects")
    if type(stored_tensors) is not dict or type(stored_objects) is not dict:
        return None
    storage_meta = parse_storage_meta(data.get("storage_meta"))
    grids = _GridEntries(sd)
    shared: dict[tuple[str, str, str, bool, bool], StoredProperties] = {}
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, Any] = {}
    names: set[str] = set()
    spans: list[tuple[int, int]] = []
    table: ChunkTable | None = None
    indexed = TensorEntry.indexed
    for fqn, raw in raw_entries.items():
        if type(raw) is dict and raw.get("type") == "bytes":
            if fqn not in stored_objects:
                return None
            objects[fqn] = stored_objects[fqn]
            continue
        info: Any = stored_tensors.get(fqn)
        parts = grids.parts(raw, info)
        if parts is None or "rows" not in info:
            return None  # not this pass's kind of entry (chunks listed, another grid, a defect)
        size, key, (dtype, fmt), grid = parts
        name = info.get("name")
        if type(name) is not str or name in names or not is_safe_name(name):
            return None
        names.add(name)
        stored = shared.get(key)
        if stored is None:
            stored = shared[key] = StoredProperties(np.dtype(dtype), key[3], fmt, key[4])
        extent = _extent(size, stored.dtype.itemsize, grid)
        if extent is None:
            return None
        nbytes, n = extent
        if table is None:
            table = ChunkTable.parse(sd.get(TABLE_KEY))
        row = info["rows"]
        if type(row) is not int or not 0 <= row <= table.rows - n:
            return None
        spans.append((row, n))
        tensors[fqn] = indexed(fqn, name, stored, size, nbytes, n, grid, table, row, info.get(SEGMENTS_KEY))
    columned = version == VERSION_COLUMNS and COLUMNS_KEY in data
    fqns: list[str] = list(raw_entries)
    if columned:
        lists = checked_columns(data[COLUMNS_KEY])
        in_columns = lists[0]
        if in_columns:
            if table is None:
                table = ChunkTable.parse(sd.get(TABLE_KEY))
            if not _column_tensors(
                lists, raw_entries, stored_tensors, table, grids, shared, names, tensors, spans
            ):
                return None
            fqns = sorted(fqns + in_columns)
    if table is not None:
        # the tensors' rows tile the table: each row belongs to exactly one chunk
        at = 0
        for row, n in sorted(spans):
            if n and row != at:
                return None
            at += n
        if at != table.rows:
            return None
    md = IndexedMetadata.__new__(IndexedMetadata)
    md.__dict__.update(
        _index=(fqns, tensors),
        planner_data=pd,
        storage_meta=storage_meta,
        version=version,
    )
    if not columned:
        md.storage_data = sd
    else:
        md.__dict__["_columns_of"] = data
    return md, tensors, objects


def beyond_any_array(size: tuple[int, ...], itemsize: int) -> bool:
    """Whether no array of ``itemsize``-byte elements can have shape ``size``: an axis of
    :data:`MAX_EXTENT` or more, or non-empty axes spanning that many bytes together (an empty
    axis makes a tensor hold nothing, but NumPy still sizes an array by the others)."""
    if not size:
        return False
    return max(size) >= MAX_EXTENT or math.prod(n for n in size if n) * itemsize >= MAX_EXTENT


def _extent(size: tuple[int, ...], itemsize: int, grid: Any) -> tuple[int, int] | None:
    """``(bytes, chunks)`` of a tensor of ``size`` on ``grid`` (None: stored whole), checked as the
    general path checks them; None where it refuses them."""
    if beyond_any_array(size, itemsize):
        return None
    nbytes = math.prod(size) * itemsize
    if grid is None:
        return nbytes, 1
    if any(c > max(s, 1) for c, s in zip(grid.chunk_shape, size, strict=True)):
        return None  # a chunk larger than the tensor: gpuckpt never writes one
    return nbytes, 0 if 0 in size else grid.nchunks


def _column_tensors(
    lists: tuple[list[Any], ...],
    raw_entries: dict[str, Any],
    stored_tensors: dict[str, Any],
    table: ChunkTable,
    grids: _GridEntries,
    shared: dict[tuple[str, str, str, bool, bool], StoredProperties],
    names: set[str],
    tensors: dict[str, TensorEntry],
    spans: list[tuple[int, int]],
) -> bool:
    """Add the tensors of the lists of a ``tensor_columns`` object (format version 3; their shape
    checked by :func:`~gpuckpt.tensor_columns.checked_columns`) to ``tensors``, checked as
    :func:`~gpuckpt.tensor_columns.expand` and the version 2 path check them; False for
    anything else."""
    fqns, column_names, sizes, properties, prop, shapes, rows = lists
    # each distinct properties object is checked once
    stored_of: list[StoredProperties] = []
    for raw in properties:
        props = grids.checked_properties(raw)
        if props is None:
            return False
        key, (dtype, fmt) = props
        stored = shared.get(key)
        if stored is None:
            stored = shared[key] = StoredProperties(np.dtype(dtype), key[3], fmt, key[4])
        stored_of.append(stored)
    indexed = TensorEntry.indexed
    regular_grid = grids.regular_grid
    for i, fqn in enumerate(fqns):
        if fqn in raw_entries or fqn in stored_tensors:
            return False
        size_raw, shape = sizes[i], shapes[i]
        sized = regular_grid(size_raw, size_raw if shape is None else shape)
        if sized is None:
            return False
        size, grid = sized
        name = column_names[i]
        if name is None:
            name = fqn
        if name in names or not is_safe_name(name):
            return False
        names.add(name)
        stored = stored_of[prop[i]]
        extent = _extent(size, stored.dtype.itemsize, grid)
        if extent is None:
            return False
        nbytes, n = extent
        row = rows[i]
        if type(row) is not int or not 0 <= row <= table.rows - n:
            return False
        spans.append((row, n))
        tensors[fqn] = indexed(fqn, name, stored, size, nbytes, n, grid, table, row, None)
    return True
