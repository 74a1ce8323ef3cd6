"""zarr-python data types for the ``ml_dtypes`` floating-point types.

zarr-python knows only the data types of the Zarr core specification. This
module teaches it bfloat16 and the float8 family under the names TensorStore
writes in ``zarr.json`` (``"bfloat16"``, ``"float8_e4m3fn"``, ...), so an
array written by either library opens in the other.

There are two ways to make zarr-python use these types:

* call :func:`register_zarr_dtypes` (idempotent), or
* install gpuckpt, whose ``zarr.data_type`` entry points name the classes
  below; zarr-python then loads them the first time it resolves a data type.

Fill values use the JSON encoding the Zarr v3 specification defines for
floating-point types: a JSON number, one of ``"NaN"``, ``"Infinity"`` and
``"-Infinity"``, or ``"0x"`` followed by the raw bit pattern in hexadecimal.

Zarr v2 arrays are read-only: zarr-python opens those whose ``.zarray``
``dtype`` is one of these names (as TensorStore's ``zarr`` driver writes
them, little-endian), but cannot write them, because its v2 chunk encoder
passes chunks through the buffer protocol, which NumPy refuses for
``ml_dtypes`` arrays. NumPy's own spelling of these dtypes (``"<V2"``,
``"<V1"``) is not used: it cannot tell bfloat16 from raw bytes, nor the
float8 types from each other.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self, TypeGuard, cast, overload

import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import DTypeConfig_V2, DTypeJSON, HasEndianness, HasItemSize
from zarr.core.dtype.npy.common import (
    endianness_to_numpy_str,
    get_endianness_from_numpy_dtype,
)
from zarr.core.dtype.wrapper import TBaseDType, ZDType

from gpuckpt.format._zarr_compat import DataTypeValidationError, check_dtype_spec_no_object_codec_v2
from gpuckpt.format.dtypes import ML_DTYPE_NAMES, dtype_from_name

if TYPE_CHECKING:
    from zarr.core.common import JSON, ZarrFormat

__all__ = [
    "ZARR_DTYPE_CLASSES",
    "BFloat16",
    "Float8E3M4",
    "Float8E4M3",
    "Float8E4M3B11FNUZ",
    "Float8E4M3FN",
    "Float8E4M3FNUZ",
    "Float8E5M2",
    "Float8E5M2FNUZ",
    "Float8E8M0FNU",
    "register_zarr_dtypes",
]

# The special strings of the Zarr v3 float fill-value encoding.
_NAN = "NaN"
_POS_INF = "Infinity"
_NEG_INF = "-Infinity"

# Unsigned integer dtypes of the same width, used to read and write bit patterns.
_BITS_DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16)}

# Scalar types of all the ml_dtypes types: cast_scalar accepts a value of any
# of them for any type (converting through float64).
_ML_SCALAR_TYPES: frozenset[type[np.generic]] = frozenset(
    dtype_from_name(name).type for name in ML_DTYPE_NAMES
)


def _as_scalar(array: np.ndarray[Any, Any]) -> np.generic:
    """Return the element of a 0-d array as a NumPy scalar."""
    # Indexing with () gives a scalar for a 0-d array; the stubs cannot know that.
    return cast("np.generic", array[()])


@dataclass(frozen=True, kw_only=True)
class _MLFloat(ZDType[TBaseDType, np.generic], HasItemSize):
    """Shared behaviour of the ``ml_dtypes`` floating-point data types.

    A concrete subclass sets only ``_zarr_v3_name``; ``__init_subclass__``
    derives everything else from the NumPy dtype of that name, so the nine
    classes cannot drift apart from :mod:`gpuckpt.format.dtypes`.

    Attributes
    ----------
    dtype_cls : ClassVar[type]
        The NumPy dtype class (``type(np.dtype(ml_dtypes.X))``).
    _zarr_v3_name : ClassVar[str]
        The data-type name, as TensorStore writes it.
    """

    dtype_cls: ClassVar[type[TBaseDType]]
    _zarr_v3_name: ClassVar[str]
    # Scalar type (e.g. ``ml_dtypes.bfloat16``) and the native-order dtype.
    _scalar_type: ClassVar[type[np.generic]]
    _native: ClassVar[np.dtype[Any]]
    # Unsigned integer dtype of the same width, for bit-pattern work.
    _bits_dtype: ClassVar[np.dtype[Any]]
    # Bit pattern of the NaN that the string "NaN" stands for.
    _nan_bits: ClassVar[int]
    # Whether the type can hold infinities (the "fn"/"fnuz"/"fnu" types cannot).
    _has_inf: ClassVar[bool]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("_zarr_v3_name")
        if name is None:
            # An intermediate base class, not a data type.
            return
        native = dtype_from_name(name)
        cls.dtype_cls = type(native)
        cls._scalar_type = native.type
        cls._native = native
        cls._bits_dtype = _BITS_DTYPES[native.itemsize]
        cls._nan_bits = int(np.array(np.nan).astype(native).view(cls._bits_dtype))
        cls._has_inf = bool(np.isinf(np.array(np.inf).astype(native)))

    @property
    def item_size(self) -> int:
        """Size of one element in bytes.

        Returns
        -------
        int
            1 for the float8 types, 2 for bfloat16.
        """
        return int(self._native.itemsize)

    # ------------------------------------------------------------------ #
    # Data-type JSON
    # ------------------------------------------------------------------ #

    @classmethod
    def _check_json_v2(cls, data: DTypeJSON) -> TypeGuard[DTypeConfig_V2[str, None]]:
        return check_dtype_spec_no_object_codec_v2(data) and data["name"] == cls._zarr_v3_name

    @classmethod
    def _check_json_v3(cls, data: DTypeJSON) -> TypeGuard[str]:
        return data == cls._zarr_v3_name

    @classmethod
    def _from_json_v2(cls, data: DTypeJSON) -> Self:
        if cls._check_json_v2(data):
            return cls._from_json_v2_checked()
        raise DataTypeValidationError(
            f"Invalid Zarr v2 JSON for {cls.__name__}: {data!r}; expected "
            f"{{'name': {cls._zarr_v3_name!r}, 'object_codec_id': None}}."
        )

    @classmethod
    def _from_json_v3(cls, data: DTypeJSON) -> Self:
        if cls._check_json_v3(data):
            return cls()
        raise DataTypeValidationError(
            f"Invalid Zarr v3 JSON for {cls.__name__}: {data!r}; expected {cls._zarr_v3_name!r}."
        )

    @classmethod
    def _from_json_v2_checked(cls) -> Self:
        """Instance for Zarr v2 metadata that names this type."""
        return cls()

    @overload
    def to_json(self, zarr_format: Literal[2]) -> DTypeConfig_V2[str, None]: ...

    @overload
    def to_json(self, zarr_format: Literal[3]) -> str: ...

    def to_json(self, zarr_format: ZarrFormat) -> DTypeConfig_V2[str, None] | str:
        """Serialize the data type for array metadata.

        Parameters
        ----------
        zarr_format : {2, 3}
            The Zarr format version.

        Returns
        -------
        str
            The name (Zarr v3).

        Raises
        ------
        DataTypeValidationError
            For Zarr v2, which zarr-python can read these types from but not
            write them to.
        """
        if zarr_format == 2:
            # Reading works (chunks are viewed as this dtype), but zarr-python's
            # v2 writer hands chunks to numcodecs through the buffer protocol,
            # which NumPy refuses for these dtypes; fail before any metadata is
            # written rather than leave an array whose chunks cannot be stored.
            raise DataTypeValidationError(
                f"zarr-python cannot write Zarr v2 arrays of {self._zarr_v3_name}: its v2 "
                "chunk encoder does not accept ml_dtypes arrays. Use zarr_format=3."
            )
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"zarr_format must be 2 or 3, got {zarr_format}")  # pragma: no cover

    # ------------------------------------------------------------------ #
    # Scalars
    # ------------------------------------------------------------------ #

    def _check_scalar(self, data: object) -> bool:
        if isinstance(data, str):
            try:
                self._parse_string(data)
            except ValueError:
                return False
            return True
        if isinstance(data, np.ndarray):
            # A 0-d array stands for the scalar it holds, as in NumPy.
            return data.shape == () and self._check_scalar(data[()])
        return isinstance(data, numbers.Real | np.number | np.bool_) or (type(data) in _ML_SCALAR_TYPES)

    def cast_scalar(self, data: object) -> np.generic:
        """Convert a Python or NumPy value to a scalar of this type.

        Parameters
        ----------
        data : object
            A real number, a NumPy or ``ml_dtypes`` scalar, or one of the
            fill-value strings (``"NaN"``, ``"Infinity"``, ``"-Infinity"``,
            ``"0x..."``).

        Returns
        -------
        numpy.generic
            The value, rounded to this type as NumPy's ``astype`` rounds.

        Raises
        ------
        TypeError
            If ``data`` is of a kind that cannot stand for a number.
        """
        if not self._check_scalar(data):
            raise TypeError(
                f"Cannot convert {data!r} (type {type(data).__name__}) to a {self._zarr_v3_name} "
                "scalar; expected a real number or one of 'NaN', 'Infinity', '-Infinity', '0x...'."
            )
        if isinstance(data, str):
            return self._parse_string(data)
        if isinstance(data, np.generic | np.ndarray) and data.dtype.type is self._scalar_type:
            # Already this type: keep the bits, since a detour through float64
            # would turn every NaN into the canonical one.
            return _as_scalar(np.asarray(data).astype(self._native))
        # ml_dtypes casts only from floating types (not every type casts from
        # integers, nor to each other). float64 holds every value of these
        # types, and every int a fill value plausibly is, exactly; so the one
        # rounding is the final astype, nearest-even as in array writes.
        as_float64 = np.asarray(data).astype(np.float64)
        return _as_scalar(as_float64.astype(self._native))

    def default_scalar(self) -> np.generic:
        """Return the default fill value: the value whose bits are all zero.

        Returns
        -------
        numpy.generic
            ``0`` for every type except float8_e8m0fnu, which has no zero;
            there the all-zero bits mean 2**-127 (converting 0 would give NaN).
        """
        return self._from_bits(0)

    def from_json_scalar(self, data: JSON, *, zarr_format: ZarrFormat) -> np.generic:
        """Read a fill value from array metadata.

        Parameters
        ----------
        data : JSON
            A JSON number, ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, or a
            ``"0x"``-prefixed hexadecimal bit pattern.
        zarr_format : {2, 3}
            The Zarr format version; both accept the same encodings.

        Returns
        -------
        numpy.generic
            The fill value.

        Raises
        ------
        TypeError
            If ``data`` is neither a number nor a string.
        ValueError
            If a string is none of the accepted forms, or names a value the
            type cannot hold.
        """
        if isinstance(data, str):
            return self._parse_string(data)
        # bool is a subclass of int, but JSON true/false is no fill value for a float.
        if isinstance(data, int | float) and not isinstance(data, bool):
            return self.cast_scalar(data)
        raise TypeError(
            f"Invalid fill value {data!r} for {self._zarr_v3_name}: expected a JSON number or "
            "one of 'NaN', 'Infinity', '-Infinity', '0x...'."
        )

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> JSON:
        """Write a fill value for array metadata.

        Parameters
        ----------
        data : object
            Anything :meth:`cast_scalar` accepts.
        zarr_format : {2, 3}
            The Zarr format version.

        Returns
        -------
        JSON
            ``"NaN"`` for the type's canonical NaN, ``"Infinity"`` /
            ``"-Infinity"`` for infinities, a JSON number when it reads back to
            the same bits (an ``int`` for integral values, so zero is ``0``),
            and a ``"0x"`` hex bit pattern otherwise (NaNs with another sign or
            payload).
        """
        value = self.cast_scalar(data)
        bits = self._to_bits(value)
        as_float = float(value)
        if math.isnan(as_float):
            if bits == self._nan_bits:
                return _NAN
            # Only the hex form keeps the sign and payload of any other NaN.
            return self._format_hex(bits)
        if math.isinf(as_float):
            return _POS_INF if as_float > 0 else _NEG_INF
        # Every finite value of these types is exactly a float64, so this check
        # holds in practice; it stays so a lossy number is never written.
        if self._to_bits(self.cast_scalar(as_float)) != bits:
            return self._format_hex(bits)
        if as_float.is_integer() and not (as_float == 0 and math.copysign(1.0, as_float) < 0):
            # Integral values as JSON integers, so zero is written as 0. -0.0
            # stays a float: the integer 0 would lose its sign.
            return int(as_float)
        return as_float

    # ------------------------------------------------------------------ #
    # Helpers
    # ------------------------------------------------------------------ #

    def _from_bits(self, bits: int) -> np.generic:
        bits_array = np.array(bits, dtype=self._bits_dtype)
        return _as_scalar(bits_array.view(self._native))

    def _to_bits(self, value: np.generic) -> int:
        return int(np.asarray(value, dtype=self._native).view(self._bits_dtype))

    def _format_hex(self, bits: int) -> str:
        return f"0x{bits:0{2 * self._native.itemsize}x}"

    def _parse_string(self, data: str) -> np.generic:
        """Parse a fill-value string: a special float name or a hex bit pattern."""
        if data == _NAN:
            return self._from_bits(self._nan_bits)
        if data in (_POS_INF, _NEG_INF):
            if not self._has_inf:
                raise ValueError(
                    f"{self._zarr_v3_name} has no infinity, so {data!r} is not a valid fill value."
                )
            return self.cast_scalar(math.inf if data == _POS_INF else -math.inf)
        if data[:2] in ("0x", "0X"):
            digits = data[2:]
            n_bits = 8 * self._native.itemsize
            # Accept the digits leniently (any case, fewer than the full width)
            # but never a pattern wider than the type: that would drop bits.
            if digits and all(c in "0123456789abcdefABCDEF" for c in digits):
                bits = int(digits, 16)
                if bits < (1 << n_bits):
                    return self._from_bits(bits)
            raise ValueError(
                f"Invalid hex fill value {data!r} for {self._zarr_v3_name}: expected '0x' and "
                f"at most {n_bits // 4} hexadecimal digits."
            )
        raise ValueError(
            f"Invalid fill value {data!r} for {self._zarr_v3_name}: expected 'NaN', 'Infinity', "
            "'-Infinity' or a '0x'-prefixed hexadecimal bit pattern."
        )


@dataclass(frozen=True, kw_only=True)
class _MLFloat8(_MLFloat):
    """Base class of the one-byte types, which have no byte order."""

    @classmethod
    def from_native_dtype(cls, dtype: TBaseDType) -> Self:
        """Wrap a NumPy dtype of this type.

        Parameters
        ----------
        dtype : numpy.dtype
            The NumPy dtype.

        Returns
        -------
        Self
            The data type.

        Raises
        ------
        DataTypeValidationError
            If ``dtype`` is another type (this is how the registry tells
            that a class does not match).
        """
        if cls._check_native_dtype(dtype):
            return cls()
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected an instance of {cls.dtype_cls}")

    def to_native_dtype(self) -> TBaseDType:
        """Return the NumPy dtype of this type.

        Returns
        -------
        numpy.dtype
            e.g. ``np.dtype(ml_dtypes.float8_e4m3fn)``.
        """
        return self._native


@dataclass(frozen=True, kw_only=True)
class _MLFloat16(_MLFloat, HasEndianness):
    """Base class of the two-byte types.

    Like zarr-python's ``Float16``, the data type carries the byte order of
    the in-memory array (``endianness``), and being a ``HasEndianness`` makes
    the ``bytes`` codec require and honour an ``endian`` setting for the
    stored bytes, independently of the in-memory order.
    """

    @classmethod
    def from_native_dtype(cls, dtype: TBaseDType) -> Self:
        """Wrap a NumPy dtype of this type, keeping its byte order.

        Parameters
        ----------
        dtype : numpy.dtype
            The NumPy dtype, in either byte order.

        Returns
        -------
        Self
            The data type.

        Raises
        ------
        DataTypeValidationError
            If ``dtype`` is another type.
        """
        if cls._check_native_dtype(dtype):
            return cls(endianness=get_endianness_from_numpy_dtype(dtype))
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected an instance of {cls.dtype_cls}")

    def to_native_dtype(self) -> TBaseDType:
        """Return the NumPy dtype of this type in the data type's byte order.

        Returns
        -------
        numpy.dtype
            e.g. ``np.dtype(ml_dtypes.bfloat16)``, byte-swapped when
            ``endianness`` is not the machine's.
        """
        return self._native.newbyteorder(endianness_to_numpy_str(self.endianness))

    @classmethod
    def _from_json_v2_checked(cls) -> Self:
        # Zarr v2 chunks hold the in-memory bytes, and TensorStore writes these
        # types little-endian there. (For Zarr v3 the bytes codec sets the
        # stored order, so the in-memory order stays the machine's.)
        return cls(endianness="little")


# One class per type. ``__init_subclass__`` fills in everything but the name.


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloat16):
    """bfloat16: 1 sign, 8 exponent, 7 mantissa bits; infinities and NaNs."""

    _zarr_v3_name: ClassVar[str] = "bfloat16"


@dataclass(frozen=True, kw_only=True)
class Float8E3M4(_MLFloat8):
    """float8_e3m4: IEEE-like 8-bit float, 3 exponent bits; infinities and NaNs."""

    _zarr_v3_name: ClassVar[str] = "float8_e3m4"


@dataclass(frozen=True, kw_only=True)
class Float8E4M3(_MLFloat8):
    """float8_e4m3: IEEE-like 8-bit float, 4 exponent bits; infinities and NaNs."""

    _zarr_v3_name: ClassVar[str] = "float8_e4m3"


@dataclass(frozen=True, kw_only=True)
class Float8E4M3B11FNUZ(_MLFloat8):
    """float8_e4m3b11fnuz: exponent bias 11; no infinities, no -0, one NaN (0x80)."""

    _zarr_v3_name: ClassVar[str] = "float8_e4m3b11fnuz"


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MLFloat8):
    """float8_e4m3fn: 4 exponent bits; no infinities, NaN is 0x7f / 0xff."""

    _zarr_v3_name: ClassVar[str] = "float8_e4m3fn"


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FNUZ(_MLFloat8):
    """float8_e4m3fnuz: 4 exponent bits; no infinities, no -0, one NaN (0x80)."""

    _zarr_v3_name: ClassVar[str] = "float8_e4m3fnuz"


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MLFloat8):
    """float8_e5m2: IEEE-like 8-bit float, 5 exponent bits; infinities and NaNs."""

    _zarr_v3_name: ClassVar[str] = "float8_e5m2"


@dataclass(frozen=True, kw_only=True)
class Float8E5M2FNUZ(_MLFloat8):
    """float8_e5m2fnuz: 5 exponent bits; no infinities, no -0, one NaN (0x80)."""

    _zarr_v3_name: ClassVar[str] = "float8_e5m2fnuz"


@dataclass(frozen=True, kw_only=True)
class Float8E8M0FNU(_MLFloat8):
    """float8_e8m0fnu: unsigned powers of two 2**-127..2**127; no zero, NaN is 0xff."""

    _zarr_v3_name: ClassVar[str] = "float8_e8m0fnu"


#: The data-type classes, keyed by their Zarr v3 (TensorStore) name.
ZARR_DTYPE_CLASSES: dict[str, type[_MLFloat]] = {
    cls._zarr_v3_name: cls
    for cls in (
        BFloat16,
        Float8E3M4,
        Float8E4M3,
        Float8E4M3B11FNUZ,
        Float8E4M3FN,
        Float8E4M3FNUZ,
        Float8E5M2,
        Float8E5M2FNUZ,
        Float8E8M0FNU,
    )
}

# A name added to gpuckpt.format.dtypes without a class here would fail only when an
# array of that type is written; fail at import instead.
if set(ZARR_DTYPE_CLASSES) != set(ML_DTYPE_NAMES):  # pragma: no cover
    raise ImportError(
        "gpuckpt.format.zarr_dtypes is out of step with gpuckpt.format.dtypes.ML_DTYPE_NAMES: "
        f"{sorted(set(ZARR_DTYPE_CLASSES) ^ set(ML_DTYPE_NAMES))}"
    )


def register_zarr_dtypes() -> None:
    """Register the ``ml_dtypes`` data types with zarr-python.

    Afterwards ``zarr.create_array(..., dtype=ml_dtypes.bfloat16)`` picks
    :class:`BFloat16`, and arrays whose metadata names one of these types
    open. Calling it again does nothing. An installed gpuckpt also registers
    them through its ``zarr.data_type`` entry points, which zarr-python 3.4 and
    later load; zarr-python 3.1 (Python 3.11) does not, so call this there.
    """
    for name, cls in ZARR_DTYPE_CLASSES.items():
        # The registry keys classes by name, so registering again replaces
        # an entry with itself.
        data_type_registry.register(name, cls)
