"""The checkpoint layout: which Zarr v3 documents go where.

::

    CHECKPOINT/
      zarr.json                 root group; attributes["gpuckpt"] holds the Metadata
      <array name>/zarr.json    one Zarr v3 array per tensor (logical shape and dtype)
      <array name>/c.0.0        its chunks: bytes codec (little-endian) + crc32c

Array names come from FQNs (:mod:`gpuckpt.format.names`). Chunk keys use
Zarr's ``default`` encoding with the ``.`` separator, so an array's chunks
are plain files in its directory. The root ``zarr.json`` is written last; a
directory or prefix without it is not a checkpoint.

Documents are size-capped, by the writer and by every reader, before a byte
of them is read: :data:`MAX_ROOT_DOCUMENT_BYTES` for the root (about 100
bytes per chunk: room for some 2 million chunks, or some 450,000 single-chunk
tensors with 40-character names) and :data:`MAX_ARRAY_DOCUMENT_BYTES` for an
array's ``zarr.json`` (a regular grid takes a few hundred bytes; a
rectilinear one at most about 20 bytes per chunk edge, well under what the
same chunks take in the root document).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import numpy as np

from gpuckpt.errors import MetadataError
from gpuckpt.format import jsontext
from gpuckpt.format.checksum import crc32c_loaded
from gpuckpt.format.codecs import Codec
from gpuckpt.format.dtypes import dtype_name
from gpuckpt.format.grid import ChunkGrid
from gpuckpt.format.metadata import Metadata

__all__ = [
    "ATTRIBUTE",
    "MAX_ARRAY_DOCUMENT_BYTES",
    "MAX_ROOT_DOCUMENT_BYTES",
    "ROOT_DOCUMENT_PREFIX",
    "ROOT_KEY",
    "array_document",
    "chunk_file_key",
    "expected_array_document",
    "is_chunk_file_key",
    "metadata_json",
    "root_document",
    "root_document_problem",
]

ROOT_KEY = "zarr.json"
#: Largest root ``zarr.json`` gpuckpt writes or reads (256 MiB): larger ones are refused unread.
MAX_ROOT_DOCUMENT_BYTES = 256 << 20
#: Largest array ``zarr.json`` gpuckpt reads (64 MiB): larger ones are refused unread.
MAX_ARRAY_DOCUMENT_BYTES = 64 << 20
ATTRIBUTE = "gpuckpt"
_CHUNK_KEY_RE = re.compile(r"^c(\.(0|[1-9][0-9]{0,17}))*$")


@functools.lru_cache(maxsize=4096)
def chunk_file_key(coords: tuple[int, ...]) -> str:
    """File name of a chunk inside its array directory (``c.0.1``; ``c`` for 0-d)."""
    return "c." + ".".join(map(str, coords)) if coords else "c"


def is_chunk_file_key(key: object) -> bool:
    return isinstance(key, str) and _CHUNK_KEY_RE.match(key) is not None


_INT_NAMES = frozenset(("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"))


def _fill_value(dtype: np.dtype[Any]) -> Any:
    if dtype.kind == "b":
        return False
    if dtype.kind == "c":
        return [0.0, 0.0]
    if dtype.kind == "f" or dtype_name(dtype) not in _INT_NAMES:
        if dtype_name(dtype) in ("float16", "float32", "float64"):
            return 0.0
        # ml_dtypes floats: the all-zero bit pattern, spelled as hex as the
        # Zarr v3 spec allows for floats (not every such type has a zero)
        return "0x" + "00" * dtype.itemsize
    return 0


def expected_array_document(
    *,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    grid: ChunkGrid,
    fqn: str,
    memory_format: str,
    codec: Codec | None = None,
) -> dict[str, Any]:
    """The ``zarr.json`` of one tensor's array, as the JSON object a save writes.

    The one definition of that document: :func:`array_document` encodes it for
    a writer, and :func:`gpuckpt.verify.verify_checkpoint` compares a stored
    document with it. ``attributes.gpuckpt`` names the tensor (``fqn``) and
    its ``memory_format`` (a :class:`~gpuckpt.format.memory_format.MemoryFormat` name).
    A compressed tensor's ``codec`` goes between ``bytes`` and ``crc32c``
    (:mod:`gpuckpt.format.codecs`).
    """
    codecs: list[dict[str, Any]] = [{"name": "bytes"}, {"name": "crc32c"}]
    if dtype.itemsize > 1:
        codecs[0]["configuration"] = {"endian": "little"}
    if codec is not None:
        codecs.insert(1, codec.to_json())
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtype_name(dtype),
        "chunk_grid": grid.to_zarr_json(),
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": _fill_value(dtype),
        "codecs": codecs,
        "attributes": {ATTRIBUTE: {"fqn": fqn, "memory_format": memory_format}},
    }


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _ints(values: tuple[int, ...]) -> bytes:
    return b"[" + ",".join(map(str, values)).encode() + b"]"


@functools.lru_cache(maxsize=256)
def _document_parts(
    dtype: np.dtype[Any], memory_format: str, codec: Codec | None
) -> tuple[bytes, bytes, bytes]:
    """The parts of an array document that follow from its dtype, memory format and codec: what
    goes between the shape and the chunk grid, between the grid and the FQN, and after the FQN."""
    doc = expected_array_document(
        shape=(), dtype=dtype, grid=ChunkGrid.regular((), ()), fqn="", memory_format="", codec=codec
    )
    codecs, fill = doc["codecs"], doc["fill_value"]
    before_grid = b',"data_type":' + _dumps(doc["data_type"]) + b',"chunk_grid":'
    before_fqn = (
        b',"chunk_key_encoding":' + _dumps(doc["chunk_key_encoding"]) + b',"fill_value":' + _dumps(fill)
    )
    before_fqn += b',"codecs":' + _dumps(codecs) + b',"attributes":{"' + ATTRIBUTE.encode() + b'":{"fqn":'
    return before_grid, before_fqn, b',"memory_format":' + _dumps(memory_format) + b"}}}"


def array_document(
    *,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    grid: ChunkGrid,
    fqn: str,
    memory_format: str,
    codec: Codec | None = None,
) -> bytes:
    """The ``zarr.json`` of one tensor's array (:func:`expected_array_document`), encoded: the
    bytes ``json.dumps`` gives the object with compact separators, built from parts kept per
    dtype (a save of many small tensors writes thousands of them)."""
    before_grid, before_fqn, end = _document_parts(dtype, memory_format, codec)
    if grid.kind == "regular":
        chunk_grid = b'{"name":"regular","configuration":{"chunk_shape":' + _ints(grid.chunk_shape) + b"}}"
    else:
        chunk_grid = _dumps(grid.to_zarr_json())
    return b"".join(
        (
            b'{"zarr_format":3,"node_type":"array","shape":',
            _ints(shape),
            before_grid,
            chunk_grid,
            before_fqn,
            _dumps(fqn),
            end,
        )
    )


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


_ROOT_PREFIX = (
    b'{"zarr_format":3,"node_type":"group","attributes":{"' + ATTRIBUTE.encode() + b'":{"metadata":'
)
_ROOT_SUFFIX = re.compile(rb',"metadata_crc32c":(0|[1-9][0-9]{0,9})\}\}\}\Z')


def root_document(metadata: Metadata) -> bytes:
    """The root group's ``zarr.json``, carrying the metadata and its CRC32C.

    The metadata is embedded in its canonical form (sorted keys, compact), so
    it is encoded once and its checksum covers exactly those bytes.
    """
    canonical = _canonical(metadata.to_json_dict())
    doc = (
        _ROOT_PREFIX
        + canonical
        + b',"metadata_crc32c":'
        + str(crc32c_loaded(memoryview(canonical))).encode()
        + b"}}}"
    )
    if len(doc) > MAX_ROOT_DOCUMENT_BYTES:
        # readers refuse it unread: never publish a checkpoint that cannot be loaded
        raise MetadataError(
            f"the checkpoint's root metadata would be {len(doc)} bytes, more than "
            f"MAX_ROOT_DOCUMENT_BYTES ({MAX_ROOT_DOCUMENT_BYTES} bytes) that gpuckpt reads back; "
            f"nothing was published: {_what_to_shrink(metadata)}"
        )
    return doc


def _what_to_shrink(metadata: Metadata) -> str:
    """What makes a root document too large, and what to do about it: plain values (kept in the
    document) that are large, else the chunk records."""
    objects = metadata.storage_data.get("objects") if isinstance(metadata.storage_data, dict) else None
    sizes = sorted(((len(_canonical(v)), fqn) for fqn, v in (objects or {}).items()), reverse=True)
    if sizes and sizes[0][0] > MAX_ROOT_DOCUMENT_BYTES // 4:
        size, fqn = sizes[0]
        return (
            f"the plain value {fqn!r} takes {size} bytes of it (plain values are kept in the metadata): "
            "store large data as an array instead (np.frombuffer(data, np.uint8) for bytes or text)"
        )
    return "save with a larger chunk_bytes (fewer chunks), or split the state into several checkpoints"


def too_large(where: str, size: int, limit: int, name: str) -> MetadataError:
    """The error for a document of ``size`` bytes over the cap ``name`` (= ``limit``)."""
    return MetadataError(
        f"{where} is {size} bytes, more than {name} ({limit} bytes) that gpuckpt reads; "
        "refusing to read it: the checkpoint is damaged or hostile, or was not written by gpuckpt"
    )


def _text(view: memoryview) -> str:
    """The JSON text in ``view``, decoded as :func:`json.loads` decodes bytes, with no copy of the bytes."""
    return str(view, json.detect_encoding(bytes(view[:4])), "surrogatepass")


def _as_written(raw: bytes | bytearray) -> Any:
    """The metadata of a root document exactly as :func:`root_document` writes it, or None.

    Then the checksum is checked on the stored bytes themselves, and only they are
    parsed; any other layout (a document re-serialized by another tool, a damaged
    one) takes the general path, which re-encodes the parsed metadata.
    """
    if not raw.startswith(_ROOT_PREFIX):
        return None
    tail = _ROOT_SUFFIX.search(raw, len(_ROOT_PREFIX))
    if tail is None:
        return None
    canonical = memoryview(raw)[len(_ROOT_PREFIX) : tail.start()]
    if crc32c_loaded(canonical) != int(tail.group(1)):
        return None
    try:
        return jsontext.loads(_text(canonical))
    except (ValueError, RecursionError):
        return None


def leading_planner_entry(raw: bytes | bytearray, key: str) -> tuple[bool, Any]:
    """``(True, planner_data[key])`` of a root document exactly as :func:`root_document` writes
    it, its checksum checked on the stored bytes, when that entry is the first of the
    metadata's canonical form (sorted keys: ``planner_data`` is the first key of the metadata,
    and ``key`` the first of its entries when no other sorts before it); ``(False, None)``
    otherwise: the caller reads the whole (:func:`metadata_json`).

    A local tier's part record is such an entry: a restore lists every part of a tier, and
    parsing the whole document of a part of 289 tensors took 1.6 ms (of 10,000, tens of ms)
    for the few fields it needs."""
    if len(raw) > MAX_ROOT_DOCUMENT_BYTES or not raw.startswith(_ROOT_PREFIX):
        return False, None
    lead = b'{"planner_data":{' + json.dumps(key).encode() + b":"
    start = len(_ROOT_PREFIX)
    if raw[start : start + len(lead)] != lead:
        return False, None
    tail = _ROOT_SUFFIX.search(raw, start)
    if tail is None:
        return False, None
    canonical = memoryview(raw)[start : tail.start()]
    if crc32c_loaded(canonical) != int(tail.group(1)):
        return False, None
    text = _text(canonical[len(lead) :])
    try:
        value, _end = jsontext.STRICT.raw_decode(text)
    except (ValueError, RecursionError):
        return False, None
    return True, value


def metadata_json(raw: bytes | bytearray, where: str) -> Any:
    """The JSON value of the metadata of a root ``zarr.json``, its checksum checked (the value
    itself is not: :func:`gpuckpt.format.reader.read_index` checks it); raises :class:`MetadataError`."""
    if len(raw) > MAX_ROOT_DOCUMENT_BYTES:
        raise too_large(where, len(raw), MAX_ROOT_DOCUMENT_BYTES, "MAX_ROOT_DOCUMENT_BYTES")
    md = _as_written(raw)
    if md is not None:
        return md
    try:
        doc = jsontext.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise MetadataError(
            f"{where} is not valid JSON ({exc}); the checkpoint's root metadata is damaged"
        ) from None
    if isinstance(doc, dict) and doc.get("zarr_format") == 3 and doc.get("node_type") == "array":
        raise MetadataError(
            f"{where} is not a Zarr v3 group document: it describes a Zarr array, not a checkpoint "
            "(a Zarr group); open the checkpoint's directory, the one above its arrays"
        )
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise MetadataError(f"{where} is not a Zarr v3 group document")
    attrs = doc.get("attributes")
    entry = attrs.get(ATTRIBUTE) if isinstance(attrs, dict) else None
    if not isinstance(entry, dict) or "metadata" not in entry:
        found = (
            f"no attributes.{ATTRIBUTE}"
            if not isinstance(attrs, dict) or ATTRIBUTE not in attrs
            else f"its attributes.{ATTRIBUTE} is {repr(entry)[:100]}, where gpuckpt's is an object "
            "with a metadata entry"
        )
        raise MetadataError(
            f"{where} is a Zarr group but not a gpuckpt checkpoint ({found}): a Zarr store another "
            "program wrote, or a checkpoint whose root document was rewritten"
        )
    md = entry["metadata"]
    expected = entry.get("metadata_crc32c")
    try:
        actual = crc32c_loaded(_canonical(md))
    except (ValueError, TypeError, RecursionError) as exc:
        raise MetadataError(f"{where}: metadata cannot be re-encoded ({exc})") from None
    if expected != actual:
        raise MetadataError(
            f"{where}: metadata checksum mismatch (stored {expected!r}, computed {actual}); "
            "the root metadata is damaged"
        )
    return md


#: how every root document written by :func:`root_document` begins
ROOT_DOCUMENT_PREFIX = _ROOT_PREFIX


def root_document_problem(raw: bytes) -> str | None:
    """Why ``raw`` is not the root ``zarr.json`` of a gpuckpt checkpoint; None when it is one.

    This is the identity test of :func:`metadata_json` (a Zarr v3
    group carrying ``attributes.gpuckpt.metadata``) without its integrity
    checks: a damaged checkpoint still counts as one, a Zarr store of another
    program does not. A document as gpuckpt writes it is recognised by its
    first bytes (:data:`ROOT_DOCUMENT_PREFIX`) without being parsed.
    """
    if raw.startswith(_ROOT_PREFIX):
        return None
    try:
        doc = jsontext.loads(raw)
    except (ValueError, RecursionError):
        return f"its {ROOT_KEY} is not JSON"
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3:
        return f"its {ROOT_KEY} is not a Zarr v3 document"
    if doc.get("node_type") != "group":
        return f"its {ROOT_KEY} describes a Zarr {str(doc.get('node_type'))[:20]!r} node, not a gpuckpt group"
    attrs = doc.get("attributes")
    entry = attrs.get(ATTRIBUTE) if isinstance(attrs, dict) else None
    if not isinstance(entry, dict) or "metadata" not in entry:
        return f"its {ROOT_KEY} is a Zarr group without attributes.{ATTRIBUTE} (another program's Zarr store)"
    return None
