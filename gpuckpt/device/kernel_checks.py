"""Validation of the arrays and boxes the channels-last kernels are given.

Pure Python, for NumPy and CuPy arrays alike: shapes, strides, element sizes
and boxes are checked before any launch, with the shape in the message. The
NumPy reference (:mod:`gpuckpt.device._kernel_ref`) runs the same checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuckpt.format import memory_format as mf

__all__ = [
    "SUPPORTED_ITEMSIZES",
    "Box",
    "channels_last_strides",
    "check_channels_last",
    "check_contiguous_block",
    "check_itemsize",
    "is_channels_last",
    "normalize_box",
]

SUPPORTED_ITEMSIZES = (1, 2, 4, 8)

Box = tuple[tuple[int, ...], tuple[int, ...]]


def check_itemsize(dtype: Any, *, name: str = "array") -> int:
    """Return the element size of ``dtype`` if the kernels support it.

    Parameters
    ----------
    dtype : numpy.dtype or dtype-like
        Element type (any dtype of size 1, 2, 4 or 8 bytes: the kernels only
        move bytes).
    name : str
        Argument name used in the error message.

    Returns
    -------
    int
        The element size in bytes.

    Raises
    ------
    TypeError
        If the element size is not 1, 2, 4 or 8 bytes, or the dtype holds
        Python objects.
    """
    import numpy as np

    dt = np.dtype(dtype)
    if dt.hasobject or dt.itemsize not in SUPPORTED_ITEMSIZES:
        raise TypeError(
            f"{name}: dtype {dt} has element size {dt.itemsize} bytes; the "
            f"channels-last kernels support element sizes "
            f"{SUPPORTED_ITEMSIZES} and no object dtypes"
        )
    return int(dt.itemsize)


def _check_ndim(shape: Sequence[int], name: str) -> None:
    if len(shape) not in (4, 5):
        raise ValueError(
            f"{name}: logical shape {tuple(shape)} has {len(shape)} dimensions; "
            "expected 4 (N, C, H, W) or 5 (N, C, D, H, W)"
        )


def channels_last_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Return the byte strides of a dense channels-last tensor.

    Parameters
    ----------
    shape : sequence of int
        Logical shape ``(N, C, H, W)`` or ``(N, C, D, H, W)``.
    itemsize : int
        Element size in bytes.

    Returns
    -------
    tuple of int
        Strides in logical dimension order, for memory order
        ``[N][spatial...][C]``.
    """
    _check_ndim(shape, "shape")
    strides = [0] * len(shape)
    step = itemsize
    strides[1] = step
    step *= shape[1]
    for dim in range(len(shape) - 1, 1, -1):
        strides[dim] = step
        step *= shape[dim]
    strides[0] = step
    return tuple(strides)


def is_channels_last(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Tell whether ``strides`` describe a dense channels-last tensor.

    Strides of size-1 dimensions are ignored (any value addresses the same
    elements), as are all strides of an empty tensor.

    Parameters
    ----------
    shape : sequence of int
        Logical shape, 4-D or 5-D.
    strides : sequence of int
        Byte strides in logical dimension order.
    itemsize : int
        Element size in bytes.

    Returns
    -------
    bool
        True for a dense channels-last (or channels-last 3-D) layout.
    """
    if len(shape) not in (4, 5) or len(strides) != len(shape):
        return False
    if 0 in shape:
        return True
    fmt = mf.channels_last if len(shape) == 4 else mf.channels_last_3d
    return mf.is_dense_in_order(shape, strides, itemsize, mf.physical_order(len(shape), fmt))


def check_channels_last(
    shape: Sequence[int], strides: Sequence[int], itemsize: int, *, name: str = "array"
) -> None:
    """Raise unless ``shape``/``strides`` describe a dense channels-last tensor.

    Parameters
    ----------
    shape : sequence of int
        Logical shape, 4-D or 5-D.
    strides : sequence of int
        Byte strides in logical dimension order.
    itemsize : int
        Element size in bytes.
    name : str
        Argument name used in the error message.

    Raises
    ------
    ValueError
        With the shape and strides found and the strides expected.
    """
    _check_ndim(shape, name)
    if not is_channels_last(shape, strides, itemsize):
        layout = "channels_last" if len(shape) == 4 else "channels_last_3d"
        raise ValueError(
            f"{name}: strides {tuple(strides)} (bytes) for logical shape "
            f"{tuple(shape)} are not dense {layout}; expected "
            f"{channels_last_strides(shape, itemsize)} (memory order "
            f"{'NHWC' if len(shape) == 4 else 'NDHWC'}; size-1 dimensions may "
            "have any stride)"
        )


def normalize_box(box: Any, shape: Sequence[int]) -> Box:
    """Turn a box description into ``(offsets, sizes)`` and check its bounds.

    Parameters
    ----------
    box : None, tuple of slices, or (offsets, sizes)
        ``None`` is the whole tensor.  A tuple of ``slice`` objects (one per
        dimension, step 1) or a pair of integer sequences ``(offsets, sizes)``
        in logical coordinates.
    shape : sequence of int
        Logical shape of the tensor the box lies in.

    Returns
    -------
    tuple
        ``(offsets, sizes)`` as tuples of int.

    Raises
    ------
    ValueError
        If the box has the wrong rank, a step other than 1, or leaves the
        tensor.
    TypeError
        If the box is of an unsupported form.
    """
    ndim = len(shape)
    if box is None:
        return (0,) * ndim, tuple(int(n) for n in shape)
    box = tuple(box)
    if box and all(isinstance(s, slice) for s in box):
        if len(box) != ndim:
            raise ValueError(f"box {box} has {len(box)} slices; expected {ndim} for shape {tuple(shape)}")
        starts: list[int] = []
        lengths: list[int] = []
        for dim, (s, n) in enumerate(zip(box, shape, strict=True)):
            start, stop, step = s.indices(n)
            if step != 1:
                raise ValueError(
                    f"box slice {s} in dimension {dim} has step {step}; only step 1 is supported"
                )
            starts.append(start)
            lengths.append(max(0, stop - start))
        return tuple(starts), tuple(lengths)
    if len(box) != 2:
        raise TypeError(f"box must be None, a tuple of slices or (offsets, sizes); got {box!r}")
    try:
        offsets = tuple(int(v) for v in box[0])
        sizes = tuple(int(v) for v in box[1])
    except TypeError as exc:
        raise TypeError(f"box must be None, a tuple of slices or (offsets, sizes); got {box!r}") from exc
    if len(offsets) != ndim or len(sizes) != ndim:
        raise ValueError(
            f"box offsets {offsets} and sizes {sizes} must both have {ndim} entries for shape {tuple(shape)}"
        )
    for dim, (o, s, n) in enumerate(zip(offsets, sizes, shape, strict=True)):
        if o < 0 or s < 0 or o + s > n:
            raise ValueError(
                f"box offsets {offsets} sizes {sizes} leave shape {tuple(shape)} in dimension {dim} "
                f"([{o}, {o + s}) not within [0, {n}))"
            )
    return offsets, sizes


def check_contiguous_block(
    shape: Sequence[int],
    dtype: Any,
    c_contiguous: bool,
    sizes: Sequence[int],
    expected_dtype: Any,
    *,
    name: str,
) -> None:
    """Check a logical-order block against the box it must hold.

    Parameters
    ----------
    shape, dtype, c_contiguous
        Shape, dtype and C-contiguity of the block.
    sizes : sequence of int
        Box sizes it must match.
    expected_dtype
        The tensor's dtype.
    name : str
        Argument name used in the error message.

    Raises
    ------
    ValueError
        On a shape mismatch or a non C-contiguous block.
    TypeError
        On a dtype mismatch.
    """
    import numpy as np

    if tuple(shape) != tuple(sizes):
        raise ValueError(f"{name}: shape {tuple(shape)} does not match the box sizes {tuple(sizes)}")
    if np.dtype(dtype) != np.dtype(expected_dtype):
        raise TypeError(
            f"{name}: dtype {np.dtype(dtype)} does not match the tensor dtype {np.dtype(expected_dtype)}"
        )
    if not c_contiguous:
        raise ValueError(f"{name}: a C-contiguous array is required (shape {tuple(shape)})")


# --------------------------------------------------------------------------
# Launch planning (pure Python)
