"""The CuPy adapter on a real GPU (``gpu`` marker), and its behaviour without one."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gpuckpt
from gpuckpt.device import cuda


class FakeCudaArray:
    """Claims to live in device memory; there is no device behind it."""

    __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False), "version": 3}


def test_no_gpu_is_detected_without_crashing() -> None:
    if cuda.gpu_available():
        pytest.skip("a GPU is present")
    # CuPy may be installed (it is in the test extra): detection still says no
    assert cuda.gpu_available() is False
    assert cuda.is_pinned_pointer(np.zeros(4).ctypes.data) is False
    with pytest.raises(gpuckpt.DeviceUnavailableError, match="no usable GPU"):
        gpuckpt.save({"x": FakeCudaArray()}, "/nonexistent/never-written")
    assert gpuckpt.TensorProperties.create_from_tensor(np.zeros(3)).pin_memory is False


class GradCudaTensor:
    """Like a PyTorch CUDA tensor that requires grad: its
    ``__cuda_array_interface__`` raises RuntimeError, not AttributeError."""

    requires_grad = True

    @property
    def __cuda_array_interface__(self) -> dict:
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad.")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)  # kDLCUDA

    def __dlpack__(self, **kwargs: object) -> object:
        raise BufferError("no device memory behind this test double")


class GradCudaNoDlpack:
    requires_grad = True

    @property
    def __cuda_array_interface__(self) -> dict:
        raise RuntimeError("refuses")


@pytest.mark.parametrize("cls", [GradCudaTensor, GradCudaNoDlpack])
def test_refusing_cuda_array_interface_is_still_a_device_array(cls: type) -> None:
    from gpuckpt.device.arrays import adapt, is_array

    value = cls()
    assert is_array(value)
    if cuda.gpu_available():
        pytest.skip("a GPU is present (the real case runs in test_torch_cuda_tensors)")
    with pytest.raises(gpuckpt.DeviceUnavailableError, match="lives in device memory"):
        adapt(value)
    with pytest.raises(gpuckpt.DeviceUnavailableError, match="lives in device memory"):
        gpuckpt.TensorProperties.create_from_tensor(value)


def test_import_does_not_touch_cupy() -> None:
    import subprocess
    import sys

    code = "import sys, gpuckpt; gpuckpt.save; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_saving_host_arrays_does_not_load_cupy(tmp_path: Path) -> None:
    # CuPy costs tens of MB of memory and a second to import: a save, load or
    # async save of host arrays must not bring it in (it is installed here)
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, gpuckpt; p = sys.argv[1]; s = {'w': np.ones((4, 3, 5, 2)), 'n': 1};"
        "gpuckpt.save(s, p + '/a'); gpuckpt.async_save(s, p + '/b').result();"
        "gpuckpt.load(s, p + '/a'); gpuckpt.load_state_dict(p + '/b');"
        "print('cupy' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


gpu = pytest.mark.gpu


@pytest.fixture
def cp() -> object:
    import cupy

    return cupy


def _cl(cp: object, shape: tuple[int, ...], dtype: object) -> object:
    x = cp.random.standard_normal((shape[0], *shape[2:], shape[1])).astype(dtype)  # type: ignore[attr-defined]
    return cp.moveaxis(x, -1, 1)  # type: ignore[attr-defined]


@gpu
def test_cupy_round_trip_and_in_place(tmp_path: Path, cp: object) -> None:
    state = {
        "w": cp.random.standard_normal((3000, 1024), dtype=cp.float32),  # type: ignore[attr-defined]
        "cl": _cl(cp, (8, 64, 14, 14), cp.float16),  # type: ignore[attr-defined]
        "cl3d": cp.moveaxis(cp.random.standard_normal((2, 4, 5, 6, 3)), -1, 1),  # type: ignore[attr-defined]
        "t": cp.random.standard_normal((17, 9))[::2],  # type: ignore[attr-defined]
    }
    md = gpuckpt.save(state, tmp_path / "c", chunk_bytes=1 << 20)
    assert md.state_dict_metadata["cl"].properties.memory_format is gpuckpt.channels_last
    host = gpuckpt.load_state_dict(tmp_path / "c")
    for k, v in state.items():
        assert np.array_equal(host[k], v.get()), k  # type: ignore[attr-defined]
    dev = gpuckpt.load_state_dict(tmp_path / "c", device="cuda:0")
    assert dev["cl"].strides == state["cl"].strides
    for k, v in state.items():
        assert bool((dev[k] == v).all()), k
    targets = {k: cp.zeros_like(v) for k, v in state.items()}  # type: ignore[attr-defined]
    targets["cl"] = _cl(cp, (8, 64, 14, 14), cp.float16)  # type: ignore[attr-defined]
    gpuckpt.load(targets, tmp_path / "c")
    for k, v in state.items():
        assert bool((targets[k] == v).all()), k


@gpu
def test_async_save_snapshot_cupy(tmp_path: Path, cp: object) -> None:
    for staging in ("host", "device"):
        x = cp.arange(1 << 22, dtype=cp.float32)  # type: ignore[attr-defined]
        want = x.get()
        fut = gpuckpt.async_save({"x": x}, tmp_path / staging, staging=staging)
        x *= -1
        fut.result(timeout=120)
        assert np.array_equal(gpuckpt.load_state_dict(tmp_path / staging)["x"], want)


@gpu
def test_a_device_bool_view_of_other_bytes_is_stored_as_0_and_1(tmp_path: Path, cp: object) -> None:
    raw = (cp.arange(4 * 3 * 5 * 6, dtype=cp.uint8) * 37 % 5).reshape(4, 5, 6, 3)  # type: ignore[attr-defined]
    mask = cp.moveaxis(raw, -1, 1).view(cp.bool_)  # type: ignore[attr-defined]  # channels-last, bytes 0-4
    gpuckpt.save({"m": mask}, tmp_path / "c", chunk_bytes=64)
    assert int(raw.max()) == 4  # the caller's array keeps its bytes
    back = gpuckpt.load_state_dict(tmp_path / "c")["m"]
    assert back.view(np.uint8).max() == 1
    assert np.array_equal(back, cp.moveaxis(raw, -1, 1).get() != 0)  # type: ignore[attr-defined]


@gpu
def test_a_stored_bool_byte_other_than_0_and_1_loads_into_the_device_as_true(
    tmp_path: Path, cp: object
) -> None:
    from gpuckpt.format.checksum import crc32c
    from gpuckpt.testing.faults import rewrite_root_metadata

    gpuckpt.save({"b": np.array([True, False, True])}, tmp_path / "c")
    f = tmp_path / "c" / "b" / "c.0"
    body = bytearray(f.read_bytes()[:-4])
    body[0] = 2
    f.write_bytes(bytes(body) + crc32c(bytes(body)).to_bytes(4, "little"))
    rewrite_root_metadata(
        tmp_path / "c",
        lambda md: md["storage_data"]["tensors"]["b"]["chunks"][0].update(crc32c=crc32c(bytes(body))),
    )
    got = gpuckpt.load_state_dict(tmp_path / "c", device="cuda:0")["b"]
    assert got.view(cp.uint8).get().tolist() == [1, 0, 1]  # type: ignore[attr-defined]


@gpu
def test_pinned_host_memory_is_detected(cp: object) -> None:
    mem = cp.cuda.alloc_pinned_memory(4096)  # type: ignore[attr-defined]
    view = np.frombuffer(mem, np.float32, 1024)
    assert gpuckpt.TensorProperties.create_from_tensor(view).pin_memory is True
    assert gpuckpt.TensorProperties.create_from_tensor(np.zeros(1024, np.float32)).pin_memory is False


@gpu
def test_torch_cuda_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    w = torch.randn(64, 32, device="cuda", requires_grad=True)
    bf = torch.randn(40, 8, device="cuda").to(torch.bfloat16)
    cl = torch.randn(4, 16, 5, 5, device="cuda").to(memory_format=torch.channels_last)
    pinned = torch.randn(10).pin_memory()
    p = gpuckpt.TensorProperties.create_from_tensor(w)
    assert p.requires_grad and p.dtype == np.float32
    assert gpuckpt.TensorProperties.create_from_tensor(bf).dtype == ml_dtypes.bfloat16
    assert gpuckpt.TensorProperties.create_from_tensor(cl).memory_format is gpuckpt.channels_last
    assert gpuckpt.TensorProperties.create_from_tensor(pinned).pin_memory is True
    clbf = torch.randn(3, 64, 9, 16, device="cuda").to(torch.bfloat16).to(memory_format=torch.channels_last)
    gpuckpt.save({"w": w, "bf": bf, "cl": cl, "clbf": clbf, "pinned": pinned}, tmp_path / "c")
    back = gpuckpt.load_state_dict(tmp_path / "c")
    assert np.array_equal(back["bf"].view(np.uint16), bf.view(torch.int16).cpu().numpy().view(np.uint16))
    # stored in logical order, whatever the memory format
    assert np.array_equal(
        back["clbf"].view(np.uint16), clbf.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
    )
    tgt = {
        "w": torch.zeros(64, 32, device="cuda"),
        "cl": torch.zeros(4, 16, 5, 5, device="cuda").to(memory_format=torch.channels_last),
        "bf": torch.zeros(40, 8, device="cuda", dtype=torch.bfloat16),
        "clbf": torch.zeros(3, 64, 9, 16, device="cuda", dtype=torch.bfloat16).to(
            memory_format=torch.channels_last
        ),
    }
    gpuckpt.load(tgt, tmp_path / "c", strict=False)
    assert torch.equal(tgt["w"], w.detach()) and torch.equal(tgt["cl"], cl)
    assert torch.equal(tgt["bf"], bf) and torch.equal(tgt["clbf"], clbf)
    assert tgt["clbf"].is_contiguous(memory_format=torch.channels_last)
