"""Memory formats and layouts, and their detection from strides.

A tensor's *logical* shape is what users index (``N, C, H, W``); its memory
format says in which order the elements lie in memory. gpuckpt always stores
tensors in logical C order and records the memory format so that a load can
give back an array with the same strides.

``contiguous_format``
    C order (row-major) over the logical shape.
``channels_last``
    A 4-D ``N, C, H, W`` tensor stored as ``N, H, W, C`` in memory.
``channels_last_3d``
    A 5-D ``N, C, D, H, W`` tensor stored as ``N, D, H, W, C`` in memory.
``preserve_format``
    Anything else (Fortran order, arbitrary strided views). Such arrays are
    restored C-contiguous: there is no canonical layout to restore.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Layout",
    "MemoryFormat",
    "channels_last",
    "channels_last_3d",
    "contiguous_format",
    "detect_memory_format",
    "is_dense_in_order",
    "memory_format_from_name",
    "natural_order",
    "physical_order",
    "preserve_format",
    "strided",
]


@dataclass(frozen=True, slots=True)
class MemoryFormat:
    """A named memory format; compare with ``==`` or ``is``."""

    name: str

    def __repr__(self) -> str:
        return f"gpuckpt.{self.name}"


@dataclass(frozen=True, slots=True)
class Layout:
    """A tensor layout. gpuckpt stores dense (``strided``) tensors only."""

    name: str

    def __repr__(self) -> str:
        return f"gpuckpt.{self.name}"


contiguous_format = MemoryFormat("contiguous_format")
channels_last = MemoryFormat("channels_last")
channels_last_3d = MemoryFormat("channels_last_3d")
preserve_format = MemoryFormat("preserve_format")
strided = Layout("strided")

_FORMATS = {f.name: f for f in (contiguous_format, channels_last, channels_last_3d, preserve_format)}


def memory_format_from_name(name: str) -> MemoryFormat:
    """Inverse of ``MemoryFormat.name``; raises ``KeyError`` for unknown names."""
    return _FORMATS[name]


@functools.cache
def natural_order(ndim: int) -> tuple[int, ...]:
    """``(0, 1, ..., ndim - 1)``: the axis order of C order (one tuple per ``ndim``)."""
    return tuple(range(ndim))


def physical_order(ndim: int, memory_format: MemoryFormat) -> tuple[int, ...]:
    """Logical axes listed from outermost to innermost in memory.

    ``channels_last`` on 4-D gives ``(0, 2, 3, 1)``: N, H, W, then C fastest.
    """
    if memory_format is contiguous_format or ndim < 4:  # (most arrays: no comparison of fields)
        return natural_order(ndim)
    if memory_format == channels_last and ndim == 4:
        return (0, 2, 3, 1)
    if memory_format == channels_last_3d and ndim == 5:
        return (0, 2, 3, 4, 1)
    return natural_order(ndim)


def is_dense_in_order(
    shape: Sequence[int], strides: Sequence[int], itemsize: int, order: Sequence[int]
) -> bool:
    # Walk axes from innermost to outermost; size-1 axes may carry any stride,
    # as in every array library (their stride is never used to address memory).
    expected = itemsize
    for axis in reversed(order):
        if shape[axis] != 1 and strides[axis] != expected:
            return False
        expected *= shape[axis]
    return True


def detect_memory_format(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> MemoryFormat:
    """Memory format of a dense array from its shape and byte strides.

    C-contiguous wins over channels-last when both describe the array (for
    example when ``C == 1``), matching what array libraries report.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.empty((2, 5, 6, 3)).transpose(0, 3, 1, 2)  # NHWC memory, NCHW view
    >>> detect_memory_format(x.shape, x.strides, x.itemsize)
    gpuckpt.channels_last
    """
    ndim = len(shape)
    if any(s == 0 for s in shape):
        return contiguous_format
    if is_dense_in_order(shape, strides, itemsize, tuple(range(ndim))):
        return contiguous_format
    if ndim == 4 and is_dense_in_order(shape, strides, itemsize, physical_order(4, channels_last)):
        return channels_last
    if ndim == 5 and is_dense_in_order(shape, strides, itemsize, physical_order(5, channels_last_3d)):
        return channels_last_3d
    return preserve_format
