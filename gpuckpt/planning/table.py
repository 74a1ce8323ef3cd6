"""Which rank writes which rows of a distributed save's chunk table, as pure data.

A large save keeps one record per chunk (its CRC32C, and its stored size where
it is compressed) in the chunk table (:mod:`gpuckpt.format.records`), in C order
of each tensor's grid, tensor after tensor. Gathering those records costs rank 0
as much as the job has chunks: 16 million rows at 16,384 ranks x 1,000 tensors.

In the layouts of FSDP and of row-wise tensor parallelism each rank writes one
contiguous run of every tensor's chunks (its row shard), the same number of
chunks of a tensor for every rank. A :class:`TableLayout` then orders the table by
*block*: block ``b`` holds the chunks that rank ``writers[b]`` writes, tensor after
tensor, so that each rank encodes and stores its own rows (whole chunks of the
table's column arrays) and sends rank 0 only their checksums. Chunk ``i`` of a
tensor whose chunks are split ``k`` per block (its *span*) is row ::

    (i // k) * block_rows + offset + i % k

and the chunks of the other tensors (those stored whole by one rank, those split
any other way) follow the blocks in the usual order, in the *tail*, whose rows
rank 0 still gathers (:mod:`gpuckpt.format.blocks` describes the stored form).

:func:`table_layout` finds the layout from a plan, costing per tensor and per
distinct writer layout, not per chunk; None where no block layout applies (one
process, a small save, a save that records content hashes, or no tensor split
into runs that at least two ranks write).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.format.grid import starts_of
from gpuckpt.format.records import ROWS_PER_CHUNK
from gpuckpt.planning.plan import SavePlan, TensorPlan

__all__ = ["TableLayout", "table_layout"]


@dataclass(frozen=True, eq=False)
class TableLayout:
    """Where each chunk of a plan has its row of the chunk table: see the module docstring.

    ``writers[b]``: the rank that writes block ``b`` (each rank at most one block);
    ``used``: rows of a block that hold records, ``block_rows`` (a multiple of
    ``chunk_rows``, the rows of one stored chunk of a column) the rows it spans;
    per tensor of the plan, in its order: ``spans`` (chunks per block, 0 for a tensor in
    the tail) and ``bases`` (its offset in a block, or its first row in the tail).
    """

    writers: tuple[int, ...]
    used: int
    block_rows: int
    chunk_rows: int
    spans: np.ndarray  # int64, per tensor
    bases: np.ndarray  # int64, per tensor
    starts: np.ndarray  # int64, per tensor: its first row in the plan's order (TensorPlan.row)
    tail: int  # rows of the tail
    #: the table's columns: the CRC32C, and the stored size where a tensor is compressed
    columns: tuple[str, ...] = ("crc32c",)

    @property
    def blocks(self) -> int:
        return len(self.writers)

    @property
    def rows(self) -> int:
        """Rows of the whole table: the blocks, then the tail."""
        return self.blocks * self.block_rows + self.tail

    def block_of(self, rank: int) -> int | None:
        """The block ``rank`` writes, or None."""
        try:
            return self.writers.index(rank)
        except ValueError:
            return None

    def table_rows(self, rows: np.ndarray) -> np.ndarray:
        """The table rows of the chunks at ``rows`` of the plan's order (``ChunkAssignment.row``)."""
        rows = np.asarray(rows, np.int64)
        t = np.searchsorted(self.starts, rows, side="right") - 1
        flat = rows - self.starts[t]
        span, base = self.spans[t], self.bases[t]
        blocked = span > 0
        k = np.where(blocked, span, 1)
        out: np.ndarray = np.where(blocked, (flat // k) * self.block_rows + base + flat % k, base + flat)
        return out

    def tensor_row(self, index: int) -> int:
        """What tensor ``index``'s entry records as its ``rows``: its offset in a block, or its
        first row in the tail (never less than the blocks' rows)."""
        return int(self.bases[index])


def _runs(t: TensorPlan) -> tuple[tuple[int, ...], int] | None:
    """``(writer of each run, chunks per run)`` when the chunks of ``t`` split into runs of equal
    length in C order, each inside one box, the runs in the order of the writers; else None."""
    w, grid = t.writes, t.grid
    starts = starts_of(grid)
    gshape = grid.grid_shape
    found: list[tuple[int, int, int]] = []  # (first chunk, chunks, rank)
    for i in range(len(w)):
        offsets, sizes = w.box(i)
        if 0 in sizes:
            continue
        lo = [bisect.bisect_left(s, o) for s, o in zip(starts, offsets, strict=True)]
        hi = [bisect.bisect_left(s, o + n) for s, o, n in zip(starts, offsets, sizes, strict=True)]
        # contiguous in C order: one chunk along the leading axes, everything along the trailing ones
        j = next((d for d in range(len(lo)) if hi[d] - lo[d] != 1), len(lo))
        if any(lo[d] != 0 or hi[d] != gshape[d] for d in range(j + 1, len(lo))):
            return None
        first = 0
        for c, g in zip(lo, gshape, strict=True):
            first = first * g + c
        found.append((first, math.prod(h - lo_ for h, lo_ in zip(hi, lo, strict=True)), w.ranks[i]))
    if len(found) < 2:
        return None
    found.sort()
    k = found[0][1]
    if any(n != k or first != b * k for b, (first, n, _) in enumerate(found)):
        return None
    if len(found) * k != t.nchunks:
        return None
    return tuple(r for _, _, r in found), k


def table_layout(plan: SavePlan, *, min_chunks: int, hashing: bool = False) -> TableLayout | None:
    """The block layout of ``plan``'s chunk table, or None (see the module docstring): a
    save of more than ``min_chunks`` chunks (it has a chunk table), of at least two
    processes, that does not record content hashes (``hashing``: those columns are
    complete only when every chunk was hashed, known after the writes)."""
    if hashing or plan.world_size < 2 or plan.nchunks <= min_chunks:
        return None
    runs: list[tuple[tuple[int, ...], int] | None] = []
    seen: dict[tuple[Any, ...], tuple[tuple[int, ...], int] | None] = {}
    for t in plan.tensors:
        if t.nchunks < 2:
            runs.append(None)
            continue
        key = (
            id(t.writes),
            t.grid.kind,
            t.grid.shape,
            t.grid.chunk_shape if t.grid.kind == "regular" else None,
        )
        if key not in seen or t.grid.kind != "regular":
            seen[key] = _runs(t)
        runs.append(seen[key])
    weight: Counter[tuple[int, ...]] = Counter()
    for r, t in zip(runs, plan.tensors, strict=True):
        if r is not None and len(set(r[0])) == len(r[0]):
            weight[r[0]] += t.nchunks
    if not weight:
        return None
    writers = weight.most_common(1)[0][0]
    n = len(writers)
    spans = np.zeros(len(plan.tensors), np.int64)
    bases = np.zeros(len(plan.tensors), np.int64)
    used = 0
    for i, r in enumerate(runs):
        if r is not None and r[0] == writers:
            spans[i], bases[i] = r[1], used
            used += r[1]
    per_chunk = math.ceil(used / math.ceil(used / ROWS_PER_CHUNK))
    block_rows = per_chunk * math.ceil(used / per_chunk)
    tail = n * block_rows
    for i, t in enumerate(plan.tensors):
        if spans[i] == 0:
            bases[i] = tail
            tail += t.nchunks
    starts = np.fromiter((t.row for t in plan.tensors), np.int64, len(plan.tensors))
    columns = ("crc32c", "nbytes") if any(t.codec is not None for t in plan.tensors) else ("crc32c",)
    return TableLayout(
        writers, used, block_rows, per_chunk, spans, bases, starts, tail - n * block_rows, columns
    )
