"""Between DCP's metadata and gpuckpt's: pure data, no I/O.

DCP flattens a state dict into FQNs and records, per FQN, the path of keys
and list indices that leads to it (its ``planner_data``). gpuckpt records the
nesting as a structure skeleton (:mod:`gpuckpt.state`). A checkpoint written
through :class:`gpuckpt.dcp.Writer` stores DCP's FQNs as they are, with a
skeleton built from DCP's paths, so that :func:`gpuckpt.load_state_dict`
rebuilds the nested dict. A checkpoint written by :func:`gpuckpt.save` is
shown to DCP the way DCP would have flattened the same state dict: lists
without tensors and tuples are single values for DCP (its traversal rule),
so such containers become one bytes entry each.

DCP's non-tensor items are bytes that DCP serialised itself (``torch.save``).
They are stored as gpuckpt ``bytes`` values, and their FQNs are listed under
``planner_data["torch_dcp"]["torch_save"]`` so that a reader knows to hand
them back to DCP unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.dcp.tensors import DCP_VERSION, numpy_dtype, torch, torch_dtype
from gpuckpt.errors import MetadataError
from gpuckpt.format import memory_format as mf
from gpuckpt.format.metadata import Metadata, TensorProperties, TensorStorageMetadata

__all__ = [
    "DCP_KEY",
    "Entry",
    "LocalBoxes",
    "View",
    "dcp_planner_data",
    "dcp_view",
    "leaves",
    "local_boxes",
    "skeleton_from_paths",
    "stored_properties",
]

#: key of ``planner_data`` that marks a checkpoint written through DCP
DCP_KEY = "torch_dcp"
_FORMAT = 1

Path = tuple[str | int, ...]


# save side ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LocalBoxes:
    """The boxes one rank writes of one tensor, in the order of its plan's items."""

    fqn: str
    global_shape: tuple[int, ...]
    dtype: np.dtype[Any]
    properties: Any  # DCP's TensorProperties
    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def local_boxes(items: Iterable[Any]) -> list[LocalBoxes]:
    """Group a rank's tensor write items (``WriteItem`` with ``tensor_data``) by FQN."""
    found: dict[str, list[Any]] = {}
    for item in items:
        if item.tensor_data is not None:
            found.setdefault(item.index.fqn, []).append(item)
    out = []
    for fqn, group in found.items():
        td = group[0].tensor_data
        shape = tuple(int(s) for s in td.size)
        for other in group[1:]:
            if (
                tuple(other.tensor_data.size) != shape
                or other.tensor_data.properties.dtype != td.properties.dtype
            ):
                raise MetadataError(
                    f"tensor {fqn!r}: the write items of one rank disagree on its size or dtype "
                    f"({tuple(other.tensor_data.size)}, {other.tensor_data.properties.dtype} vs {shape}, "
                    f"{td.properties.dtype}); the save planner produced an inconsistent plan"
                )
        boxes = tuple(
            (
                tuple(int(o) for o in i.tensor_data.chunk.offsets),
                tuple(int(s) for s in i.tensor_data.chunk.sizes),
            )
            for i in group
        )
        out.append(LocalBoxes(fqn, shape, numpy_dtype(td.properties.dtype, fqn), td.properties, boxes))
    return out


def stored_properties(props: Any, dtype: np.dtype[Any], memory_format: Any) -> TensorProperties:
    """gpuckpt's properties of a tensor from DCP's properties and the memory format seen on write."""
    return TensorProperties(
        dtype=dtype,
        layout=mf.strided,
        requires_grad=bool(props.requires_grad),
        memory_format=memory_format,
        pin_memory=bool(props.pin_memory),
    )


def skeleton_from_paths(paths: Any, fqns: Iterable[str]) -> Any:
    """A structure skeleton rebuilding DCP's nesting from its ``planner_data`` (FQN -> path).

    String path items are dict keys, integers list indices (DCP's rule). FQNs
    without a usable path stay top-level keys, as do the FQNs on a path that
    another FQN's path runs through: ranks that hold ``k`` as a dict on one
    rank (``k.a``) and as a tensor or value on another (``k``) save both, and
    DCP's own metadata lists both names. A structure cannot hold ``k`` as both
    a dict and a leaf, so each of them stays a top-level key under its DCP name,
    whichever rank held which (the result depends on the set of paths, not on
    their order).
    """
    fqns = list(fqns)
    valid = isinstance(paths, Mapping)
    keyed: dict[str, tuple[tuple[type, str | int], ...]] = {}
    for fqn in fqns:
        path = paths.get(fqn) if valid else None
        if (
            isinstance(path, (list, tuple))
            and path
            and isinstance(path[0], str)
            and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path)
        ):
            keyed[fqn] = tuple((type(p), p) for p in path)
    # a leaf's path that another path runs through (or that two FQNs claim) cannot nest
    count: dict[tuple[tuple[type, str | int], ...], int] = {}
    for key in keyed.values():
        count[key] = count.get(key, 0) + 1
    inner = {key[:i] for key in keyed.values() for i in range(1, len(key))}
    apart = {
        fqn
        for fqn, key in keyed.items()
        if count[key] > 1 or key in inner or any(key[:i] in count for i in range(1, len(key)))
    }
    root: dict[Any, Any] = {}
    flat: list[str] = []
    for fqn in fqns:
        if fqn not in keyed or fqn in apart or not _insert(root, keyed[fqn], fqn):
            flat.append(fqn)
    items = [["s", k, _emit(v)] for (_, k), v in root.items()]
    items += [["s", f, {"v": f}] for f in flat]
    if len({k for _, k, _ in items}) != len(items):  # a flat FQN equal to a nested top key
        return {"d": [["s", f, {"v": f}] for f in fqns]}
    return {"d": items}


def _insert(root: dict[Any, Any], path: tuple[tuple[type, str | int], ...], fqn: str) -> bool:
    node = root
    for p in path[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            return False
        node = child
    if path[-1] in node:
        return False
    node[path[-1]] = fqn
    return True


def _emit(node: Any) -> Any:
    if isinstance(node, str):
        return {"v": node}
    keys = list(node)
    if keys and all(t is int for t, _ in keys) and sorted(k for _, k in keys) == list(range(len(keys))):
        return {"l": [_emit(node[(int, i)]) for i in range(len(keys))]}
    # string keys, or list indices with gaps: a dict ("i" keys are list indices here)
    return {"d": [["i" if t is int else "s", k, _emit(v)] for (t, k), v in node.items()]}


# load side ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """What one of DCP's FQNs is in the checkpoint.

    ``kind``: ``"tensor"`` (gpuckpt tensor ``fqn``), ``"torch_save"`` (bytes DCP
    serialised, stored as the value ``fqn``), ``"value"`` (a plain value ``fqn``
    stored by gpuckpt), ``"container"`` (a list or tuple DCP treats as one value:
    the structure ``node``, whose leaves are gpuckpt FQNs).
    """

    kind: str
    fqn: str
    node: Any = None


@dataclass(frozen=True, slots=True)
class View:
    """A checkpoint as DCP sees it: DCP's ``Metadata``, and what each of its FQNs is."""

    metadata: Any
    entries: dict[str, Entry]


def dcp_view(md: Metadata, tensor_fqns: set[str], value_fqns: set[str], checkpoint_id: str) -> View:
    """DCP's view of a validated checkpoint (its tensors' and its values' FQNs)."""
    from torch.distributed.checkpoint import metadata as dm

    pd = md.planner_data if isinstance(md.planner_data, dict) else {}
    marker = pd.get(DCP_KEY)
    written_by_dcp = marker is not None
    blobs: set[str] = set()
    if marker is not None:
        if not isinstance(marker, dict):
            raise MetadataError(f"planner_data.{DCP_KEY} must be an object, found {str(marker)[:200]}")
        listed = marker.get("torch_save")
        if marker.get("format") != _FORMAT or not isinstance(listed, list):
            raise MetadataError(
                f"planner_data.{DCP_KEY} is {str(marker)[:200]}; expected format {_FORMAT} with a "
                "'torch_save' list (written by a newer gpuckpt? upgrade gpuckpt to read it)"
            )
        odd = [f for f in listed if not isinstance(f, str) or f not in value_fqns]
        if odd:
            raise MetadataError(
                f"planner_data.{DCP_KEY}.torch_save lists {odd[0]!r:.200}, which names no plain "
                "value of the checkpoint (each entry is the FQN of a value DCP serialised); the "
                "checkpoint's metadata is damaged"
            )
        blobs = set(listed)
    entries: dict[str, Entry] = {}
    paths: dict[str, Path] = {}

    def leaf(path: Path, fqn: str) -> None:
        name = ".".join(map(str, path))
        if fqn in tensor_fqns:
            entries[name] = Entry("tensor", fqn)
        elif fqn in blobs and fqn in value_fqns:
            entries[name] = Entry("torch_save", fqn)
        elif fqn in value_fqns:
            entries[name] = Entry("value", fqn)
        else:
            raise MetadataError(f"planner_data names {fqn!r}, which the checkpoint does not hold")
        paths[name] = path

    def walk(node: Any, path: Path, depth: int) -> None:
        if depth > 200 or not isinstance(node, dict) or len(node) != 1:
            raise MetadataError(f"malformed structure node in planner_data: {str(node)[:200]}")
        ((tag, body),) = node.items()
        if tag == "v" and isinstance(body, str):
            leaf(path, body)
        elif tag == "d" and isinstance(body, list):
            for item in body:
                if not (isinstance(item, list) and len(item) == 3):
                    raise MetadataError(f"malformed dict item in planner_data: {str(item)[:200]}")
                kt, k, child = item
                # DCP-written: "i" keys are list indices with gaps; gpuckpt-written: int dict keys,
                # which DCP would have turned into strings
                key: str | int = k if (written_by_dcp and kt == "i" and isinstance(k, int)) else str(k)
                walk(child, (*path, key), depth + 1)
        elif tag in ("l", "t") and isinstance(body, list):
            if written_by_dcp or (tag == "l" and _dcp_traverses(node, tensor_fqns)):
                for i, child in enumerate(body):
                    walk(child, (*path, i), depth + 1)
            else:
                name = ".".join(map(str, path))
                missing = [f for f in leaves(node) if f not in tensor_fqns and f not in value_fqns]
                if missing:
                    raise MetadataError(
                        f"planner_data names {missing[0]!r}, which the checkpoint does not hold"
                    )
                entries[name] = Entry("container", name, node)
                paths[name] = path
        else:
            raise MetadataError(f"malformed structure node in planner_data: {str(node)[:200]}")

    structure = pd.get("structure")
    walk(structure, (), 0)
    state: dict[str, Any] = {}
    for name, e in entries.items():
        if e.kind == "tensor":
            state[name] = _tensor_metadata(md.state_dict_metadata[e.fqn], e.fqn)
        else:
            state[name] = dm.BytesStorageMetadata()
    meta = md.storage_meta
    storage_meta = dm.StorageMeta(
        checkpoint_id=checkpoint_id,
        save_id=None if meta is None or meta.checkpoint_id is None else str(meta.checkpoint_id),
        modules=[] if meta is None else list(meta.modules),
    )
    # the view is made now, in the shape of this torch's metadata: its version, whoever wrote the checkpoint
    metadata = dm.Metadata(state, planner_data=paths, storage_meta=storage_meta, version=DCP_VERSION)
    return View(metadata, entries)


def _dcp_traverses(node: Any, tensor_fqns: set[str], depth: int = 0) -> bool:
    """Whether DCP's flattening descends into this list (it holds a tensor, a dict, or such a list)."""
    ((_, body),) = node.items()
    for child in body:
        if not isinstance(child, dict) or len(child) != 1:
            continue
        ((tag, b),) = child.items()
        if tag == "d" or (tag == "v" and b in tensor_fqns):
            return True
        if tag == "l" and depth < 200 and _dcp_traverses(child, tensor_fqns, depth + 1):
            return True
    return False


def _tensor_metadata(t: Any, fqn: str) -> Any:
    from torch.distributed.checkpoint import metadata as dm

    assert isinstance(t, TensorStorageMetadata)
    props = t.properties
    return dm.TensorStorageMetadata(
        properties=dm.TensorProperties(
            dtype=torch_dtype(np.dtype(props.dtype), fqn),
            layout=torch.strided,
            requires_grad=bool(props.requires_grad),
            # DCP's own encoding knows these three; it ignores the field on load
            memory_format=torch.channels_last
            if props.memory_format == mf.channels_last
            else torch.contiguous_format,
            pin_memory=bool(props.pin_memory),
        ),
        size=torch.Size(t.size),
        chunks=[dm.ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks],
    )


def leaves(node: Any, depth: int = 0) -> list[str]:
    """The FQNs of the leaves of a structure node."""
    if depth > 200 or not isinstance(node, dict) or len(node) != 1:
        raise MetadataError(f"malformed structure node in planner_data: {str(node)[:200]}")
    ((tag, body),) = node.items()
    if tag == "v" and isinstance(body, str):
        return [body]
    if not isinstance(body, list):
        raise MetadataError(f"malformed structure node in planner_data: {str(node)[:200]}")
    children = (
        [item[2] if isinstance(item, list) and len(item) == 3 else None for item in body]
        if tag == "d"
        else body
    )
    return [f for child in children for f in leaves(child, depth + 1)]


def dcp_planner_data(blob_fqns: Iterable[str]) -> dict[str, Any]:
    """The ``planner_data`` entry that marks a checkpoint written through DCP."""
    return {"format": _FORMAT, "torch_save": sorted(blob_fqns)}
