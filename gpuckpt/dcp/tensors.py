"""torch as ``gpuckpt.dcp`` sees it: the import, and dtypes and arrays across the NumPy boundary.

Imported first by :mod:`gpuckpt.dcp`: without torch (or without
``torch.distributed``), importing :mod:`gpuckpt.dcp` fails here with an
``ImportError`` that says how to install it. ``import gpuckpt`` itself never
imports torch.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from gpuckpt.errors import MetadataError, UnsupportedValueError
from gpuckpt.format.dtypes import dtype_from_name, dtype_name

try:
    import torch
    import torch.distributed.checkpoint  # the interfaces gpuckpt.dcp implements
except ImportError as _exc:
    raise ImportError(
        f"gpuckpt.dcp needs PyTorch with torch.distributed.checkpoint, which cannot be imported ({_exc}); "
        "install it with `pip install 'gpuckpt[torch]'` (or see https://pytorch.org/get-started/)"
    ) from _exc

__all__ = ["DCP_VERSION", "as_torch", "host_view", "numpy_dtype", "torch", "torch_dtype"]

#: the version of DCP's ``Metadata`` this torch writes (its FileSystemWriter records
#: ``CURRENT_DCP_VERSION``; a torch without one records none)
DCP_VERSION: str | None = getattr(torch.distributed.checkpoint.filesystem, "CURRENT_DCP_VERSION", None)

# dtypes NumPy lacks (ml_dtypes has them): NumPy sees them through integers of the same size
_BITS = {1: "uint8", 2: "uint16"}


def numpy_dtype(dtype: Any, fqn: str) -> np.dtype[Any]:
    """The stored (NumPy/ml_dtypes) dtype of a torch dtype; unsupported ones name the entry."""
    name = str(dtype).removeprefix("torch.")
    try:
        return dtype_from_name(name)
    except MetadataError:
        raise UnsupportedValueError(
            f"tensor {fqn!r} has dtype {dtype}, which gpuckpt cannot store; convert it (e.g. .float()) "
            "in the state dict, or save it with torch.distributed.checkpoint.FileSystemWriter"
        ) from None


def torch_dtype(dtype: np.dtype[Any], fqn: str) -> Any:
    """The torch dtype of a stored dtype; raises when torch has no such type."""
    name = dtype_name(dtype)
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise UnsupportedValueError(
            f"tensor {fqn!r} is stored as {name}, which this torch ({torch.__version__}) has no dtype for; "
            "read it with gpuckpt.load_state_dict instead"
        )
    return found


def host_view(tensor: Any) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory (same shape and strides), no copy; dtypes
    NumPy lacks (bfloat16, float8) through unsigned integers of their size."""
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.dtype not in _NUMPY_VIEWABLE:
        t = t.view(_TORCH_BITS[t.element_size()])
    # not Tensor.numpy(): it makes the tensor's storage unresizable for good
    return np.from_dlpack(t)


def as_torch(array: np.ndarray, on_free: Any = None) -> Any:
    """A torch tensor sharing ``array``'s memory (same strides), for any dtype gpuckpt stores.

    ``on_free``: called once torch has let go of the memory (the tensor and
    every view of it are gone).
    """
    dt = array.dtype
    native = dtype_name(dt) in _TORCH_NATIVE
    held = array if native else array.view(_BITS[dt.itemsize])
    if on_free is not None:
        weakref.finalize(held, on_free)
    tensor = torch.from_numpy(held)
    return tensor if native else tensor.view(torch_dtype(dt, "<array>"))


_TORCH_NATIVE = frozenset(
    ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
) | frozenset(("float16", "float32", "float64", "complex64", "complex128"))

# torch dtypes .numpy() takes as they are; the others are viewed through integers of their size
_NUMPY_VIEWABLE = frozenset(getattr(torch, n) for n in _TORCH_NATIVE if hasattr(torch, n))
_TORCH_BITS = {1: torch.uint8, 2: torch.int16}
