"""Sharded tensors: a rank's boxes of a global tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuckpt.errors import UnsupportedValueError

__all__ = ["ShardedArray", "from_dtensor", "is_dtensor", "is_sharded_leaf", "shard_dtensors", "sharded_boxes"]


class ShardedArray:
    """One rank's box of a global tensor, for a state dict.

    Parameters
    ----------
    local
        The rank's data: any array kind gpuckpt accepts (NumPy, CuPy, torch, ...).
        ``load`` fills it in place.
    offsets
        Where the box starts in the global tensor, one integer per axis.
    global_shape
        Shape of the whole tensor.

    A rank holding several boxes of one tensor puts a list of ``ShardedArray``
    under the tensor's key. Boxes held by several ranks (replication) are
    written once.

    Examples
    --------
    >>> import numpy as np
    >>> rows = np.zeros((5, 4))   # rows 5..9 of a 10 x 4 tensor
    >>> ShardedArray(rows, (5, 0), (10, 4)).offsets
    (5, 0)
    """

    __slots__ = ("global_shape", "local", "offsets")

    def __init__(self, local: Any, offsets: Sequence[int], global_shape: Sequence[int]) -> None:
        self.local = local
        self.offsets = tuple(int(o) for o in offsets)
        self.global_shape = tuple(int(s) for s in global_shape)
        shape = tuple(int(s) for s in getattr(local, "shape", ()))
        if len(self.offsets) != len(self.global_shape) or len(shape) != len(self.global_shape):
            raise UnsupportedValueError(
                f"ShardedArray: local shape {shape}, offsets {self.offsets} and global shape "
                f"{self.global_shape} must have the same number of axes"
            )
        for d, (o, n, g) in enumerate(zip(self.offsets, shape, self.global_shape, strict=True)):
            if o < 0 or o + n > g:
                raise UnsupportedValueError(
                    f"ShardedArray: on axis {d} the box [{o}, {o + n}) lies outside the global extent {g}; "
                    "fix offsets or global_shape"
                )

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.local.shape)

    def __repr__(self) -> str:
        return f"ShardedArray(offsets={self.offsets}, sizes={self.sizes}, global_shape={self.global_shape})"


def is_sharded_leaf(value: Any) -> bool:
    """A ShardedArray, or a non-empty list/tuple of them (several boxes of one tensor)."""
    if isinstance(value, ShardedArray):
        return True
    return (
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, ShardedArray) for v in value)
    )


def sharded_boxes(value: Any) -> list[ShardedArray]:
    boxes = [value] if isinstance(value, ShardedArray) else list(value)
    shapes = {b.global_shape for b in boxes}
    if len(shapes) != 1:
        raise UnsupportedValueError(f"boxes of one tensor disagree on its global shape: {sorted(shapes)}")
    return boxes


def from_dtensor(tensor: Any) -> list[ShardedArray]:
    """The local shards of a PyTorch ``DTensor`` as ShardedArrays (zero-copy views).

    Uses the DTensor's own chunk metadata (what torch.distributed.checkpoint
    writes), so every placement torch supports maps onto boxes.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError as exc:  # pragma: no cover - torch absent
        raise UnsupportedValueError("from_dtensor needs PyTorch with torch.distributed") from exc
    if not isinstance(tensor, DTensor):
        raise UnsupportedValueError(f"from_dtensor expects a DTensor, got {type(tensor).__name__}")
    local = tensor.to_local()
    chunks = tensor.__create_chunk_list__()
    shape = tuple(tensor.shape)
    if len(chunks) == 1:
        return [ShardedArray(local, tuple(chunks[0].offsets), shape)]
    # several local chunks (rare placements): cut them out of the local tensor in order
    out, start = [], 0
    for c in chunks:
        n = int(c.sizes[0])
        out.append(ShardedArray(local[start : start + n], tuple(c.offsets), shape))
        start += n
    return out


def is_dtensor(value: Any) -> bool:
    """A PyTorch ``DTensor`` (told by its type, without importing torch)."""
    t = type(value)
    return t.__name__ == "DTensor" and t.__module__.startswith("torch.distributed")


def shard_dtensors(state: Any) -> Any:
    """``state`` with each ``DTensor`` leaf replaced by its local shards as ShardedArrays
    (:func:`from_dtensor`: views, so a load into them fills the DTensors in place), in new
    containers on the way to them; ``state`` itself when it holds no DTensor.

    This is how a state dict of ``torch.distributed.checkpoint`` (``get_state_dict`` of an
    FSDP or tensor-parallel model) goes through a :class:`~gpuckpt.CheckpointManager`."""

    def visit(value: Any, depth: int) -> Any:
        if is_dtensor(value):
            return from_dtensor(value)
        if depth > 200 or not isinstance(value, dict | list | tuple):
            return value
        if isinstance(value, dict):
            items = {k: visit(v, depth + 1) for k, v in value.items()}
            return value if all(items[k] is v for k, v in value.items()) else items
        kids = [visit(v, depth + 1) for v in value]
        if all(a is b for a, b in zip(kids, value, strict=True)):
            return value
        return kids if isinstance(value, list) else tuple(kids)

    return visit(state, 0)
