"""A state dict split into what the planner sees and the arrays a save reads.

:func:`describe_state` flattens a state dict once and returns two things:
its :class:`~gpuckpt.planning.plan.StateDescription` (shapes, dtypes,
properties and boxes of its tensors, its plain values encoded: pure data,
what :func:`gpuckpt.planning.plan.plan_save` plans from) and its
:data:`Sources` (for each tensor, the arrays holding the boxes this
process has: what the plan is bound to when it runs). A background save
replaces the sources by its snapshot of them; the description, and so the
plan, stays as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, adapt, adapt_leaf, canonical_bools, is_array
from gpuckpt.device.sharded import is_sharded_leaf, sharded_boxes
from gpuckpt.errors import UnsupportedValueError
from gpuckpt.format.dtypes import dtype_name
from gpuckpt.format.metadata import TensorProperties
from gpuckpt.format.values import encode_object
from gpuckpt.planning.boxes import Box, LocalTensor
from gpuckpt.planning.plan import StateDescription
from gpuckpt.state import flatten_state_dict

__all__ = ["Source", "Sources", "TensorMemo", "contains_sharded", "describe_state", "is_leaf"]

_MAX_DEPTH = 200


@dataclass(frozen=True, slots=True)
class Source:
    """The array holding one box of a tensor in this process, and where the box starts."""

    array: ArrayAdapter
    offsets: tuple[int, ...]  # of the box in the global tensor


#: FQN -> the sources of the tensor's boxes held here, in the order of ``LocalTensor.boxes``
Sources = Mapping[str, tuple[Source, ...]]


def is_leaf(value: Any) -> bool:
    """Whether ``value`` is stored as (part of) a tensor: an array or ShardedArray boxes."""
    return is_array(value) or is_sharded_leaf(value)


def contains_sharded(value: Any, depth: int = 0) -> bool:
    """Whether a state dict holds any ShardedArray (a quick walk, no flattening)."""
    if is_sharded_leaf(value):
        return True
    if depth > _MAX_DEPTH:
        return False  # flattening reports the nesting (or the cycle) as an error
    if isinstance(value, dict):
        return any(contains_sharded(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)) and not is_array(value):
        return any(contains_sharded(v, depth + 1) for v in value)
    return False


class TensorMemo:
    """What :func:`describe_state` made of each NumPy array of the last state it described
    with this memo, for a caller that describes the same state at every step (a local
    tier's saves, on the training thread): an array of the same name, shape, strides, dtype
    and pinned memory has the same :class:`~gpuckpt.planning.boxes.LocalTensor`, taken
    from here rather than made again (with its properties, its memory format found from the
    strides, its dtype's name and boxes: about 5 us and five objects per array, which for
    10,000 arrays also cost a collection of the garbage collector's youngest generation
    tens of milliseconds). Holds no array; its descriptions are never handed to the caller
    of a save (they describe the tier's own parts)."""

    def __init__(self) -> None:
        self._tensors: dict[str, tuple[tuple[Any, ...], LocalTensor]] = {}

    def _describe(self, fqn: str, value: np.ndarray, fresh: dict[str, Any]) -> tuple[LocalTensor, Source]:
        a = adapt(value)
        key = (value.shape, value.strides, value.dtype, a.pinned)
        hit = self._tensors.get(fqn)
        if hit is None or hit[0] != key:
            shape = value.shape
            origin = (0,) * len(shape)
            hit = (key, _local_tensor(fqn, shape, a, ((origin, shape),)))
        fresh[fqn] = hit
        t = hit[1]
        return t, Source(canonical_bools(a), t.boxes[0][0])


def describe_state(
    state_dict: dict[str, Any], *, allow_pickle: bool, memo: TensorMemo | None = None
) -> tuple[StateDescription, dict[str, tuple[Source, ...]]]:
    """The description of ``state_dict`` for the planner, and the arrays behind it
    (``memo``: see :class:`TensorMemo`; the same description with it or without).

    Raises :class:`~gpuckpt.errors.UnsupportedValueError` for what cannot be
    stored (see :func:`gpuckpt.state.flatten_state_dict`, including a state
    dict that contains itself, and :func:`gpuckpt.format.values.encode_object`).

    A bool array holding bytes other than 0 and 1 is read from a copy holding 0 and 1
    (:func:`~gpuckpt.device.arrays.canonical_bools`); its description is the array's own.
    """
    leaves, skeleton = flatten_state_dict(state_dict, is_leaf)
    tensors: list[LocalTensor] = []
    sources: dict[str, tuple[Source, ...]] = {}
    objects: dict[str, Any] = {}
    fresh: dict[str, Any] = {}
    for fqn, leaf in leaves.items():
        v = leaf.value
        boxes: tuple[Box, ...]
        if memo is not None and type(v) is np.ndarray:
            t, source = memo._describe(fqn, v, fresh)
            tensors.append(t)
            sources[fqn] = (source,)
            continue
        if is_sharded_leaf(v):
            parts = sharded_boxes(v)
            held = tuple(Source(canonical_bools(adapt_leaf(b.local, fqn)), tuple(b.offsets)) for b in parts)
            dts = {s.array.dtype for s in held}
            if len(dts) != 1:
                raise UnsupportedValueError(
                    f"boxes of tensor {fqn!r} have different dtypes: {sorted(map(str, dts))}; "
                    "every box of a tensor must have the tensor's dtype"
                )
            shape = tuple(parts[0].global_shape)
            boxes = tuple((tuple(b.offsets), tuple(b.sizes)) for b in parts)
            a = held[0].array
        elif is_array(v):
            a = adapt_leaf(v, fqn)
            shape = a.shape
            origin = (0,) * len(shape)
            boxes = ((origin, shape),)
            held = (Source(canonical_bools(a), origin),)
        else:
            objects[fqn] = encode_object(v, allow_pickle=allow_pickle, fqn=fqn)
            continue
        tensors.append(_local_tensor(fqn, shape, a, boxes))
        sources[fqn] = held
    if memo is not None:
        memo._tensors = fresh  # (what the state no longer holds is forgotten)
    return StateDescription(tuple(tensors), objects, skeleton), sources


def _local_tensor(fqn: str, shape: tuple[int, ...], a: ArrayAdapter, boxes: tuple[Box, ...]) -> LocalTensor:
    return LocalTensor(
        fqn,
        tuple(shape),
        dtype_name(a.dtype),
        a.dtype.itemsize,
        TensorProperties.from_array(a),
        boxes,
    )
