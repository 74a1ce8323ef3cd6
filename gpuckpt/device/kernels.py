"""Device kernels that move channels-last tensors to and from logical order.

A channels-last tensor has logical shape ``(N, C, H, W)`` (``channels_last``)
or ``(N, C, D, H, W)`` (``channels_last_3d``) while its memory is laid out as
``[N][H][W][C]`` / ``[N][D][H][W][C]``.  Checkpoints store the logical
C-order, so saving transposes on the device before the device-to-host copy,
and loading transposes contiguous chunks back into channels-last targets.

The work is split by role: :mod:`~gpuckpt.device.kernel_checks` validates
arrays and boxes, :mod:`~gpuckpt.device.kernel_plan` chooses the kernel path
and plans a launch, :mod:`~gpuckpt.device.kernel_source` finds the CUDA
source and compiles it (lazily, once per device; importing never imports
CuPy). This module caches validated plans per layout and box, launches them,
and re-exports the public names of the other three.

Three kernel paths do the work, each thread transposing in registers where
it can: a pixel path for few channels (C = 1..8), in which each thread moves
whole pixels with vector loads and stores; a micro-tile path for many
channels in 16-byte groups, in which each thread moves a 16-byte wide block
of channels by a few positions; and a tiled transpose through shared memory
for every other shape.  :func:`choose_path` picks one by shape; the choice
and the whole launch plan are made once per layout and box and cached, so
that a launch costs little more than the kernel call.

Everything except :func:`load_module` and the two copy functions is pure
Python, shared with the NumPy reference implementation
(:mod:`gpuckpt.device._kernel_ref`) and with the CPU-emulation tests, which
run the very same launch plans.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from gpuckpt.device.kernel_checks import (
    SUPPORTED_ITEMSIZES,
    Box,
    channels_last_strides,
    check_channels_last,
    check_contiguous_block,
    check_itemsize,
    is_channels_last,
    normalize_box,
)
from gpuckpt.device.kernel_plan import (
    MAX_GRID,
    MICRO_GROUP_BYTES,
    PATHS,
    PIXEL_MAX_CHANNELS,
    THREADS_PER_BLOCK,
    TILE_ELEMS,
    TILE_MAX_CHANNELS,
    BoxCopyPlan,
    choose_path,
    micro_groups_log2,
    micro_positions_per_thread,
    pixel_positions_per_thread,
    plan_box_copy,
)
from gpuckpt.device.kernel_source import (
    KERNEL_FILE,
    kernel_source,
    kernel_source_dir,
    load_module,
    module_part_options,
)
from gpuckpt.device.kernel_source import _modules as _modules  # the compile cache (tests replace entries)

__all__ = [
    "KERNEL_FILE",
    "MAX_GRID",
    "MICRO_GROUP_BYTES",
    "PATHS",
    "PIXEL_MAX_CHANNELS",
    "SUPPORTED_ITEMSIZES",
    "THREADS_PER_BLOCK",
    "TILE_ELEMS",
    "TILE_MAX_CHANNELS",
    "Box",
    "BoxCopyPlan",
    "channels_last_strides",
    "channels_last_to_contiguous",
    "check_channels_last",
    "check_contiguous_block",
    "check_itemsize",
    "choose_path",
    "contiguous_to_channels_last",
    "is_channels_last",
    "kernel_source",
    "kernel_source_dir",
    "load_module",
    "micro_groups_log2",
    "micro_positions_per_thread",
    "module_part_options",
    "normalize_box",
    "pixel_positions_per_thread",
    "plan_box_copy",
]


# --------------------------------------------------------------------------
# CuPy entry points


def _require_cupy_array(cupy: Any, array: Any, name: str) -> None:
    if not isinstance(array, cupy.ndarray):
        raise TypeError(f"{name}: expected a cupy.ndarray, got {type(array).__name__}")


def _check_no_overlap(a: Any, b: Any) -> None:
    """Both arrays are dense with positive strides (checked before): each
    spans ``[data.ptr, data.ptr + nbytes)``."""
    a_lo, b_lo = int(a.data.ptr), int(b.data.ptr)
    if a_lo < b_lo + b.nbytes and b_lo < a_lo + a.nbytes:
        raise ValueError("source and destination memory overlap; the kernels need distinct buffers")


@dataclass(frozen=True)
class _Launch:
    """A validated, planned box copy: what a launch needs besides the two arrays."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    plan: BoxCopyPlan
    name: str
    args: tuple[Any, ...]  # the kernel parameters after the two pointers, as NumPy scalars
    # device id -> the loaded kernel (filled on first launch per device)
    kernels: dict[int, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)


def _check_block(block: Any, sizes: tuple[int, ...], dtype: Any, name: str) -> None:
    """The logical-order block matches the box: the common case in three
    attribute reads, the full check (with its messages) otherwise."""
    if block.shape == sizes and block.dtype == dtype and block.flags.c_contiguous:
        return
    check_contiguous_block(block.shape, block.dtype, block.flags.c_contiguous, sizes, dtype, name=name)


def _box_key(box: Any) -> Any:
    """A hashable form of ``box`` (the same box), or ``None`` if it has none."""
    if box is None:
        return ("whole",)
    try:
        hash(box)
        return ("box", box)
    except TypeError:
        pass
    try:
        return ("box", tuple(tuple(int(v) for v in part) for part in box))
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=4096)
def _prepare_cached(
    shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any, box_key: tuple[Any, ...], to_cl: bool
) -> _Launch:
    return _prepare(shape, strides, dtype, None if box_key[0] == "whole" else box_key[1], to_cl)


def _prepare(shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any, box: Any, to_cl: bool) -> _Launch:
    import numpy as np

    name = "dst" if to_cl else "src"
    itemsize = check_itemsize(dtype, name=name)
    check_channels_last(shape, strides, itemsize, name=name)
    offsets, sizes = normalize_box(box, shape)
    plan = plan_box_copy(shape, offsets, sizes, itemsize)
    args = (*(np.int64(v) for v in plan.params()), *(np.int32(v) for v in plan.int_params()))
    return _Launch(offsets, sizes, plan, plan.kernel_name(to_cl), args)


def _prepared(array: Any, box: Any, to_cl: bool) -> _Launch:
    """Validation and plan of a box copy, cached per layout and box: a launch
    then costs little more than the kernel call itself."""
    shape, strides, dtype = array.shape, array.strides, array.dtype
    key = _box_key(box)
    if key is None:  # not hashable: checked and planned every time
        return _prepare(shape, strides, dtype, box, to_cl)
    return _prepare_cached(shape, strides, dtype, key, to_cl)


# (device, part, kernel name) -> the loaded function, so that a launch after
# the first is one dictionary lookup and the kernel call.
_functions: dict[tuple[int, int, str], Any] = {}


def _kernel(device_id: int, prep: _Launch) -> Any:
    module = load_module(device_id, part=prep.plan.module_part)
    key = (device_id, id(module), prep.name)
    kernel = _functions.get(key)
    if kernel is None:
        kernel = _functions[key] = module.get_function(prep.name)
    return kernel


def _launch(cupy: Any, prep: _Launch, src: Any, dst: Any) -> None:
    """One kernel on the current stream; nothing else (no synchronisation,
    no allocation): the launch plan and the kernel come from caches."""
    if prep.plan.empty:
        return
    device_id = src.data.device_id
    kernel = prep.kernels.get(device_id)
    if kernel is None:
        kernel = prep.kernels[device_id] = _kernel(device_id, prep)
    if _single_device(cupy):
        kernel(prep.plan.grid, prep.plan.block, (src, dst, *prep.args))
    else:
        with cupy.cuda.Device(device_id):
            kernel(prep.plan.grid, prep.plan.block, (src, dst, *prep.args))


@functools.cache
def _single_device(cupy: Any) -> bool:
    return int(cupy.cuda.runtime.getDeviceCount()) == 1


def channels_last_to_contiguous(src: Any, out: Any = None, *, box: Any = None) -> Any:
    """Copy a box of a channels-last device tensor into logical C-order.

    Parameters
    ----------
    src : cupy.ndarray
        Logical shape ``(N, C, H, W)`` or ``(N, C, D, H, W)`` with dense
        channels-last strides (memory ``NHWC`` / ``NDHWC``); element size 1,
        2, 4 or 8 bytes.
    out : cupy.ndarray, optional
        C-contiguous destination of the box's shape and ``src``'s dtype, on
        the same device; allocated when omitted.
    box : None, tuple of slices, or (offsets, sizes), optional
        The part of ``src`` to copy, in logical coordinates; the whole tensor
        when omitted.

    Returns
    -------
    cupy.ndarray
        ``out``, holding ``src[box]`` in logical C-order.  The copy is
        enqueued on the current stream.

    Raises
    ------
    TypeError
        For non-CuPy arrays, unsupported element sizes or a dtype mismatch.
    ValueError
        For wrong shapes, non-channels-last strides, a box out of bounds, a
        non-contiguous or overlapping ``out``, or arrays on different devices.
    """
    import cupy

    _require_cupy_array(cupy, src, "src")
    prep = _prepared(src, box, False)
    if out is None:
        if _single_device(cupy):
            out = cupy.empty(prep.sizes, dtype=src.dtype)
        else:
            with cupy.cuda.Device(src.data.device_id):
                out = cupy.empty(prep.sizes, dtype=src.dtype)
    else:
        _require_cupy_array(cupy, out, "out")
        _check_block(out, prep.sizes, src.dtype, "out")
        if out.data.device_id != src.data.device_id:
            raise ValueError(f"out is on device {out.data.device_id}, src on device {src.data.device_id}")
        _check_no_overlap(src, out)
    _launch(cupy, prep, src, out)
    return out


def contiguous_to_channels_last(src: Any, dst: Any, *, box: Any = None) -> Any:
    """Write a logical C-order block into a box of a channels-last tensor.

    Parameters
    ----------
    src : cupy.ndarray
        C-contiguous block of the box's shape and ``dst``'s dtype.
    dst : cupy.ndarray
        Channels-last tensor (see :func:`channels_last_to_contiguous`),
        written in place; elements outside the box are left alone.
    box : None, tuple of slices, or (offsets, sizes), optional
        Where ``src`` goes in ``dst``, in logical coordinates; the whole
        tensor when omitted.

    Returns
    -------
    cupy.ndarray
        ``dst``.  The copy is enqueued on the current stream.

    Raises
    ------
    TypeError, ValueError
        As for :func:`channels_last_to_contiguous`.
    """
    import cupy

    _require_cupy_array(cupy, dst, "dst")
    _require_cupy_array(cupy, src, "src")
    prep = _prepared(dst, box, True)
    _check_block(src, prep.sizes, dst.dtype, "src")
    if src.data.device_id != dst.data.device_id:
        raise ValueError(f"src is on device {src.data.device_id}, dst on device {dst.data.device_id}")
    _check_no_overlap(src, dst)
    _launch(cupy, prep, src, dst)
    return dst
