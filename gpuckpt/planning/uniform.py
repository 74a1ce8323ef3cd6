"""Planning that costs per tensor, not per chunk: the layouts where every rank holds one box of each tensor.

The common layout of data- and tensor-parallel jobs (FSDP, TP, their
products): every rank holds the same tensors, one box of each, and the boxes
of a tensor are an even split of it (the boxes at the upper edge may be
smaller). Each rank then sends a :class:`CompactDescription`: a digest of its
tensors' names, shapes, dtypes and properties, and its box offsets and sizes
as one little-endian ``int64`` block; when every rank's digest is the same,
the planner checks and plans each tensor with NumPy over the ranks
(:func:`plan_uniform`) instead of visiting every box and chunk in Python.
A tensor whose boxes are not such a split is planned by the general path
(:func:`gpuckpt.planning.boxes.plan_one_tensor`), so the result is always the
plan the general path makes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.planning.boxes import (
    LocalTensor,
    TensorWrites,
    grid_from_edges,
    plan_one_tensor,
)
from gpuckpt.planning.grid import ChunkGrid, plan_regular_grid

__all__ = [
    "CompactDescription",
    "compact_description",
    "layout_digest",
    "local_layout_digest",
    "plan_uniform",
]


@dataclass(frozen=True, slots=True)
class CompactDescription:
    """What one rank holds, when it holds exactly one box of each tensor (small and picklable).

    ``digest``: :func:`layout_digest` of its tensors (names, shapes, dtypes,
    properties, in order); ``tensors``: those tensors (sent by one rank only:
    the others send None, since every rank with the same digest holds the same
    tensors); ``boxes``: the offsets and sizes of its box of every tensor,
    ``int64`` little-endian, ``ntensors x 2 x ndim`` with ``ndim`` the largest
    rank of its tensors (unused axes: offset 0, size 1).
    """

    digest: bytes
    ndim: int
    boxes: bytes
    tensors: tuple[LocalTensor, ...] | None
    objects: Mapping[str, Any]
    skeleton: Any

    def without_tensors(self) -> CompactDescription:
        return CompactDescription(self.digest, self.ndim, self.boxes, None, self.objects, self.skeleton)


def layout_digest(tensors: Sequence[LocalTensor]) -> bytes:
    """A 32-byte digest of the names, global shapes, dtypes and properties of ``tensors``, in order."""
    h = hashlib.blake2b(digest_size=32)
    for t in tensors:
        props = json.dumps(t.properties.to_json(), sort_keys=True, separators=(",", ":"))
        h.update(f"{len(t.fqn)}:{t.fqn}|{t.global_shape}|{t.dtype}|{t.itemsize}|{props}\n".encode())
    return h.digest()


def compact_description(
    tensors: Sequence[LocalTensor], objects: Mapping[str, Any], skeleton: Any
) -> CompactDescription | None:
    """The compact form of a rank's description, or None when some tensor has not exactly one box."""
    if any(len(t.boxes) != 1 for t in tensors):
        return None
    ndim = max((len(t.global_shape) for t in tensors), default=0)
    block = np.zeros((len(tensors), 2, ndim), np.int64)
    block[:, 1, :] = 1
    for i, t in enumerate(tensors):
        ((offsets, sizes),) = t.boxes
        n = len(offsets)
        if n:
            block[i, 0, :n] = offsets
            block[i, 1, :n] = sizes
    return CompactDescription(
        layout_digest(tensors), ndim, block.astype("<i8").tobytes(), tuple(tensors), objects, skeleton
    )


def _boxes_of(ranks: Sequence[CompactDescription], ntensors: int) -> np.ndarray:
    """Every rank's boxes as one ``ranks x tensors x 2 x ndim`` array."""
    ndim = ranks[0].ndim
    for r, d in enumerate(ranks):
        if d.ndim != ndim or len(d.boxes) != ntensors * 2 * ndim * 8:
            raise ValueError(f"rank {r}'s compact description does not match rank 0's tensors")
    raw = b"".join(d.boxes for d in ranks)
    return np.frombuffer(raw, "<i8").reshape(len(ranks), ntensors, 2, ndim)


@dataclass(frozen=True, slots=True)
class _Split:
    """A checked even split of one tensor shape among the ranks: its grid, writers and per-rank bytes."""

    grid: ChunkGrid
    writes: TensorWrites
    written: np.ndarray  # bytes each rank writes of the tensor


def _split(
    offs: np.ndarray, sizes: np.ndarray, lt: LocalTensor, chunk_bytes: int, portable: bool
) -> _Split | None:
    """The plan of boxes that split ``lt`` evenly, each held by one rank; None for any other layout."""
    shape = lt.global_shape
    shp = np.array(shape, np.int64).reshape(1, len(shape))
    step = sizes.max(axis=0)
    if not (
        bool((sizes > 0).all())
        and bool((offs >= 0).all())
        and bool((offs % step == 0).all())
        and bool((sizes == np.minimum(step, shp - offs)).all())
    ):
        return None
    nblocks = -(-shp[0] // step)
    ids = np.ravel_multi_index(tuple((offs // step).T), tuple(nblocks.tolist()))
    if len(ids) != int(np.prod(nblocks)) or len(np.unique(ids)) != len(ids):
        return None  # replicas, or blocks left out: planned with the loads of the moment
    edges = [[*range(0, n, int(s)), n] for n, s in zip(shape, step.tolist(), strict=True)]
    grid = grid_from_edges(edges, shape, lt.itemsize, chunk_bytes=chunk_bytes, portable=portable)
    nranks = len(offs)
    writes = TensorWrites(
        len(shape),
        tuple(range(nranks)),
        (0,) * nranks,
        tuple(offs.ravel().tolist()),
        tuple(sizes.ravel().tolist()),
    )
    return _Split(grid, writes, np.prod(sizes, axis=1) * lt.itemsize)


def plan_uniform(
    ranks: Sequence[CompactDescription], *, chunk_bytes: int, portable: bool
) -> Iterator[tuple[LocalTensor, ChunkGrid, TensorWrites]]:
    """Each tensor's description, chunk grid and writers, for ranks that all sent the same digest.

    The same result as :func:`gpuckpt.planning.boxes.plan_tensors` on the full
    descriptions; ``ranks[0].tensors`` names the tensors. Tensors with the same
    shape, element size and boxes (the layers of a model) share one plan of
    their split, checked and made once: the cost per further tensor does not
    grow with the ranks but for adding up the bytes each rank writes.
    """
    first = ranks[0].tensors
    if first is None:
        raise ValueError("the first rank's compact description must carry its tensors")
    nranks = len(ranks)
    # tensor-major, so that each tensor's boxes are one contiguous block
    boxes = np.ascontiguousarray(_boxes_of(ranks, len(first)).transpose(1, 0, 2, 3))
    load = np.zeros(nranks, np.int64)
    splits: dict[tuple[tuple[int, ...], int, bytes], _Split | None] = {}
    generals: dict[tuple[tuple[int, ...], int, bytes], _Split] = {}
    for t, lt in enumerate(first):
        shape = lt.global_shape
        nd = len(shape)
        block = boxes[t, :, :, :nd]
        offs, sizes = block[:, 0, :], block[:, 1, :]
        if nd == 0 or (not offs.any() and bool((sizes == np.array(shape, np.int64)).all())):
            # held whole by every rank: written once, by the least-loaded rank, on the grid
            # a single-process save plans
            rank = int(np.argmin(load))
            load[rank] += math.prod(shape) * lt.itemsize
            whole = ((0,) * nd, shape)
            yield lt, plan_regular_grid(shape, lt.itemsize, chunk_bytes), TensorWrites.one(rank, 0, whole)
            continue
        key = (shape, lt.itemsize, block.tobytes())
        if key in splits:
            split = splits[key]
        else:
            split = splits[key] = _split(offs, sizes, lt, chunk_bytes, portable)
        if split is not None:
            load += split.written
            yield lt, split.grid, split.writes
            continue
        general = generals.get(key)
        if general is not None:
            load += general.written
            yield lt, general.grid, general.writes
            continue
        held_offs, held_sizes = offs.tolist(), sizes.tolist()
        held = [
            (r, ((tuple(o), tuple(z)),)) for r, (o, z) in enumerate(zip(held_offs, held_sizes, strict=True))
        ]
        grid, writes = plan_one_tensor(lt, held, load, chunk_bytes=chunk_bytes, portable=portable)
        if len(writes) == nranks:
            # every box held once: its holder writes it whatever the loads, so the next
            # tensors of this layout get the same plan
            generals[key] = _Split(grid, writes, np.prod(sizes, axis=1) * lt.itemsize)
        yield lt, grid, writes


def local_layout_digest(tensors: Sequence[LocalTensor], *, chunk_bytes: int, portable: bool) -> bytes:
    """A 32-byte digest of everything a plan is made from on one rank: its tensors' names,
    shapes, dtypes and properties, its boxes, and the planning options. Two saves whose
    every rank gives the same digest get the same plan (see :mod:`gpuckpt.distributed.save`)."""
    h = hashlib.blake2b(layout_digest(tensors), digest_size=32)
    h.update(f"|{chunk_bytes}|{portable}|".encode())
    for t in tensors:
        h.update(repr(t.boxes).encode())
        h.update(b"\n")
    return h.digest()
