"""Safe encoding of non-tensor values as tagged JSON.

Every value becomes a JSON object with exactly one member whose name is the
type tag, so that it comes back with its type:

=================  ==============================================
Python value       encoded as
=================  ==============================================
``None``           ``{"none": null}``
``bool``           ``{"bool": true}``
``int``            ``{"int": "123"}`` (decimal text), ``{"int": "-0x1f..."}`` (hex, large ints)
``float``          ``{"float": "0x1.8p+1"}`` (``float.hex``), ``{"float": "nan:7ff8000000000001"}``
``complex``        ``{"complex": ["0x1p+0", "-0x0.0p+0"]}`` (each part as for ``float``)
``str``            ``{"str": "text"}``
``bytes``          ``{"bytes": "<base64>"}``
``list``/``tuple``  ``{"list": [...]}`` / ``{"tuple": [...]}``
``dict``           ``{"dict": [[key, value], ...]}`` (keys encoded too)
NumPy scalar       ``{"numpy": {"dtype": "float32", "hex": "0000803f"}}``
other objects      ``{"pickle": "<base64>"}`` only with ``allow_pickle=True``
=================  ==============================================

Every value comes back bit for bit. ``float.hex`` is exact for every
float but a NaN, whose sign and payload it drops (``"nan"``): a NaN is
written as ``nan:`` and the 16 hex digits of its IEEE 754 bits instead
(format v1 files holding ``"nan"`` still load, as the default quiet NaN).
An int is written in decimal while it has at most 2,048 bits (617 digits,
under the lowest limit Python's ``int``/``str`` conversion can be set to),
in hex beyond that (linear time, no limit applies), up to
:data:`MAX_INT_BITS` bits; a larger int is refused on save, and a stored
one on load, so a hostile checkpoint cannot make the loader convert a
number of unbounded size.

Decoding never runs code: a ``pickle`` entry raises
:class:`~gpuckpt.errors.UnsafeCheckpointError` unless the caller opted in.
"""

from __future__ import annotations

import base64
import binascii
import pickle
import re
import struct
from typing import Any

import numpy as np

from gpuckpt.errors import MetadataError, UnsafeCheckpointError, UnsupportedValueError
from gpuckpt.format.dtypes import dtype_from_name, dtype_name, is_storable_dtype

__all__ = ["MAX_INT_BITS", "decode_object", "encode_object"]

_MAX_DEPTH = 100
#: The largest plain ``int`` stored, in bits (1 MiB of hex text).
MAX_INT_BITS = 1 << 22
_DECIMAL_BITS = 2048  # 617 digits: below 640, the lowest int_max_str_digits Python accepts
_MAX_DECIMAL_CHARS = 10_000  # what format v1 readers accepted (v1 wrote str(int))
_DECIMAL_RE = re.compile(r"-?[0-9]+")
_HEX_INT_RE = re.compile(r"-?0x[0-9a-f]+")
_NAN_RE = re.compile(r"nan:[0-9a-f]{16}")
_MAX_FLOAT_CHARS = 64  # float.hex never writes more than 24


def _int_text(v: int, fqn: str) -> str:
    bits = abs(v).bit_length()
    if bits <= _DECIMAL_BITS:
        return str(v)
    if bits > MAX_INT_BITS:
        raise UnsupportedValueError(
            f"value of {fqn!r} is an int of {bits} bits; plain ints are stored up to {MAX_INT_BITS} "
            "bits: store it as bytes (v.to_bytes(...)) or as an array instead"
        )
    return hex(v)


def _int_from_text(s: str) -> int:
    if _HEX_INT_RE.fullmatch(s):
        ndigits = len(s) - s.index("x") - 1
        if ndigits > MAX_INT_BITS // 4:
            raise ValueError(f"hex int of {ndigits} digits exceeds the {MAX_INT_BITS}-bit limit")
        return int(s, 16)
    if not _DECIMAL_RE.fullmatch(s):
        raise ValueError(f"{s[:40]!r} is not a decimal or hex integer")
    if len(s) > _MAX_DECIMAL_CHARS:
        raise ValueError(f"decimal int of {len(s)} characters exceeds {_MAX_DECIMAL_CHARS}")
    # in pieces below any int_max_str_digits setting; 10,000 digits cost microseconds
    neg = s.startswith("-")
    digits = s[1:] if neg else s
    v = 0
    for i in range(0, len(digits), 600):
        part = digits[i : i + 600]
        v = v * 10 ** len(part) + int(part)
    return -v if neg else v


def _float_text(x: float) -> str:
    if x != x:  # float.hex would write "nan", dropping the sign and payload
        return "nan:" + struct.pack(">d", x).hex()
    return x.hex()


def _float_from_text(s: Any) -> float:
    if not isinstance(s, str) or len(s) > _MAX_FLOAT_CHARS:
        raise ValueError(f"float text {str(s)[:40]!r} is not a string of at most {_MAX_FLOAT_CHARS} chars")
    if s.startswith("nan:"):
        if not _NAN_RE.fullmatch(s):
            raise ValueError(f"{s!r} is not 'nan:' and 16 lowercase hex digits")
        x: float = struct.unpack(">d", bytes.fromhex(s[4:]))[0]
        if x == x:
            raise ValueError(f"{s!r} holds the bits of a number, not of a NaN")
        return x
    return float.fromhex(s)


def encode_object(value: Any, *, allow_pickle: bool = False, fqn: str = "") -> dict[str, Any]:
    """Tagged JSON for ``value``; see the module docstring."""

    def enc(v: Any, depth: int) -> dict[str, Any]:
        if depth > _MAX_DEPTH:
            raise UnsupportedValueError(f"value of {fqn!r} is nested deeper than {_MAX_DEPTH} levels")
        if v is None:
            return {"none": None}
        if isinstance(v, np.generic):
            if not is_storable_dtype(v.dtype):
                return fallback(v)
            return {
                "numpy": {
                    "dtype": dtype_name(v.dtype),
                    "hex": np.asarray(v).astype(v.dtype.newbyteorder("<")).tobytes().hex(),
                }
            }
        # exact types: subclasses (enums, named tuples, ...) would not come back as themselves
        t = type(v)
        if t is bool:
            return {"bool": v}
        if t is int:
            return {"int": _int_text(v, fqn)}
        if t is float:
            return {"float": _float_text(v)}
        if t is complex:
            return {"complex": [_float_text(v.real), _float_text(v.imag)]}
        if t is str:
            return {"str": v}
        if t is bytes:
            return {"bytes": base64.b64encode(v).decode("ascii")}
        if t is list:
            return {"list": [enc(x, depth + 1) for x in v]}
        if t is tuple:
            return {"tuple": [enc(x, depth + 1) for x in v]}
        if t is dict:
            return {"dict": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
        return fallback(v)

    def fallback(v: Any) -> dict[str, Any]:
        if not allow_pickle:
            raise UnsupportedValueError(
                f"value of {fqn!r} has type {type(v).__module__}.{type(v).__qualname__}, which cannot be "
                "stored safely; convert it to plain types (int, float, str, bytes, lists, dicts, "
                "NumPy scalars) or pass allow_pickle=True to save (loading it will then need "
                "allow_pickle=True as well)"
            )
        try:
            payload = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise UnsupportedValueError(f"value of {fqn!r} cannot be pickled: {exc}") from exc
        return {"pickle": base64.b64encode(payload).decode("ascii")}

    return enc(value, 0)


#: how many keys of one dict may share a hash value. Python's hashes of ints, floats and tuples
#: of them are not salted: keys chosen to share one (``i * (2**61 - 1)``) make building the dict
#: quadratic, hours for a document of a few MB; real states have almost none.
MAX_KEYS_OF_ONE_HASH = 32


def refuse_flooded_keys(keys: list[Any], what: str) -> None:
    """A :class:`MetadataError` where more than :data:`MAX_KEYS_OF_ONE_HASH` of ``keys`` (about to
    become one dict's) share a hash value: work made quadratic on purpose. Linear in ``keys``:
    the counting dict is keyed by the hash values, ints that hash to themselves, all distinct."""
    if len(keys) <= MAX_KEYS_OF_ONE_HASH:
        return
    counts: dict[int, int] = {}
    for k in keys:
        h = hash(k)
        n = counts[h] = counts.get(h, 0) + 1
        if n > MAX_KEYS_OF_ONE_HASH:
            raise MetadataError(
                f"{what} has more than {MAX_KEYS_OF_ONE_HASH} keys of one hash value (e.g. {str(k)[:40]!r}): "
                "keys chosen to make loading take hours; the checkpoint is not one gpuckpt wrote"
            )


def decode_object(data: Any, *, allow_pickle: bool = False, fqn: str = "") -> Any:
    """Inverse of :func:`encode_object`; malformed input raises :class:`MetadataError`."""

    def bad(what: str) -> MetadataError:
        return MetadataError(f"stored value of {fqn!r} is malformed: {what}")

    def dec(d: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise bad(f"nested deeper than {_MAX_DEPTH} levels")
        if not isinstance(d, dict) or len(d) != 1:
            raise bad(f"expected a one-member object, found {str(d)[:100]}")
        ((tag, body),) = d.items()
        try:
            if tag == "none" and body is None:
                return None
            if tag == "bool" and isinstance(body, bool):
                return body
            if tag == "int" and isinstance(body, str):
                return _int_from_text(body)
            if tag == "float" and isinstance(body, str):
                return _float_from_text(body)
            if tag == "complex" and isinstance(body, list) and len(body) == 2:
                return complex(_float_from_text(body[0]), _float_from_text(body[1]))
            if tag == "str" and isinstance(body, str):
                return body
            if tag == "bytes" and isinstance(body, str):
                return base64.b64decode(body, validate=True)
            if tag == "list" and isinstance(body, list):
                return [dec(x, depth + 1) for x in body]
            if tag == "tuple" and isinstance(body, list):
                return tuple(dec(x, depth + 1) for x in body)
            if tag == "dict" and isinstance(body, list):
                pairs = []
                for item in body:
                    if not (isinstance(item, list) and len(item) == 2):
                        raise bad("dict item is not a [key, value] pair")
                    pairs.append((dec(item[0], depth + 1), dec(item[1], depth + 1)))
                refuse_flooded_keys([k for k, _ in pairs], f"stored value of {fqn!r}: a dict")
                return dict(pairs)
            if tag == "numpy" and isinstance(body, dict) and isinstance(body.get("hex"), str):
                dt = dtype_from_name(body.get("dtype"))  # type: ignore[arg-type]
                raw = bytes.fromhex(body["hex"])
                if len(raw) != dt.itemsize:
                    raise bad(f"numpy scalar has {len(raw)} bytes, dtype {dt} needs {dt.itemsize}")
                return np.frombuffer(raw, dt.newbyteorder("<"))[0].astype(dt)[()]
            if tag == "pickle" and isinstance(body, str):
                if not allow_pickle:
                    raise UnsafeCheckpointError(
                        f"entry {fqn!r} is a pickle; loading it could run arbitrary code. Pass "
                        "allow_pickle=True (--allow-pickle) only if you trust the checkpoint's origin"
                    )
                return pickle.loads(base64.b64decode(body, validate=True))
        except MetadataError:
            raise
        except (ValueError, TypeError, OverflowError, binascii.Error) as exc:
            # TypeError also covers an unhashable (list) dict key
            raise bad(f"{tag}: {exc}") from None
        except RecursionError:
            raise bad("nested too deeply") from None
        raise bad(f"unknown tag {tag!r} or wrong body type {type(body).__name__}")

    return dec(data, 0)
