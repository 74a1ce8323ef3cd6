"""Launch planning of the channels-last kernels: which path, which grid, which parameters.

Pure Python. :func:`choose_path` picks a kernel path by shape (pixel, micro-tile
or tiled); :func:`plan_box_copy` turns a box into a :class:`BoxCopyPlan`, the
parameters one launch needs. The CPU-emulation tests run the very same plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuckpt.device.kernel_checks import SUPPORTED_ITEMSIZES, _check_ndim, channels_last_strides

__all__ = [
    "MAX_GRID",
    "MICRO_GROUP_BYTES",
    "PATHS",
    "PIXEL_MAX_CHANNELS",
    "THREADS_PER_BLOCK",
    "TILE_ELEMS",
    "TILE_MAX_CHANNELS",
    "BoxCopyPlan",
    "choose_path",
    "micro_groups_log2",
    "micro_positions_per_thread",
    "pixel_positions_per_thread",
    "plan_box_copy",
]

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

#: Largest channel count of the pixel path (``gpuckpt_px_*`` kernels).
PIXEL_MAX_CHANNELS = 8

#: The kernel paths (see :func:`choose_path`).
PATHS = ("tiled", "pixel", "micro")

#: Bytes of channels one micro-tile spans (``16 / itemsize`` channels).
MICRO_GROUP_BYTES = 16


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
    largest power of two up to 16 and up to the box's groups.

    Not 32: on an H200 (2026-12-04) every row with 32 groups per block copied
    to logical order at 22-26% of a device-to-device copy (C = 64 float64;
    C = 256 with 2-, 4- and 8-byte elements) while every row with 16 reached
    80-89%, and both moved 82-93% to channels-last."""
    groups = max(1, nch * itemsize // MICRO_GROUP_BYTES)
    return min(4, groups.bit_length() - 1)


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
