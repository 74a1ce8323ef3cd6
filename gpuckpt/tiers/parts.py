"""A rank's state as a part of a local tier, and back: sharded leaves as their local arrays,
the boxes they were, a digest of the layout (:func:`layout_of`), the bytes a part costs."""

from __future__ import annotations

import hashlib
import json
import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from gpuckpt.device.arrays import adapt, is_array
from gpuckpt.device.sharded import ShardedArray, is_dtensor, is_sharded_leaf, sharded_boxes
from gpuckpt.state import flatten_state_dict

if TYPE_CHECKING:
    from gpuckpt.planning.boxes import LocalTensor
    from gpuckpt.saving.sources import Sources

__all__ = [
    "Boxes",
    "LayoutMemo",
    "copy_values_back",
    "holds",
    "layout_and_bytes",
    "layout_of",
    "part_bytes",
    "part_view",
    "sharded_from_part",
]

Boxes = dict[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]

_DESCEND = object()


def _rebuilt(value: Any, prefix: str, leaf: Callable[[Any, str], Any]) -> Any:
    """``value`` with what ``leaf(item, fqn)`` returns for each item it takes (anything but
    ``_DESCEND``), in new dicts, lists and tuples on the way; the FQNs of a state dict."""
    out = leaf(value, prefix)
    if out is not _DESCEND:
        return out
    if isinstance(value, dict):
        return {k: _rebuilt(v, f"{prefix}.{k}" if prefix else str(k), leaf) for k, v in value.items()}
    if isinstance(value, list | tuple) and not is_array(value):
        kids = [_rebuilt(v, f"{prefix}.{i}" if prefix else str(i), leaf) for i, v in enumerate(value)]
        return kids if isinstance(value, list) else tuple(kids)
    return value


def part_view(state: Any) -> tuple[dict[str, Any], Boxes]:
    """``state`` with each ``ShardedArray`` leaf replaced by its local array (a list of them for
    several boxes), sharing every array and value; and each sharded FQN's boxes."""
    boxes: Boxes = {}

    def local(value: Any, fqn: str) -> Any:
        if not is_sharded_leaf(value):
            return _DESCEND
        found = sharded_boxes(value)
        boxes[fqn] = tuple((b.offsets, b.global_shape) for b in found)
        return found[0].local if isinstance(value, ShardedArray) else [b.local for b in found]

    return _rebuilt(state, "", local), boxes


def sharded_from_part(loaded: Any, boxes: Boxes) -> Any:
    """The inverse of :func:`part_view` for a loaded part: arrays under a sharded FQN become
    ``ShardedArray`` boxes again."""

    def sharded(value: Any, fqn: str) -> Any:
        if fqn not in boxes:
            return _DESCEND
        found = boxes[fqn]
        if isinstance(value, list | tuple):  # saved as a list of boxes (of one or more)
            return [ShardedArray(a, o, g) for a, (o, g) in zip(value, found, strict=True)]
        ((offsets, shape),) = found
        return ShardedArray(value, offsets, shape)

    return _rebuilt(loaded, "", sharded)


def copy_values_back(target: Any, loaded: Any) -> None:
    """Put the plain values a load left in ``loaded`` (a :func:`part_view` of ``target``) into
    ``target``'s containers; arrays were filled in place."""
    if isinstance(target, dict):
        items: Any = target.items()
    elif isinstance(target, list | tuple):
        items = enumerate(target)
    else:
        return
    for key, value in list(items):
        got = loaded[key]
        if is_sharded_leaf(value) or is_array(value) or is_dtensor(value):
            continue
        if isinstance(value, dict) or (isinstance(value, list | tuple) and _holds_containers(value)):
            copy_values_back(value, got)
        elif not isinstance(target, tuple):
            target[key] = got


def _holds_containers(value: list[Any] | tuple[Any, ...]) -> bool:
    return any(isinstance(v, dict | list | tuple) or is_array(v) or is_sharded_leaf(v) for v in value)


def layout_and_bytes(view: dict[str, Any], boxes: Boxes) -> tuple[str, int]:
    """:func:`layout_of` and :func:`part_bytes` in one pass over the part's arrays."""
    leaves, _ = flatten_state_dict(view, is_array)
    arrays = []
    total = 0
    for fqn, leaf in sorted(leaves.items()):
        if is_array(leaf.value):
            a = adapt(leaf.value)
            shape = list(a.shape)
            arrays.append([fqn, shape, _dtype_text(a.dtype)])
            total += a.dtype.itemsize * math.prod(shape)
    return _digest(arrays, boxes), total


class LayoutMemo:
    """:func:`layout_and_bytes` of a part from its save's description (what a local tier's save
    asks for on the caller's thread, at every step), remembering the last digest.

    The description (:func:`~gpuckpt.saving.sources.describe_state` of the part's view) has
    every array already: no second walk of the state and no adapter per array. And a part
    keeps its layout from step to step: when its arrays' names, shapes and dtypes are those
    of the last call (one comparison of lists, in C), the digest is the last one, not the
    JSON text and the hash again (for 10,000 tensors the walk, the text and the hash took
    90 ms, more than the copy of an 80 MiB state). The digest is :func:`layout_of`'s."""

    def __init__(self) -> None:
        self._last: tuple[list[list[Any]], list[Any], str] | None = None
        #: the last call's tensors, boxes and answer
        self._seen: tuple[tuple[LocalTensor, ...], Boxes, tuple[str, int]] | None = None

    def layout_and_bytes(
        self, tensors: Sequence[LocalTensor], sources: Sources, boxes: Boxes
    ) -> tuple[str, int]:
        """``(layout digest, bytes)`` of the part whose view ``describe_state`` described as
        ``tensors`` and ``sources``, with the sharded FQNs' ``boxes`` (:func:`part_view`).

        Tensors that are the very objects of the last call, in the same order (what a
        :class:`~gpuckpt.saving.sources.TensorMemo` gives for arrays of the same names,
        shapes, strides and dtypes), have the last answer, found in one pass of identity
        tests: their dtypes are equal, and a storable dtype prints as any dtype equal to it."""
        seen = self._seen
        tensors = tuple(tensors)
        if (
            seen is not None
            and len(seen[0]) == len(tensors)
            and all(map(operator.is_, seen[0], tensors))
            and seen[1] == boxes
        ):
            return seen[2]
        answer = self._layout_and_bytes(tensors, sources, boxes)
        self._seen = (tensors, dict(boxes), answer)
        return answer

    def _layout_and_bytes(
        self, tensors: Sequence[LocalTensor], sources: Sources, boxes: Boxes
    ) -> tuple[str, int]:
        arrays = []
        total = 0
        for t in sorted(tensors, key=_fqn):
            shape = list(t.global_shape)
            arrays.append([t.fqn, shape, _dtype_text(sources[t.fqn][0].array.dtype)])
            total += t.itemsize * math.prod(shape)
        boxed = _boxes_text(boxes)
        last = self._last
        if last is not None and last[0] == arrays and last[1] == boxed:
            return last[2], total
        digest = _digest(arrays, boxes, boxed)
        self._last = (arrays, boxed, digest)
        return digest, total


def _fqn(t: LocalTensor) -> str:
    return t.fqn


def _boxes_text(boxes: Boxes) -> list[Any]:
    return sorted((k, [list(map(list, b)) for b in v]) for k, v in boxes.items())


def _digest(arrays: list[list[Any]], boxes: Boxes, boxed: list[Any] | None = None) -> str:
    text = json.dumps([arrays, _boxes_text(boxes) if boxed is None else boxed])
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


_DTYPE_TEXT: dict[tuple[Any, str], str] = {}


def _dtype_text(dtype: Any) -> str:
    """``str(dtype)``, remembered: NumPy makes that text in Python, a few microseconds per
    array, which a save of hundreds of tensors pays on the caller's thread at every step.
    Keyed by the dtype and its byte-order code as well, so two dtypes that compare equal but
    print differently never share a text."""
    key = (dtype, dtype.str)
    text = _DTYPE_TEXT.get(key)
    if text is None:
        text = _DTYPE_TEXT.setdefault(key, str(dtype))
    return text


def layout_of(view: dict[str, Any], boxes: Boxes) -> str:
    """A digest of a part's layout: every array's FQN, shape and dtype, every box."""
    return layout_and_bytes(view, boxes)[0]


def holds(view: dict[str, Any], boxes: Boxes, stored: dict[str, Any], stored_boxes: Boxes) -> bool:
    """Whether a part holds every array of ``view`` (a rank's present state, :func:`part_view`)
    as it is: of the same FQN, shape and dtype (``stored``: the part's ``state_dict_metadata``),
    each sharded FQN of the same boxes (``stored_boxes``: its record's). A state that is a subset
    of what a step saved loads from its part, as from the root's step (a partial load)."""
    leaves, _ = flatten_state_dict(view, is_array)
    for fqn, leaf in leaves.items():
        if not is_array(leaf.value):
            continue
        a = adapt(leaf.value)
        meta = stored.get(fqn)
        size, props = getattr(meta, "size", None), getattr(meta, "properties", None)
        if size is None or props is None or tuple(size) != tuple(a.shape):
            return False
        if _dtype_text(props.dtype) != _dtype_text(a.dtype):
            return False
    return all(
        fqn in stored_boxes and _boxes_text({fqn: b}) == _boxes_text({fqn: stored_boxes[fqn]})
        for fqn, b in boxes.items()
    )


def part_bytes(view: dict[str, Any]) -> int:
    """The bytes of a part's arrays (what a part costs its tier, plain values aside)."""
    return layout_and_bytes(view, {})[1]
