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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from gpuckpt import memory_format as mf
from gpuckpt import tensor_columns
from gpuckpt.dtypes import dtype_from_name, dtype_name, get_default_dtype
from gpuckpt.errors import MetadataError, UnsupportedVersionError

if TYPE_CHECKING:
    from gpuckpt.device.arrays import ArrayAdapter

__all__ = [
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "VERSION_COLUMNS",
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
FORMAT_VERSION = "3"
#: The version of a checkpoint that lists every chunk in its metadata (the only form of version 1).
VERSION_LISTED = "1"
#: The version of a checkpoint that keeps its per-chunk records in a chunk table.
VERSION_WITH_TABLE = "2"
#: The version of a checkpoint that keeps its usual tensor entries as columns
#: (:mod:`gpuckpt.tensor_columns`; a superset of version 2).
VERSION_COLUMNS = "3"
#: Every format version this release reads.
READABLE_VERSIONS = ("1", "2", "3")


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
        # at call time: the format layer depends on no array kind; only this convenience reads one
        from gpuckpt.device.arrays import adapt

        return TensorProperties.from_array(adapt(tensor))

    @staticmethod
    def from_array(array: ArrayAdapter) -> TensorProperties:
        """The properties of the array behind ``array`` (an adapter of :mod:`gpuckpt.device.arrays`)."""
        return TensorProperties(
            dtype=array.dtype,
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
        """Serialise to a JSON string (format version included)."""
        return json.dumps(self.to_json_dict(), separators=(",", ":"), allow_nan=False)

    def to_json_dict(self) -> dict[str, Any]:
        """The JSON value of the metadata as a root document stores it: in format version 3, the
        usual tensor entries as columns (:func:`gpuckpt.tensor_columns.compact`)."""
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
        version = self.version or FORMAT_VERSION
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
        return tensor_columns.compact(data) if version == VERSION_COLUMNS else data

    @classmethod
    def from_json(cls, text: str | bytes) -> Metadata:
        """Parse the JSON form; raises :class:`MetadataError` on any defect."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise MetadataError(f"checkpoint metadata is not valid JSON: {exc}") from None
        return cls.from_json_dict(data)

    @classmethod
    def from_json_dict(cls, data: Any) -> Metadata:
        d = _expect_dict(data, "metadata")
        version = parse_version(d)
        if version == VERSION_COLUMNS:
            d = tensor_columns.expand(d)
        raw_entries = _expect_dict(d.get("state_dict_metadata"), "metadata.state_dict_metadata")
        entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        storage_data = d.get("storage_data")
        fast = _GridEntries(storage_data) if version != "1" else None
        for fqn, raw in raw_entries.items():
            if fast is not None:
                # format version 2's usual tensor entry, in one pass (see _GridEntries)
                made = fast.entry(fqn, raw)
                if made is not None:
                    entries[fqn] = made
                    continue
            where = f"state_dict_metadata[{fqn!r}]"
            e = _expect_dict(raw, where)
            kind = e.get("type")
            if kind == "bytes":
                entries[fqn] = BytesStorageMetadata()
            elif kind == "tensor":
                size = _int_tuple(e.get("size"), f"{where}.size")
                if version != "1" and "chunks" not in e:
                    # format version 2: the chunks are those of the tensor's chunk grid
                    entries[fqn] = GridTensorStorageMetadata(
                        TensorProperties.from_json(e.get("properties"), f"{where}.properties"),
                        size,
                        grid=_grid_of(storage_data, fqn, size),
                        listed=False,
                    )
                    continue
                chunks_raw = e.get("chunks")
                if not isinstance(chunks_raw, list):
                    raise MetadataError(f"{where}.chunks must be a list, found {type(chunks_raw).__name__}")
                chunks = []
                for i, c in enumerate(chunks_raw):
                    cd = _expect_dict(c, f"{where}.chunks[{i}]")
                    offsets = _int_tuple(cd.get("offsets"), f"{where}.chunks[{i}].offsets")
                    sizes = _int_tuple(cd.get("sizes"), f"{where}.chunks[{i}].sizes")
                    if len(offsets) != len(size) or len(sizes) != len(size):
                        raise MetadataError(f"{where}.chunks[{i}] has the wrong number of dimensions")
                    if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
                        raise MetadataError(f"{where}.chunks[{i}] lies outside the tensor of size {size}")
                    chunks.append(ChunkStorageMetadata(offsets, sizes))
                entries[fqn] = TensorStorageMetadata(
                    properties=TensorProperties.from_json(e.get("properties"), f"{where}.properties"),
                    size=size,
                    chunks=chunks,
                )
            else:
                raise MetadataError(f"{where}.type is {kind!r}; expected 'tensor' or 'bytes'")
        return cls(
            state_dict_metadata=entries,
            planner_data=d.get("planner_data"),
            storage_data=d.get("storage_data"),
            storage_meta=parse_storage_meta(d.get("storage_meta")),
            version=version,
        )


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

#: most chunks one tensor's grid may have when its chunks are not listed (2**32)
MAX_GRID_CHUNKS = 1 << 32


def _regular_grid(size: tuple[int, ...], chunk_shape: tuple[int, ...]) -> Any:
    """``ChunkGrid.regular(size, chunk_shape)``."""
    # at call time: the grid is planning's type, and planning builds on this module
    from gpuckpt.planning.grid import ChunkGrid

    return ChunkGrid(size, "regular", chunk_shape)


def _grid_of(storage_data: Any, fqn: str, size: tuple[int, ...]) -> Any:
    """The chunk grid of tensor ``fqn`` from ``storage_data.tensors[fqn].chunk_grid``."""
    # at call time: the grid is planning's type, and planning builds on this module
    from gpuckpt.planning.grid import ChunkGrid

    where = f"storage_data.tensors[{fqn!r}]"
    tensors = storage_data.get("tensors") if isinstance(storage_data, dict) else None
    info = tensors.get(fqn) if isinstance(tensors, dict) else None
    if not isinstance(info, dict):
        raise MetadataError(
            f"state_dict_metadata[{fqn!r}] lists no chunks and {where} is missing; a format version 2 "
            "tensor without a chunk list needs its chunk grid in storage_data"
        )
    try:
        grid = ChunkGrid.from_zarr_json(size, info.get("chunk_grid"))
    except ValueError as exc:
        raise MetadataError(f"{where}.chunk_grid: {exc}") from None
    if grid.nchunks > MAX_GRID_CHUNKS:
        raise MetadataError(
            f"{where}.chunk_grid has {grid.nchunks} chunks, more than the {MAX_GRID_CHUNKS} gpuckpt reads"
        )
    return grid


class _GridEntries:
    """The tensor entries of a format version 2 document that leave their chunks to a regular
    grid, parsed without the general path's per-entry steps: what many tensors share (their
    properties, their grid) is parsed and checked once.

    :meth:`entry` accepts only an entry that the general path of
    :meth:`Metadata.from_json_dict` accepts, and makes the equal object (a
    :class:`GridTensorStorageMetadata` with its own :class:`TensorProperties`; equal grids are
    one shared :class:`~gpuckpt.planning.grid.ChunkGrid`, which is immutable). For anything
    else (another grid kind, a value of an unexpected type, a defect) it returns None, and
    the general path parses the entry and raises its error.
    """

    __slots__ = ("_grids", "_properties", "_tensors")

    def __init__(self, storage_data: Any) -> None:
        tensors = storage_data.get("tensors") if isinstance(storage_data, dict) else None
        self._tensors: dict[str, Any] | None = tensors if isinstance(tensors, dict) else None
        #: (layout, dtype, memory format, requires_grad, pin_memory) as stored -> (dtype, format)
        self._properties: dict[tuple[str, str, str, bool, bool], tuple[Any, mf.MemoryFormat]] = {}
        #: (size, chunk shape) -> the checked grid
        self._grids: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}

    def entry(self, fqn: str, raw: Any) -> GridTensorStorageMetadata | None:
        tensors = self._tensors
        parts = None if tensors is None else self.parts(raw, tensors.get(fqn))
        if parts is None:
            return None
        size, (_layout, _dtype, _fmt, grad, pin), (dtype, fmt), grid = parts
        return GridTensorStorageMetadata(
            TensorProperties(
                dtype=dtype, layout=mf.strided, requires_grad=grad, memory_format=fmt, pin_memory=pin
            ),
            size,
            grid=_regular_grid(size, size) if grid is None else grid,
            listed=False,
        )

    def parts(
        self, raw: Any, info: Any
    ) -> tuple[tuple[int, ...], tuple[str, str, str, bool, bool], tuple[Any, mf.MemoryFormat], Any] | None:
        """``(size, properties as stored, (dtype, memory format), grid)`` of a tensor entry ``raw``
        whose storage entry ``info`` gives it a regular grid, checked as the general path checks
        them; ``grid`` is None when the tensor is stored whole (its one chunk its own shape, none
        of its axes empty). None for anything else."""
        if type(raw) is not dict or raw.get("type") != "tensor" or "chunks" in raw:
            return None
        props = self.checked_properties(raw.get("properties"))
        if props is None:
            return None
        grid_raw = info.get("chunk_grid") if type(info) is dict else None
        conf = grid_raw.get("configuration") if type(grid_raw) is dict else None
        if type(conf) is not dict or grid_raw.get("name") != "regular":  # type: ignore[union-attr]
            return None
        sized = self.regular_grid(raw.get("size"), conf.get("chunk_shape"))
        if sized is None:
            return None
        return sized[0], props[0], props[1], sized[1]

    def regular_grid(self, size_raw: Any, shape_raw: Any) -> tuple[tuple[int, ...], Any] | None:
        """``(size, grid)`` of a tensor of size ``size_raw`` on a regular grid of chunk shape
        ``shape_raw`` (both as stored), checked as the general path checks them; ``grid`` is
        None when the tensor is stored whole (its one chunk its own shape, none of its axes
        empty). None for anything else."""
        if type(size_raw) is not list or len(size_raw) > 32:
            return None
        for n in size_raw:
            if type(n) is not int or n < 0:
                return None
        if type(shape_raw) is not list:
            return None
        for c in shape_raw:
            if type(c) is not int:
                return None
        size = tuple(size_raw)
        if shape_raw == size_raw and 0 not in size:
            return size, None  # the usual grid of a small tensor
        chunk_shape = tuple(shape_raw)
        key = (size, chunk_shape)
        grid = self._grids.get(key)
        if grid is None:
            # what ChunkGrid.regular and _grid_of check, here without their per-call steps
            if len(chunk_shape) != len(size):
                return None
            nchunks = 1
            for n, c in zip(size, chunk_shape, strict=True):
                if c < 1:
                    return None
                nchunks *= -(-n // c)
            if nchunks > MAX_GRID_CHUNKS:
                return None
            grid = self._grids[key] = _regular_grid(size, chunk_shape)
        return size, grid

    def checked_properties(
        self, raw: Any
    ) -> tuple[tuple[str, str, str, bool, bool], tuple[Any, mf.MemoryFormat]] | None:
        """The properties ``raw`` as stored and their parsed dtype and memory format, or None."""
        if type(raw) is not dict:
            return None
        get = raw.get
        key: Any = (
            get("layout"),
            get("dtype"),
            get("memory_format"),
            get("requires_grad"),
            get("pin_memory"),
        )
        layout, dtype, fmt, grad, pin = key
        # the JSON booleans are the two singletons: no 1 or 0 passes for True or False (equal
        # keys: a key of the cache is one of strings and booleans, so only these need a look)
        try:
            known = self._properties.get(key)
        except TypeError:
            return None  # an unhashable value (a list, an object): no valid property is one
        if known is not None and (grad is True or grad is False) and (pin is True or pin is False):
            return key, known
        if (
            type(layout) is not str
            or type(dtype) is not str
            or type(fmt) is not str
            or (grad is not True and grad is not False)
            or (pin is not True and pin is not False)
        ):
            return None
        try:
            parsed = TensorProperties.from_json(raw)
        except MetadataError:
            return None
        known = self._properties[key] = (parsed.dtype, parsed.memory_format)
        return key, known


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


def _int_tuple(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise MetadataError(f"{where} must be a list of non-negative integers, found {value!r}")
    if len(value) > 32:
        raise MetadataError(f"{where} has {len(value)} dimensions; at most 32 are supported")
    return tuple(value)
