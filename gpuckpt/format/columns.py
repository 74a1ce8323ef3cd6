"""Format version 3: the usual tensor entries of the root document as columns.

In format version 2 every tensor has two JSON objects in the root document:
its ``state_dict_metadata`` entry ``{"type": "tensor", "properties": {...},
"size": [...]}`` and its ``storage_data.tensors`` entry ``{"name", "chunk_grid":
{"name": "regular", "configuration": {"chunk_shape": [...]}}, "rows": R}``.
With 10,000 small tensors that is about 3 MB of JSON and some 200,000 objects
to decode and check on every load. Version 3 stores those entries as one
object of parallel lists, ``metadata.tensor_columns``::

    {"fqn":         ["a", "b", ...],       # strictly ascending (code point order)
     "name":        [null, "x%2Fy", ...],  # the array name; null: the FQN itself
     "size":        [[3, 4], [7], ...],
     "properties":  [{...}, ...],          # each distinct properties object once
     "property":    [0, 0, ...],           # index into "properties"
     "chunk_shape": [null, [2, 4], ...],   # the regular grid's chunk shape; null: the size
     "rows":        [0, 1, ...]}           # first row of the tensor's chunks in the chunk table

(about 0.6 MB for the same 10,000 tensors). Every other entry (values, tensors
with listed chunks, another grid kind, segment records) stays as in version 2,
and a version 3 document without ``tensor_columns`` is a version 2 document.

:func:`compact` and :func:`expand` convert between the two shapes exactly
(``expand(compact(d)) == d``): everything that reads version 2 reads version 3
through :func:`expand`, and :mod:`gpuckpt.format.reader` reads the columns
directly for a load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gpuckpt.errors import MetadataError

__all__ = ["COLUMNS_KEY", "COLUMN_NAMES", "checked_columns", "column_entry", "compact", "expand"]

#: the key of the metadata object that holds the columns
COLUMNS_KEY = "tensor_columns"
#: the lists of the columns object, each as long as ``fqn`` except ``properties``
COLUMN_NAMES = ("fqn", "name", "size", "properties", "property", "chunk_shape", "rows")


def column_entry(raw: Any, info: Any) -> tuple[Any, Any, Any, Any, Any] | None:
    """``(properties, size, name, chunk shape, rows)`` of a tensor whose version 2 entries
    ``raw`` (``state_dict_metadata``) and ``info`` (``storage_data.tensors``) have exactly the
    shape the columns hold, so that :func:`expand` gives them back equal; else None."""
    if type(raw) is not dict or len(raw) != 3 or raw.get("type") != "tensor":
        return None
    props, size = raw.get("properties"), raw.get("size")
    if type(props) is not dict or type(size) is not list:
        return None
    if type(info) is not dict or len(info) != 3:
        return None
    name, grid, rows = info.get("name"), info.get("chunk_grid"), info.get("rows")
    if type(name) is not str or type(rows) is not int:
        return None
    if type(grid) is not dict or len(grid) != 2 or grid.get("name") != "regular":
        return None
    conf = grid.get("configuration")
    if type(conf) is not dict or len(conf) != 1 or type(conf.get("chunk_shape")) is not list:
        return None
    return props, size, name, conf["chunk_shape"], rows


def compact(data: dict[str, Any]) -> dict[str, Any]:
    """The metadata object ``data`` (shaped as format version 2) with every tensor that
    :func:`column_entry` accepts moved into ``tensor_columns``; ``data`` is not changed.
    Without such a tensor the result has no columns."""
    entries: dict[str, Any] = data["state_dict_metadata"]
    sd = data.get("storage_data")
    stored = sd.get("tensors") if type(sd) is dict else None
    if type(stored) is not dict:
        return data
    kept: dict[str, Any] = {}
    kept_stored = dict(stored)
    cols: dict[str, list[Any]] = {k: [] for k in COLUMN_NAMES}
    prop_index: dict[Any, int] = {}
    for fqn in sorted(entries):
        raw = entries[fqn]
        parts = column_entry(raw, stored.get(fqn))
        if parts is None:
            kept[fqn] = raw
            continue
        props, size, name, chunk_shape, rows = parts
        try:
            # the types too: True and 1 are equal keys, and the columns give back each value as it was
            key: Any = tuple(sorted((k, v, type(v)) for k, v in props.items()))
            at = prop_index.get(key)
        except TypeError:  # a value that is not hashable (gpuckpt writes strings and booleans)
            key = json.dumps(props, sort_keys=True)
            at = prop_index.get(key)
        if at is None:
            at = prop_index[key] = len(cols["properties"])
            cols["properties"].append(props)
        cols["fqn"].append(fqn)
        cols["name"].append(None if name == fqn else name)
        cols["size"].append(size)
        cols["property"].append(at)
        cols["chunk_shape"].append(None if chunk_shape == size else chunk_shape)
        cols["rows"].append(rows)
        del kept_stored[fqn]
    if not cols["fqn"]:
        return data
    out = dict(data)
    out["state_dict_metadata"] = kept
    out["storage_data"] = {**sd, "tensors": kept_stored}  # type: ignore[dict-item]
    out[COLUMNS_KEY] = cols
    return out


def _bad(what: str) -> MetadataError:
    return MetadataError(
        f"metadata.{COLUMNS_KEY} {what}; the checkpoint is damaged or was not written by gpuckpt"
    )


def checked_columns(cols: Any) -> tuple[list[Any], ...]:
    """The lists of a ``tensor_columns`` object in :data:`COLUMN_NAMES` order, their shape
    checked: all per-tensor lists as long as ``fqn``, FQNs strings in strictly ascending
    order, names strings or null, property indexes in range. The values inside (sizes,
    properties, rows) are the version 2 parser's to check."""
    if type(cols) is not dict or set(cols) != set(COLUMN_NAMES):
        raise _bad(f"must be an object with exactly the lists {', '.join(COLUMN_NAMES)}")
    lists = tuple(cols[k] for k in COLUMN_NAMES)
    for k, v in zip(COLUMN_NAMES, lists, strict=True):
        if type(v) is not list:
            raise _bad(f"field {k!r} must be a list, found {type(v).__name__}")
    fqns, names, _sizes, props, prop, _shapes, _rows = lists
    n = len(fqns)
    for k, v in zip(COLUMN_NAMES, lists, strict=True):
        if k != "properties" and len(v) != n:
            raise _bad(f"field {k!r} has {len(v)} items, 'fqn' {n}")
    prev: str | None = None
    for f in fqns:
        if type(f) is not str:
            raise _bad(f"lists an FQN that is not a string: {f!r:.60}")
        if prev is not None and not prev < f:
            raise _bad(f"lists FQN {f!r:.200} out of order or twice (after {prev!r:.200})")
        prev = f
    for nm in names:
        if nm is not None and type(nm) is not str:
            raise _bad(f"lists an array name that is neither a string nor null: {nm!r:.60}")
    count = len(props)
    for i in prop:
        if type(i) is not int or not 0 <= i < count:
            raise _bad(f"lists property index {i!r:.60}; there are {count} properties")
    return lists


def expand(data: Mapping[str, Any]) -> dict[str, Any]:
    """The metadata object ``data`` of format version 3 shaped as version 2: every tensor of
    ``tensor_columns`` back in ``state_dict_metadata`` and ``storage_data.tensors`` (both in
    key order, as a canonical document has them). Raises :class:`MetadataError` where the
    columns are malformed or name a tensor that also has an entry of its own."""
    out = dict(data)
    if COLUMNS_KEY not in out:
        return out
    cols = out.pop(COLUMNS_KEY)
    fqns, names, sizes, props, prop, shapes, rows = checked_columns(cols)
    entries, sd = out.get("state_dict_metadata"), out.get("storage_data")
    if type(entries) is not dict:
        raise MetadataError("metadata.state_dict_metadata must be a JSON object")
    stored = sd.get("tensors") if type(sd) is dict else None
    if type(stored) is not dict:
        raise MetadataError("metadata.storage_data must hold 'tensors' and 'objects' objects")
    merged = dict(entries)
    merged_stored = dict(stored)
    for i, fqn in enumerate(fqns):
        if fqn in merged or fqn in merged_stored:
            raise _bad(f"lists {fqn!r:.200}, which has an entry of its own too")
        size, shape, name = sizes[i], shapes[i], names[i]
        if shape is None:
            shape = list(size) if type(size) is list else size  # its own list, as when parsed
        merged[fqn] = {"type": "tensor", "properties": props[prop[i]], "size": size}
        merged_stored[fqn] = {
            "name": fqn if name is None else name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shape}},
            "rows": rows[i],
        }
    out["state_dict_metadata"] = {k: merged[k] for k in sorted(merged)}
    out["storage_data"] = {**sd, "tensors": {k: merged_stored[k] for k in sorted(merged_stored)}}  # type: ignore[dict-item]
    return out
