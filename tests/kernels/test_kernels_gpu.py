"""The kernels on a real GPU through CuPy, against NumPy; and under
compute-sanitizer (memcheck, racecheck) where it is installed.

Skipped unless CuPy imports and sees at least one CUDA device.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuckpt.device import _kernel_ref as ref
from gpuckpt.device import kernels as K

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]


def _gpu_missing() -> str | None:
    try:
        import cupy
    except Exception as exc:  # not installed, or its CUDA libraries missing
        return f"CuPy is not importable ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no usable CUDA device ({exc})"
    return None if count > 0 else "no CUDA device"


@pytest.fixture(scope="module")
def cp() -> Any:
    reason = _gpu_missing()
    if reason:
        pytest.skip(reason)
    import cupy

    return cupy


def to_device(cp: Any, host: np.ndarray) -> Any:
    """Channels-last NumPy array -> channels-last CuPy array."""
    physical = cp.asarray(np.ascontiguousarray(np.moveaxis(host, 1, -1)))
    return physical.transpose(0, host.ndim - 1, *range(1, host.ndim - 1))


def _random(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return rng.integers(0, 256, size=size, dtype=np.uint8).view(dtype).reshape(shape)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


SHAPES = [
    (1, 1, 1, 1),
    (2, 3, 17, 31),
    (4, 64, 56, 56),
    (2, 2048, 7, 7),
    (1, 5, 67, 67),
    (2, 3, 4, 5, 6),
    (2, 40, 5, 9, 11),
    # the micro-tile path (C = 64, 256 above and here), then the pixel path:
    # images and video, planes 16-byte aligned or not
    (2, 256, 14, 14),
    (2, 32, 3, 9, 9),
    (4, 3, 224, 224),
    (2, 4, 97, 101),
    (3, 1, 64, 130),
    (2, 2, 4, 31, 33),
    (1, 8, 8, 56, 56),
    (2, 6, 3, 7, 9),
]
DTYPES = [np.uint8, np.float16, np.float32, np.float64, np.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_whole_tensor(cp: Any, shape: tuple[int, ...], dtype: Any) -> None:
    host = ref.as_channels_last(_random(shape, dtype, 0))
    dev = to_device(cp, host)
    out = K.channels_last_to_contiguous(dev)
    assert out.flags.c_contiguous and out.dtype == dtype
    assert _same(out.get(), ref.channels_last_to_contiguous(host))
    back = to_device(cp, ref.empty_channels_last(shape, dtype))
    K.contiguous_to_channels_last(out, back)
    assert _same(cp.ascontiguousarray(back).get(), np.ascontiguousarray(host))


BOXES = [
    ((3, 70, 6, 40), ((1, 5, 1, 0), (2, 60, 4, 40))),
    ((2, 5, 4, 6, 8), ((1, 1, 1, 2, 3), (1, 3, 2, 3, 4))),
    ((2, 9, 4, 6, 8), ((0, 0, 0, 0, 7), (2, 9, 4, 6, 1))),
    ((2, 256, 33, 33), ((0, 100, 0, 0), (2, 100, 33, 33))),
    # few channels: a channel slab (chunks of large images), rows, a video slab
    ((2, 3, 130, 128), ((0, 1, 0, 0), (2, 2, 130, 128))),
    ((2, 4, 130, 128), ((1, 0, 17, 0), (1, 4, 60, 128))),
    ((1, 3, 16, 48, 64), ((0, 0, 5, 0, 0), (1, 3, 6, 48, 64))),
]


@pytest.mark.parametrize("itemsize", K.SUPPORTED_ITEMSIZES)
@pytest.mark.parametrize("shape,box", BOXES)
def test_boxes(cp: Any, shape: tuple[int, ...], box: tuple, itemsize: int) -> None:
    dtype = np.dtype(f"u{itemsize}")
    host = ref.as_channels_last(_random(shape, dtype, 1))
    dev = to_device(cp, host)
    got = K.channels_last_to_contiguous(dev, box=box)
    want = ref.channels_last_to_contiguous(host, box=box)
    assert _same(got.get(), want)
    target_host = ref.as_channels_last(_random(shape, dtype, 2))
    target = to_device(cp, target_host)
    K.contiguous_to_channels_last(got, target, box=box)
    ref.contiguous_to_channels_last(want, target_host, box=box)
    assert _same(cp.ascontiguousarray(target).get(), np.ascontiguousarray(target_host))


@pytest.mark.parametrize("shape", [(2, 3, 40, 48), (2, 64, 20, 24)], ids=["pixel", "micro"])
@pytest.mark.parametrize("offset", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "dtype", [np.uint8, np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name
)
def test_misaligned_buffers(cp: Any, dtype: Any, offset: int, shape: tuple[int, ...]) -> None:
    # Logical blocks that start `offset` elements into an allocation: the
    # pixel and micro-tile kernels fall back to narrower units (or element by
    # element) instead of faulting on a misaligned vector access.
    host = ref.as_channels_last(_random(shape, dtype, 4))
    dev = to_device(cp, host)
    n = int(np.prod(shape))
    buf = cp.zeros(n + offset, dtype=dtype)
    out = buf[offset:].reshape(shape)
    K.channels_last_to_contiguous(dev, out)
    assert _same(out.get(), np.ascontiguousarray(host))
    back = to_device(cp, ref.empty_channels_last(shape, dtype))
    K.contiguous_to_channels_last(out, back)
    assert _same(cp.ascontiguousarray(back).get(), np.ascontiguousarray(host))


def test_kernel_parts_compile_on_demand(cp: Any) -> None:
    # Each launch compiles only its part: the tiled or the micro-tile
    # kernels, or one element size's pixel kernels; once per device.
    part = K.load_module(part="px2")
    assert K.load_module(cp.cuda.Device().id, part="px2") is part
    assert part.get_function("gpuckpt_px_cl_to_cf_2_3") is not None
    with pytest.raises(Exception, match="named symbol not found|not found"):
        part.get_function("gpuckpt_cl_to_cf_2")
    tiled = K.load_module(part="tiled")
    assert tiled.get_function("gpuckpt_cl_to_cf_2") is not None
    assert K.load_module(part="micro").get_function("gpuckpt_mt_cf_to_cl_1") is not None


@pytest.mark.parametrize(
    "shape", [(8, 3, 64, 64), (8, 64, 16, 16), (8, 33, 16, 16)], ids=["pixel", "micro", "tiled"]
)
def test_small_copy_is_capturable_in_a_cuda_graph(cp: Any, shape: tuple[int, ...]) -> None:
    # A small (launch-bound) copy is one kernel on the current stream and
    # nothing else: once its plan and kernel are warm, it can be captured in
    # a CUDA graph, which any synchronisation, allocation or host-side wait
    # in the call would break, and the replay gives the same result.
    stream = cp.cuda.Stream(non_blocking=True)
    if not hasattr(stream, "begin_capture"):
        pytest.skip("this CuPy has no stream capture")
    host = ref.as_channels_last(_random(shape, np.float16, 5))
    dev = to_device(cp, host)
    out = cp.empty(shape, np.float16)
    back = to_device(cp, ref.empty_channels_last(shape, np.float16))
    K.channels_last_to_contiguous(dev, out)  # warm: compile, plan, kernel
    K.contiguous_to_channels_last(out, back)
    cp.cuda.Device().synchronize()
    out[...] = 0
    back[...] = 0
    cp.cuda.Device().synchronize()
    with stream:
        stream.begin_capture()
        K.channels_last_to_contiguous(dev, out)
        K.contiguous_to_channels_last(out, back)
        graph = stream.end_capture()
    assert not out.any().get()  # captured, not run
    graph.launch(stream)
    stream.synchronize()
    assert _same(out.get(), np.ascontiguousarray(host))
    assert _same(cp.ascontiguousarray(back).get(), np.ascontiguousarray(host))


def test_out_argument_and_stream(cp: Any) -> None:
    host = ref.as_channels_last(_random((2, 8, 5, 5), np.float32, 3))
    dev = to_device(cp, host)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = cp.empty((2, 8, 5, 5), np.float32)
        assert K.channels_last_to_contiguous(dev, out) is out
    stream.synchronize()
    assert _same(out.get(), np.ascontiguousarray(host))


def test_validation(cp: Any) -> None:
    dev = to_device(cp, ref.empty_channels_last((2, 3, 4, 5), np.float32))
    with pytest.raises(ValueError, match="not dense channels_last"):
        K.channels_last_to_contiguous(cp.zeros((2, 3, 4, 5), np.float32))
    with pytest.raises(ValueError, match="does not match the box"):
        K.channels_last_to_contiguous(dev, cp.empty((2, 3, 4, 4), np.float32))
    with pytest.raises(TypeError, match="dtype"):
        K.channels_last_to_contiguous(dev, cp.empty((2, 3, 4, 5), np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        K.contiguous_to_channels_last(cp.empty((2, 3, 5, 4), np.float32).transpose(0, 1, 3, 2), dev)
    with pytest.raises(ValueError, match="leave shape"):
        K.channels_last_to_contiguous(dev, box=((0, 0, 0, 0), (2, 3, 5, 5)))
    with pytest.raises(TypeError, match="element size"):
        K.channels_last_to_contiguous(cp.empty((1, 2, 2, 2), np.complex128))
    physical = cp.empty((2, 4, 5, 3), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        K.contiguous_to_channels_last(physical.reshape(2, 3, 4, 5), physical.transpose(0, 3, 1, 2))


def test_module_cached_per_device(cp: Any) -> None:
    first = K.load_module()
    assert K.load_module(cp.cuda.Device().id) is first


def test_over_2_pow_31_elements(cp: Any) -> None:
    # 2_181_038_080 one-byte elements, twice: about 4.4 GB of device memory.
    shape = (1, 64, 32768, 1040)
    n = int(np.prod(shape))
    free, _ = cp.cuda.runtime.memGetInfo()
    if free < 12 * n:
        pytest.skip("not enough device memory for the >2**31-element tensor")
    idx = cp.arange(n, dtype=cp.uint32)  # n < 2**32
    physical = (idx % 251).astype(cp.uint8).reshape(1, 32768, 1040, 64)
    del idx
    dev = physical.transpose(0, 3, 1, 2)
    out = K.channels_last_to_contiguous(dev)
    # Spot checks at the far end, past 2**31.
    for c in (0, 37, 63):
        for h in (0, 20000, 32767):
            assert cp.array_equal(out[0, c, h], dev[0, c, h])
    back = cp.zeros_like(physical).transpose(0, 3, 1, 2)
    K.contiguous_to_channels_last(out, back)
    assert bool((back.transpose(0, 2, 3, 1) == physical).all())


def test_over_2_pow_31_elements_pixel_path(cp: Any) -> None:
    # 3 * 32768 * 24000 = 2_359_296_000 one-byte elements, on the pixel path.
    shape = (1, 3, 32768, 24000)
    n = int(np.prod(shape))
    assert K.choose_path(shape, shape, 1) == "pixel"
    free, _ = cp.cuda.runtime.memGetInfo()
    if free < 12 * n:
        pytest.skip("not enough device memory for the >2**31-element tensor")
    idx = cp.arange(n, dtype=cp.uint32)
    physical = (idx % 253).astype(cp.uint8).reshape(1, 32768, 24000, 3)
    del idx
    dev = physical.transpose(0, 3, 1, 2)
    out = K.channels_last_to_contiguous(dev)
    for c in range(3):
        for h in (0, 20000, 32767):
            assert cp.array_equal(out[0, c, h], dev[0, c, h])
    back = cp.zeros_like(physical).transpose(0, 3, 1, 2)
    K.contiguous_to_channels_last(out, back)
    assert bool((back.transpose(0, 2, 3, 1) == physical).all())


# ---- compute-sanitizer ------------------------------------------------------------


def _compute_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "bin", "compute-sanitizer").is_file():
            return str(Path(root, "bin", "compute-sanitizer"))
    return None


def _sanitize(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = _compute_sanitizer()
    if exe is None:
        pytest.skip("compute-sanitizer not found")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    )
    return subprocess.run(
        [
            exe,
            "--tool",
            tool,
            "--error-exitcode",
            "99",
            sys.executable,
            str(HERE / "kernel_gpu_runner.py"),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_clean(cp: Any, tool: str) -> None:
    proc = _sanitize(tool)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "results match" in proc.stdout


def test_racecheck_catches_missing_syncthreads(cp: Any) -> None:
    proc = _sanitize("racecheck", "--broken-sync")
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "hazard" in text.lower(), text[-4000:]
