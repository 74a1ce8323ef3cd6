"""Array adapters: one view of every array kind gpuckpt accepts.

An adapter exposes what the checkpoint logic needs from an array — shape,
dtype, strides, properties, and host access — so that the rest of the
package never checks array types itself. Host memory (NumPy, and CPU arrays
reachable through ``__array_interface__`` or DLPack) is handled here;
device arrays go through the GPU adapter.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gpuckpt import memory_format as mf
from gpuckpt.errors import DeviceUnavailableError, UnsupportedValueError

__all__ = ["ArrayAdapter", "HostArray", "HostMemory", "adapt", "is_array"]

_DLPACK_CPU = 1  # kDLCPU
_DLPACK_CUDA_HOST = 3  # kDLCUDAHost: page-locked host memory


@runtime_checkable
class ArrayAdapter(Protocol):
    """What the checkpoint logic reads from an array."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...

    @property
    def is_device(self) -> bool: ...

    def properties(self) -> Any: ...

    def host_array(self) -> np.ndarray: ...


def is_array(value: Any) -> bool:
    """True for values stored as tensors (NumPy scalars and plain values are objects)."""
    if isinstance(value, np.ndarray):
        return True
    if isinstance(value, (np.generic, str, bytes, int, float, complex, bool, type(None), list, tuple, dict)):
        return False
    return any(
        _has_attribute(value, a)
        for a in ("__gpuckpt_adapter__", "__cuda_array_interface__", "__dlpack__", "__array_interface__")
    )


def _has_attribute(value: Any, name: str) -> bool:
    # hasattr runs properties: PyTorch's __cuda_array_interface__ raises
    # RuntimeError (not AttributeError) for a CUDA tensor that requires grad,
    # which means the attribute is there but refuses
    try:
        return hasattr(value, name)
    except Exception:
        return True


@dataclass(slots=True)
class HostArray:
    """A host array viewed as a NumPy array, without copying."""

    array: np.ndarray
    requires_grad: bool = False
    pinned: bool = False

    @property
    def is_device(self) -> bool:
        return False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.array.dtype

    def properties(self) -> Any:
        from gpuckpt.metadata import TensorProperties

        a = self.array
        return TensorProperties(
            dtype=a.dtype,
            layout=mf.strided,
            requires_grad=self.requires_grad,
            memory_format=mf.detect_memory_format(a.shape, a.strides, a.itemsize),
            pin_memory=self.pinned,
        )

    def host_array(self) -> np.ndarray:
        return self.array


def _dlpack_device(value: Any) -> tuple[int, int] | None:
    fn = getattr(value, "__dlpack_device__", None)
    if fn is None:
        return None
    try:
        dev_type, dev_id = fn()
        return int(dev_type), int(dev_id)
    except Exception:
        return None


def _is_device_object(value: Any, dev: tuple[int, int] | None) -> bool:
    if dev is not None:  # DLPack says where the memory is
        return dev[0] not in (_DLPACK_CPU, _DLPACK_CUDA_HOST)
    return _has_attribute(value, "__cuda_array_interface__")


def _host_pinned(arr: np.ndarray) -> bool:
    # host memory is page-locked through a CUDA library; where CuPy is not loaded
    # yet, loading it (tens of MB, for every save of plain NumPy arrays) to ask is
    # not worth it: such memory then reports as not pinned
    if arr.size == 0 or "cupy" not in sys.modules:
        return False
    from gpuckpt.device import cuda

    return cuda.gpu_available() and cuda.is_pinned_pointer(arr.ctypes.data)


def adapt(value: Any) -> ArrayAdapter:
    """The adapter for ``value``; raises :class:`UnsupportedValueError` for non-arrays.

    Host arrays (NumPy, CPU tensors through DLPack) are viewed without a copy;
    device arrays (CuPy, CUDA tensors, ``__cuda_array_interface__`` and CUDA
    DLPack objects) go to the CuPy backend; objects with a
    ``__gpuckpt_adapter__()`` method supply their own adapter.
    """
    if isinstance(value, np.ndarray):
        return HostArray(value, pinned=_host_pinned(value))
    hook = getattr(value, "__gpuckpt_adapter__", None)
    if hook is not None:
        return hook()  # type: ignore[no-any-return]
    requires_grad = bool(getattr(value, "requires_grad", False))
    dev = _dlpack_device(value)
    if _is_device_object(value, dev):
        from gpuckpt.device import cuda
        from gpuckpt.device.backend import DeviceArray

        if not cuda.gpu_available():
            raise DeviceUnavailableError(
                f"{type(value).__module__}.{type(value).__qualname__} lives in device memory, but no usable "
                "GPU was found (CuPy missing, or no driver/device); install CuPy for your CUDA version "
                "(pip install 'gpuckpt[gpu]') on a machine with an NVIDIA GPU"
            )
        data, dtype, requires_grad = cuda.as_device_array(value)
        return DeviceArray(data, cuda.backend_for_device(int(data.device.id)), dtype, requires_grad)
    try:
        if type(value).__module__.startswith("torch"):
            from gpuckpt.device.cuda import _torch_dtype

            dtype, view = _torch_dtype(value.detach())
            arr = np.from_dlpack(view).view(dtype)
            pinned = bool(value.is_pinned())
        elif dev is not None and hasattr(value, "__dlpack__"):
            arr = np.from_dlpack(value)
            pinned = dev[0] == _DLPACK_CUDA_HOST
        else:
            arr = np.asarray(value)
            pinned = False
    except (TypeError, ValueError, BufferError, RuntimeError) as exc:
        raise UnsupportedValueError(
            f"cannot view {type(value).__qualname__} as a host array without copying: {exc}"
        ) from exc
    if arr.dtype == object:
        raise UnsupportedValueError(
            f"{type(value).__qualname__} converts to an object array; it cannot be stored"
        )
    return HostArray(arr, requires_grad=requires_grad, pinned=pinned)


class HostMemory:
    """Allocates host arrays for loads (the default memory target)."""

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any], memory_format: Any) -> np.ndarray:
        """An uninitialised array with ``shape`` whose strides follow ``memory_format``."""
        order = mf.physical_order(len(shape), memory_format)
        physical = np.empty(tuple(shape[a] for a in order), dtype=dtype)
        inverse = [order.index(a) for a in range(len(shape))]
        return physical.transpose(inverse)
