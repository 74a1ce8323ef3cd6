"""NumPy reference implementations of the channels-last kernels.

Same signatures and the same validation as the device functions in
:mod:`gpuckpt.device.kernels`, on NumPy arrays.  The tests compare the kernels
(on the GPU and in the CPU emulation) with these; the host save/load path uses
them for channels-last NumPy arrays.  NumPy's own strided copy does the work,
so these stay independent of the kernels' tiling.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .kernels import (
    check_channels_last,
    check_contiguous_block,
    check_itemsize,
    normalize_box,
)

__all__ = [
    "as_channels_last",
    "channels_last_to_contiguous",
    "contiguous_to_channels_last",
    "empty_channels_last",
]


def _box_slices(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


def _require_numpy(array: Any, name: str) -> None:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name}: expected a numpy.ndarray, got {type(array).__name__}")


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.shares_memory(a, b))


def empty_channels_last(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Allocate an uninitialised channels-last array.

    Parameters
    ----------
    shape : tuple of int
        Logical shape ``(N, C, H, W)`` or ``(N, C, D, H, W)``.
    dtype : dtype-like
        Element type.

    Returns
    -------
    numpy.ndarray
        A view with the logical shape over memory in ``NHWC`` / ``NDHWC``
        order.
    """
    if len(shape) not in (4, 5):
        raise ValueError(f"shape {tuple(shape)} must be 4-D or 5-D")
    physical = (shape[0], *shape[2:], shape[1])
    return np.moveaxis(np.empty(physical, dtype=dtype), -1, 1)


def as_channels_last(array: np.ndarray) -> np.ndarray:
    """Copy a logical-order array into channels-last memory.

    Parameters
    ----------
    array : numpy.ndarray
        4-D or 5-D array in any layout.

    Returns
    -------
    numpy.ndarray
        Equal to ``array``, with channels-last strides.
    """
    out = empty_channels_last(array.shape, array.dtype)
    out[...] = array
    return out


def channels_last_to_contiguous(
    src: np.ndarray, out: np.ndarray | None = None, *, box: Any = None
) -> np.ndarray:
    """Copy a box of a channels-last array into logical C-order.

    Parameters
    ----------
    src : numpy.ndarray
        Channels-last array with logical shape ``(N, C, H, W)`` or
        ``(N, C, D, H, W)``; element size 1, 2, 4 or 8 bytes.
    out : numpy.ndarray, optional
        C-contiguous destination of the box's shape and ``src``'s dtype.
    box : None, tuple of slices, or (offsets, sizes), optional
        Part of ``src`` to copy; the whole array when omitted.

    Returns
    -------
    numpy.ndarray
        ``out`` (or a new array) holding ``src[box]``.

    Raises
    ------
    TypeError, ValueError
        As :func:`gpuckpt.device.kernels.channels_last_to_contiguous`.
    """
    _require_numpy(src, "src")
    itemsize = check_itemsize(src.dtype, name="src")
    check_channels_last(src.shape, src.strides, itemsize, name="src")
    offsets, sizes = normalize_box(box, src.shape)
    view = src[_box_slices(offsets, sizes)]
    if out is None:
        return np.ascontiguousarray(view)
    _require_numpy(out, "out")
    check_contiguous_block(out.shape, out.dtype, out.flags.c_contiguous, sizes, src.dtype, name="out")
    if _overlap(src, out):
        raise ValueError("source and destination memory overlap")
    out[...] = view
    return out


def contiguous_to_channels_last(src: np.ndarray, dst: np.ndarray, *, box: Any = None) -> np.ndarray:
    """Write a logical C-order block into a box of a channels-last array.

    Parameters
    ----------
    src : numpy.ndarray
        C-contiguous block of the box's shape and ``dst``'s dtype.
    dst : numpy.ndarray
        Channels-last array, written in place.
    box : None, tuple of slices, or (offsets, sizes), optional
        Where ``src`` goes; the whole array when omitted.

    Returns
    -------
    numpy.ndarray
        ``dst``.

    Raises
    ------
    TypeError, ValueError
        As :func:`gpuckpt.device.kernels.contiguous_to_channels_last`.
    """
    _require_numpy(dst, "dst")
    _require_numpy(src, "src")
    itemsize = check_itemsize(dst.dtype, name="dst")
    check_channels_last(dst.shape, dst.strides, itemsize, name="dst")
    offsets, sizes = normalize_box(box, dst.shape)
    check_contiguous_block(src.shape, src.dtype, src.flags.c_contiguous, sizes, dst.dtype, name="src")
    if _overlap(src, dst):
        raise ValueError("source and destination memory overlap")
    dst[_box_slices(offsets, sizes)] = src
    return dst
