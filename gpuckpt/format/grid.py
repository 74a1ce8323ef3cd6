"""Chunk grids: pure data, no arrays and no I/O.

A tensor is stored as a Zarr array whose chunk grid mirrors the metadata:
every :class:`~gpuckpt.format.metadata.ChunkStorageMetadata` is exactly one Zarr
chunk. :class:`ChunkGrid` describes the grid (regular, the portable default,
or rectilinear for uneven boxes), and :func:`plan_regular_grid` picks a
regular grid for a tensor of a given shape and element size.

The default plan splits a tensor along one axis only, keeping every axis
after it whole. Each chunk is then one contiguous run of bytes of a
C-contiguous array, so writes and reads need no gather or scatter copies.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ChunkGrid",
    "ChunkSpec",
    "axis_starts",
    "plan_regular_grid",
    "starts_of",
]

#: the default target size of a stored chunk (a save's ``chunk_bytes``)
DEFAULT_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """One chunk of a grid: its grid coordinates and its box in the tensor."""

    coords: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def view(self, array: Any) -> Any:
        """The chunk's box of ``array`` as a view (an array even for 0-d tensors)."""
        if not self.sizes:
            return array[...]
        return array[tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))]

    @property
    def nelem(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class ChunkGrid:
    """A chunk grid over a tensor of ``shape``.

    ``kind == "regular"``: every chunk has ``chunk_shape``; chunks at the upper
    edge are stored padded to the full chunk shape (Zarr's rule) and their
    metadata sizes are clipped to the tensor.
    ``kind == "rectilinear"``: ``edges[d]`` lists the extent of each chunk
    along axis ``d``; nothing is padded.
    """

    shape: tuple[int, ...]
    kind: str
    chunk_shape: tuple[int, ...] = ()
    edges: tuple[tuple[int, ...], ...] = ()
    # derived once (a plan asks for them several times per tensor)
    _grid_shape: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _nchunks: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind == "regular":
            if len(self.chunk_shape) != len(self.shape) or any(c < 1 for c in self.chunk_shape):
                raise ValueError(
                    f"regular chunk shape {self.chunk_shape} does not fit tensor shape {self.shape}"
                )
            # arithmetic, not enumeration: a hostile shape must not make this slow
            gs = tuple(-(-n // c) for n, c in zip(self.shape, self.chunk_shape, strict=True))
        elif self.kind == "rectilinear":
            if len(self.edges) != len(self.shape):
                raise ValueError(f"rectilinear edges {self.edges} do not fit tensor shape {self.shape}")
            for d, (e, n) in enumerate(zip(self.edges, self.shape, strict=True)):
                if any(x < 1 for x in e) or (sum(e) != n and not (n == 0 and e == (1,))):
                    raise ValueError(f"rectilinear edges {e} of axis {d} do not sum to its size {n}")
            gs = tuple(len(e) for e in self.edges)
        else:
            raise ValueError(f"unknown chunk grid kind {self.kind!r}")
        object.__setattr__(self, "_grid_shape", gs)
        object.__setattr__(self, "_nchunks", math.prod(gs))

    @classmethod
    def regular(cls, shape: Sequence[int], chunk_shape: Sequence[int]) -> ChunkGrid:
        return cls(tuple(shape), "regular", chunk_shape=tuple(chunk_shape))

    @classmethod
    def rectilinear(cls, shape: Sequence[int], edges: Sequence[Sequence[int]]) -> ChunkGrid:
        return cls(tuple(shape), "rectilinear", edges=tuple(tuple(e) for e in edges))

    # geometry ---------------------------------------------------------------

    def _axis_bounds(self, d: int) -> list[tuple[int, int]]:
        """(start, stop) of every chunk along axis ``d``, clipped to the tensor."""
        n = self.shape[d]
        if self.kind == "regular":
            c = self.chunk_shape[d]
            return [(s, min(s + c, n)) for s in range(0, n, c)]
        starts = itertools.accumulate(self.edges[d], initial=0)
        return [(s, s + e) for s, e in zip(starts, self.edges[d], strict=False)]

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """Chunks along each axis."""
        return self._grid_shape

    @property
    def nchunks(self) -> int:
        """Chunks of the grid (one for an empty tensor's grid: Zarr's rule; a plan counts none)."""
        return self._nchunks

    def stored_chunk_shape(self, spec: ChunkSpec) -> tuple[int, ...]:
        """Shape of the chunk as stored (padded to the full chunk on regular grids)."""
        return self.chunk_shape if self.kind == "regular" else spec.sizes

    def chunks(self) -> Iterator[ChunkSpec]:
        """Every chunk in C order of grid coordinates; none if the tensor is empty."""
        if any(n == 0 for n in self.shape):
            return
        bounds = [self._axis_bounds(d) for d in range(len(self.shape))]
        for coords in itertools.product(*(range(len(b)) for b in bounds)):
            lo_hi = [bounds[d][i] for d, i in enumerate(coords)]
            yield ChunkSpec(
                coords=tuple(coords),
                offsets=tuple(lo for lo, _ in lo_hi),
                sizes=tuple(hi - lo for lo, hi in lo_hi),
            )

    def chunk_list(self) -> list[ChunkSpec]:
        """:meth:`chunks` as a list; cheap for a one-chunk grid, the common case of small tensors."""
        if (
            self.kind == "regular"
            and 0 not in self.shape
            and all(c >= n for c, n in zip(self.chunk_shape, self.shape, strict=True))
        ):
            zero = (0,) * len(self.shape)
            return [ChunkSpec(zero, zero, self.shape)]
        return list(self.chunks())

    def to_zarr_json(self) -> dict[str, object]:
        """The ``chunk_grid`` member of the array's ``zarr.json``."""
        if self.kind == "regular":
            return {"name": "regular", "configuration": {"chunk_shape": list(self.chunk_shape)}}
        return {
            "name": "rectilinear",
            "configuration": {"kind": "inline", "chunk_shapes": [list(e) for e in self.edges]},
        }

    @classmethod
    def from_zarr_json(cls, shape: Sequence[int], data: object) -> ChunkGrid:
        """Inverse of :meth:`to_zarr_json` (as gpuckpt writes it)."""
        if not isinstance(data, dict):
            raise ValueError(f"chunk_grid must be an object, found {data!r}")
        name, conf = data.get("name"), data.get("configuration")
        if not isinstance(conf, dict):
            raise ValueError(f"chunk_grid.configuration must be an object, found {conf!r}")
        if name == "regular":
            cs = conf.get("chunk_shape")
            if not isinstance(cs, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in cs
            ):
                raise ValueError(f"chunk_shape must be a list of integers, found {cs!r}")
            return cls.regular(shape, cs)
        if name == "rectilinear":
            es = conf.get("chunk_shapes")
            if not isinstance(es, list) or not all(
                isinstance(e, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in e)
                for e in es
            ):
                raise ValueError(f"chunk_shapes must be lists of integers, found {es!r}")
            return cls.rectilinear(shape, es)
        raise ValueError(f"unknown chunk grid {name!r}")


def plan_regular_grid(
    shape: Sequence[int], itemsize: int, target_bytes: int = DEFAULT_CHUNK_BYTES
) -> ChunkGrid:
    """A regular grid of chunks of at most about ``target_bytes`` each.

    The tensor is split along the outermost axis ``d`` whose inner block
    ``prod(shape[d+1:])`` still fits the target; axes before ``d`` get chunk
    extent 1 and axes after it stay whole, so every chunk is one contiguous
    byte range of the C-ordered tensor. A tensor that fits the target is one
    chunk. Empty axes get extent 1 (Zarr forbids 0).

    Examples
    --------
    >>> plan_regular_grid((1000, 1024), 4, 1 << 20).chunk_shape
    (250, 1024)
    """
    shape = tuple(map(int, shape))
    if itemsize < 1 or target_bytes < 1:
        raise ValueError(f"itemsize ({itemsize}) and target_bytes ({target_bytes}) must be positive")
    ndim = len(shape)
    if ndim == 0:
        return ChunkGrid.regular((), ())
    whole = tuple(max(s, 1) for s in shape)
    if math.prod(whole) * itemsize <= target_bytes:
        return ChunkGrid.regular(shape, whole)
    for d in range(ndim):
        inner = math.prod(whole[d + 1 :]) * itemsize
        if inner <= target_bytes:
            per = max(1, target_bytes // inner)
            # balance the chunks so that the last one is not a sliver
            nsplit = math.ceil(whole[d] / per)
            per = math.ceil(whole[d] / nsplit)
            return ChunkGrid.regular(shape, (1,) * d + (per,) + whole[d + 1 :])
    # a single element row of the innermost axis exceeds the target
    return ChunkGrid.regular(shape, (1,) * (ndim - 1) + (max(1, target_bytes // itemsize),))


def starts_of(grid: ChunkGrid) -> list[list[int]]:
    """The first index of every chunk along each axis of ``grid`` (new lists each call)."""
    if grid.kind == "regular":
        return [list(range(0, max(n, 1), c)) for n, c in zip(grid.shape, grid.chunk_shape, strict=True)]
    return [list(itertools.accumulate(e, initial=0))[:-1] for e in grid.edges]


@functools.lru_cache(maxsize=64)
def axis_starts(grid: ChunkGrid) -> list[list[int]]:
    """The first index of every chunk along each axis of ``grid`` (kept for the last grids
    asked for: the layers of a model share one; callers must not change the lists)."""
    return starts_of(grid)
