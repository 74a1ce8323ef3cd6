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

What rank 0 receives need not grow with ranks x tensors either. The tensors of
a model fall into a few *groups* whose boxes are the same on every rank (the
layers of one shape). Each rank fingerprints the box it holds of every tensor
together with its rank (:func:`box_fingerprints`); the XOR of those
fingerprints over the ranks (one reduction the transport does in a tree,
:meth:`~gpuckpt.distributed.coordinator.Coordinator.all_reduce_xor`) is then the
same for two tensors exactly when (but for a 2**-128 chance) their boxes are
the same on every rank. Every rank finds the same groups from it
(:func:`tensor_groups`), checks them against its own boxes
(:meth:`CompactDescription.grouped`: so the plan never rests on the chance),
and sends only the boxes of one tensor per group: rank 0 plans from
``ranks x groups`` boxes and a per-tensor loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.format.grid import ChunkGrid, plan_regular_grid
from gpuckpt.planning.boxes import (
    LocalTensor,
    TensorWrites,
    grid_from_edges,
    plan_one_tensor,
)

__all__ = [
    "CompactDescription",
    "TensorGroups",
    "box_fingerprints",
    "compact_description",
    "layout_digest",
    "local_layout_digest",
    "plan_uniform",
    "tensor_groups",
]


@dataclass(frozen=True, slots=True)
class TensorGroups:
    """The tensors of a state in groups whose boxes are the same on every rank (see the module docstring).

    ``representatives``: the index of each group's first tensor, ascending;
    ``group_of``: for each tensor, the index of its group in ``representatives``.
    """

    representatives: tuple[int, ...]
    group_of: tuple[int, ...]

    @property
    def digest(self) -> bytes:
        """32 bytes that differ when two ranks grouped differently."""
        h = hashlib.blake2b(digest_size=32)
        h.update(np.asarray(self.representatives, "<i8").tobytes())
        h.update(b"|")
        h.update(np.asarray(self.group_of, "<i8").tobytes())
        return h.digest()


@dataclass(frozen=True, slots=True)
class CompactDescription:
    """What one rank holds, when it holds exactly one box of each tensor (small and picklable).

    ``digest``: :func:`layout_digest` of its tensors (names, shapes, dtypes,
    properties, in order); ``tensors``: those tensors (sent by one rank only:
    the others send None, since every rank with the same digest holds the same
    tensors); ``boxes``: the offsets and sizes of its box of every tensor,
    ``int64`` little-endian, ``ntensors x 2 x ndim`` with ``ndim`` the largest
    rank of its tensors (unused axes: offset 0, size 1). A *grouped* description
    (:meth:`grouped`) holds in ``boxes`` only the box of each group's first
    tensor; ``groups`` (sent by one rank, like ``tensors``) says which tensor
    belongs to which group, and ``groups_digest`` (sent by every rank) lets the
    planner check that every rank grouped alike.
    """

    digest: bytes
    ndim: int
    boxes: bytes
    tensors: tuple[LocalTensor, ...] | None
    objects: Mapping[str, Any]
    skeleton: Any
    groups: TensorGroups | None = None
    groups_digest: bytes = b""

    def without_tensors(self) -> CompactDescription:
        return dataclasses.replace(self, tensors=None, groups=None)

    def block(self) -> np.ndarray:
        """The boxes of an ungrouped description with its tensors: one ``tensors x 2 x ndim`` int64 array."""
        if self.tensors is None or self.groups_digest:
            raise ValueError("block() needs an ungrouped description that carries its tensors")
        return np.frombuffer(self.boxes, "<i8").reshape(len(self.tensors), 2, self.ndim)

    def grouped(self, groups: TensorGroups) -> CompactDescription:
        """This description with the boxes of ``groups``' representatives only.

        Raises ValueError when this rank's box of some tensor differs from its box of
        the first tensor of its group: fingerprints that collided (the save then fails
        on every rank rather than plan from a wrong box; try it again).
        """
        block = self.block()
        if len(groups.group_of) != len(block):
            raise ValueError(f"groups of {len(groups.group_of)} tensors given for {len(block)} tensors")
        reps = np.asarray(groups.representatives, np.int64)
        first = reps[np.asarray(groups.group_of, np.int64)] if len(block) else reps
        if not np.array_equal(block, block[first]):
            bad = int(np.flatnonzero((block != block[first]).reshape(len(block), -1).any(axis=1))[0])
            raise ValueError(
                f"tensor {bad} was grouped with tensor {int(first[bad])}, but this rank holds different "
                "boxes of them (their box fingerprints collided); save again"
            )
        return dataclasses.replace(
            self,
            boxes=np.ascontiguousarray(block[reps]).astype("<i8").tobytes(),
            groups=groups,
            groups_digest=groups.digest,
        )


def layout_digest(tensors: Sequence[LocalTensor]) -> bytes:
    """A 32-byte digest of the names, global shapes, dtypes and properties of ``tensors``, in order."""
    h = hashlib.blake2b(digest_size=32)
    for t in tensors:
        props = json.dumps(t.properties.to_json(), sort_keys=True, separators=(",", ":"))
        h.update(
            f"{len(t.fqn)}:{t.fqn}|{t.global_shape}|{t.dtype}|{t.itemsize}|{props}\n".encode(
                "utf-8", "surrogatepass"
            )
        )
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


#: odd 64-bit constants: the finaliser of SplitMix64, and one seed per half of a fingerprint
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SEEDS = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03))


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def box_fingerprints(description: CompactDescription, rank: int) -> np.ndarray:
    """A 128-bit fingerprint of (``rank``, its box) for each tensor of an ungrouped description:
    ``tensors x 2`` ``uint64``. XORed over the ranks, two tensors get the same value when each
    rank holds the same box of both; the tensor itself does not enter the fingerprint."""
    block = description.block()
    words = np.ascontiguousarray(block).reshape(len(block), 2 * description.ndim).view(np.uint64)
    out = np.empty((len(block), 2), np.uint64)
    for lane, seed in enumerate(_SEEDS):
        h = _mix(np.full(len(block), seed ^ np.uint64(rank), np.uint64))
        for j in range(words.shape[1]):
            h = _mix(h ^ words[:, j])
        out[:, lane] = h
    return out


def tensor_groups(combined: np.ndarray, tensors: Sequence[LocalTensor]) -> TensorGroups:
    """The groups of ``tensors`` by their fingerprints XORed over every rank (``combined``, from
    :func:`box_fingerprints`), global shape and element size; the same on every rank."""
    keys = np.ascontiguousarray(combined, np.uint64).reshape(len(tensors), 2)
    found: dict[tuple[int, int, tuple[int, ...], int], int] = {}
    reps: list[int] = []
    group_of: list[int] = []
    for i, ((a, b), t) in enumerate(zip(keys.tolist(), tensors, strict=True)):
        key = (a, b, t.global_shape, t.itemsize)
        g = found.get(key)
        if g is None:
            g = found[key] = len(reps)
            reps.append(i)
        group_of.append(g)
    return TensorGroups(tuple(reps), tuple(group_of))


def _boxes_of(ranks: Sequence[CompactDescription], rows: int) -> np.ndarray:
    """Every rank's boxes as one ``ranks x rows x 2 x ndim`` array."""
    ndim, grouping = ranks[0].ndim, ranks[0].groups_digest
    for r, d in enumerate(ranks):
        if d.ndim != ndim or len(d.boxes) != rows * 2 * ndim * 8:
            raise ValueError(f"rank {r}'s compact description does not match rank 0's tensors")
        if d.groups_digest != grouping:
            raise ValueError(f"rank {r} grouped the tensors differently from rank 0; save again")
    raw = b"".join(d.boxes for d in ranks)
    return np.frombuffer(raw, "<i8").reshape(len(ranks), rows, 2, ndim)


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
    their split, checked and made once; with grouped descriptions
    (:meth:`CompactDescription.grouped`) the ranks said which tensors those are
    and sent one box per group, so the cost per further tensor does not grow
    with the ranks at all.
    """
    first = ranks[0].tensors
    if first is None:
        raise ValueError("the first rank's compact description must carry its tensors")
    groups = ranks[0].groups
    if groups is not None and len(groups.group_of) != len(first):
        raise ValueError("the first rank's groups do not match its tensors")
    if groups is None and ranks[0].groups_digest:
        raise ValueError("the first rank's compact description is grouped but carries no groups")
    nranks = len(ranks)
    rows = len(first) if groups is None else len(groups.representatives)
    # row-major (tensor or group first), so that each row's boxes are one contiguous block
    boxes = np.ascontiguousarray(_boxes_of(ranks, rows).transpose(1, 0, 2, 3))
    load = np.zeros(nranks, np.int64)
    # plans of a layout already checked and made: by group, or by shape, element size and boxes
    splits: dict[Any, _Split | None] = {}
    generals: dict[Any, _Split] = {}
    # bytes each rank writes, added to ``load`` only when a decision reads it (tensors of a
    # group add the same bytes: counted, and added once per group)
    owed: dict[Any, int] = {}
    shares: dict[Any, np.ndarray] = {}

    def settle() -> None:
        nonlocal load
        for key, n in owed.items():
            load += n * shares[key]
        owed.clear()

    for t, lt in enumerate(first):
        shape = lt.global_shape
        nd = len(shape)
        block = boxes[t if groups is None else groups.group_of[t], :, :, :nd]
        offs, sizes = block[:, 0, :], block[:, 1, :]
        if nd == 0 or (not offs.any() and bool((sizes == np.array(shape, np.int64)).all())):
            # held whole by every rank: written once, by the least-loaded rank, on the grid
            # a single-process save plans
            settle()
            rank = int(np.argmin(load))
            load[rank] += math.prod(shape) * lt.itemsize
            whole = ((0,) * nd, shape)
            yield lt, plan_regular_grid(shape, lt.itemsize, chunk_bytes), TensorWrites.one(rank, 0, whole)
            continue
        key: Any = groups.group_of[t] if groups is not None else (shape, lt.itemsize, block.tobytes())
        if key in splits:
            split = splits[key]
        else:
            split = splits[key] = _split(offs, sizes, lt, chunk_bytes, portable)
        if split is None:
            split = generals.get(key)
        if split is not None:
            shares[key] = split.written
            owed[key] = owed.get(key, 0) + 1
            yield lt, split.grid, split.writes
            continue
        settle()
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
