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

import sys
import threading
from typing import Any

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

#: Names of the floating-point types gpuckpt stores (NumPy's and ``ml_dtypes``'): NumPy gives
#: the ``ml_dtypes`` ones the kind "V", not "f", so a test of the kind misses bfloat16 and float8.
FLOAT_NAMES: frozenset[str] = frozenset(("float16", "float32", "float64", *ML_DTYPE_NAMES))

# Both maps start with NumPy's own types; ``ml_dtypes`` joins them on first need (its
# import registers many ufunc loops and costs 0.4 s with NumPy 2.4, the last NumPy for
# Python 3.11), so a process whose checkpoints hold none of its types never imports it.
_BY_NAME: dict[str, np.dtype[Any]] = dict(_NUMPY_NAMES)
_BY_DTYPE: dict[np.dtype[Any], str] = {dt: name for name, dt in _BY_NAME.items()}
_ML_LOCK = threading.Lock()
_ml_loaded = False


def _load_ml_dtypes() -> None:
    """Add the ``ml_dtypes`` types to the maps (once)."""
    global _ml_loaded
    with _ML_LOCK:
        if _ml_loaded:
            return
        import ml_dtypes

        for name in ML_DTYPE_NAMES:
            dt = np.dtype(getattr(ml_dtypes, name))
            _BY_NAME[name] = dt
            _BY_DTYPE[dt] = name
        _ml_loaded = True


def _name_of(dt: np.dtype[Any]) -> str | None:
    name = _BY_DTYPE.get(dt)
    # an ml_dtypes dtype exists only once its module is imported: no need to import it here
    if name is None and not _ml_loaded and "ml_dtypes" in sys.modules:
        _load_ml_dtypes()
        name = _BY_DTYPE.get(dt)
    return name


def _known_names() -> str:
    return ", ".join(sorted({*_NUMPY_NAMES, *ML_DTYPE_NAMES}))


def _as_dtype(dtype: Any) -> np.dtype[Any]:
    """``np.dtype(dtype)``, which knows the ``ml_dtypes`` names only once that module is in."""
    if isinstance(dtype, str) and dtype in ML_DTYPE_NAMES:
        return dtype_from_name(dtype)
    dt: np.dtype[Any] = np.dtype(dtype)
    return dt


def _native(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return dtype.newbyteorder("=") if dtype.byteorder not in ("=", "|") else dtype


def is_storable_dtype(dtype: Any) -> bool:
    """Return True when arrays of ``dtype`` can be stored in a checkpoint."""
    try:
        dt = _as_dtype(dtype)
    except TypeError:
        return False
    return _name_of(_native(dt)) is not None


def dtype_name(dtype: Any) -> str:
    """Canonical stored name of ``dtype`` (e.g. ``"float32"``, ``"bfloat16"``).

    Raises
    ------
    UnsupportedValueError
        For dtypes that cannot be stored (objects, strings, structured types).
    """
    dt = _as_dtype(dtype)
    name = _name_of(_native(dt))
    if name is None:
        raise UnsupportedValueError(
            f"dtype {dt!s} cannot be stored as a tensor; supported: "
            f"{_known_names()}. Convert the array (e.g. .astype('float32')) "
            "or store the value as a plain Python object."
        )
    return name


def dtype_from_name(name: str) -> np.dtype[Any]:
    """NumPy dtype (native byte order) for a stored data-type ``name``."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        pass
    if isinstance(name, str) and name in ML_DTYPE_NAMES:
        _load_ml_dtypes()
        return _BY_NAME[name]
    from gpuckpt.errors import MetadataError

    raise MetadataError(
        f"unknown stored data type {name!r}; this version knows "
        f"{_known_names()}. Upgrade gpuckpt to read this checkpoint."
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
    try:
        dt = _as_dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(
            f"set_default_dtype({dtype!r}): not a dtype ({exc}); pass a NumPy dtype, a dtype name such as "
            "'float32' or 'bfloat16', or a type such as np.float32"
        ) from None
    dtype_name(dt)  # refuse dtypes that cannot be stored
    _default_dtype = dt
