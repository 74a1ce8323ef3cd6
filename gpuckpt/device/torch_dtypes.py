"""torch tensors as NumPy sees them: the stored dtype of a tensor, and a view of the same
bytes through a type NumPy, DLPack and CuPy all know.

Used by the host adapter (CPU tensors, :mod:`gpuckpt.device.arrays`) and the CuPy back end
(CUDA tensors, :mod:`gpuckpt.device.cuda`); kept apart from the latter so that saving or
loading CPU tensors does not import the CUDA module. Imports nothing but NumPy at import
time; torch only for the dtypes NumPy lacks, when such a tensor comes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["TORCH_BITS", "torch_dtype_view"]

#: torch dtypes NumPy lacks (ml_dtypes has them), viewed through integers of their size
TORCH_BITS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8",
              "float8_e4m3fnuz": "uint8", "float8_e5m2fnuz": "uint8",
              "float8_e8m0fnu": "uint8"}  # fmt: skip


def torch_dtype_view(t: Any) -> tuple[np.dtype[Any], Any]:
    """NumPy/ml_dtypes dtype of a torch tensor, and a same-size view NumPy and CuPy can hold."""
    name = str(t.dtype).removeprefix("torch.")
    if name in TORCH_BITS:
        import torch

        from gpuckpt.format.dtypes import dtype_from_name

        return dtype_from_name(name), t.view(getattr(torch, TORCH_BITS[name]))
    return np.dtype(name), t
