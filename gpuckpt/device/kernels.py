"""Device kernels that move channels-last tensors to and from logical order.

A channels-last tensor has logical shape ``(N, C, H, W)`` (``channels_last``)
or ``(N, C, D, H, W)`` (``channels_last_3d``) while its memory is laid out as
``[N][H][W][C]`` / ``[N][D][H][W][C]``.  Checkpoints store the logical
C-order, so saving transposes on the device before the device-to-host copy,
and loading transposes contiguous chunks back into channels-last targets.

The CUDA source lives in the top-level ``kernels/`` folder of a source
checkout and in ``gpuckpt/_kernels/`` of an installed wheel.  It is compiled
at run time through CuPy (NVRTC), lazily on first use and once per device;
importing this module never imports CuPy.

Three kernel paths do the work, each thread transposing in registers where
it can: a pixel path for few channels (C = 1..8), in which each thread moves
whole pixels with vector loads and stores; a micro-tile path for many
channels in 16-byte groups, in which each thread moves a 16-byte wide block
of channels by a few positions; and a tiled transpose through shared memory
for every other shape.  :func:`choose_path` picks one by shape; the choice
and the whole launch plan are made once per layout and box and cached, so
that a launch costs little more than the kernel call.

Everything here except :func:`load_module` and the two copy functions is pure
Python, shared with the NumPy reference implementation
(:mod:`gpuckpt.device._kernel_ref`) and with the CPU-emulation tests, which
run the very same launch plans.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuckpt import memory_format as mf

__all__ = [
    "KERNEL_FILE",
    "PIXEL_MAX_CHANNELS",
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
    "normalize_box",
    "micro_positions_per_thread",
    "pixel_positions_per_thread",
    "plan_box_copy",
]

#: Name of the CUDA source file inside :func:`kernel_source_dir`.
KERNEL_FILE = "channels_last.cu"

#: Threads per block; the kernels are written for exactly this many.
THREADS_PER_BLOCK = 256

#: Tile capacity (elements) per element size; must match ``GK_DEFINE`` in the
#: CUDA source (a test checks that).
TILE_ELEMS: dict[int, int] = {1: 4096, 2: 4096, 4: 2048, 8: 1024}

#: Widest channel side of a tile when the run is long.  Small elements get
#: wider rows so that each warp reads a useful number of bytes.
TILE_MAX_CHANNELS: dict[int, int] = {1: 64, 2: 64, 4: 32, 8: 32}

#: Hardware limits on the grid; the kernels loop over anything beyond them.
MAX_GRID: tuple[int, int, int] = (2**31 - 1, 65535, 65535)

SUPPORTED_ITEMSIZES = (1, 2, 4, 8)

#: Largest channel count of the pixel path (``gpuckpt_px_*`` kernels).
PIXEL_MAX_CHANNELS = 8

#: The kernel paths (see :func:`choose_path`).
PATHS = ("tiled", "pixel", "micro")

#: Bytes of channels one micro-tile spans (``16 / itemsize`` channels).
MICRO_GROUP_BYTES = 16

Box = tuple[tuple[int, ...], tuple[int, ...]]


# --------------------------------------------------------------------------
# Locating and compiling the source


def kernel_source_dir() -> Path:
    """Return the folder that holds the CUDA kernel sources.

    Returns
    -------
    pathlib.Path
        ``gpuckpt/_kernels`` inside an installed package, else the top-level
        ``kernels/`` folder of a source checkout.

    Raises
    ------
    FileNotFoundError
        If neither location holds :data:`KERNEL_FILE`.
    """
    package_dir = Path(__file__).resolve().parent.parent
    candidates = (package_dir / "_kernels", package_dir.parent / "kernels")
    for folder in candidates:
        if (folder / KERNEL_FILE).is_file():
            return folder
    searched = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"{KERNEL_FILE} not found; searched {searched}")


def kernel_source() -> str:
    """Return the text of the CUDA kernel source.

    Returns
    -------
    str
        Contents of :data:`KERNEL_FILE`.
    """
    return (kernel_source_dir() / KERNEL_FILE).read_text(encoding="utf-8")


_modules: dict[tuple[int, tuple[str, ...], str | None], Any] = {}
_modules_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    global _modules_lock
    _modules_lock = threading.Lock()  # it may have been held by a thread that the child does not have


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)


def module_part_options(part: str | None) -> tuple[str, ...]:
    """NVRTC options that make the source define only ``part``'s kernels.

    Parameters
    ----------
    part : str or None
        ``"tiled"`` or ``"micro"`` (those kernels for every element size),
        ``"px1"``, ``"px2"``, ``"px4"`` or ``"px8"`` (the pixel kernels of
        one element size), or None for everything.

    Returns
    -------
    tuple of str
        ``-D`` options (``GK_BUILD_TILED``, ``GK_BUILD_MICRO``,
        ``GK_BUILD_PX_SIZES``).

    Raises
    ------
    ValueError
        For an unknown part.
    """
    if part is None:
        return ()
    if part == "tiled":
        return ("-DGK_BUILD_TILED=1", "-DGK_BUILD_MICRO=0", "-DGK_BUILD_PX_SIZES=0")
    if part == "micro":
        return ("-DGK_BUILD_TILED=0", "-DGK_BUILD_MICRO=1", "-DGK_BUILD_PX_SIZES=0")
    if part.startswith("px") and part[2:] in {str(es) for es in SUPPORTED_ITEMSIZES}:
        return ("-DGK_BUILD_TILED=0", "-DGK_BUILD_MICRO=0", f"-DGK_BUILD_PX_SIZES={part[2:]}")
    raise ValueError(
        f"kernel module part {part!r} is not one of 'tiled', 'micro', 'px1', 'px2', 'px4', 'px8' or None"
    )


def load_module(device_id: int | None = None, *, options: Sequence[str] = (), part: str | None = None) -> Any:
    """Compile (once per device and part) and return kernels as a CuPy module.

    Parameters
    ----------
    device_id : int, optional
        CUDA device to compile for; the current device when omitted.
    options : sequence of str, optional
        Extra NVRTC options.  Tests use ``-D`` switches here to build the
        deliberately broken variants; normal callers pass nothing.
    part : str, optional
        Compile only these kernels (see :func:`module_part_options`): the
        launches compile the tiled kernels and each element size's pixel
        kernels separately, on first use.  Everything when omitted.

    Returns
    -------
    cupy.RawModule
        The compiled module, loaded on ``device_id``.
    """
    import cupy

    if device_id is None:
        device_id = cupy.cuda.Device().id
    key = (int(device_id), tuple(options), part)
    module = _modules.get(key)  # compiled already: no lock needed to read it
    if module is not None:
        return module
    part_options = module_part_options(part)
    with _modules_lock:
        module = _modules.get(key)
        if module is None:
            with cupy.cuda.Device(device_id):
                module = cupy.RawModule(code=kernel_source(), options=("-std=c++17", *part_options, *options))
                # Compile now, on this device: RawModule would otherwise
                # compile for whichever device is current at first use.
                module.compile()
            _modules[key] = module
    return module


# --------------------------------------------------------------------------
# Validation (pure Python; works for NumPy and CuPy arrays alike)


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


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def choose_path(
    shape: Sequence[int], sizes: Sequence[int], itemsize: int, offsets: Sequence[int] | None = None
) -> str:
    """Pick the kernel path for a box copy, by shape.

    Parameters
    ----------
    shape : sequence of int
        Logical shape of the channels-last tensor, 4-D or 5-D.
    sizes : sequence of int
        Box sizes (the whole tensor: ``shape``).
    itemsize : int
        Element size in bytes: 1, 2, 4 or 8.
    offsets : sequence of int, optional
        Box offsets (the whole tensor when omitted).

    Returns
    -------
    str
        ``"pixel"`` when the tensor has 1 to :data:`PIXEL_MAX_CHANNELS`
        channels: each thread moves whole pixels with vector accesses on
        both sides (a box with some of the channels still reads whole
        pixels).  ``"micro"`` when the box's channels come in whole 16-byte
        groups (the tensor's channels, the box's first channel and its
        channel count: multiples of ``16 / itemsize``) and its planes are
        4-byte aligned in the logical block: each thread moves a micro-tile
        of one such group by a few positions.  ``"tiled"`` otherwise, the
        shared-memory transpose.

    Notes
    -----
    Pure and cheap; the launch plan that holds its answer is cached per
    layout and box (see :func:`plan_box_copy`), so it runs once per layout.
    Every box is served by every path that accepts it: the choice is about
    speed only.
    """
    _check_ndim(shape, "shape")
    if itemsize not in SUPPORTED_ITEMSIZES:
        raise TypeError(f"element size {itemsize} is not one of {SUPPORTED_ITEMSIZES}")
    if len(sizes) != len(shape) or (offsets is not None and len(offsets) != len(shape)):
        raise ValueError(f"box sizes {tuple(sizes)} do not match the rank of shape {tuple(shape)}")
    channels = int(shape[1])
    if 1 <= channels <= PIXEL_MAX_CHANNELS:
        return "pixel"
    c0 = 0 if offsets is None else int(offsets[1])
    if (
        all(v * itemsize % MICRO_GROUP_BYTES == 0 for v in (channels, c0, int(sizes[1])))
        and int(sizes[1]) > 0
        and _logical_strides_aligned(sizes, itemsize, 4)
    ):
        return "micro"
    return "tiled"


def _logical_strides_aligned(sizes: Sequence[int], itemsize: int, align: int) -> bool:
    """The logical block's plane stride and spatial strides (the products of
    the sizes after each spatial dimension) are multiples of ``align`` bytes,
    so that every plane of every line starts on such a boundary."""
    return all(_prod(sizes[d:]) * itemsize % align == 0 for d in range(3, len(sizes))) and (
        _prod(sizes[2:]) * itemsize % align == 0
    )


def micro_positions_per_thread(itemsize: int) -> int:
    """Spatial positions of one micro-tile: 16 for 1-byte elements, 8 for
    the others (256 or 128 bytes per thread).  Must match
    ``gk_mt_positions`` in the CUDA source."""
    return 16 if itemsize == 1 else 8


def micro_groups_log2(nch: int, itemsize: int) -> int:
    """log2 of the channel groups per block of the micro-tile path: the
    largest power of two up to 32 and up to the box's groups."""
    groups = max(1, nch * itemsize // MICRO_GROUP_BYTES)
    return min(5, groups.bit_length() - 1)


def pixel_positions_per_thread(channels: int, itemsize: int) -> int:
    """Spatial positions one thread of the pixel path moves (all channels).

    ``16 * G / itemsize`` with ``G`` = 4, 2, 1 for 1, 2 and more channels:
    16 bytes of every plane (64 and 32 bytes for one and two channels), so
    that each thread has at least 48 bytes in flight.  Must match
    ``gk_px_groups`` in the CUDA source.
    """
    groups = 4 if channels == 1 else 2 if channels == 2 else 1
    return 16 * groups // itemsize


@dataclass(frozen=True)
class BoxCopyPlan:
    """Kernel parameters for one box copy; see ``kernels/channels_last.cu``.

    All offsets and strides are in elements.  The box is ``nlines`` lines
    (outer dimensions, up to three, sizes ``(*, l1, l2)``) of ``run_len``
    spatial positions and ``nch`` channels.  ``path`` is ``"tiled"`` (tile
    sides ``2**log_tc`` channels by ``2**log_tq`` positions), ``"pixel"``
    (``cl_base`` then points at channel 0 of the first pixel, the box starts
    at channel ``c0``, and ``cl_qs`` is the tensor's channel count) or
    ``"micro"`` (``2**log_tc`` groups of 16 bytes of channels per block).
    """

    itemsize: int
    cl_base: int
    nlines: int
    l1: int
    l2: int
    cl_line_strides: tuple[int, int, int]
    cf_line_strides: tuple[int, int, int]
    run_len: int
    cl_qs: int
    nch: int
    cf_cs: int
    log_tc: int
    log_tq: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int] = (THREADS_PER_BLOCK, 1, 1)
    path: str = "tiled"
    c0: int = 0

    @property
    def empty(self) -> bool:
        """True when the box holds no element (nothing to launch)."""
        return self.nlines == 0 or self.run_len == 0 or self.nch == 0

    @property
    def tiles(self) -> tuple[int, int, int]:
        """Work items along the grid's (x, y, z) before capping to it: tiles
        along (run, channels, lines) on the tiled path; blocks' spans of the
        run and lines on the pixel path; blocks' spans of the run, tiles of
        channel groups and lines on the micro-tile path."""
        if self.path == "pixel":
            span = THREADS_PER_BLOCK * pixel_positions_per_thread(self.cl_qs, self.itemsize)
            return (-(-self.run_len // span), self.nlines, 1)
        if self.path == "micro":
            span = (THREADS_PER_BLOCK >> self.log_tc) * micro_positions_per_thread(self.itemsize)
            groups = self.nch * self.itemsize // MICRO_GROUP_BYTES
            return (-(-self.run_len // span), -(-groups >> self.log_tc), self.nlines)
        tq, tc = 1 << self.log_tq, 1 << self.log_tc
        return (-(-self.run_len // tq), -(-self.nch // tc), self.nlines)

    @property
    def module_part(self) -> str:
        """The part of the source (see :func:`module_part_options`) that
        holds this plan's kernels."""
        return f"px{self.itemsize}" if self.path == "pixel" else self.path

    def kernel_name(self, to_channels_last: bool) -> str:
        """Name of the ``extern "C"`` entry point for this element size."""
        direction = "cf_to_cl" if to_channels_last else "cl_to_cf"
        if self.path == "pixel":
            return f"gpuckpt_px_{direction}_{self.itemsize}_{self.cl_qs}"
        if self.path == "micro":
            return f"gpuckpt_mt_{direction}_{self.itemsize}"
        return f"gpuckpt_{direction}_{self.itemsize}"

    def params(self) -> tuple[int, ...]:
        """The 14 ``long long`` kernel parameters, in signature order."""
        return (
            self.cl_base,
            self.nlines,
            self.l1,
            self.l2,
            *self.cl_line_strides,
            *self.cf_line_strides,
            self.run_len,
            self.cl_qs,
            self.nch,
            self.cf_cs,
        )

    def int_params(self) -> tuple[int, int]:
        """The two ``int`` kernel parameters after :meth:`params`: the tile
        sides (log2) on the tiled path, the box's first channel on the pixel
        path, log2 of the channel groups per block on the micro-tile path
        (held in ``log_tc``)."""
        if self.path == "pixel":
            return (self.c0, 0)
        return (self.log_tc, self.log_tq)


def plan_box_copy(
    shape: Sequence[int],
    offsets: Sequence[int],
    sizes: Sequence[int],
    itemsize: int,
    *,
    grid_limit: tuple[int, int, int] = MAX_GRID,
    path: str | None = None,
) -> BoxCopyPlan:
    """Plan the copy of a box between a dense channels-last tensor and a
    C-contiguous logical-order block.

    Parameters
    ----------
    shape : sequence of int
        Logical shape of the channels-last tensor, 4-D or 5-D.
    offsets, sizes : sequence of int
        The box, in logical coordinates (already validated).
    itemsize : int
        Element size in bytes: 1, 2, 4 or 8.
    grid_limit : tuple of int, optional
        Largest grid to launch; the kernels loop over the rest.  Tests lower
        it to exercise those loops.
    path : str, optional
        ``"tiled"``, ``"pixel"`` or ``"micro"``; :func:`choose_path` decides
        when omitted.  Tests force one to run boxes through every path that
        accepts them.

    Returns
    -------
    BoxCopyPlan
        Everything a launch needs.
    """
    _check_ndim(shape, "shape")
    if itemsize not in SUPPORTED_ITEMSIZES:
        raise TypeError(f"element size {itemsize} is not one of {SUPPORTED_ITEMSIZES}")
    if path is None:
        path = choose_path(shape, sizes, itemsize, offsets)
    elif path not in PATHS:
        raise ValueError(f"kernel path {path!r} is not one of {PATHS}")
    elif path == "pixel" and not 1 <= shape[1] <= PIXEL_MAX_CHANNELS:
        raise ValueError(
            f"the pixel path serves 1 to {PIXEL_MAX_CHANNELS} channels; shape {tuple(shape)} has {shape[1]}"
        )
    elif path == "micro" and any(
        v * itemsize % MICRO_GROUP_BYTES for v in (int(shape[1]), int(offsets[1]), int(sizes[1]))
    ):
        raise ValueError(
            f"the micro-tile path needs whole {MICRO_GROUP_BYTES}-byte groups of channels; shape "
            f"{tuple(shape)} with box channels [{offsets[1]}, {offsets[1] + sizes[1]}) of {itemsize}-byte "
            "elements has none"
        )
    ndim = len(shape)
    # Canonical element strides: a size-1 dimension is only ever indexed at 0,
    # so its real stride does not matter and the canonical one can be used.
    cl_st = [s // itemsize for s in channels_last_strides(shape, itemsize)]
    cf_st = [_prod(sizes[d + 1 :]) for d in range(ndim)]

    # Merge the innermost spatial dimensions into one run as long as the box
    # covers the inner ones whole: the run is then evenly strided on both
    # sides (by C in channels-last memory, by 1 in the logical block).
    first_run_dim = ndim - 1
    while first_run_dim > 2 and offsets[first_run_dim] == 0 and sizes[first_run_dim] == shape[first_run_dim]:
        first_run_dim -= 1
    run_len = _prod(sizes[first_run_dim:])
    line_dims = [0, *range(2, first_run_dim)]
    line_dims = [None] * (3 - len(line_dims)) + line_dims  # pad to three
    line_sizes = [1 if d is None else int(sizes[d]) for d in line_dims]
    # A line dimension of size 1 is only indexed at 0: stride 0, which keeps
    # it out of the kernels' alignment checks.
    cl_lines = tuple(0 if d is None or sizes[d] == 1 else cl_st[d] for d in line_dims)
    cf_lines = tuple(0 if d is None or sizes[d] == 1 else cf_st[d] for d in line_dims)
    nch = int(sizes[1])
    nlines = _prod(line_sizes)

    if path == "pixel":
        # cl_base points at channel 0 of the first pixel; the kernel reads
        # whole pixels and picks channels [c0, c0 + nch) itself.
        cl_base = sum(int(o) * s for d, (o, s) in enumerate(zip(offsets, cl_st, strict=True)) if d != 1)
        span = THREADS_PER_BLOCK * pixel_positions_per_thread(int(shape[1]), itemsize)
        work = (-(-run_len // span), nlines, 1)
        log_tc = log_tq = 0
        c0 = int(offsets[1])
    elif path == "micro":
        # cl_base includes the first channel (16-byte aligned); the kernel
        # gets log2 of the channel groups per block in the first int.
        cl_base = sum(int(o) * s for o, s in zip(offsets, cl_st, strict=True))
        log_cgs = micro_groups_log2(nch, itemsize)
        span = (THREADS_PER_BLOCK >> log_cgs) * micro_positions_per_thread(itemsize)
        ngroups = nch * itemsize // MICRO_GROUP_BYTES
        work = (-(-run_len // span), -(-ngroups >> log_cgs), nlines)
        log_tc, log_tq = log_cgs, 0
        c0 = 0
    else:
        cl_base = sum(int(o) * s for o, s in zip(offsets, cl_st, strict=True))
        tile = TILE_ELEMS[itemsize]
        tc0 = min(TILE_MAX_CHANNELS[itemsize], _next_pow2(nch))
        tq = min(_next_pow2(run_len), tile // tc0)
        tc = min(_next_pow2(nch), tile // tq)
        log_tq, log_tc = tq.bit_length() - 1, tc.bit_length() - 1
        work = (-(-run_len // tq), -(-nch // tc), nlines)
        c0 = 0
    grid = tuple(max(1, min(t, g)) for t, g in zip(work, grid_limit, strict=True))
    return BoxCopyPlan(
        itemsize=itemsize,
        cl_base=cl_base,
        nlines=nlines,
        l1=max(1, line_sizes[1]),
        l2=max(1, line_sizes[2]),
        cl_line_strides=(cl_lines[0], cl_lines[1], cl_lines[2]),
        cf_line_strides=(cf_lines[0], cf_lines[1], cf_lines[2]),
        run_len=run_len,
        cl_qs=cl_st[ndim - 1],
        nch=nch,
        cf_cs=cf_st[1],
        log_tc=log_tc,
        log_tq=log_tq,
        grid=(grid[0], grid[1], grid[2]),
        path=path,
        c0=c0,
    )


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
