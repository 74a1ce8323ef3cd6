"""The unchanged CUDA source, run on the CPU through the emulation header and
compared with NumPy: every element size, both directions, many shapes and
boxes, three thread orders.  Broken variants prove the harness catches bugs."""

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
]


@pytest.mark.parametrize("to_cl", [False, True], ids=["to_contiguous", "to_channels_last"])
@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("shape,box", BOXES, ids=[f"{_ids(s)}-{i}" for i, (s, _) in enumerate(BOXES)])
def test_boxes(
    emu_lib: kernel_emu.EmuLibrary, shape: tuple[int, ...], box: tuple, itemsize: int, to_cl: bool
) -> None:
    for seed, order in enumerate(ORDERS):
        kernel_emu.check_case(emu_lib, shape, itemsize, box, to_channels_last=to_cl, order=order, seed=seed)


@pytest.mark.parametrize("grid_limit", [(1, 1, 1), (2, 1, 3), (3, 2, 1)])
@pytest.mark.parametrize("to_cl", [False, True], ids=["to_contiguous", "to_channels_last"])
@pytest.mark.parametrize(
    "shape,box",
    [
        ((3, 80, 4, 3, 45), ((0, 1, 1, 0, 0), (3, 70, 2, 2, 45))),
        ((3, 130, 2, 8, 16), ((0, 0, 0, 0, 0), (3, 130, 2, 8, 16))),  # interior and edge tiles
    ],
    ids=["edge-tiles", "interior-tiles"],
)
def test_grid_stride_loops(
    emu_lib: kernel_emu.EmuLibrary, grid_limit: tuple[int, int, int], to_cl: bool, shape: tuple, box: tuple
) -> None:
    # A grid smaller than the tile count: each block loops over several tiles
    # in all three dimensions.
    for itemsize in ITEMSIZES:
        plan = K.plan_box_copy(shape, *box, itemsize)
        assert plan.tiles[1] > 1 and plan.tiles[2] > 1
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


def test_outside_box_untouched(emu_lib: kernel_emu.EmuLibrary) -> None:
    # Scatter into a box: every element outside it keeps its value.
    dst = kernel_emu.random_channels_last((2, 6, 5, 7), 4, 1)
    block = np.zeros((1, 4, 3, 4), np.uint32)
    out = kernel_emu.emu_to_channels_last(emu_lib, block, dst, ((1, 1, 2, 3), (1, 4, 3, 4)), order="random")
    mask = np.ones(dst.shape, bool)
    mask[1:2, 1:5, 2:5, 3:7] = False
    assert np.array_equal(out[mask], dst[mask])
    assert not out[~mask].any()


# ---- the harness catches bugs --------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("to_cl", [False, True], ids=["to_contiguous", "to_channels_last"])
def test_missing_syncthreads_is_caught(emu_builds, order: str, to_cl: bool) -> None:
    lib = emu_builds.library(kernel_emu.BROKEN_SYNC)
    with pytest.raises(AssertionError, match="mismatch"):
        kernel_emu.check_case(lib, (2, 64, 8, 8), 4, None, to_channels_last=to_cl, order=order, seed=5)


def test_barrier_divergence_is_caught(emu_builds, capfd: pytest.CaptureFixture[str]) -> None:
    lib = emu_builds.library(kernel_emu.BROKEN_DIVERGENCE)
    with pytest.raises(kernel_emu.EmuError) as info:
        kernel_emu.check_case(lib, (1, 8, 4, 4), 2, None, to_channels_last=False)
    assert info.value.status == kernel_emu.EMU_BARRIER_DIVERGENCE
    assert "barrier divergence" in capfd.readouterr().err


def test_out_of_bounds_write_is_caught(emu_lib: kernel_emu.EmuLibrary) -> None:
    # The guard check itself: a plan whose run is longer than the buffer
    # makes the (correct) kernel write past the end, which must be noticed.
    src = np.arange(256 + 64, dtype=np.uint32)  # room for the over-long read
    plan = K.plan_box_copy((1, 4, 8, 8), (0,) * 4, (1, 4, 8, 8), 4)
    bad = K.BoxCopyPlan(**{**plan.__dict__, "run_len": plan.run_len + 3})
    whole, inner = kernel_emu._guarded(256, np.uint32, 7)
    assert emu_lib.launch(bad, False, src.ctypes.data, inner.ctypes.data) == 0
    with pytest.raises(AssertionError, match="outside the destination"):
        kernel_emu._check_guards(whole, 7)
