"""Safe encoding of non-tensor values as tagged JSON.

Every value becomes a JSON object with exactly one member whose name is the
type tag, so that it comes back with its type:

=================  ==============================================
Python value       encoded as
=================  ==============================================
``None``           ``{"none": null}``
``bool``           ``{"bool": true}``
``int``            ``{"int": "123"}`` (a string: no precision loss)
``float``          ``{"float": "0x1.8p+1"}`` (``float.hex``: exact, NaN/inf)
``complex``        ``{"complex": ["0x1p+0", "-0x0p+0"]}``
``str``            ``{"str": "text"}``
``bytes``          ``{"bytes": "<base64>"}``
``list``/``tuple``  ``{"list": [...]}`` / ``{"tuple": [...]}``
``dict``           ``{"dict": [[key, value], ...]}`` (keys encoded too)
NumPy scalar       ``{"numpy": {"dtype": "float32", "hex": "0000803f"}}``
other objects      ``{"pickle": "<base64>"}`` only with ``allow_pickle=True``
=================  ==============================================

Decoding never runs code: a ``pickle`` entry raises
:class:`~gpuckpt.errors.UnsafeCheckpointError` unless the caller opted in.
"""

from __future__ import annotations

import base64
import binascii
import pickle
from typing import Any

import numpy as np

from gpuckpt.dtypes import dtype_from_name, dtype_name, is_storable_dtype
from gpuckpt.errors import MetadataError, UnsafeCheckpointError, UnsupportedValueError

__all__ = ["decode_object", "encode_object"]

_MAX_DEPTH = 100


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
            return {"int": str(v)}
        if t is float:
            return {"float": v.hex()}
        if t is complex:
            return {"complex": [v.real.hex(), v.imag.hex()]}
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
            if tag == "int" and isinstance(body, str) and len(body) <= 10_000:
                return int(body)
            if tag == "float" and isinstance(body, str):
                return float.fromhex(body)
            if tag == "complex" and isinstance(body, list) and len(body) == 2:
                return complex(float.fromhex(body[0]), float.fromhex(body[1]))
            if tag == "str" and isinstance(body, str):
                return body
            if tag == "bytes" and isinstance(body, str):
                return base64.b64decode(body, validate=True)
            if tag == "list" and isinstance(body, list):
                return [dec(x, depth + 1) for x in body]
            if tag == "tuple" and isinstance(body, list):
                return tuple(dec(x, depth + 1) for x in body)
            if tag == "dict" and isinstance(body, list):
                out = {}
                for item in body:
                    if not (isinstance(item, list) and len(item) == 2):
                        raise bad("dict item is not a [key, value] pair")
                    out[dec(item[0], depth + 1)] = dec(item[1], depth + 1)
                return out
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
                        "allow_pickle=True only if you trust the checkpoint's origin"
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
