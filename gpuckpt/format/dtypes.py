"""Data types: the names gpuckpt stores and the NumPy dtypes they stand for.

Every storable dtype has one canonical Zarr v3 data-type name. NumPy's own
numeric types use the names of the Zarr v3 core specification; the
machine-learning types from ``ml_dtypes`` (bfloat16 and the float8 family)
use the names TensorStore uses, so that both zarr-python (with gpuckpt's
data-type plug-in) and TensorStore read them.

All stored data is little-endian; a big-endian source array is byte-swapped
when it is written and reads back as its native-order equivalent.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from gpuckpt.errors import UnsupportedValueError

__all__ = [
    "ML_DTYPE_NAMES",
    "dtype_from_name",
    "dtype_name",
    "get_default_dtype",
    "is_storable_dtype",
    "set_default_dtype",
]

_NUMPY_NAMES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}

#: Names of the ``ml_dtypes`` types gpuckpt stores, as TensorStore spells them.
ML_DTYPE_NAMES: tuple[str, ...] = (
    "bfloat16",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)

_ML_NAMES: dict[str, np.dtype[Any]] = {name: np.dtype(getattr(ml_dtypes, name)) for name in ML_DTYPE_NAMES}

_BY_NAME: dict[str, np.dtype[Any]] = {**_NUMPY_NAMES, **_ML_NAMES}
_BY_DTYPE: dict[np.dtype[Any], str] = {dt: name for name, dt in _BY_NAME.items()}


def _native(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return dtype.newbyteorder("=") if dtype.byteorder not in ("=", "|") else dtype


def is_storable_dtype(dtype: Any) -> bool:
    """Return True when arrays of ``dtype`` can be stored in a checkpoint."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return False
    return _native(dt) in _BY_DTYPE


def dtype_name(dtype: Any) -> str:
    """Canonical stored name of ``dtype`` (e.g. ``"float32"``, ``"bfloat16"``).

    Raises
    ------
    UnsupportedValueError
        For dtypes that cannot be stored (objects, strings, structured types).
    """
    dt = np.dtype(dtype)
    name = _BY_DTYPE.get(_native(dt))
    if name is None:
        raise UnsupportedValueError(
            f"dtype {dt!s} cannot be stored as a tensor; supported: "
            f"{', '.join(sorted(_BY_NAME))}. Convert the array (e.g. .astype('float32')) "
            "or store the value as a plain Python object."
        )
    return name


def dtype_from_name(name: str) -> np.dtype[Any]:
    """NumPy dtype (native byte order) for a stored data-type ``name``."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        from gpuckpt.errors import MetadataError

        raise MetadataError(
            f"unknown stored data type {name!r}; this version knows "
            f"{', '.join(sorted(_BY_NAME))}. Upgrade gpuckpt to read this checkpoint."
        ) from None


_default_dtype: np.dtype[Any] = np.dtype(np.float32)


def get_default_dtype() -> np.dtype[Any]:
    """The dtype a default-constructed ``TensorProperties`` carries (float32)."""
    return _default_dtype


def set_default_dtype(dtype: Any) -> None:
    """Change the dtype that ``get_default_dtype`` returns.

    Examples
    --------
    >>> import gpuckpt, numpy as np
    >>> gpuckpt.set_default_dtype(np.float64)
    >>> gpuckpt.get_default_dtype()
    dtype('float64')
    >>> gpuckpt.set_default_dtype(np.float32)
    """
    global _default_dtype
    dt = np.dtype(dtype)
    dtype_name(dt)  # refuse dtypes that cannot be stored
    _default_dtype = dt
