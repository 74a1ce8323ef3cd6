"""The save plan: what a save writes and which process writes it, as pure data.

A save is planned from descriptions of the state, never from the arrays:
each process describes what it holds (:class:`StateDescription`: its
tensors' global shapes, dtypes, properties and boxes, its plain values
already encoded, and the nesting of its state dict), and :func:`plan_save`
turns the descriptions of every process into one :class:`SavePlan`. The
same function plans single-process saves (one description, every tensor
held whole), background saves (planned before the snapshot is taken, so
the snapshot changes no plan) and distributed saves (one description per
rank, gathered on the coordinator).

A plan names no array: the chunks a process writes are
:class:`ChunkAssignment` records (which tensor, which chunk, which of the
process's boxes holds it). They are bound to the arrays only when the plan
runs (:func:`gpuckpt.saving.writing.bind_jobs`, from a mapping FQN -> the arrays
holding each box), so that a background save binds the same plan to its
snapshot, and plans are tested as data (``tests/unit/test_save_plan.py``).
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.errors import UnsupportedValueError
from gpuckpt.format.codecs import Codec, Compression
from gpuckpt.format.dtypes import dtype_from_name
from gpuckpt.format.grid import ChunkGrid, ChunkSpec
from gpuckpt.format.metadata import TensorProperties
from gpuckpt.format.names import encode_name
from gpuckpt.planning.boxes import LocalTensor, TensorWrites, axis_starts, box_chunks, plan_tensors
from gpuckpt.planning.uniform import CompactDescription, plan_uniform

__all__ = [
    "ChunkAssignment",
    "PlanMemo",
    "SavePlan",
    "StateDescription",
    "TensorPlan",
    "merge_skeletons",
    "merge_values",
    "plan_save",
]


@dataclass(frozen=True, slots=True)
class StateDescription:
    """What one process holds of a state dict, without its data (small and picklable).

    ``tensors``: one :class:`~gpuckpt.planning.boxes.LocalTensor` per array
    leaf; ``objects``: every other leaf, encoded (JSON values, see
    :mod:`gpuckpt.format.values`), by FQN; ``skeleton``: the nesting of the
    state dict (:func:`gpuckpt.state.flatten_state_dict`).
    """

    tensors: tuple[LocalTensor, ...]
    objects: Mapping[str, Any]
    skeleton: Any


@dataclass(frozen=True, slots=True)
class ChunkAssignment:
    """One stored chunk that one process writes: where it goes, and which of its boxes holds it."""

    fqn: str
    name: str  # the tensor's array name
    coords: tuple[int, ...]  # grid coordinates of the chunk
    offsets: tuple[int, ...]  # of the chunk in the global tensor
    sizes: tuple[int, ...]
    stored: tuple[int, ...]  # stored (possibly padded) chunk shape
    box: int  # index of the box in the process's ``LocalTensor.boxes`` of this tensor
    row: int = 0  # of the chunk in the plan's chunk table (see :attr:`TensorPlan.row`)
    codec: Codec | None = None  # the tensor's (see :attr:`TensorPlan.codec`)


def largest_chunk_elements(grid: ChunkGrid) -> int:
    """Elements of the largest stored chunk of ``grid``."""
    if grid.kind == "regular":
        return math.prod(grid.chunk_shape)
    return math.prod(max(e, default=0) for e in grid.edges)


@functools.lru_cache(maxsize=256)
def _specs_of(grid: ChunkGrid) -> tuple[ChunkSpec, ...]:
    return tuple(grid.chunk_list())


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """One tensor of a save: its array (name, shape, dtype, grid, properties) and who writes its chunks.

    ``writes``: which rank writes the chunks inside which box (one entry per
    box, see :class:`~gpuckpt.planning.boxes.TensorWrites`); ``row``: the row
    of its first chunk in the save's chunk table, the others following in C
    order of their grid coordinates (the order of the metadata).
    """

    fqn: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    grid: ChunkGrid
    properties: TensorProperties
    writes: TensorWrites
    row: int = 0
    #: how its chunks are compressed (:mod:`gpuckpt.format.codecs`); None: stored as they are
    codec: Codec | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def nchunks(self) -> int:
        """Chunks of the tensor's grid (none for an empty tensor), counted without listing them."""
        return 0 if any(n == 0 for n in self.shape) else self.grid.nchunks

    @property
    def specs(self) -> tuple[ChunkSpec, ...]:
        """Every chunk of the grid, in the order of the metadata (made when asked for)."""
        return _specs_of(self.grid)

    def chunks_of(self, rank: int, memo: dict[int, list[int]] | None = None) -> Iterator[ChunkAssignment]:
        """The chunks ``rank`` writes, box by box, each box's chunks in C order (``memo``: the
        boxes ``rank`` writes of each :class:`TensorWrites` already looked at, by ``id``)."""
        if self.nchunks == 0:
            return
        w = self.writes
        if memo is None:
            mine = w.of_rank(rank)
        else:
            found = memo.get(id(w))
            mine = memo[id(w)] = w.of_rank(rank) if found is None else found
        if not mine:
            return
        grid, fqn, name, codec = self.grid, self.fqn, self.name, self.codec
        if grid.nchunks == 1 and grid.kind == "regular":
            # one chunk (most tensors of a state of many small ones): written from the box that
            # holds the whole tensor; an empty box holds none of it
            nd = len(grid.shape)
            for i in mine:
                if 0 not in w.sizes[i * nd : (i + 1) * nd]:
                    zero = (0,) * nd
                    yield ChunkAssignment(
                        fqn, name, zero, zero, grid.shape, grid.chunk_shape, w.boxes[i], self.row, codec
                    )
                    return
            return
        starts = axis_starts(grid)
        gshape = grid.grid_shape
        regular = grid.kind == "regular"
        for i in mine:
            box = w.box(i)
            idx = w.boxes[i]
            for coords in box_chunks(grid, box, starts):
                offsets = tuple(st[c] for st, c in zip(starts, coords, strict=True))
                if regular:
                    sizes = tuple(
                        min(c, n - o) for c, n, o in zip(grid.chunk_shape, grid.shape, offsets, strict=True)
                    )
                    stored = grid.chunk_shape
                else:
                    sizes = stored = tuple(e[c] for e, c in zip(grid.edges, coords, strict=True))
                flat = 0
                for c, g in zip(coords, gshape, strict=True):
                    flat = flat * g + c
                yield ChunkAssignment(fqn, name, coords, offsets, sizes, stored, idx, self.row + flat, codec)


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Everything a save writes, decided before the first byte is: pure data, no arrays.

    Attributes
    ----------
    tensors
        Every tensor of the state, in the order of the state dict: its Zarr
        array, its chunk grid and who writes which of its chunks (see
        :class:`TensorPlan`).
    objects
        The plain values, encoded, by FQN.
    skeleton
        The nesting of the state dict, stored so that a load rebuilds it.
    world_size
        The number of processes (ranks) that write; a single-process save has one.

    The chunks each process writes (:meth:`assignments_of`) are listed only
    when asked for, by that process: a plan costs per tensor and box, not per
    chunk. Together they cover every chunk of every tensor exactly once.
    A plan is made by :func:`plan_save` and never changed: running it binds
    each process's assignments to that process's arrays
    (:func:`gpuckpt.saving.writing.bind_jobs`), and the chunk checksums the writes
    return complete the metadata (:func:`gpuckpt.saving.commit.assemble_metadata`).

    Examples
    --------
    >>> import numpy as np
    >>> from gpuckpt.format.metadata import TensorProperties
    >>> from gpuckpt.planning.boxes import LocalTensor
    >>> props = TensorProperties(np.dtype("float32"))
    >>> w = LocalTensor("w", (1000, 256), "float32", 4, props, (((0, 0), (1000, 256)),))
    >>> plan = plan_save([StateDescription((w,), {"step": 3}, {"d": []})], chunk_bytes=256 << 10)
    >>> [s.sizes for s in plan.tensors[0].specs]
    [(250, 256), (250, 256), (250, 256), (250, 256)]
    >>> plan.nfiles  # four chunks, the array's zarr.json, the root's
    6
    """

    tensors: tuple[TensorPlan, ...]
    objects: Mapping[str, Any]
    skeleton: Any
    world_size: int = 1
    #: what ``compression="auto"`` decided and why (:attr:`Compression.report
    #: <gpuckpt.format.codecs.Compression.report>`), kept in the checkpoint; None without "auto"
    compression_report: Any = None

    @property
    def nchunks(self) -> int:
        """Chunks of every tensor: the rows of the save's chunk table."""
        return sum(t.nchunks for t in self.tensors)

    @property
    def nfiles(self) -> int:
        """Files the checkpoint holds: each chunk, each array's document, and the root document."""
        return sum(1 + t.nchunks for t in self.tensors) + 1

    def assignments_of(self, rank: int) -> tuple[ChunkAssignment, ...]:
        """The chunks process ``rank`` writes, tensor by tensor."""
        # tensors of one layout share their writers: each is scanned for ``rank`` once
        memo: dict[int, list[int]] = {}
        return tuple(a for t in self.tensors for a in t.chunks_of(rank, memo))

    @property
    def assignments(self) -> tuple[tuple[ChunkAssignment, ...], ...]:
        """:meth:`assignments_of` every process (costs per chunk of the whole save)."""
        return tuple(self.assignments_of(r) for r in range(self.world_size))


def merge_skeletons(a: Any, b: Any, where: str = "the state") -> Any:
    """Union of two structure skeletons (ranks of a pipeline hold different parts of a dict; a
    list or tuple is merged item by item). Raises :class:`~gpuckpt.errors.UnsupportedValueError`
    where they cannot both hold: another kind of container, or sequences of other lengths, at
    one place (keeping either would lose what the other rank saved)."""
    if a == b:
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        if "d" in a and "d" in b:
            items = {(kt, k): child for kt, k, child in a["d"]}
            for kt, k, child in b["d"]:
                at = f"{where}[{k!r}]"
                items[(kt, k)] = merge_skeletons(items[(kt, k)], child, at) if (kt, k) in items else child
            return {"d": [[kt, k, child] for (kt, k), child in items.items()]}
        for tag in ("l", "t"):
            if tag in a and tag in b and len(a[tag]) == len(b[tag]):
                pairs = enumerate(zip(a[tag], b[tag], strict=True))
                return {tag: [merge_skeletons(x, y, f"{where}[{i}]") for i, (x, y) in pairs]}
    raise UnsupportedValueError(
        f"the ranks' states differ in structure at {where}: {_kind(a)} on one rank, {_kind(b)} on "
        "another; every rank must hold the same containers (a rank may hold only some keys of a "
        "dict), or the checkpoint would keep only one rank's"
    )


def _kind(skeleton: Any) -> str:
    if not isinstance(skeleton, dict):
        return "an empty container"
    if "v" in skeleton:
        return "a value or tensor"
    if "d" in skeleton:
        return "a dict"
    for tag, name in (("l", "list"), ("t", "tuple")):
        if tag in skeleton:
            return f"a {name} of {len(skeleton[tag])} items"
    return "something else"


def merge_values(ranks: Sequence[tuple[Mapping[str, Any], Any]]) -> tuple[dict[str, Any], Any]:
    """The plain values and the merged skeleton of ``(objects, skeleton)`` per rank. A value that
    several ranks hold is taken from the first; where another rank's differs, a ``UserWarning``
    names it and the ranks (as DCP, which saves plain values from one rank, keeps one)."""
    objects: dict[str, Any] = {}
    differ: dict[str, list[int]] = {}
    skeleton = ranks[0][1]
    for i, (objs, skel) in enumerate(ranks):
        for k, v in objs.items():
            if k not in objects:
                objects[k] = v
            elif objects[k] != v:
                differ.setdefault(k, []).append(i)
        if i:
            skeleton = merge_skeletons(skeleton, skel)
    if differ:
        shown = ", ".join(
            f"{k!r} (ranks {r[:8]}{f' ... {len(r)} in all' if len(r) > 8 else ''})"
            for k, r in list(differ.items())[:5]
        )
        warnings.warn(
            f"{len(differ)} plain value(s) differ between the ranks, and the checkpoint keeps the first "
            f"rank's that holds each: {shown}{' ...' if len(differ) > 5 else ''}; make them equal on "
            "every rank, or give a rank's own values keys of their own (e.g. f'rng.{rank}')",
            stacklevel=2,
        )
    return objects, skeleton


def _refuse_tensor_and_value(ranks: Sequence[StateDescription | CompactDescription]) -> None:
    """A key that is a tensor on some ranks and a plain value on others: the checkpoint would keep
    only one of them (and the tensor's boxes would not tile it)."""
    held = {t.fqn for r in ranks if r.tensors is not None for t in r.tensors}
    both = sorted({k for r in ranks for k in r.objects if k in held})
    if both:
        raise UnsupportedValueError(
            f"{len(both)} entr{'y is' if len(both) == 1 else 'ies are'} a tensor on some ranks and a plain "
            f"value on others: {both[:5]}; every rank must hold the same kind of thing under a key (the "
            "checkpoint would keep only one of them)"
        )


def plan_save(
    ranks: Sequence[StateDescription | CompactDescription],
    *,
    chunk_bytes: int,
    portable: bool = False,
    compression: Compression | None = None,
) -> SavePlan:
    """The plan of a save from what each process (rank) holds, ``ranks[r]`` being rank ``r``'s.

    Chunk grids and writers come from :func:`gpuckpt.planning.boxes.plan_tensors`
    (``chunk_bytes``: target chunk size; ``portable``: regular grids even for
    uneven boxes); a value held by several ranks is taken from the first.
    When every rank sent a :class:`~gpuckpt.planning.uniform.CompactDescription`
    with the same digest, the tensors are planned over all ranks at once
    (:func:`~gpuckpt.planning.uniform.plan_uniform`, the same plan at a cost per
    tensor). ``compression``: each tensor's codec (:meth:`Compression.codec_for
    <gpuckpt.format.codecs.Compression.codec_for>`; None: no tensor compressed).
    Raises :class:`~gpuckpt.errors.UnsupportedValueError` for boxes that
    do not tile their tensor or ranks that disagree on a tensor.
    """
    if not ranks:
        raise ValueError("plan_save needs the description of at least one process")
    _refuse_tensor_and_value(ranks)
    planned: Iterable[tuple[LocalTensor, ChunkGrid, TensorWrites]]
    if all(isinstance(r, CompactDescription) for r in ranks):
        compact = [r for r in ranks if isinstance(r, CompactDescription)]
        if any(r.digest != compact[0].digest for r in compact):
            raise ValueError(
                "plan_save got compact descriptions of different layouts; send the full StateDescription "
                "of every rank when their layout digests differ"
            )
        planned = plan_uniform(compact, chunk_bytes=chunk_bytes, portable=portable)
    else:
        full = []
        for i, r in enumerate(ranks):
            if isinstance(r, CompactDescription):
                if r.tensors is None:
                    raise ValueError(f"rank {i}'s compact description carries no tensors to plan from")
                r = StateDescription(r.tensors, r.objects, r.skeleton)
            full.append(r)
        planned = plan_tensors([r.tensors for r in full], chunk_bytes=chunk_bytes, portable=portable)
    tensors = []
    row = 0
    for lt, grid, writes in planned:
        fqn = lt.fqn
        dtype = dtype_from_name(lt.dtype)
        codec = None
        if compression is not None:
            codec = compression.codec_for(fqn, dtype, largest_chunk_elements(grid) * dtype.itemsize)
        t = TensorPlan(fqn, encode_name(fqn), lt.global_shape, dtype, grid, lt.properties, writes, row, codec)
        tensors.append(t)
        row += t.nchunks
    objects, skeleton = merge_values([(r.objects, r.skeleton) for r in ranks])
    report = None if compression is None else compression.report
    return SavePlan(tuple(tensors), objects, skeleton, len(ranks), report)


class PlanMemo:
    """:func:`plan_save` of one process's description, for a caller that saves the same tensors
    at every step (a local tier's parts, planned on its writer thread beside its copies): when
    the description's tensors are the very objects of the last call, in the same order (what a
    :class:`~gpuckpt.saving.sources.TensorMemo` gives for unchanged arrays), with the same
    options, their plans are the last ones; only the values are planned again. Plans are
    immutable, so sharing them is safe. 10,000 tensors took 0.1 s to plan, more with the
    writer's threads beside it."""

    def __init__(self) -> None:
        self._last: tuple[tuple[LocalTensor, ...], tuple[Any, ...], tuple[TensorPlan, ...]] | None = None

    def plan_save(
        self,
        local: StateDescription,
        *,
        chunk_bytes: int,
        portable: bool = False,
        compression: Compression | None = None,
    ) -> SavePlan:
        """``plan_save([local], ...)``, its tensors' plans taken from the last call where they apply."""
        options = (chunk_bytes, portable, compression)
        last = self._last
        if (
            last is not None
            and last[1] == options
            and len(last[0]) == len(local.tensors)
            and all(map(operator.is_, last[0], local.tensors))
        ):
            objects, skeleton = merge_values([(local.objects, local.skeleton)])
            return SavePlan(
                last[2], objects, skeleton, 1, None if compression is None else compression.report
            )
        plan = plan_save([local], chunk_bytes=chunk_bytes, portable=portable, compression=compression)
        self._last = (tuple(local.tensors), options, plan.tensors)
        return plan
