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
runs (:func:`gpuckpt.writing.bind_jobs`, from a mapping FQN -> the arrays
holding each box), so that a background save binds the same plan to its
snapshot, and plans are tested as data (``tests/unit/test_save_plan.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.dtypes import dtype_from_name
from gpuckpt.metadata import TensorProperties
from gpuckpt.planning.boxes import LocalTensor, plan_tensors
from gpuckpt.planning.grid import ChunkGrid, ChunkSpec
from gpuckpt.storage.names import encode_name

__all__ = [
    "ChunkAssignment",
    "SavePlan",
    "StateDescription",
    "TensorPlan",
    "merge_skeletons",
    "plan_save",
]


@dataclass(frozen=True, slots=True)
class StateDescription:
    """What one process holds of a state dict, without its data (small and picklable).

    ``tensors``: one :class:`~gpuckpt.planning.boxes.LocalTensor` per array
    leaf; ``objects``: every other leaf, encoded (JSON values, see
    :mod:`gpuckpt.storage.values`), by FQN; ``skeleton``: the nesting of the
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


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """One tensor of a save: its array (name, shape, dtype, grid, properties) and its chunks."""

    fqn: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    grid: ChunkGrid
    properties: TensorProperties
    specs: tuple[ChunkSpec, ...]  # every chunk of the grid, in the order of the metadata

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Everything a save writes, decided before the first byte is: pure data, no arrays.

    Attributes
    ----------
    tensors
        Every tensor of the state, in the order of the state dict: its Zarr
        array and every chunk of it (see :class:`TensorPlan`).
    objects
        The plain values, encoded, by FQN.
    skeleton
        The nesting of the state dict, stored so that a load rebuilds it.
    assignments
        For each process (rank), the chunks it writes; together they cover
        every chunk of every tensor exactly once. A single-process save has
        one entry.

    A plan is made by :func:`plan_save` and never changed: running it binds
    each process's assignments to that process's arrays
    (:func:`gpuckpt.writing.bind_jobs`), and the chunk sizes and checksums
    the writes return complete the metadata
    (:func:`gpuckpt.writing.assemble_metadata`).

    Examples
    --------
    >>> import numpy as np
    >>> from gpuckpt.metadata import TensorProperties
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
    assignments: tuple[tuple[ChunkAssignment, ...], ...]

    @property
    def nfiles(self) -> int:
        """Files the checkpoint holds: each chunk, each array's document, and the root document."""
        return sum(1 + len(t.specs) for t in self.tensors) + 1


def merge_skeletons(a: Any, b: Any) -> Any:
    """Union of two structure skeletons (ranks of a pipeline hold different parts)."""
    if isinstance(a, dict) and isinstance(b, dict) and "d" in a and "d" in b:
        items = {(kt, k): child for kt, k, child in a["d"]}
        for kt, k, child in b["d"]:
            items[(kt, k)] = merge_skeletons(items[(kt, k)], child) if (kt, k) in items else child
        return {"d": [[kt, k, child] for (kt, k), child in items.items()]}
    return a


def plan_save(ranks: Sequence[StateDescription], *, chunk_bytes: int, portable: bool = False) -> SavePlan:
    """The plan of a save from what each process (rank) holds, ``ranks[r]`` being rank ``r``'s.

    Chunk grids and writers come from :func:`gpuckpt.planning.boxes.plan_tensors`
    (``chunk_bytes``: target chunk size; ``portable``: regular grids even for
    uneven boxes); a value held by several ranks is taken from the first.
    Raises :class:`~gpuckpt.errors.UnsupportedValueError` for boxes that do not
    tile their tensor or ranks that disagree on a tensor.
    """
    if not ranks:
        raise ValueError("plan_save needs the description of at least one process")
    tensors = []
    assignments: list[list[ChunkAssignment]] = [[] for _ in ranks]
    planned = plan_tensors([r.tensors for r in ranks], chunk_bytes=chunk_bytes, portable=portable)
    for lt, grid, specs, writers in planned:
        fqn = lt.fqn
        name = encode_name(fqn)
        tensors.append(
            TensorPlan(fqn, name, lt.global_shape, dtype_from_name(lt.dtype), grid, lt.properties, specs)
        )
        regular = grid.kind == "regular"
        if isinstance(writers, dict):
            for s in specs:
                rank, box = writers[s.coords]
                stored = grid.chunk_shape if regular else s.sizes
                assignments[rank].append(
                    ChunkAssignment(fqn, name, s.coords, s.offsets, s.sizes, stored, box)
                )
        else:
            rank, box = writers
            mine = assignments[rank]
            for s in specs:
                stored = grid.chunk_shape if regular else s.sizes
                mine.append(ChunkAssignment(fqn, name, s.coords, s.offsets, s.sizes, stored, box))
    objects: dict[str, Any] = {}
    skeleton = ranks[0].skeleton
    for i, r in enumerate(ranks):
        for k, v in r.objects.items():
            objects.setdefault(k, v)
        if i:
            skeleton = merge_skeletons(skeleton, r.skeleton)
    return SavePlan(tuple(tensors), objects, skeleton, tuple(tuple(a) for a in assignments))
