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
  ``check_dtype_spec_v2``, of which it is the object-codec-free case.

Each name is found by trying the newer home first, so this module holds no
version numbers; when support for Python 3.11 ends, it can go.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeGuard

__all__ = ["DataTypeValidationError", "check_dtype_spec_no_object_codec_v2"]

try:
    from zarr.errors import DataTypeValidationError
except ImportError:  # zarr 3.1.x
    from zarr.core.dtype.common import DataTypeValidationError  # type: ignore[attr-defined,no-redef,unused-ignore]

if TYPE_CHECKING:
    from zarr.core.dtype.common import DTypeConfig_V2, DTypeName_V2

try:
    from zarr.core.dtype.common import check_dtype_spec_no_object_codec_v2
except ImportError:  # zarr 3.1.x
    from zarr.core.dtype.common import check_dtype_spec_v2

    def check_dtype_spec_no_object_codec_v2(  # type: ignore[misc,unused-ignore]
        data: object,
    ) -> TypeGuard[DTypeConfig_V2[DTypeName_V2, None]]:
        """Whether ``data`` is Zarr v2 data-type JSON without an object codec (as zarr 3.4's)."""
        return check_dtype_spec_v2(data) and data["object_codec_id"] is None
