"""The unchanged CUDA source, run on the CPU through the emulation header and
compared with NumPy: every element size, both directions, both kernel paths
(tiled, pixel), many shapes and boxes, aligned and misaligned buffers, three
thread orders.  Broken variants prove the harness catches bugs."""

from __future__ import annotations

import kernel_emu
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuckpt.device import kernels as K

ORDERS = ("forward", "reverse", "random")
ITEMSIZES = K.SUPPORTED_ITEMSIZES

# Odd sizes, size-1 dimensions, few and many channels, 4-D and 5-D, runs
# longer than one tile, several lines.
SHAPES = [
    (1, 1, 1, 1),
    (2, 3, 5, 7),
    (3, 3, 17, 31),
    (1, 4, 1, 1),
    (2, 1, 9, 13),
    (1, 33, 1, 65),
    (2, 64, 9, 9),
    (1, 130, 7, 5),
    (1, 2048, 3, 5),
    (1, 5, 67, 67),
    (2, 3, 4, 5, 6),
    (1, 17, 3, 1, 7),
    (2, 40, 2, 9, 11),
    # interior tiles (the unchecked path), with 32-bit words on both sides,
    # on one side only, or none (odd channel count, odd run), beside edge tiles
    (2, 64, 8, 16),
    (1, 66, 16, 9),
    (1, 65, 8, 16),
    (1, 65, 9, 15),
    (1, 128, 5, 27),
    (1, 64, 4, 8, 8),
]


def _ids(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


@pytest.mark.parametrize("to_cl", [False, True], ids=["to_contiguous", "to_channels_last"])
@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_whole_tensor(
    emu_lib: kernel_emu.EmuLibrary, shape: tuple[int, ...], itemsize: int, to_cl: bool
) -> None:
    for seed, order in enumerate(ORDERS):
        kernel_emu.check_case(emu_lib, shape, itemsize, None, to_channels_last=to_cl, order=order, seed=seed)
    if K.choose_path(shape, shape, itemsize) == "micro":
        # the tiled path serves these shapes too (interior tiles, words)
        kernel_emu.check_case(
            emu_lib, shape, itemsize, None, to_channels_last=to_cl, order="random", path="tiled"
        )


@pytest.mark.parametrize("to_cl", [False, True], ids=["to_contiguous", "to_channels_last"])
@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_tiled_path_serves_few_channels(emu_lib: kernel_emu.EmuLibrary, itemsize: int, to_cl: bool) -> None:
    # The chooser sends 1 to 8 channels to the pixel path, but the tiled path
    # is correct for them too (narrow tiles, every tile an edge tile).
    cases = [
        ((2, 3, 17, 31), None),
        ((1, 4, 1, 1), None),
        ((2, 1, 9, 13), None),
        ((2, 3, 4, 5, 6), None),
        ((2, 6, 5, 7), ((1, 1, 2, 3), (1, 4, 3, 4))),
        ((2, 5, 4, 6, 8), ((0, 0, 1, 0, 0), (2, 5, 2, 6, 8))),
    ]
    for seed, (shape, box) in enumerate(cases):
        kernel_emu.check_case(
            emu_lib,
            shape,
            itemsize,
            box,
            to_channels_last=to_cl,
            order=ORDERS[seed % 3],
            seed=seed,
            path="tiled",
        )


# ---- the pixel path: every channel count, odd sizes, every alignment ----------

# Runs shorter than a thread's slots, a block's span and longer (a block spans
# 256 * 16 / itemsize positions, four and two times that for C = 1 and 2),
# odd sizes, several lines, 4-D and 5-D.
PIXEL_SPATIAL = [(1, 1), (3, 5), (7, 9), (16, 16), (31, 33), (64, 67), (2, 3, 5), (5, 8, 13)]


@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("channels", range(1, K.PIXEL_MAX_CHANNELS + 1))
def test_pixel_sweep(emu_lib: kernel_emu.EmuLibrary, channels: int, itemsize: int) -> None:
    # misalign 0: 16-byte units where the plane size allows; 1 and 2 elements
    # off a 64-byte boundary: the narrower units and the element-wise path.
    for i, spatial in enumerate(PIXEL_SPATIAL):
        shape = (1 + i % 3, channels, *spatial)
        assert K.choose_path(shape, shape, itemsize) == "pixel"
        for to_cl in (False, True):
            for misalign in (0, 1, 2):
                order = ORDERS[(i + misalign) % 3]
                kernel_emu.check_case(
                    emu_lib,
                    shape,
                    itemsize,
                    None,
                    to_channels_last=to_cl,
                    order=order,
                    seed=i,
                    misalign=misalign,
                )


@pytest.mark.parametrize("to_cl", [False, True], ids=["to_contiguous", "to_channels_last"])
@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_pixel_long_runs_all_orders(emu_lib: kernel_emu.EmuLibrary, itemsize: int, to_cl: bool) -> None:
    # Several blocks per line (W = 16 for the aligned plane, 4 for the other
    # when the element size allows), their last thread partly past the end.
    for shape in [(2, 3, 70, 66), (1, 4, 45, 91), (1, 1, 129, 130)]:
        for seed, order in enumerate(ORDERS):
            for misalign in (0, 1):
                kernel_emu.check_case(
                    emu_lib,
                    shape,
                    itemsize,
                    None,
                    to_channels_last=to_cl,
                    order=order,
                    seed=seed,
                    misalign=misalign,
                )


# ---- the micro-tile path: many channels in 16-byte groups ----------------------


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_micro_sweep(emu_lib: kernel_emu.EmuLibrary, itemsize: int) -> None:
    # Channel counts of 1 to 40 groups (one group is 16 bytes), planes
    # 16-byte aligned (16-byte units), 4-byte aligned (the narrower unit)
    # and odd (forced: element by element), buffers aligned or 16 bytes off
    # (still 16-byte units) or one element off (element by element).
    group = 16 // itemsize
    cases = [
        (1, 9 * group, 16, 16),
        (2, 2 * group, 33, 35),
        (1, 4 * group, 5, 12),
        (3, group * 3, 7, 1, 8),
        (1, 40 * group, 3, 5),
        (2, 5 * group, 2, 3, 13),
    ]
    for i, shape in enumerate(cases):
        if shape[1] <= K.PIXEL_MAX_CHANNELS:
            continue  # the pixel path's
        for to_cl in (False, True):
            for misalign in (0, group, 1):
                kernel_emu.check_case(
                    emu_lib,
                    shape,
                    itemsize,
                    None,
                    to_channels_last=to_cl,
                    order=ORDERS[(i + misalign) % 3],
                    seed=i,
                    misalign=misalign,
                    path="micro",
                )


@pytest.mark.parametrize("itemsize", ITEMSIZES)
def test_micro_boxes(emu_lib: kernel_emu.EmuLibrary, itemsize: int) -> None:
    # Channel slabs on group boundaries, partial rows and columns, 5-D slabs.
    g = 16 // itemsize
    boxes = [
        ((2, 4 * g, 9, 20), ((0, g, 0, 0), (2, 2 * g, 9, 20))),
        ((2, 4 * g, 9, 20), ((1, 0, 2, 3), (1, 4 * g, 5, 16))),
        ((1, 3 * g, 4, 6, 8), ((0, g, 1, 0, 0), (1, g, 2, 6, 8))),
        ((2, 2 * g, 4, 6, 8), ((0, 0, 1, 2, 1), (2, 2 * g, 3, 3, 7))),
    ]
    for seed, (shape, box) in enumerate(boxes):
        if shape[1] <= K.PIXEL_MAX_CHANNELS:
            continue
        for to_cl in (False, True):
            kernel_emu.check_case(
                emu_lib,
                shape,
                itemsize,
                box,
                to_channels_last=to_cl,
                order=ORDERS[seed % 3],
                seed=seed,
                path="micro",
            )


BOXES = [
    ((2, 6, 5, 7), ((1, 1, 2, 3), (1, 4, 3, 4))),  # partial everywhere
    ((2, 6, 5, 7), ((0, 0, 2, 0), (2, 6, 3, 7))),  # rows of whole width merge
    ((3, 70, 6, 40), ((1, 5, 1, 0), (2, 60, 4, 40))),
    ((1, 300, 4, 4), ((0, 37, 0, 0), (1, 200, 4, 4))),  # channel slab
    ((2, 5, 4, 6, 8), ((1, 1, 1, 2, 3), (1, 3, 2, 3, 4))),
    ((2, 5, 4, 6, 8), ((0, 0, 1, 0, 0), (2, 5, 2, 6, 8))),  # D slab, H*W merged
    ((2, 5, 4, 6, 8), ((0, 0, 0, 2, 0), (2, 5, 4, 3, 8))),  # H slab, W merged
    ((2, 9, 4, 6, 8), ((0, 0, 0, 0, 7), (2, 9, 4, 6, 1))),  # a single W column
    ((2, 6, 5, 7), ((1, 2, 3, 4), (0, 2, 1, 1))),  # empty box
    ((1, 300, 16, 16), ((0, 37, 0, 0), (1, 256, 16, 16))),  # interior tiles, odd channel offset
    ((1, 300, 16, 16), ((0, 36, 0, 0), (1, 256, 16, 16))),  # interior tiles, even offset
    ((2, 70, 12, 16), ((1, 2, 3, 0), (1, 66, 8, 16))),  # interior tiles inside a box
    # few channels (the pixel path): channel slabs, single channels, partial
    # rows and columns, 5-D slabs, boxes whose planes are misaligned
    ((2, 3, 40, 40), ((0, 1, 0, 0), (2, 2, 40, 40))),
    ((1, 8, 24, 24), ((0, 5, 0, 0), (1, 1, 24, 24))),
    ((2, 4, 33, 35), ((1, 0, 2, 0), (1, 4, 30, 35))),
    ((2, 4, 33, 35), ((0, 0, 3, 5), (2, 4, 20, 17))),
    ((1, 3, 6, 20, 24), ((0, 0, 2, 0, 0), (1, 3, 3, 20, 24))),
    ((1, 6, 6, 20, 24), ((0, 2, 1, 4, 0), (1, 3, 4, 15, 24))),
    ((2, 2, 64, 64), ((0, 0, 1, 0), (2, 2, 63, 64))),
]


@pytest.mark.parametrize("to_cl", [False, True], ids=["to_contiguous", "to_channels_last"])
@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("shape,box", BOXES, ids=[f"{_ids(s)}-{i}" for i, (s, _) in enumerate(BOXES)])
def test_boxes(
    emu_lib: kernel_emu.EmuLibrary, shape: tuple[int, ...], box: tuple, itemsize: int, to_cl: bool
) -> None:
    for seed, order in enumerate(ORDERS):
        kernel_emu.check_case(emu_lib, shape, itemsize, box, to_channels_last=to_cl, order=order, seed=seed)
    if K.choose_path(shape, box[1], itemsize, box[0]) == "micro":
        kernel_emu.check_case(
            emu_lib, shape, itemsize, box, to_channels_last=to_cl, order="random", path="tiled"
        )


@pytest.mark.parametrize("grid_limit", [(1, 1, 1), (2, 1, 3), (3, 2, 1)])
@pytest.mark.parametrize("to_cl", [False, True], ids=["to_contiguous", "to_channels_last"])
@pytest.mark.parametrize(
    "shape,box",
    [
        ((3, 80, 4, 3, 45), ((0, 1, 1, 0, 0), (3, 70, 2, 2, 45))),
        ((3, 130, 2, 8, 16), ((0, 0, 0, 0, 0), (3, 130, 2, 8, 16))),  # interior and edge tiles
        ((3, 3, 100, 99), ((0, 0, 0, 0), (3, 3, 100, 99))),  # pixel path: blocks along the run, lines
        ((2, 1040, 2, 5, 29), ((0, 16, 0, 0, 0), (2, 1024, 2, 5, 29))),  # micro-tile path, channel tiles
    ],
    ids=["edge-tiles", "interior-tiles", "pixel", "micro"],
)
def test_grid_stride_loops(
    emu_lib: kernel_emu.EmuLibrary, grid_limit: tuple[int, int, int], to_cl: bool, shape: tuple, box: tuple
) -> None:
    # A grid smaller than the work: each block loops over several tiles (or
    # spans of the run) in every grid dimension the path uses.
    for itemsize in ITEMSIZES:
        plan = K.plan_box_copy(shape, *box, itemsize)
        assert sum(t > 1 for t in plan.tiles) >= 2, plan.tiles
        for order in ORDERS:
            kernel_emu.check_case(
                emu_lib,
                shape,
                itemsize,
                box,
                to_channels_last=to_cl,
                order=order,
                grid_limit=grid_limit,
            )


box_cases = st.integers(4, 5).flatmap(
    lambda ndim: st.tuples(st.integers(1, 3), st.integers(1, 70), *[st.integers(1, 9)] * (ndim - 2)).flatmap(
        lambda shape: st.tuples(
            st.just(shape),
            st.tuples(*[st.integers(0, n - 1) for n in shape]).flatmap(
                lambda offs: st.tuples(
                    st.just(offs),
                    st.tuples(*[st.integers(1, n - o) for n, o in zip(shape, offs, strict=True)]),
                )
            ),
        )
    )
)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    case=box_cases,
    itemsize=st.sampled_from(ITEMSIZES),
    to_cl=st.booleans(),
    order=st.sampled_from(ORDERS),
    grid_limit=st.sampled_from([K.MAX_GRID, (1, 1, 1), (2, 2, 2)]),
)
def test_random_boxes(
    emu_lib: kernel_emu.EmuLibrary, case: tuple, itemsize: int, to_cl: bool, order: str, grid_limit: tuple
) -> None:
    shape, box = case
    kernel_emu.check_case(
        emu_lib,
        shape,
        itemsize,
        box,
        to_channels_last=to_cl,
        order=order,
        seed=len(shape),
        grid_limit=grid_limit,
    )


pixel_box_cases = st.integers(4, 5).flatmap(
    lambda ndim: st.tuples(
        st.integers(1, 3), st.integers(1, K.PIXEL_MAX_CHANNELS), *[st.integers(1, 40)] * (ndim - 2)
    ).flatmap(
        lambda shape: st.tuples(
            st.just(shape),
            st.tuples(*[st.integers(0, n - 1) for n in shape]).flatmap(
                lambda offs: st.tuples(
                    st.just(offs),
                    st.tuples(*[st.integers(1, n - o) for n, o in zip(shape, offs, strict=True)]),
                )
            ),
        )
    )
)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    case=pixel_box_cases,
    itemsize=st.sampled_from(ITEMSIZES),
    to_cl=st.booleans(),
    order=st.sampled_from(ORDERS),
    misalign=st.integers(0, 3),
    grid_limit=st.sampled_from([K.MAX_GRID, (1, 1, 1), (2, 2, 1)]),
)
def test_random_pixel_boxes(
    emu_lib: kernel_emu.EmuLibrary,
    case: tuple,
    itemsize: int,
    to_cl: bool,
    order: str,
    misalign: int,
    grid_limit: tuple,
) -> None:
    shape, box = case
    kernel_emu.check_case(
        emu_lib,
        shape,
        itemsize,
        box,
        to_channels_last=to_cl,
        order=order,
        seed=len(shape),
        grid_limit=grid_limit,
        misalign=misalign,
    )


@pytest.mark.parametrize("path", K.PATHS)
def test_outside_box_untouched(emu_lib: kernel_emu.EmuLibrary, path: str) -> None:
    # Scatter into a box: every element outside it keeps its value (the
    # micro-tile path needs whole groups of four 4-byte channels).
    channels, c0, nch = (24, 4, 8) if path == "micro" else (6, 1, 4)
    dst = kernel_emu.random_channels_last((2, channels, 5, 7), 4, 1)
    block = np.zeros((1, nch, 3, 4), np.uint32)
    out = kernel_emu.emu_to_channels_last(
        emu_lib, block, dst, ((1, c0, 2, 3), (1, nch, 3, 4)), order="random", path=path
    )
    mask = np.ones(dst.shape, bool)
    mask[1:2, c0 : c0 + nch, 2:5, 3:7] = False
    assert np.array_equal(out[mask], dst[mask])
    assert not out[~mask].any()


# ---- the harness catches bugs --------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("to_cl", [False, True], ids=["to_contiguous", "to_channels_last"])
def test_missing_syncthreads_is_caught(emu_builds, order: str, to_cl: bool) -> None:
    lib = emu_builds.library(kernel_emu.BROKEN_SYNC)
    with pytest.raises(AssertionError, match="mismatch"):
        kernel_emu.check_case(
            lib, (2, 64, 8, 8), 4, None, to_channels_last=to_cl, order=order, seed=5, path="tiled"
        )


def test_barrier_divergence_is_caught(emu_builds, capfd: pytest.CaptureFixture[str]) -> None:
    lib = emu_builds.library(kernel_emu.BROKEN_DIVERGENCE)
    with pytest.raises(kernel_emu.EmuError) as info:
        kernel_emu.check_case(lib, (1, 16, 4, 4), 2, None, to_channels_last=False, path="tiled")
    assert info.value.status == kernel_emu.EMU_BARRIER_DIVERGENCE
    assert "barrier divergence" in capfd.readouterr().err


@pytest.mark.parametrize("path", K.PATHS)
def test_out_of_bounds_write_is_caught(emu_lib: kernel_emu.EmuLibrary, path: str) -> None:
    # The guard check itself: a plan whose run is longer than the buffer
    # makes the (correct) kernel write past the end, which must be noticed.
    src = np.arange(256 + 64, dtype=np.uint32)  # room for the over-long read
    plan = K.plan_box_copy((1, 4, 8, 8), (0,) * 4, (1, 4, 8, 8), 4, path=path)
    bad = K.BoxCopyPlan(**{**plan.__dict__, "run_len": plan.run_len + 3})
    whole, inner = kernel_emu._guarded(256, np.uint32, 7)
    assert emu_lib.launch(bad, False, src.ctypes.data, inner.ctypes.data) == 0
    with pytest.raises(AssertionError, match="outside the destination"):
        kernel_emu._check_guards(whole, 7)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("to_cl", [False, True], ids=["to_contiguous", "to_channels_last"])
def test_colliding_pixel_slots_are_caught(emu_builds, order: str, to_cl: bool) -> None:
    # Pairs of threads own the same slots (and half the slots nobody): a
    # mismatch in every thread order.
    lib = emu_builds.library(kernel_emu.BROKEN_PX_SLOTS)
    with pytest.raises(AssertionError, match="mismatch"):
        kernel_emu.check_case(lib, (2, 3, 40, 40), 4, None, to_channels_last=to_cl, order=order, seed=3)
    with pytest.raises(AssertionError, match="mismatch"):  # the micro-tile path
        kernel_emu.check_case(lib, (2, 64, 40, 40), 4, None, to_channels_last=to_cl, order=order, seed=3)


def test_partial_builds_hold_only_their_kernels(emu_builds) -> None:
    # GK_BUILD_*: the tiled-only build has no pixel or micro-tile kernel, the
    # pixel-only build of 4-byte elements no tiled kernel and no other
    # element size (it keeps the micro-tile kernels).
    tiled_only = emu_builds.library(kernel_emu.BROKEN_SYNC)
    pixel_only = emu_builds.library(kernel_emu.BROKEN_PX_SLOTS)
    src = np.zeros(4096, np.uint64)
    dst = np.zeros(4096, np.uint64)
    pixel = K.plan_box_copy((1, 3, 8, 8), (0,) * 4, (1, 3, 8, 8), 4)
    pixel8 = K.plan_box_copy((1, 3, 8, 8), (0,) * 4, (1, 3, 8, 8), 8)
    args = (src.ctypes.data, dst.ctypes.data)
    micro = K.plan_box_copy((1, 16, 8, 8), (0,) * 4, (1, 16, 8, 8), 4)
    tiled = K.plan_box_copy((1, 16, 8, 8), (0,) * 4, (1, 16, 8, 8), 4, path="tiled")
    assert micro.path == "micro"
    assert tiled_only.launch(pixel, False, *args) == kernel_emu.EMU_UNKNOWN_KERNEL
    assert tiled_only.launch(micro, False, *args) == kernel_emu.EMU_UNKNOWN_KERNEL
    assert pixel_only.launch(micro, False, *args) == kernel_emu.EMU_OK
    assert pixel_only.launch(tiled, False, *args) == kernel_emu.EMU_UNKNOWN_KERNEL
    assert pixel_only.launch(pixel8, False, *args) == kernel_emu.EMU_UNKNOWN_KERNEL
    assert tiled_only.launch(tiled, False, *args) == kernel_emu.EMU_OK


def test_the_shipped_source_holds_no_broken_variant_and_every_mutant_applies() -> None:
    from mutants import MUTANTS, clean_source, mutated_source

    source = clean_source()
    assert "GPUCKPT_BREAK" not in source and "broken" not in source.lower()
    for name in MUTANTS:
        assert mutated_source([name]) != source, name  # each replacement found exactly as often as expected
