"""Boxes: which process writes which chunk of a tensor, and box overlaps for resharding loads.

Pure data: shapes, offsets, boxes and ranks; no arrays and no I/O, so that
plans are tested as data (and with Hypothesis). Every function here is
linear or ``n log n`` in the number of boxes: a job of 64 ranks with 1,000
tensors each is planned in well under a second.

Every save is planned this way (a single-process save is one rank holding
each tensor whole):

1. each rank describes its tensors (:class:`LocalTensor`: global shape, dtype,
   properties, the boxes it holds);
2. :func:`plan_global` merges them: boxes held by several ranks are written
   once, by the least-loaded holder; the boxes of each tensor must tile it
   exactly. A tensor held whole gets the grid :func:`~gpuckpt.format.grid.plan_regular_grid`
   chooses; otherwise the chunk grid is the grid of box edges (regular when
   the boxes are an even split, rectilinear otherwise, or a regular
   refinement on request) so that every chunk lies in one box;
3. each rank writes the chunks assigned to it
   (:func:`gpuckpt.planning.plan.plan_save` turns this into the save plan).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from gpuckpt.errors import UnsupportedValueError
from gpuckpt.format.grid import ChunkGrid, ChunkSpec, axis_starts, plan_regular_grid, starts_of
from gpuckpt.format.metadata import TensorProperties

__all__ = [
    "Box",
    "GlobalTensorPlan",
    "LocalTensor",
    "TensorWrites",
    "axis_starts",
    "box_chunks",
    "grid_for_boxes",
    "grid_from_edges",
    "intersect",
    "overlapping_chunks",
    "plan_global",
    "plan_one_tensor",
    "plan_tensors",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """What one rank holds of one tensor (small and picklable: no data).

    ``dtype`` is the stored dtype name (:func:`gpuckpt.format.dtypes.dtype_name`, so that
    ranks holding different byte orders agree); ``boxes`` are the ``(offsets,
    sizes)`` of the rank's pieces in the global tensor, a whole tensor being
    one box at the origin.
    """

    fqn: str
    global_shape: tuple[int, ...]
    dtype: str
    itemsize: int
    properties: TensorProperties
    boxes: tuple[Box, ...]


@dataclass(frozen=True, slots=True)
class GlobalTensorPlan:
    """One tensor of a save, as :func:`plan_global` decided it."""

    fqn: str
    global_shape: tuple[int, ...]
    dtype: str
    properties: TensorProperties
    grid: ChunkGrid
    specs: tuple[ChunkSpec, ...]  # every chunk of the grid (:meth:`ChunkGrid.chunk_list`)
    # chunk coords -> (writer rank, index of the box in that rank's LocalTensor.boxes)
    writers: dict[tuple[int, ...], tuple[int, int]]


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def _edges(boxes: Iterable[Box], shape: tuple[int, ...]) -> list[list[int]]:
    edges: list[set[int]] = [{0, n} for n in shape]
    for offs, sizes in boxes:
        for d, (o, s) in enumerate(zip(offs, sizes, strict=True)):
            edges[d].add(o)
            edges[d].add(o + s)
    return [sorted(e) for e in edges]


def _regular_step(intervals: list[int], max_len: int) -> int | None:
    """One chunk extent that splits every interval into whole chunks of at most ``max_len``
    (the last chunk of the axis may be shorter), so that the grid stays regular; None if
    only chunks much smaller than ``max_len`` would do that."""
    first = intervals[0]
    if len(intervals) == 1:
        # one box along the axis: equal chunks and a shorter last one, as gpuckpt.save plans
        return -(-first // -(-first // max_len))
    if any(iv != first for iv in intervals[:-1]) or intervals[-1] > first:
        return None
    # equal boxes: the largest divisor of their extent that fits, if not much smaller
    divisors = (d for k in range(1, math.isqrt(first) + 1) if first % k == 0 for d in (k, first // k))
    best = max((d for d in divisors if d <= max_len), default=1)
    return best if 2 * best >= max_len else None


def _refine(edges: list[int], max_len: int) -> list[int]:
    """Split every interval longer than ``max_len``: into chunks of one extent where the
    grid then stays regular, else into near-equal parts."""
    intervals = [b - a for a, b in itertools.pairwise(edges)]
    if all(iv <= max_len for iv in intervals):
        return edges
    step = _regular_step(intervals, max_len)
    if step is not None:
        cut = [e for lo, hi in itertools.pairwise(edges) for e in range(lo, hi, step)]
        return [*cut, edges[-1]]
    out = [edges[0]]
    for lo, hi in itertools.pairwise(edges):
        parts = max(1, math.ceil((hi - lo) / max_len))
        out.extend(lo + round(k * (hi - lo) / parts) for k in range(1, parts + 1))
    return out


def grid_for_boxes(
    boxes: Sequence[Box], shape: tuple[int, ...], itemsize: int, *, chunk_bytes: int, portable: bool = False
) -> ChunkGrid:
    """A chunk grid in which every chunk lies inside one of ``boxes``.

    The grid of box edges along each axis, with the first axis refined so
    that chunks stay near ``chunk_bytes``. Regular when every axis is an even
    split (a smaller last interval allowed), else rectilinear; with
    ``portable=True`` always regular, with the greatest common divisor of the
    intervals as chunk size.
    """
    if any(n == 0 for n in shape):
        return ChunkGrid.regular(shape, tuple(max(1, n) for n in shape))
    return grid_from_edges(_edges(boxes, shape), shape, itemsize, chunk_bytes=chunk_bytes, portable=portable)


def grid_from_edges(
    edges: list[list[int]], shape: tuple[int, ...], itemsize: int, *, chunk_bytes: int, portable: bool = False
) -> ChunkGrid:
    """:func:`grid_for_boxes` from the sorted box edges of each axis (0 and the axis size included)."""
    if shape:
        inner = math.prod(max(b - a for a, b in itertools.pairwise(e)) for e in edges[1:]) * itemsize
        edges[0] = _refine(edges[0], max(1, chunk_bytes // max(1, inner)))
    intervals = [[b - a for a, b in itertools.pairwise(e)] for e in edges]
    if portable:
        return ChunkGrid.regular(shape, tuple(math.gcd(*iv) for iv in intervals))
    if all(len(set(iv[:-1])) <= 1 and iv[-1] <= iv[0] for iv in intervals):
        return ChunkGrid.regular(shape, tuple(iv[0] for iv in intervals))
    return ChunkGrid.rectilinear(shape, intervals)


def overlapping_chunks(
    grid: ChunkGrid, box: Box, starts: list[list[int]] | None = None
) -> Iterable[tuple[int, ...]]:
    """Grid coordinates of every chunk that overlaps ``box`` (``starts``: the grid's, if known)."""
    if starts is None:
        starts = axis_starts(grid)
    ranges = []
    for d, (o, s) in enumerate(zip(box[0], box[1], strict=True)):
        if s == 0:
            return
        first = bisect.bisect_right(starts[d], o) - 1
        last = bisect.bisect_left(starts[d], o + s) - 1
        ranges.append(range(max(first, 0), last + 1))
    yield from itertools.product(*ranges)


def _box_chunks(grid: ChunkGrid, box: Box, starts: list[list[int]]) -> Iterable[tuple[int, ...]]:
    """Chunks inside ``box`` (whose edges are grid edges); the common one-chunk case without a generator."""
    first = tuple(bisect.bisect_right(st, o) - 1 for st, o in zip(starts, box[0], strict=True))
    ends = [(st[i + 1] if i + 1 < len(st) else n) for st, i, n in zip(starts, first, grid.shape, strict=True)]
    one = all(s > 0 and o + s == e for o, s, e in zip(box[0], box[1], ends, strict=True))
    return (first,) if one else overlapping_chunks(grid, box, starts)


@dataclass(frozen=True, slots=True)
class TensorWrites:
    """Who writes which part of one tensor: one entry per distinct box, as flat tuples.

    Entry ``i`` is the box at ``offsets[i*ndim:(i+1)*ndim]`` of extent
    ``sizes[i*ndim:(i+1)*ndim]``, written by rank ``ranks[i]`` from the box of
    index ``boxes[i]`` in that rank's :attr:`LocalTensor.boxes`; the chunks of
    the tensor's grid inside the box are that rank's to write. One entry per
    box, not per chunk, so that a plan costs per box (and flat tuples of ints,
    so that it pickles and compares as plain data).
    """

    ndim: int
    ranks: tuple[int, ...]
    boxes: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def one(cls, rank: int, box: int, whole: Box) -> TensorWrites:
        return cls(len(whole[1]), (rank,), (box,), tuple(whole[0]), tuple(whole[1]))

    def __len__(self) -> int:
        return len(self.ranks)

    def box(self, i: int) -> Box:
        n = self.ndim
        return tuple(self.offsets[i * n : (i + 1) * n]), tuple(self.sizes[i * n : (i + 1) * n])

    def of_rank(self, rank: int) -> list[int]:
        """Indices of the entries ``rank`` writes (scanned in C: a tensor may have thousands)."""
        found: list[int] = []
        i = -1
        ranks = self.ranks
        while True:
            try:
                i = ranks.index(rank, i + 1)
            except ValueError:
                return found
            found.append(i)


def box_chunks(grid: ChunkGrid, box: Box, starts: list[list[int]]) -> Iterable[tuple[int, ...]]:
    """Grid coordinates of the chunks inside ``box`` (whose edges are edges of ``grid``), in C order."""
    return _box_chunks(grid, box, starts)


def _check_agree(fqn: str, held: Sequence[tuple[int, LocalTensor]]) -> None:
    rank0, first = held[0]
    for rank, lt in held[1:]:
        if (lt.global_shape, lt.dtype) != (first.global_shape, first.dtype):
            raise UnsupportedValueError(
                f"tensor {fqn!r}: rank {rank0} has shape {first.global_shape} and dtype "
                f"{first.dtype}, rank {rank} has {lt.global_shape} and {lt.dtype}; every rank must agree"
            )


def plan_one_tensor(
    first: LocalTensor,
    held: Sequence[tuple[int, Sequence[Box]]],
    load: np.ndarray,
    *,
    chunk_bytes: int,
    portable: bool,
) -> tuple[ChunkGrid, TensorWrites]:
    """The grid and writers of one tensor from the boxes each holder has (``(rank, boxes)``);
    ``load[rank]`` (bytes each rank writes so far) is updated. Costs per chunk: the check
    that the boxes tile the tensor visits each chunk."""
    fqn, shape, itemsize = first.fqn, first.global_shape, first.itemsize
    if len(held) == 1 and len(held[0][1]) == 1:
        ((offsets, sizes),) = held[0][1]
        if sizes == shape and not any(offsets):
            # the common case (every tensor of a single-process save): one holder, one box
            load[held[0][0]] += math.prod(shape) * itemsize
            return plan_regular_grid(shape, itemsize, chunk_bytes), TensorWrites.one(
                held[0][0], 0, (offsets, sizes)
            )
    whole = ((0,) * len(shape), shape)
    # replicated boxes are written once, by the least-loaded holder
    holders: dict[Box, list[tuple[int, int]]] = {}
    for rank, boxes in held:
        for i, box in enumerate(boxes):
            holders.setdefault(box, []).append((rank, i))
    unique = list(holders)
    volume = sum(math.prod(s) for _, s in unique)
    if volume != math.prod(shape):
        raise UnsupportedValueError(
            _not_tiled(fqn, shape, unique, f"cover {volume} elements of {math.prod(shape)}")
        )

    def least_loaded(hs: list[tuple[int, int]]) -> tuple[int, int]:
        return hs[0] if len(hs) == 1 else min(hs, key=lambda h: (int(load[h[0]]), h[0]))

    if unique == [whole]:
        # held whole by several ranks (a replicated array): the grid a single-process
        # save plans, so that the same array is chunked alike on every path
        rank, idx = least_loaded(holders[whole])
        load[rank] += math.prod(shape) * itemsize
        return plan_regular_grid(shape, itemsize, chunk_bytes), TensorWrites.one(rank, idx, whole)
    grid = grid_for_boxes(unique, shape, itemsize, chunk_bytes=chunk_bytes, portable=portable)
    starts = starts_of(grid)
    seen: set[tuple[int, ...]] = set()
    ranks: list[int] = []
    idxs: list[int] = []
    offs: list[int] = []
    sizes_flat: list[int] = []
    for box in unique:
        rank, idx = least_loaded(holders[box])
        load[rank] += math.prod(box[1]) * itemsize
        for coords in _box_chunks(grid, box, starts):
            if coords in seen:
                raise UnsupportedValueError(
                    f"tensor {fqn!r}: boxes overlap (around chunk {coords}); the ranks' ShardedArray "
                    "boxes must not overlap unless they are identical (replicas)"
                )
            seen.add(coords)
        ranks.append(rank)
        idxs.append(idx)
        offs.extend(box[0])
        sizes_flat.extend(box[1])
    if len(seen) != (0 if any(n == 0 for n in shape) else grid.nchunks):
        raise UnsupportedValueError(_not_tiled(fqn, shape, unique, "leave parts of the tensor uncovered"))
    return grid, TensorWrites(len(shape), tuple(ranks), tuple(idxs), tuple(offs), tuple(sizes_flat))


#: the most cells of the grid of box edges, times boxes, that an error message looks through
#: for a region no box covers
_GAP_SEARCH = 1 << 20


def _not_tiled(fqn: str, shape: tuple[int, ...], boxes: Sequence[Box], what: str) -> str:
    """Why the ``boxes`` of tensor ``fqn`` do not tile it, in the tensor's words: its shape, a
    region no box covers (where a search of the grid of box edges is cheap), and the fix."""
    text = "x".join(map(str, shape)) if shape else "()"
    gap = _first_gap(shape, boxes)
    where = "" if gap is None else f"; no box holds [{', '.join(f'{a}:{b}' for a, b in gap)}]"
    total = math.prod(shape)
    if sum(math.prod(s) for _, s in boxes) > total and gap is None:
        where = "; some boxes overlap (boxes held by several ranks must be identical)"
    return (
        f"tensor {fqn!r} of shape {text}: its ShardedArray boxes {what}{where}; together the "
        "ranks' ShardedArray boxes must tile the whole tensor exactly: give a ShardedArray for "
        "every region (in one process, a list of them under the tensor's key), or make "
        "global_shape the shape the boxes cover"
    )


def _first_gap(shape: tuple[int, ...], boxes: Sequence[Box]) -> list[tuple[int, int]] | None:
    """The first cell (C order) of the grid of box edges that no box covers, as a range per
    axis; None where every cell is covered or the grid is too large to look through."""
    edges = [
        sorted(
            {
                0,
                n,
                *(min(max(o[d], 0), n) for o, _ in boxes),
                *(min(max(o[d] + s[d], 0), n) for o, s in boxes),
            }
        )
        for d, n in enumerate(shape)
    ]
    cells = [list(itertools.pairwise(e)) for e in edges]
    if math.prod(len(c) for c in cells) * max(1, len(boxes)) > _GAP_SEARCH:
        return None
    for cell in itertools.product(*cells):
        if not any(all(o[d] <= a and b <= o[d] + s[d] for d, (a, b) in enumerate(cell)) for o, s in boxes):
            return list(cell)
    return None


def plan_tensors(
    locals_by_rank: Sequence[Sequence[LocalTensor]], *, chunk_bytes: int, portable: bool = False
) -> Iterator[tuple[LocalTensor, ChunkGrid, TensorWrites]]:
    """Each tensor's description (the first rank's), chunk grid and writers; see
    :func:`plan_global`, of which this is the core (without a record per chunk)."""
    by_fqn: dict[str, list[tuple[int, LocalTensor]]] = {}
    for rank, tensors in enumerate(locals_by_rank):
        for lt in tensors:
            by_fqn.setdefault(lt.fqn, []).append((rank, lt))
    load = np.zeros(len(locals_by_rank), np.int64)
    for fqn, held in by_fqn.items():
        _check_agree(fqn, held)
        first = held[0][1]
        grid, writes = plan_one_tensor(
            first, [(r, lt.boxes) for r, lt in held], load, chunk_bytes=chunk_bytes, portable=portable
        )
        yield first, grid, writes


def plan_global(
    locals_by_rank: Sequence[Sequence[LocalTensor]],
    *,
    chunk_bytes: int,
    portable: bool = False,
) -> list[GlobalTensorPlan]:
    """Merge every rank's tensors into one plan; raises on inconsistent or incomplete boxes."""
    plans = []
    for lt, grid, writes in plan_tensors(locals_by_rank, chunk_bytes=chunk_bytes, portable=portable):
        starts = axis_starts(grid)
        writers = {}
        if not any(n == 0 for n in lt.global_shape):
            for i in range(len(writes)):
                for coords in _box_chunks(grid, writes.box(i), starts):
                    writers[coords] = (writes.ranks[i], writes.boxes[i])
        specs = tuple(grid.chunk_list())
        plans.append(GlobalTensorPlan(lt.fqn, lt.global_shape, lt.dtype, lt.properties, grid, specs, writers))
    return plans
