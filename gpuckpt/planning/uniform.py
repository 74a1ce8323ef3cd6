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


def plan_uniform(
    ranks: Sequence[CompactDescription], *, chunk_bytes: int, portable: bool
) -> Iterator[tuple[LocalTensor, ChunkGrid, TensorWrites]]:
    """Each tensor's description, chunk grid and writers, for ranks that all sent the same digest.

    The same result as :func:`gpuckpt.planning.boxes.plan_tensors` on the full
    descriptions; ``ranks[0].tensors`` names the tensors.
    """
    first = ranks[0].tensors
    if first is None:
        raise ValueError("the first rank's compact description must carry its tensors")
    nranks = len(ranks)
    boxes = _boxes_of(ranks, len(first))
    load = np.zeros(nranks, np.int64)
    all_ranks = np.arange(nranks)
    for t, lt in enumerate(first):
        shape = lt.global_shape
        nd = len(shape)
        offs = boxes[:, t, 0, :nd]
        sizes = boxes[:, t, 1, :nd]
        shp = np.array(shape, np.int64).reshape(1, nd)
        nbytes = int(np.prod(shp)) * lt.itemsize
        if nd == 0 or (not offs.any() and (sizes == shp).all()):
            # held whole by every rank: written once, by the least-loaded rank, on the grid
            # a single-process save plans
            rank = int(np.argmin(load))
            load[rank] += nbytes
            whole = ((0,) * nd, shape)
            yield lt, plan_regular_grid(shape, lt.itemsize, chunk_bytes), TensorWrites.one(rank, 0, whole)
            continue
        step = sizes.max(axis=0)
        split = (
            bool((sizes > 0).all())
            and bool((offs >= 0).all())
            and bool((offs % step == 0).all())
            and bool((sizes == np.minimum(step, shp - offs)).all())
        )
        if not split:
            held = [(r, ((tuple(offs[r].tolist()), tuple(sizes[r].tolist())),)) for r in range(nranks)]
            grid, writes = plan_one_tensor(lt, held, load, chunk_bytes=chunk_bytes, portable=portable)
            yield lt, grid, writes
            continue
        nblocks = -(-shp[0] // step)
        ids = np.ravel_multi_index(tuple((offs // step).T), tuple(nblocks.tolist()))
        if len(ids) == int(np.prod(nblocks)) and len(np.unique(ids)) == len(ids):
            writers = all_ranks  # each box held once: its holder writes it
        else:
            # replicas: each distinct box is written by its least-loaded holder (lowest rank on ties)
            order = np.lexsort((all_ranks, load, ids))
            uniq, first_at = np.unique(ids[order], return_index=True)
            if len(uniq) != int(np.prod(nblocks)):
                held = [(r, ((tuple(offs[r].tolist()), tuple(sizes[r].tolist())),)) for r in range(nranks)]
                grid, writes = plan_one_tensor(lt, held, load, chunk_bytes=chunk_bytes, portable=portable)
                yield lt, grid, writes
                continue
            writers = np.sort(order[first_at])
        load[writers] += np.prod(sizes[writers], axis=1) * lt.itemsize
        edges = [[*range(0, n, int(s)), n] for n, s in zip(shape, step.tolist(), strict=True)]
        grid = grid_from_edges(edges, shape, lt.itemsize, chunk_bytes=chunk_bytes, portable=portable)
        writes = TensorWrites(
            nd,
            tuple(writers.tolist()),
            (0,) * len(writers),
            tuple(offs[writers].ravel().tolist()),
            tuple(sizes[writers].ravel().tolist()),
        )
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
