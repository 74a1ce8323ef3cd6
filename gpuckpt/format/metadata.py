"""The checkpoint metadata model and its JSON form.

The names and behaviours follow the DCP-style model of the project's spec:
``ChunkStorageMetadata``, ``TensorProperties``, ``TensorStorageMetadata``,
``BytesStorageMetadata``, ``StorageMeta``, ``Metadata`` and
``MetadataIndex``. Unlike the reference framework, ``TensorProperties``
records the tensor's real memory format, and ``Metadata`` is stored as JSON
with a format version, never as a pickle.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from gpuckpt.errors import MetadataError, UnsupportedVersionError
from gpuckpt.format import columns as tensor_columns
from gpuckpt.format import memory_format as mf
from gpuckpt.format.dtypes import dtype_from_name, dtype_name, get_default_dtype


class ArrayProperties(Protocol):
    """What :meth:`TensorProperties.from_array` reads of an array (the adapters of
    :mod:`gpuckpt.device.arrays` have it)."""

    @property
    def dtype(self) -> Any: ...
    @property
    def requires_grad(self) -> bool: ...
    @property
    def memory_format(self) -> mf.MemoryFormat: ...
    @property
    def pinned(self) -> bool: ...


#: how :meth:`TensorProperties.create_from_tensor` views an array of any kind: set by
#: :mod:`gpuckpt.device.arrays` when it is imported (``import gpuckpt`` imports it), so that the
#: format imports no layer above it
_array_view: Callable[[Any], ArrayProperties] | None = None


def register_array_view(view: Callable[[Any], ArrayProperties]) -> None:
    """Let :meth:`TensorProperties.create_from_tensor` read arrays through ``view``."""
    global _array_view
    _array_view = view


#: the one reader of metadata (:func:`gpuckpt.format.reader.metadata_from_json`, which registers
#: itself: it builds on this module), behind :meth:`Metadata.from_json`
_json_reader: Callable[[Any], Metadata] | None = None


def register_json_reader(reader: Callable[[Any], Metadata]) -> None:
    """Let :meth:`Metadata.from_json` read metadata through ``reader``."""
    global _json_reader
    _json_reader = reader


__all__ = [
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "VERSION_COLUMNS",
    "COLUMN_VERSIONS",
    "CODEC_VERSIONS",
    "VERSION_BLOCKS",
    "VERSION_COMPRESSED",
    "VERSION_LISTED",
    "VERSION_WITH_TABLE",
    "STATE_DICT_TYPE",
    "STORAGE_TYPES",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "GridTensorStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
]

#: The newest version of the on-disk format this release writes (it reads every version up to it).
FORMAT_VERSION = "5"
#: The version of a checkpoint that lists every chunk in its metadata (the only form of version 1).
VERSION_LISTED = "1"
#: The version of a checkpoint that keeps its per-chunk records in a chunk table.
VERSION_WITH_TABLE = "2"
#: The version of a checkpoint that keeps its usual tensor entries as columns
#: (:mod:`gpuckpt.format.columns`; a superset of version 2).
VERSION_COLUMNS = "3"
#: The version of a checkpoint with compressed tensors (:mod:`gpuckpt.format.codecs`; a superset of
#: version 3: a tensor's entry may name its ``codec``, and its records give each chunk's stored size).
VERSION_COMPRESSED = "4"
#: The version of a checkpoint whose chunk table is ordered by the rank that wrote each block of
#: its rows (:mod:`gpuckpt.format.blocks`; a superset of version 4: its table entry has ``blocks``).
VERSION_BLOCKS = "5"
#: Every format version this release reads.
READABLE_VERSIONS = ("1", "2", "3", "4", "5")
#: The versions whose documents may hold tensor entries as columns (:mod:`gpuckpt.format.columns`).
COLUMN_VERSIONS = ("3", "4", "5")
#: The versions whose tensors may name a codec (:mod:`gpuckpt.format.codecs`).
CODEC_VERSIONS = ("4", "5")


@dataclass
class ChunkStorageMetadata:
    """One stored chunk: where it starts in the tensor and its extent."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class _MEM_FORMAT_ENCODING(Enum):
    CONTIGUOUS = 0
    CHANNELS_LAST = 1
    PRESERVE = 2
    CHANNELS_LAST_3D = 3


_ENCODING_OF = {
    mf.contiguous_format: _MEM_FORMAT_ENCODING.CONTIGUOUS,
    mf.channels_last: _MEM_FORMAT_ENCODING.CHANNELS_LAST,
    mf.preserve_format: _MEM_FORMAT_ENCODING.PRESERVE,
    mf.channels_last_3d: _MEM_FORMAT_ENCODING.CHANNELS_LAST_3D,
}
_FORMAT_OF = {enc: fmt for fmt, enc in _ENCODING_OF.items()}


_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass
class TensorProperties:
    """Properties of a stored tensor.

    Pickling encodes ``memory_format`` as an enum, as the spec requires; an
    unknown memory format or encoding raises ``RuntimeError``.
    """

    dtype: Any = field(default_factory=get_default_dtype)
    layout: Any = field(default_factory=lambda: mf.strided)
    requires_grad: bool = False
    memory_format: Any = field(default_factory=lambda: mf.contiguous_format)
    pin_memory: bool = False

    def __getstate__(self) -> tuple[Any, Any, bool, _MEM_FORMAT_ENCODING, bool]:
        memory_format = self.memory_format
        if memory_format is None:
            encoding = _MEM_FORMAT_ENCODING.CONTIGUOUS
        else:
            found = _ENCODING_OF.get(memory_format) if isinstance(memory_format, mf.MemoryFormat) else None
            if found is None:
                raise RuntimeError(f"invalid memory format: {memory_format}")
            encoding = found
        return (self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory)

    def __setstate__(self, state: tuple[Any, Any, bool, _MEM_FORMAT_ENCODING, bool]) -> None:
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        fmt = _FORMAT_OF.get(encoding) if isinstance(encoding, _MEM_FORMAT_ENCODING) else None
        if fmt is None:
            raise RuntimeError(f"invalid memory format encoding: {encoding}")
        self.memory_format = fmt

    @staticmethod
    def create_from_tensor(tensor: Any) -> TensorProperties:
        """Read dtype, layout, requires_grad, memory format and pinning of ``tensor``.

        Accepts the array kinds gpuckpt stores (NumPy arrays here; device
        arrays through :mod:`gpuckpt.device`). The memory format is the real
        one, detected from the strides.

        Examples
        --------
        >>> import numpy as np
        >>> x = np.zeros((8, 3, 4, 4), np.float32)
        >>> TensorProperties.create_from_tensor(x).memory_format
        gpuckpt.contiguous_format
        """
        if _array_view is None:  # gpuckpt.device.arrays registers it; import gpuckpt imports that
            raise RuntimeError("TensorProperties.create_from_tensor needs gpuckpt imported: import gpuckpt")
        return TensorProperties.from_array(_array_view(tensor))

    @staticmethod
    def from_array(array: ArrayProperties) -> TensorProperties:
        """The properties of the array behind ``array`` (an adapter of :mod:`gpuckpt.device.arrays`)."""
        dtype = array.dtype
        if dtype.byteorder == ">" or (dtype.byteorder == "=" and not _LITTLE_ENDIAN):
            dtype = dtype.newbyteorder("<")  # as stored: every chunk is little-endian
        return TensorProperties(
            dtype=dtype,
            layout=mf.strided,
            requires_grad=bool(array.requires_grad),
            memory_format=array.memory_format,
            pin_memory=bool(array.pinned),
        )

    # JSON form -------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        fmt = self.memory_format if self.memory_format is not None else mf.contiguous_format
        if fmt not in _ENCODING_OF:
            raise MetadataError(f"invalid memory format {fmt!r}; expected one of {list(_ENCODING_OF)}")
        return {
            "dtype": dtype_name(self.dtype),
            "layout": "strided",
            "requires_grad": bool(self.requires_grad),
            "memory_format": fmt.name,
            "pin_memory": bool(self.pin_memory),
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "properties") -> TensorProperties:
        d = _expect_dict(data, where)
        layout = _expect(d, "layout", str, where)
        if layout != "strided":
            raise MetadataError(f"{where}.layout is {layout!r}; only 'strided' is supported")
        fmt_name = _expect(d, "memory_format", str, where)
        try:
            fmt = mf.memory_format_from_name(fmt_name)
        except KeyError:
            raise MetadataError(
                f"{where}.memory_format is {fmt_name!r}; expected one of "
                "contiguous_format, channels_last, channels_last_3d, preserve_format"
            ) from None
        return cls(
            dtype=dtype_from_name(_expect(d, "dtype", str, where)),
            layout=mf.strided,
            requires_grad=_expect(d, "requires_grad", bool, where),
            memory_format=fmt,
            pin_memory=_expect(d, "pin_memory", bool, where),
        )


@dataclass
class TensorStorageMetadata:
    """A stored tensor: its properties, logical size and chunks."""

    properties: TensorProperties
    size: tuple[int, ...]
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    """A stored non-tensor value."""


@dataclass
class StorageMeta:
    """Identifiers of the checkpoint and of the save that wrote it."""

    checkpoint_id: str | os.PathLike[str] | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


class GridTensorStorageMetadata(TensorStorageMetadata):
    """A :class:`TensorStorageMetadata` whose chunks are those of a chunk grid, listed when first asked for.

    A checkpoint of a million chunks lists them in no document: each tensor's
    chunks are the chunks of its grid, in C order of their grid coordinates.
    ``chunks`` is built on first access (then it is a plain list, as on any
    :class:`TensorStorageMetadata`); equality, ``repr`` and pickling are those
    of the base class. ``listed``: whether the JSON form lists the chunks
    (format version 1 style) or leaves them to the grid.
    """

    def __init__(
        self,
        properties: TensorProperties,
        size: tuple[int, ...],
        chunks: list[ChunkStorageMetadata] | None = None,
        *,
        grid: Any = None,
        listed: bool = True,
    ) -> None:
        # ``chunks`` given (as by ``dataclasses.replace``): a plain entry of this class
        self.properties = properties
        self.size = size
        self._grid = grid
        self._listed = listed
        if chunks is not None or grid is None:
            self.chunks = [] if chunks is None else chunks

    def __getattr__(self, name: str) -> Any:
        if name == "chunks":
            grid = self.__dict__.get("_grid")
            if grid is None:
                raise AttributeError(name)
            chunks = [ChunkStorageMetadata(s.offsets, s.sizes) for s in grid.chunk_list()]
            self.chunks = chunks
            return chunks
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorStorageMetadata):
            return NotImplemented
        return (self.properties, tuple(self.size), self.chunks) == (
            other.properties,
            tuple(other.size),
            other.chunks,
        )

    __hash__ = None  # type: ignore[assignment]  # as the base dataclass: mutable, unhashable

    def __repr__(self) -> str:
        return (
            f"TensorStorageMetadata(properties={self.properties!r}, size={self.size!r}, "
            f"chunks={self.chunks!r})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (TensorStorageMetadata, (self.properties, self.size, self.chunks))


STORAGE_TYPES = TensorStorageMetadata | BytesStorageMetadata
STATE_DICT_TYPE = dict[str, Any]


@dataclass
class Metadata:
    """Everything a loader needs to know about a checkpoint.

    ``planner_data`` and ``storage_data`` hold JSON values only: the nested
    structure of the state dict (for unflattening) and, per tensor, the array
    path, chunk grid and per-chunk key, byte size and CRC32C checksum.
    """

    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None

    def to_json(self) -> str:
        """Serialise to a JSON string (format version included: unversioned metadata is written
        as the current version); :meth:`from_json` reads it back."""
        return json.dumps(self.to_json_dict(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, data: str | bytes | Mapping[str, Any]) -> Metadata:
        """The Metadata of ``data``: the text :meth:`to_json` wrote (or its parsed JSON value),
        read by the one reader of checkpoint metadata
        (:func:`gpuckpt.format.reader.metadata_from_json`) and checked as a checkpoint's is; a
        :class:`~gpuckpt.errors.MetadataError` names the first defect. Never a pickle."""
        if _json_reader is None:  # gpuckpt.format.reader registers it; import gpuckpt imports that
            raise RuntimeError("Metadata.from_json needs gpuckpt imported: import gpuckpt")
        return _json_reader(data)

    def to_json_dict(self) -> dict[str, Any]:
        """The JSON value of the metadata as a root document stores it: in format version 3, the
        usual tensor entries as columns (:func:`gpuckpt.format.columns.compact`)."""
        entries: dict[str, Any] = {}
        for fqn, md in self.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                entries[fqn] = {
                    "type": "tensor",
                    "properties": md.properties.to_json(),
                    "size": [int(s) for s in md.size],
                }
                if not isinstance(md, GridTensorStorageMetadata) or md._listed:
                    # chunk boxes come from the planner as Python ints: no per-element conversion
                    entries[fqn]["chunks"] = [
                        {"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks
                    ]
            elif isinstance(md, BytesStorageMetadata):
                entries[fqn] = {"type": "bytes"}
            else:
                raise MetadataError(f"entry {fqn!r} has unsupported metadata type {type(md).__name__}")
        meta = self.storage_meta
        # unversioned metadata is written as version 3, as before version 4 (compressed
        # tensors) existed: a save always names its version
        version = self.version or VERSION_COLUMNS
        data = {
            "version": version,
            "state_dict_metadata": entries,
            "planner_data": self.planner_data,
            "storage_data": self.storage_data,
            "storage_meta": None
            if meta is None
            else {
                "checkpoint_id": None if meta.checkpoint_id is None else os.fspath(meta.checkpoint_id),
                "save_id": meta.save_id,
                "load_id": meta.load_id,
                "modules": list(meta.modules),
            },
        }
        compact = version in COLUMN_VERSIONS
        return tensor_columns.compact(data) if compact else data


def parse_version(d: Mapping[str, Any]) -> str:
    """The format version of the metadata object ``d``, checked: one this gpuckpt reads."""
    version = d.get("version")
    if not isinstance(version, str):
        raise MetadataError(f"metadata.version must be a string, found {version!r}")
    if version not in READABLE_VERSIONS:
        numeric = version.isascii() and version.isdigit() and len(version) <= 9
        if numeric and int(version) > int(FORMAT_VERSION):
            raise UnsupportedVersionError(
                f"checkpoint format version {version} is newer than this gpuckpt "
                f"understands (version {FORMAT_VERSION}); upgrade gpuckpt to read it"
            )
        raise MetadataError(f"unknown checkpoint format version {version!r}")
    return version


def parse_storage_meta(raw: Any) -> StorageMeta | None:
    """The :class:`StorageMeta` of the JSON value ``raw`` (``metadata.storage_meta``), checked."""
    if raw is None:
        return None
    sm = _expect_dict(raw, "metadata.storage_meta")
    modules = sm.get("modules", [])
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise MetadataError("metadata.storage_meta.modules must be a list of strings")
    ids = {}
    for k in ("checkpoint_id", "save_id", "load_id"):
        v = sm.get(k)
        if v is not None and not isinstance(v, str):
            raise MetadataError(f"metadata.storage_meta.{k} must be a string or null")
        ids[k] = v
    return StorageMeta(modules=list(modules), **ids)


@dataclass(frozen=True, init=False)
class MetadataIndex:
    """Index of a tensor or of one of its chunks.

    ``offset`` is normalised to a tuple; ``index`` is a lookup hint that
    takes no part in equality or hashing.
    """

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = field(default=None, compare=False, hash=False)

    def __init__(self, fqn: str, offset: Sequence[int] | None = None, index: int | None = None) -> None:
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "offset", tuple(offset) if offset is not None else None)
        object.__setattr__(self, "index", index)


# helpers for strict parsing of untrusted JSON --------------------------------


def _expect_dict(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise MetadataError(f"{where} must be a JSON object, found {type(value).__name__}")
    return value


def _expect(d: Mapping[str, Any], key: str, typ: type, where: str) -> Any:
    v = d.get(key)
    # bool is an int subclass; keep the two apart in both directions
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        raise MetadataError(f"{where}.{key} must be {typ.__name__}, found {v!r}")
    return v
