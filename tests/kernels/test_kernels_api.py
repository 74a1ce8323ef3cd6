"""Pure-Python parts of the kernel module: validation, planning, references."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuckpt.device import _kernel_ref as ref
from gpuckpt.device import kernels as K

REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- source location -------------------------------------------------------


def test_source_dir_in_checkout() -> None:
    folder = K.kernel_source_dir()
    assert (folder / K.KERNEL_FILE).is_file()
    assert "__global__" in K.kernel_source()


def test_source_dir_in_installed_layout(tmp_path: Path) -> None:
    # A wheel ships kernels/ as gpuckpt/_kernels/; the loader must look there.
    pkg = tmp_path / "site" / "gpuckpt"
    (pkg / "device").mkdir(parents=True)
    # the module that locates the source (kernels.py re-exports it) sits in device/
    source_module = Path(sys.modules[K.kernel_source_dir.__module__].__file__ or "")
    assert source_module.parent == Path(K.__file__).parent
    shutil.copy(source_module, pkg / "device" / source_module.name)
    shutil.copytree(K.kernel_source_dir(), pkg / "_kernels")
    spec = importlib.util.spec_from_file_location("installed_kernels", pkg / "device" / source_module.name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        assert module.kernel_source_dir() == (pkg / "_kernels").resolve()
    finally:
        del sys.modules[spec.name]


def test_source_includes_nothing() -> None:
    # NVRTC compiles without standard headers; the emulation header supplies
    # everything the CPU build needs.
    assert not re.search(r"^\s*#\s*include", K.kernel_source(), re.MULTILINE)


def test_tile_sizes_match_source() -> None:
    found = {
        int(es): int(tile)
        for es, tile in re.findall(r"^GK_DEFINE\((\d+),[^,]+,\s*(\d+)\)", K.kernel_source(), re.MULTILINE)
    }
    assert found == K.TILE_ELEMS
    threads = re.search(r"#define GK_THREADS (\d+)", K.kernel_source())
    assert threads and int(threads.group(1)) == K.THREADS_PER_BLOCK


def test_import_does_not_import_cupy() -> None:
    code = "import sys, gpuckpt.device.kernels, gpuckpt.device._kernel_ref; assert 'cupy' not in sys.modules"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ---- validation --------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [
        np.uint8,
        np.int16,
        np.float16,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        np.float32,
        np.int64,
        np.complex64,
        np.bool_,
    ],
)
def test_itemsize_accepted(dtype: type) -> None:
    assert K.check_itemsize(dtype) == np.dtype(dtype).itemsize


@pytest.mark.parametrize("dtype", [np.complex128, "V3", "S16", object])
def test_itemsize_rejected(dtype: object) -> None:
    with pytest.raises(TypeError, match=r"element size|object"):
        K.check_itemsize(dtype)


def test_channels_last_strides() -> None:
    assert K.channels_last_strides((2, 3, 4, 5), 4) == (240, 4, 60, 12)
    assert K.channels_last_strides((2, 3, 4, 5, 6), 2) == (720, 2, 180, 36, 6)
    a = ref.empty_channels_last((2, 3, 4, 5), np.float32)
    assert a.strides == K.channels_last_strides(a.shape, 4)


def test_check_channels_last_messages() -> None:
    a = np.zeros((2, 3, 4, 5), np.float32)  # NCHW, not channels-last
    with pytest.raises(
        ValueError, match=r"strides \(240, 80, 20, 4\).*\(2, 3, 4, 5\).*expected \(240, 4, 60, 12\)"
    ):
        K.check_channels_last(a.shape, a.strides, 4, name="src")
    with pytest.raises(ValueError, match="3 dimensions"):
        K.check_channels_last((2, 3, 4), (48, 16, 4), 4)


def test_size_one_dims_ignore_strides() -> None:
    # C == 1: NCHW and NHWC are the same memory.
    a = np.zeros((2, 1, 4, 5), np.float32)
    assert K.is_channels_last(a.shape, a.strides, 4)
    # H == W == 1 with any C.
    b = np.zeros((3, 7, 1, 1), np.float32)
    assert K.is_channels_last(b.shape, b.strides, 4)
    c = np.zeros((3, 7, 2, 1), np.float32)
    assert not K.is_channels_last(c.shape, c.strides, 4)


def test_non_dense_rejected() -> None:
    big = ref.empty_channels_last((2, 8, 6, 6), np.float32)
    with pytest.raises(ValueError, match="not dense channels_last"):
        K.check_channels_last(big[:, :4].shape, big[:, :4].strides, 4)
    big3 = ref.empty_channels_last((2, 8, 4, 6, 6), np.float32)
    view = big3[:, :, :, ::2]
    with pytest.raises(ValueError, match="channels_last_3d"):
        K.check_channels_last(view.shape, view.strides, 4)


def test_normalize_box_forms() -> None:
    shape = (2, 3, 10, 12)
    assert K.normalize_box(None, shape) == ((0, 0, 0, 0), shape)
    assert K.normalize_box((slice(None), slice(1, 3), slice(2, 7), slice(None, 5)), shape) == (
        (0, 1, 2, 0),
        (2, 2, 5, 5),
    )
    assert K.normalize_box(((1, 0, 0, 0), (1, 3, 10, 12)), shape) == ((1, 0, 0, 0), (1, 3, 10, 12))
    with pytest.raises(ValueError, match="step"):
        K.normalize_box((slice(None), slice(None), slice(None, None, 2), slice(None)), shape)
    with pytest.raises(ValueError, match="leave shape"):
        K.normalize_box(((0, 0, 5, 0), (1, 3, 6, 12)), shape)
    with pytest.raises(ValueError, match="leave shape"):
        K.normalize_box(((-1, 0, 0, 0), (1, 3, 1, 12)), shape)
    with pytest.raises(ValueError, match="4 entries"):
        K.normalize_box(((0, 0, 0), (1, 1, 1)), shape)
    with pytest.raises(TypeError):
        K.normalize_box((1, 2, 3), shape)


# ---- planning ------------------------------------------------------------------


def _pad(tc: int, itemsize: int) -> int:
    # Same rule as the kernel's row padding.
    return (1 if itemsize >= 4 else 4 // itemsize) if tc * itemsize >= 8 else 0


box_cases = st.integers(4, 5).flatmap(
    lambda ndim: st.lists(st.integers(1, 3000), min_size=ndim, max_size=ndim).flatmap(
        lambda shape: st.tuples(
            st.just(tuple(shape)),
            st.tuples(*[st.integers(0, n - 1) for n in shape]).flatmap(
                lambda offs: st.tuples(
                    st.just(offs),
                    st.tuples(*[st.integers(0, n - o) for n, o in zip(shape, offs, strict=True)]),
                )
            ),
            st.sampled_from(K.SUPPORTED_ITEMSIZES),
        )
    )
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(box_cases)
def test_plan_invariants(case: tuple) -> None:
    shape, (offsets, sizes), itemsize = case
    plan = K.plan_box_copy(shape, offsets, sizes, itemsize, path="tiled")
    tc, tq = 1 << plan.log_tc, 1 << plan.log_tq
    tile = K.TILE_ELEMS[itemsize]
    assert tc * tq <= tile
    assert tq * (tc + _pad(tc, itemsize)) <= 2 * tile  # fits the __shared__ array
    assert all(1 <= g <= m for g, m in zip(plan.grid, K.MAX_GRID, strict=True))
    if not plan.empty:
        assert plan.nlines * plan.run_len * plan.nch == int(np.prod(sizes))
        assert plan.cf_cs * plan.nch * sizes[0] == int(np.prod(sizes))
        assert plan.cl_qs == shape[1]
    assert len(plan.params()) == 14


pixel_box_cases = st.integers(4, 5).flatmap(
    lambda ndim: st.tuples(
        st.integers(1, 3000), st.integers(1, K.PIXEL_MAX_CHANNELS), *[st.integers(1, 3000)] * (ndim - 2)
    ).flatmap(
        lambda shape: st.tuples(
            st.just(shape),
            st.tuples(*[st.integers(0, n - 1) for n in shape]).flatmap(
                lambda offs: st.tuples(
                    st.just(offs),
                    st.tuples(*[st.integers(0, n - o) for n, o in zip(shape, offs, strict=True)]),
                )
            ),
            st.sampled_from(K.SUPPORTED_ITEMSIZES),
        )
    )
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(pixel_box_cases)
def test_pixel_plan_invariants(case: tuple) -> None:
    shape, (offsets, sizes), itemsize = case
    plan = K.plan_box_copy(shape, offsets, sizes, itemsize)
    assert plan.path == "pixel" and plan.module_part == f"px{itemsize}"
    assert plan.kernel_name(True) == f"gpuckpt_px_cf_to_cl_{itemsize}_{shape[1]}"
    assert plan.int_params() == (offsets[1], 0) and plan.grid[2] == 1
    assert all(1 <= g <= m for g, m in zip(plan.grid, K.MAX_GRID, strict=True))
    span = K.THREADS_PER_BLOCK * K.pixel_positions_per_thread(shape[1], itemsize)
    if not plan.empty:
        assert plan.nlines * plan.run_len * plan.nch == int(np.prod(sizes))
        # the grid covers the run and the lines (capped: loops cover the rest)
        assert plan.tiles == (-(-plan.run_len // span), plan.nlines, 1)
        assert plan.grid[:2] == (min(plan.tiles[0], K.MAX_GRID[0]), min(plan.tiles[1], K.MAX_GRID[1]))
        # cl_base points at channel 0 of the first pixel of the box
        cl_strides = [s // itemsize for s in K.channels_last_strides(shape, itemsize)]
        first = sum(o * s for d, (o, s) in enumerate(zip(offsets, cl_strides, strict=True)) if d != 1)
        assert plan.cl_base == first and plan.cl_qs == shape[1]
    assert len(plan.params()) == 14


@pytest.mark.parametrize("itemsize", K.SUPPORTED_ITEMSIZES)
def test_choose_path_by_channel_count(itemsize: int) -> None:
    for channels in range(1, K.PIXEL_MAX_CHANNELS + 1):
        for shape in [(8, channels, 224, 224), (2, channels, 16, 112, 112), (1, channels, 1, 1)]:
            assert K.choose_path(shape, shape, itemsize) == "pixel"
            # boxes (chunks: a batch range, a channel slab, a row range) too
            box = (1, max(1, channels // 2), *shape[2:])
            assert K.choose_path(shape, box, itemsize) == "pixel"
    for channels in (9, 17, 33, 65):  # odd: never whole 16-byte groups of channels
        shape = (8, channels, 14, 14)
        assert K.choose_path(shape, shape, itemsize) == "tiled"
    assert K.choose_path((1, 0, 4, 4), (1, 0, 4, 4), itemsize) == "tiled"  # empty: either serves


@pytest.mark.parametrize("itemsize", K.SUPPORTED_ITEMSIZES)
def test_choose_micro_for_whole_channel_groups(itemsize: int) -> None:
    group = 16 // itemsize  # channels per 16 bytes
    for channels in (64, 256, 2048):
        shape = (8, channels, 28, 28)  # planes of 784 elements: 4-byte aligned
        assert K.choose_path(shape, shape, itemsize) == "micro"
        # channel slabs on group boundaries, or not
        slab = (8, 2 * group, 28, 28)
        assert K.choose_path(shape, slab, itemsize, (0, group, 0, 0)) == "micro"
        assert K.choose_path(shape, (8, group + 1, 28, 28), itemsize, (0, 0, 0, 0)) == "tiled"
        if group > 1:
            assert K.choose_path(shape, slab, itemsize, (0, 1, 0, 0)) == "tiled"
    # odd planes of 1- and 2-byte elements cannot take 4-byte units: tiled
    odd = (8, 64, 7, 7)
    assert K.choose_path(odd, odd, itemsize) == ("tiled" if itemsize < 4 else "micro")
    # the tensor's channel count must be whole groups too (pixel stride)
    if itemsize < 8:
        shape = (8, 16 + 16 // itemsize // 2, 4, 4)
        if shape[1] * itemsize % 16:
            assert K.choose_path(shape, shape, itemsize) == "tiled"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(box_cases)
def test_micro_plan_invariants(case: tuple) -> None:
    shape, (offsets, sizes), itemsize = case
    if K.choose_path(shape, sizes, itemsize, offsets) != "micro":
        return
    plan = K.plan_box_copy(shape, offsets, sizes, itemsize)
    assert plan.path == "micro" and plan.module_part == "micro"
    assert plan.kernel_name(False) == f"gpuckpt_mt_cl_to_cf_{itemsize}"
    groups = sizes[1] * itemsize // 16
    assert 1 << plan.log_tc <= min(16, groups) < 2 << plan.log_tc
    assert plan.int_params() == (plan.log_tc, 0)
    assert all(1 <= g <= m for g, m in zip(plan.grid, K.MAX_GRID, strict=True))
    if not plan.empty:
        assert plan.nlines * plan.run_len * plan.nch == int(np.prod(sizes))
        span = (K.THREADS_PER_BLOCK >> plan.log_tc) * K.micro_positions_per_thread(itemsize)
        assert plan.tiles == (-(-plan.run_len // span), -(-groups >> plan.log_tc), plan.nlines)
        assert plan.cl_base * itemsize % 16 == 0  # the first channel group is 16-byte aligned


def test_choose_path_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="3 dimensions"):
        K.choose_path((2, 3, 4), (2, 3, 4), 4)
    with pytest.raises(TypeError, match="element size 3"):
        K.choose_path((2, 3, 4, 4), (2, 3, 4, 4), 3)
    with pytest.raises(ValueError, match="do not match the rank"):
        K.choose_path((2, 3, 4, 4), (2, 3, 4), 4)
    with pytest.raises(ValueError, match="serves 1 to 8 channels"):
        K.plan_box_copy((1, 9, 2, 2), (0,) * 4, (1, 9, 2, 2), 4, path="pixel")
    with pytest.raises(ValueError, match="kernel path 'vector'"):
        K.plan_box_copy((1, 3, 2, 2), (0,) * 4, (1, 3, 2, 2), 4, path="vector")
    with pytest.raises(ValueError, match=r"whole 16-byte groups of channels.*\[1, 17\)"):
        K.plan_box_copy((1, 32, 2, 2), (0, 1, 0, 0), (1, 16, 2, 2), 1, path="micro")


def test_micro_positions_match_source() -> None:
    src = K.kernel_source()
    assert "return sizeof(T) == 1 ? 16 : 8;" in src
    assert [K.micro_positions_per_thread(es) for es in K.SUPPORTED_ITEMSIZES] == [16, 8, 8, 8]
    assert [K.micro_groups_log2(n, 4) for n in (4, 8, 12, 64, 128, 4096)] == [0, 1, 1, 4, 4, 4]


def test_pixel_positions_match_source() -> None:
    # gk_px_groups in the CUDA source: G = 4, 2, 1 for 1, 2, more channels;
    # a thread moves 16*G bytes of each plane.
    src = K.kernel_source()
    assert "return C == 1 ? 4 : (C == 2 ? 2 : 1);" in src
    assert "constexpr int M = 16 * G / ES;  // positions per thread" in src
    for channels, groups in [(1, 4), (2, 2), (3, 1), (8, 1)]:
        for itemsize in K.SUPPORTED_ITEMSIZES:
            assert K.pixel_positions_per_thread(channels, itemsize) == 16 * groups // itemsize


def test_launch_plan_made_once_per_layout() -> None:
    # The path choice and the plan are cached per (shape, strides, dtype, box,
    # direction): a second launch of the same layout reuses the same plan.
    K._prepare_cached.cache_clear()
    a = ref.empty_channels_last((4, 3, 32, 32), np.float16)
    b = ref.empty_channels_last((4, 3, 32, 32), np.float16)  # another tensor, same layout
    first = K._prepared(a, None, False)
    assert first.plan.path == "pixel" and first.name == "gpuckpt_px_cl_to_cf_2_3"
    assert K._prepared(b, None, False) is first
    assert K._prepared(a, ((1, 0, 0, 0), (2, 3, 32, 32)), False) is not first
    info = K._prepare_cached.cache_info()
    assert (info.hits, info.misses) == (1, 2)
    back = K._prepared(a, None, True)
    assert back.name == "gpuckpt_px_cf_to_cl_2_3" and back.plan is not first.plan
    many = K._prepared(ref.empty_channels_last((2, 64, 8, 8), np.float32), None, False)
    assert many.plan.path == "micro" and many.name == "gpuckpt_mt_cl_to_cf_4"
    odd = K._prepared(ref.empty_channels_last((2, 33, 8, 8), np.float32), None, False)
    assert odd.plan.path == "tiled" and odd.name == "gpuckpt_cl_to_cf_4"
    # the launch arguments: 14 int64 and 2 int32 (c0 for the pixel path)
    assert [type(v).__name__ for v in first.args] == ["int64"] * 14 + ["int32"] * 2


def test_block_check_fast_path_and_messages() -> None:
    # The common case passes on three attribute reads; anything else gets
    # the full check and its message.
    sizes = (2, 3, 4, 5)
    K._check_block(np.empty(sizes, np.float32), sizes, np.dtype(np.float32), "out")
    with pytest.raises(ValueError, match=r"out: shape \(2, 3, 4, 4\) does not match the box sizes"):
        K._check_block(np.empty((2, 3, 4, 4), np.float32), sizes, np.dtype(np.float32), "out")
    with pytest.raises(TypeError, match="src: dtype float64 does not match the tensor dtype float32"):
        K._check_block(np.empty(sizes, np.float64), sizes, np.dtype(np.float32), "src")
    with pytest.raises(ValueError, match="src: a C-contiguous array is required"):
        K._check_block(
            np.empty((2, 3, 5, 4), np.float32).transpose(0, 1, 3, 2), sizes, np.dtype(np.float32), "src"
        )


def test_module_part_options() -> None:
    assert K.module_part_options(None) == ()
    assert K.module_part_options("tiled") == (
        "-DGK_BUILD_TILED=1",
        "-DGK_BUILD_MICRO=0",
        "-DGK_BUILD_PX_SIZES=0",
    )
    assert K.module_part_options("micro") == (
        "-DGK_BUILD_TILED=0",
        "-DGK_BUILD_MICRO=1",
        "-DGK_BUILD_PX_SIZES=0",
    )
    assert K.module_part_options("px8") == (
        "-DGK_BUILD_TILED=0",
        "-DGK_BUILD_MICRO=0",
        "-DGK_BUILD_PX_SIZES=8",
    )
    with pytest.raises(ValueError, match="'px3'"):
        K.module_part_options("px3")
    src = K.kernel_source()
    assert "#if GK_BUILD_TILED" in src and "#if GK_BUILD_MICRO" in src
    for es in K.SUPPORTED_ITEMSIZES:
        assert f"#if GK_BUILD_PX_SIZES & {es}\nGK_PX_DEFINE_ALL({es}," in src


def test_plan_merges_full_spatial_dims() -> None:
    plan = K.plan_box_copy((2, 64, 7, 9), (0, 0, 0, 0), (2, 64, 7, 9), 4)
    assert (plan.nlines, plan.run_len, plan.nch) == (2, 63, 64)
    plan = K.plan_box_copy((2, 64, 7, 9), (0, 0, 0, 3), (2, 64, 7, 4), 4)
    assert (plan.nlines, plan.run_len) == (14, 4)
    plan = K.plan_box_copy((2, 8, 5, 7, 9), (1, 0, 2, 0, 0), (1, 8, 3, 7, 9), 2)
    assert (plan.nlines, plan.run_len, plan.cl_base) == (1, 189, (1 * 5 * 7 * 9 + 2 * 7 * 9) * 8)


def test_plan_small_and_many_channels() -> None:
    few = K.plan_box_copy((1, 3, 256, 256), (0,) * 4, (1, 3, 256, 256), 4, path="tiled")
    assert (1 << few.log_tc, 1 << few.log_tq) == (4, 512)
    many = K.plan_box_copy((1, 2048, 56, 56), (0,) * 4, (1, 2048, 56, 56), 4, path="tiled")
    assert (1 << many.log_tc, 1 << many.log_tq) == (32, 64)


def test_plan_huge_tensor_caps_grid() -> None:
    shape = (70000, 2048, 128, 128)  # 2**41 elements
    plan = K.plan_box_copy(shape, (0,) * 4, shape, 1)
    assert plan.grid[2] == 65535 and plan.tiles[2] == 70000
    plan = K.plan_box_copy(shape, (0, 0, 0, 1), (70000, 2048, 128, 1), 8)
    assert plan.nlines == 70000 * 128
    assert plan.grid[2] == 65535


# ---- NumPy references ----------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [np.uint8, ml_dtypes.bfloat16, ml_dtypes.float8_e5m2, np.float32, np.float64]
)
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 1, 1, 1), (2, 4, 3, 5, 6)])
def test_reference_round_trip(dtype: type, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    logical = rng.standard_normal(shape).astype(dtype)
    cl = ref.as_channels_last(logical)
    assert K.is_channels_last(cl.shape, cl.strides, cl.itemsize)
    # Memory really is NHWC / NDHWC.
    physical = np.ascontiguousarray(np.moveaxis(logical, 1, -1))
    assert np.moveaxis(cl, 1, -1).flags.c_contiguous
    assert _same_bytes(np.moveaxis(cl, 1, -1), physical)
    out = ref.channels_last_to_contiguous(cl)
    assert out.flags.c_contiguous and _same_bytes(out, logical)
    back = ref.contiguous_to_channels_last(out, ref.empty_channels_last(shape, dtype))
    assert _same_bytes(back, cl)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    # Byte comparison: NaN payloads and float8 oddities compare as stored.
    return a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def test_reference_box() -> None:
    logical = np.arange(2 * 5 * 6 * 7, dtype=np.int32).reshape(2, 5, 6, 7)
    cl = ref.as_channels_last(logical)
    box = (slice(1, 2), slice(1, 4), slice(2, 6), slice(3, 5))
    assert np.array_equal(ref.channels_last_to_contiguous(cl, box=box), logical[box])
    block = -np.ones((1, 3, 4, 2), np.int32)
    ref.contiguous_to_channels_last(block, cl, box=((1, 1, 2, 3), (1, 3, 4, 2)))
    expected = logical.copy()
    expected[box] = -1
    assert np.array_equal(cl, expected)


def test_reference_validation() -> None:
    cl = ref.empty_channels_last((2, 3, 4, 5), np.float32)
    with pytest.raises(ValueError, match="not dense channels_last"):
        ref.channels_last_to_contiguous(np.zeros((2, 3, 4, 5), np.float32))
    with pytest.raises(ValueError, match="does not match the box"):
        ref.channels_last_to_contiguous(cl, np.empty((2, 3, 4, 4), np.float32))
    with pytest.raises(TypeError, match="dtype"):
        ref.channels_last_to_contiguous(cl, np.empty((2, 3, 4, 5), np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        ref.contiguous_to_channels_last(np.empty((2, 3, 5, 4), np.float32).transpose(0, 1, 3, 2), cl)
    with pytest.raises(TypeError, match="element size"):
        ref.channels_last_to_contiguous(ref.empty_channels_last((1, 2, 2, 2), np.complex128))
    with pytest.raises(TypeError, match=r"numpy\.ndarray"):
        ref.channels_last_to_contiguous([[1]])  # type: ignore[arg-type]


def test_device_functions_reject_numpy() -> None:
    pytest.importorskip("cupy", reason="CuPy is not installed")
    cl = ref.empty_channels_last((2, 3, 4, 5), np.float32)
    with pytest.raises(TypeError, match=r"cupy\.ndarray"):
        K.channels_last_to_contiguous(cl)
    with pytest.raises(TypeError, match=r"cupy\.ndarray"):
        K.contiguous_to_channels_last(np.empty((2, 3, 4, 5), np.float32), cl)
