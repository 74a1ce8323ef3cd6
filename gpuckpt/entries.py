"""The tensors of a validated checkpoint as a load sees them: :class:`TensorEntry` and :class:`ChunkRead`.

An entry is made by :func:`gpuckpt.reading.validate_metadata` from parsed
:class:`~gpuckpt.metadata.Metadata`, or straight from the JSON of a root
document by :mod:`gpuckpt.load_index` (the usual format version 2 document,
with no per-tensor metadata objects: those are made when first asked for).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt import memory_format as mf
from gpuckpt.errors import MetadataError
from gpuckpt.metadata import GridTensorStorageMetadata, TensorProperties, TensorStorageMetadata
from gpuckpt.planning import ChunkGrid, ChunkSpec
from gpuckpt.planning.boxes import axis_starts
from gpuckpt.storage.checksum import CRC_BYTES
from gpuckpt.storage.chunk_table import ChunkTable
from gpuckpt.storage.chunks import stored_nbytes
from gpuckpt.storage.layout import chunk_file_key

__all__ = ["ChunkRead", "StoredProperties", "TensorEntry", "whole_chunk_key"]


@dataclass(slots=True)
class ChunkRead:
    spec: ChunkSpec
    key: str
    nbytes: int
    crc: int
    stored: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StoredProperties:
    """The checked :class:`~gpuckpt.metadata.TensorProperties` of a document, shared by every
    tensor that stores the same ones (a :class:`TensorProperties` is mutable: each entry's
    metadata gets its own, made from these when first asked for)."""

    dtype: np.dtype[Any]
    requires_grad: bool
    memory_format: mf.MemoryFormat
    pin_memory: bool

    def properties(self) -> TensorProperties:
        return TensorProperties(
            dtype=self.dtype,
            layout=mf.strided,
            requires_grad=self.requires_grad,
            memory_format=self.memory_format,
            pin_memory=self.pin_memory,
        )


_WHOLE_KEYS: dict[int, str] = {}


def whole_chunk_key(ndim: int) -> str:
    """The file key of the one chunk of a tensor of ``ndim`` axes stored whole."""
    key = _WHOLE_KEYS.get(ndim)
    if key is None:
        key = _WHOLE_KEYS[ndim] = chunk_file_key((0,) * ndim)
    return key


class TensorEntry:
    """A tensor of a validated checkpoint: its array, grid and the records of its chunks.

    ``crcs`` holds the CRC32C of every chunk (C order of grid coordinates); for a
    checkpoint that keeps its records in a chunk table it is None until
    :func:`~gpuckpt.reading.load_chunk_records` reads the rows of this tensor (``table``,
    ``row``). ``listed``: the other per-chunk columns its listed records hold (content
    hashes; :func:`~gpuckpt.reading.chunk_column` reads them from either form). ``chunks``
    (every chunk's :class:`ChunkRead`) is built when first asked for; :meth:`chunk` makes
    one. ``whole``: the tensor's only chunk is the whole tensor (the usual small tensor).
    An entry made by :meth:`indexed` makes its ``metadata`` and ``grid`` when first asked for.
    """

    __slots__ = (
        "_chunks",
        "_grid",
        "_metadata",
        "_stored",
        "crcs",
        "dtype",
        "fqn",
        "listed",
        "name",
        "nbytes",
        "nchunks",
        "row",
        "segments",
        "shape",
        "table",
        "whole",
    )

    def __init__(
        self,
        fqn: str,
        name: str,
        metadata: TensorStorageMetadata,
        grid: ChunkGrid,
        crcs: np.ndarray | None,
        table: ChunkTable | None = None,
        row: int = 0,
        listed: Mapping[str, np.ndarray] | None = None,
        segments: Any = None,
        *,
        nchunks: int | None = None,
    ) -> None:
        self.fqn, self.name = fqn, name
        self._metadata: TensorStorageMetadata | None = metadata
        self._grid: ChunkGrid | None = grid
        self._stored: StoredProperties | None = None
        self.crcs, self.table, self.row = crcs, table, row
        self.listed = listed
        #: the segment records of its chunks as stored (untrusted; see :mod:`gpuckpt.ranged`)
        self.segments = segments
        self._chunks: list[ChunkRead] | None = None
        # asked for per chunk by every load: worked out once (the metadata of a validated
        # checkpoint is never changed, see validated_metadata)
        #: the tensor's shape
        self.shape: tuple[int, ...] = tuple(metadata.size)
        #: the tensor's dtype
        self.dtype: np.dtype[Any] = np.dtype(metadata.properties.dtype)
        #: the tensor's size in bytes
        self.nbytes: int = math.prod(self.shape) * self.dtype.itemsize
        own_shape = grid.kind == "regular" and grid.chunk_shape == self.shape
        #: how many chunks it has (none when it is empty); ``nchunks``: that number, worked out
        #: by the caller (as :func:`validate_metadata` does)
        self.nchunks: int = (
            nchunks if nchunks is not None else 0 if 0 in self.shape else 1 if own_shape else grid.nchunks
        )
        self.whole: bool = own_shape and self.nchunks == 1

    @classmethod
    def indexed(
        cls,
        fqn: str,
        name: str,
        stored: StoredProperties,
        shape: tuple[int, ...],
        nbytes: int,
        nchunks: int,
        grid: ChunkGrid | None,
        table: ChunkTable | None,
        row: int,
        segments: Any,
    ) -> TensorEntry:
        """An entry from checked values (:mod:`gpuckpt.load_index`); ``grid`` None: the tensor
        is stored whole (one chunk of its own shape, the grid made when first asked for)."""
        self = cls.__new__(cls)
        self.fqn, self.name, self._metadata, self._grid, self._stored = fqn, name, None, grid, stored
        self.crcs, self.table, self.row, self.listed, self.segments = None, table, row, None, segments
        self._chunks = None
        self.shape, self.dtype, self.nbytes, self.nchunks = shape, stored.dtype, nbytes, nchunks
        self.whole = grid is None
        return self

    @property
    def grid(self) -> ChunkGrid:
        """The tensor's chunk grid."""
        grid = self._grid
        if grid is None:
            grid = self._grid = ChunkGrid(self.shape, "regular", self.shape)
        return grid

    @property
    def metadata(self) -> TensorStorageMetadata:
        """The tensor's entry of ``Metadata.state_dict_metadata``."""
        md = self._metadata
        if md is None:
            assert self._stored is not None, "an entry holds its metadata or what makes it"
            md = self._metadata = GridTensorStorageMetadata(
                self._stored.properties(), self.shape, grid=self.grid, listed=False
            )
        return md

    @property
    def memory_format(self) -> Any:
        """The memory format the tensor was saved in (without making its metadata)."""
        if self._stored is not None:
            return self._stored.memory_format
        return self.metadata.properties.memory_format

    def _crcs(self) -> np.ndarray:
        if self.crcs is None:
            raise MetadataError(
                f"the chunk records of tensor {self.fqn!r} were not read from the chunk table; "
                "call gpuckpt.reading.load_chunk_records first"
            )
        return self.crcs

    def _read(self, spec: ChunkSpec, crc: int) -> ChunkRead:
        stored = self.grid.stored_chunk_shape(spec)
        return ChunkRead(
            spec, chunk_file_key(spec.coords), stored_nbytes(stored, self.dtype.itemsize), crc, stored
        )

    @property
    def chunks(self) -> list[ChunkRead]:
        if self._chunks is None:
            crcs = self._crcs()
            if self.whole and len(crcs) == 1:
                # the one chunk of a small tensor: what chunk_list and _read make, made directly
                zero = (0,) * len(self.shape)
                shape = self.shape
                self._chunks = [
                    ChunkRead(
                        ChunkSpec(zero, zero, shape),
                        whole_chunk_key(len(shape)),
                        self.nbytes + CRC_BYTES,
                        int(crcs[0]),
                        shape,
                    )
                ]
            else:
                values = crcs.tolist()
                self._chunks = [self._read(s, c) for s, c in zip(self.grid.chunk_list(), values, strict=True)]
        return self._chunks

    def chunk(self, coords: tuple[int, ...]) -> ChunkRead:
        """The chunk at grid coordinates ``coords`` (made without listing the others)."""
        if self._chunks is not None:
            flat = _flat(coords, self.grid.grid_shape)
            return self._chunks[flat]
        grid = self.grid
        if grid.kind == "regular":
            offsets = tuple(c * k for c, k in zip(coords, grid.chunk_shape, strict=True))
            sizes = tuple(
                min(k, n - o) for k, n, o in zip(grid.chunk_shape, grid.shape, offsets, strict=True)
            )
        else:
            starts = axis_starts(grid)
            offsets = tuple(st[c] for st, c in zip(starts, coords, strict=True))
            sizes = tuple(e[c] for e, c in zip(grid.edges, coords, strict=True))
        spec = ChunkSpec(tuple(coords), offsets, sizes)
        return self._read(spec, int(self._crcs()[_flat(coords, grid.grid_shape)]))


def _flat(coords: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for c, g in zip(coords, shape, strict=True):
        flat = flat * g + c
    return flat
