"""The zarr-python names gpuckpt needs that differ between the zarr lines it supports.

Python 3.12 and later get zarr >= 3.4; Python 3.11 gets zarr 3.1.x, the last
line that installs there (see the markers in ``pyproject.toml``). The data-type
plug-in API (``ZDType``, the registry, the ``zarr.data_type`` entry points) is
the same in both, but two names moved:

* ``DataTypeValidationError`` lives in ``zarr.errors`` from 3.4 on (importing
  it from ``zarr.core.dtype.common`` there warns); 3.1 defines it in
  ``zarr.core.dtype.common`` only. It is the exception the registry catches to
  mean "this class does not match", so it must be zarr's own class.
* ``check_dtype_spec_no_object_codec_v2`` is new in 3.4; 3.1 has only
  ``check_dtype_spec_v2``, of which it is the object-codec-free case, so it is
  defined here on top of that, for both lines.

The error class is found by trying its newer home first. Two things of zarr 3.1 no
shim can give, so tests that need them expect a failure where
:data:`ZARR_BEFORE_3_4` holds:

* its data-type registry collects the ``zarr.data_type`` entry points but never
  loads them, so with zarr 3.1 plain zarr-python knows bfloat16 and the float8
  types only after :func:`gpuckpt.format.zarr_dtypes.register_zarr_dtypes`;
* it has no ``rectilinear`` chunk grid, so it cannot open the arrays of an
  uneven sharded save unless that was saved with ``portable=True``.

When support for Python 3.11 ends, this module can go.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard

import zarr
from zarr.core.dtype.common import check_dtype_spec_v2

if TYPE_CHECKING:
    from zarr.core.dtype.common import DTypeConfig_V2, DTypeName_V2

__all__ = ["ZARR_BEFORE_3_4", "DataTypeValidationError", "check_dtype_spec_no_object_codec_v2"]

#: Whether the installed zarr-python is of a line before 3.4 (3.1.x, on Python 3.11).
ZARR_BEFORE_3_4: bool = tuple(int(part) for part in zarr.__version__.split(".")[:2]) < (3, 4)

try:
    from zarr.errors import DataTypeValidationError  # type: ignore[attr-defined,unused-ignore]
except ImportError:  # zarr 3.1.x
    from zarr.core.dtype.common import DataTypeValidationError  # type: ignore[attr-defined,no-redef,unused-ignore]


def check_dtype_spec_no_object_codec_v2(data: object) -> TypeGuard[DTypeConfig_V2[DTypeName_V2, None]]:
    """Whether ``data`` is the Zarr v2 JSON of a data type without an object codec (as in zarr 3.4)."""
    return check_dtype_spec_v2(data) and data["object_codec_id"] is None
