"""The tensors of a validated checkpoint as a load sees them: :class:`TensorEntry` and :class:`ChunkRead`.

An entry is made straight from the JSON of a root document by the one reader
(:mod:`gpuckpt.format.reader`), with no per-tensor metadata object: that is made
when first asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.errors import MetadataError
from gpuckpt.format import memory_format as mf
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.chunks import stored_nbytes
from gpuckpt.format.codecs import Codec
from gpuckpt.format.documents import chunk_file_key
from gpuckpt.format.grid import ChunkGrid, ChunkSpec, axis_starts
from gpuckpt.format.metadata import GridTensorStorageMetadata, TensorProperties, TensorStorageMetadata
from gpuckpt.format.records import ChunkTable

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
    """The checked :class:`~gpuckpt.format.metadata.TensorProperties` of a document, shared by every
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
    :func:`~gpuckpt.loading.checks.load_chunk_records` reads the rows of this tensor (``table``,
    ``row``). ``listed``: the other per-chunk columns its listed records hold (content
    hashes; :func:`~gpuckpt.loading.checks.chunk_column` reads them from either form). ``chunks``
    (every chunk's :class:`ChunkRead`) is built when first asked for; :meth:`chunk` makes
    one. ``whole``: the tensor's only chunk is the whole tensor (the usual small tensor).
    An entry makes its ``metadata`` and ``grid`` when first asked for (unless its document lists
    its chunk boxes).
    """

    __slots__ = (
        "_chunks",
        "_grid",
        "_metadata",
        "_stored",
        "codec",
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
        "sizes",
        "table",
        "whole",
    )

    def __init__(
        self,
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
        *,
        crcs: np.ndarray | None = None,
        listed: Mapping[str, np.ndarray] | None = None,
        metadata: TensorStorageMetadata | None = None,
        codec: Codec | None = None,
        sizes: np.ndarray | None = None,
    ) -> None:
        """An entry from checked values (:mod:`gpuckpt.format.reader` makes them); ``grid`` None:
        the tensor is stored whole (one chunk of its own shape, the grid made when first asked
        for). ``crcs`` and ``listed``: the records of its chunks, where its entry lists them;
        ``metadata``: its entry where that lists its chunk boxes (else made when first asked
        for, its chunks left to its grid)."""
        self.fqn, self.name, self._metadata, self._grid, self._stored = fqn, name, metadata, grid, stored
        self.crcs, self.table, self.row, self.listed, self.segments = crcs, table, row, listed, segments
        #: how its chunks are compressed (None: stored as they are) and, for a compressed tensor,
        #: each chunk's stored size (like ``crcs``, None until read from a chunk table)
        self.codec: Codec | None = codec
        self.sizes: np.ndarray | None = sizes
        self._chunks: list[ChunkRead] | None = None
        #: the tensor's shape, dtype and size in bytes (asked for per chunk by every load)
        self.shape: tuple[int, ...] = shape
        self.dtype: np.dtype[Any] = stored.dtype
        self.nbytes: int = nbytes
        #: how many chunks it has (none when it is empty)
        self.nchunks: int = nchunks
        #: its only chunk is the whole tensor (the usual small tensor)
        self.whole: bool = grid is None

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
            md = self._metadata = GridTensorStorageMetadata(
                self._stored.properties(), self.shape, grid=self.grid, listed=False
            )
        return md

    @property
    def memory_format(self) -> Any:
        """The memory format the tensor was saved in (without making its metadata)."""
        return self._stored.memory_format

    def _crcs(self) -> np.ndarray:
        if self.crcs is None:
            raise MetadataError(
                f"the chunk records of tensor {self.fqn!r} were not read from the chunk table; "
                "call gpuckpt.loading.checks.load_chunk_records first"
            )
        return self.crcs

    def max_stored(self) -> int:
        """The most bytes one stored chunk of this tensor may hold (checksum included)."""
        itemsize = self.dtype.itemsize
        if self.whole:
            logical = self.nbytes
        elif self.grid.kind == "regular":
            logical = math.prod(self.grid.chunk_shape) * itemsize
        else:
            logical = math.prod(max(e, default=0) for e in self.grid.edges) * itemsize
        return (logical if self.codec is None else self.codec.max_stored(logical)) + CRC_BYTES

    def _stored_size(self, flat: int, stored: tuple[int, ...]) -> int:
        if self.codec is None:
            return stored_nbytes(stored, self.dtype.itemsize)
        if self.sizes is None:
            raise MetadataError(
                f"the chunk records of tensor {self.fqn!r} were not read from the chunk table; "
                "call gpuckpt.loading.checks.load_chunk_records first"
            )
        return int(self.sizes[flat])

    def _read(self, spec: ChunkSpec, crc: int, flat: int) -> ChunkRead:
        stored = self.grid.stored_chunk_shape(spec)
        return ChunkRead(spec, chunk_file_key(spec.coords), self._stored_size(flat, stored), crc, stored)

    @property
    def chunks(self) -> list[ChunkRead]:
        if self._chunks is None:
            crcs = self._crcs()
            if self.whole and len(crcs) == 1 and self.codec is None:
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
                self._chunks = [
                    self._read(s, c, i)
                    for i, (s, c) in enumerate(zip(self.grid.chunk_list(), values, strict=True))
                ]
        return self._chunks

    def chunk_files(self) -> tuple[list[str], list[int]]:
        """The key and stored size of every chunk (C order), without reading their checksums."""
        if self._chunks is not None:
            return [c.key for c in self._chunks], [c.nbytes for c in self._chunks]
        grid = self.grid
        keys, sizes = [], []
        for i, spec in enumerate(grid.chunk_list()):
            keys.append(chunk_file_key(spec.coords))
            sizes.append(self._stored_size(i, grid.stored_chunk_shape(spec)))
        return keys, sizes

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
        flat = _flat(coords, grid.grid_shape)
        return self._read(spec, int(self._crcs()[flat]), flat)


def _flat(coords: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for c, g in zip(coords, shape, strict=True):
        flat = flat * g + c
    return flat
