"""What the bytes of a safetensors file and of a Hugging Face index mean: pure parsing, no I/O.

A safetensors file: 8 bytes (little-endian u64) giving the header length ``N``,
``N`` bytes of JSON (``{"name": {"dtype": "F32", "shape": [..], "data_offsets":
[begin, end]}, ..., "__metadata__": {str: str}}``), then the tensors' bytes, C
order, little-endian, at those offsets from the end of the header. The header is
validated as strictly as the reference implementation does: known dtypes, sizes
that match the shapes, offsets that tile the data exactly; and shapes within
gpuckpt's bounds (:func:`~gpuckpt.format.shapes.check_shape`).

A Hugging Face sharded directory adds ``model.safetensors.index.json``:
``{"metadata": {"total_size": N, ...}, "weight_map": {"name": "model-00001-of-00002.safetensors"}}``.
Every file name it gives must be a plain name in the same directory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from gpuckpt.errors import MetadataError
from gpuckpt.format import jsontext
from gpuckpt.format.dtypes import dtype_from_name
from gpuckpt.format.shapes import check_shape

__all__ = [
    "INDEX_NAME",
    "MAX_HEADER",
    "METADATA_KEY",
    "SAFETENSORS_DTYPES",
    "SINGLE_NAME",
    "check_bool_bytes",
    "parse_header",
    "parse_index",
    "shard_name",
]

#: safetensors dtype code -> the stored name of its dtype (every code gpuckpt can store)
_CODE_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}


class _CodeDtypes(Mapping[str, np.dtype[Any]]):
    """safetensors dtype code -> NumPy dtype, each looked up when asked for: ``ml_dtypes`` is
    imported only when one of its types is (:mod:`gpuckpt.format.dtypes`)."""

    def __getitem__(self, code: str) -> np.dtype[Any]:
        return dtype_from_name(_CODE_NAMES[code])

    def __iter__(self) -> Iterator[str]:
        return iter(_CODE_NAMES)

    def __len__(self) -> int:
        return len(_CODE_NAMES)

    def __contains__(self, code: object) -> bool:
        # a code read from a header may be anything JSON holds (a list is unhashable)
        return isinstance(code, str) and code in _CODE_NAMES


#: safetensors dtype code -> NumPy dtype (every code gpuckpt can store).
SAFETENSORS_DTYPES: Mapping[str, np.dtype[Any]] = _CodeDtypes()
#: the reference implementation's limit on the header length
MAX_HEADER = 100_000_000
#: The header key of the file's string metadata: no tensor can have this name.
METADATA_KEY = "__metadata__"
#: The index file of a sharded Hugging Face directory, and the name of an unsharded one's file.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: the index of a directory of a million tensors is some 100 MB; more is not an index
MAX_INDEX = 256 * 2**20


def shard_name(i: int, n: int) -> str:
    """The name transformers gives shard ``i`` (from 1) of ``n``: ``model-00001-of-00003.safetensors``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def parse_header(raw: bytes, data_len: int, where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensor entries and ``__metadata__`` of a header ``raw``, checked against ``data_len``
    bytes of data after it (``where`` names the file in errors).

    Raises
    ------
    MetadataError
        For anything the reference reader refuses, naming the tensor and the fix.
    """
    try:
        # UTF-8, as the format says (json.loads would take UTF-16 and UTF-32 too)
        header = jsontext.loads(bytes(raw).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise MetadataError(
            f"{where} is not a safetensors file: its header is not JSON in UTF-8 ({exc!s:.200})"
        ) from None
    if not isinstance(header, dict):
        raise MetadataError(f"{where}: safetensors header must be a JSON object")
    meta = header.pop(METADATA_KEY, None)
    if meta is None:  # (absent, or null)
        meta = {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise MetadataError(f"{where}: __metadata__ must map strings to strings")
    spans = []
    for name, e in header.items():
        at = f"{where}: tensor {name!r}"
        if not isinstance(e, dict):
            raise MetadataError(f"{at}: entry must be an object")
        code: Any = e.get("dtype")  # anything JSON holds: SAFETENSORS_DTYPES answers for all of it
        shape, offs = e.get("shape"), e.get("data_offsets")
        if code not in SAFETENSORS_DTYPES:
            raise MetadataError(
                f"{at}: dtype {code!r} is not supported; known: {', '.join(SAFETENSORS_DTYPES)}"
            )
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise MetadataError(f"{at}: shape {str(shape)[:200]} is not a list of non-negative integers")
        check_shape(shape, SAFETENSORS_DTYPES[code].itemsize, at)  # before any product of it
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise MetadataError(f"{at}: data_offsets {offs!r} must be [begin, end] with begin <= end")
        need = math.prod(shape) * SAFETENSORS_DTYPES[code].itemsize
        if offs[1] - offs[0] != need:
            raise MetadataError(
                f"{at}: data_offsets span {offs[1] - offs[0]} bytes, shape {shape} needs {need}"
            )
        spans.append((offs[0], offs[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise MetadataError(
                f"{where}: tensor {name!r} starts at {begin}, expected {end} (overlap or hole)"
            )
        end = stop
    if end != data_len:
        raise MetadataError(
            f"{where}: tensors cover {end} bytes, the file holds {data_len} after the header (truncated?); "
            "the file is damaged: export it again from its source"
        )
    return header, meta


def check_bool_bytes(values: np.ndarray, at: str) -> None:
    """Refuse a ``BOOL`` tensor's ``values`` (as read, C order) holding a byte other than 0 and
    1: safetensors stores a bool as one of those two, and another byte makes a NumPy or torch
    bool whose comparisons and reductions disagree with each other. Other dtypes pass as they are.

    Raises
    ------
    MetadataError
        Naming ``at`` (the file and tensor), the first such element and how many there are.
    """
    if values.dtype != np.bool_ or values.size == 0:
        return
    raw = values.reshape(-1).view(np.uint8)
    bad = raw > 1
    first = int(np.argmax(bad))
    if bad[first]:
        raise MetadataError(
            f"{at}: BOOL element {first} is the byte {int(raw[first]):#04x} "
            f"({int(np.count_nonzero(bad))} elements are "
            "neither 0 nor 1); safetensors stores a bool as 0 or 1, so the file is damaged or was not "
            "written by a safetensors writer: export it again from its source"
        )


def parse_index(raw: bytes | bytearray, where: str) -> tuple[dict[str, str], dict[str, Any]]:
    """``(weight_map, metadata)`` of a ``model.safetensors.index.json`` document ``raw``.

    Every shard name must be a plain file name ending in ``.safetensors`` (no directory
    part: an index cannot send a reader elsewhere).

    Raises
    ------
    MetadataError
        When the document is not JSON, lacks a ``weight_map`` of strings to strings, or names
        a shard outside its directory.
    """
    try:
        doc = jsontext.loads(raw, unique_keys=True)  # (a tensor in two shards: which one?)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise MetadataError(
            f"{where} is not a Hugging Face index: not JSON ({exc}); write it again (gpuckpt convert "
            "CKPT DIR --to hf writes one)"
        ) from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()
    ):
        raise MetadataError(
            f'{where}: expected an object with a "weight_map" of tensor names to shard file names; '
            "the index is damaged or not a safetensors index"
        )
    for name, shard in wmap.items():
        if shard in ("", ".", "..") or "/" in shard or "\\" in shard or "\0" in shard:
            raise MetadataError(
                f"{where}: tensor {name!r} maps to {shard[:200]!r}, which is not a file name in the "
                "index's directory; the index is damaged"
            )
        if name == METADATA_KEY:
            raise MetadataError(f"{where}: {METADATA_KEY!r} is not a tensor name; the index is damaged")
    meta = doc.get("metadata") or {}
    if not isinstance(meta, dict):
        raise MetadataError(f'{where}: "metadata" must be an object, got {type(meta).__name__}')
    return dict(wmap), dict(meta)
