"""Distributed saves: every rank writes its own chunks into one shared checkpoint.

The protocol, with a collective error check after every step so that a
failure on any rank fails the save on every rank and publishes nothing:

1. every rank describes its tensors (boxes, no data) and plain values;
2. rank 0 gathers the descriptions, plans globally
   (:func:`gpuckpt.distributed.planner.plan_global`), begins the save and writes
   the array documents, then scatters each rank's chunk assignments;
3. every rank writes its chunks (fsynced) into the shared temporary;
4. rank 0 gathers the chunk sizes and checksums, assembles the global
   Metadata and commits atomically; every rank returns that Metadata.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpuckpt.device.arrays import ArrayAdapter, adapt, is_array
from gpuckpt.device.backend import DEFAULT_STAGING_BYTES
from gpuckpt.distributed.coordinator import Coordinator
from gpuckpt.distributed.planner import LocalTensor, plan_global
from gpuckpt.distributed.sharded import is_sharded_leaf, sharded_boxes
from gpuckpt.dtypes import dtype_from_name, dtype_name
from gpuckpt.errors import UnsupportedValueError
from gpuckpt.metadata import Metadata, TensorProperties
from gpuckpt.planning import DEFAULT_CHUNK_BYTES
from gpuckpt.progress import ProgressCallback
from gpuckpt.state import flatten_state_dict
from gpuckpt.storage.layout import root_document
from gpuckpt.storage.local import LocalWriter
from gpuckpt.storage.names import encode_name
from gpuckpt.storage.objects import encode_object
from gpuckpt.storage.stores import open_writer, scheme_of
from gpuckpt.writing import (
    ChunkJob,
    SavePlan,
    TensorPlan,
    assemble_metadata,
    write_array_documents,
    write_chunks,
    writing,
)

__all__ = [
    "ChunkAssignment",
    "assigned_jobs",
    "contains_sharded",
    "distributed_save",
    "is_leaf",
    "plan_tensors",
]


def is_leaf(value: Any) -> bool:
    return is_array(value) or is_sharded_leaf(value)


def contains_sharded(value: Any, depth: int = 0) -> bool:
    """Whether a state dict holds any ShardedArray (a quick walk, no flattening)."""
    if is_sharded_leaf(value):
        return True
    if depth > 200:
        return False
    if isinstance(value, dict):
        return any(contains_sharded(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)) and not is_array(value):
        return any(contains_sharded(v, depth + 1) for v in value)
    return False


def _describe(
    state_dict: dict[str, Any], allow_pickle: bool
) -> tuple[list[LocalTensor], dict[str, list[ArrayAdapter]], dict[str, Any], Any]:
    leaves, skeleton = flatten_state_dict(state_dict, is_leaf)
    tensors: list[LocalTensor] = []
    sources: dict[str, list[ArrayAdapter]] = {}
    objects: dict[str, Any] = {}
    for fqn, leaf in leaves.items():
        v = leaf.value
        if is_sharded_leaf(v):
            boxes = sharded_boxes(v)
            adapters = [adapt(b.local) for b in boxes]
            dts = {a.dtype for a in adapters}
            if len(dts) != 1:
                raise UnsupportedValueError(
                    f"boxes of tensor {fqn!r} have different dtypes: {sorted(map(str, dts))}"
                )
            shape = boxes[0].global_shape
            box_list = [(b.offsets, b.sizes) for b in boxes]
        elif is_array(v):
            adapters = [adapt(v)]
            shape = adapters[0].shape
            box_list = [((0,) * len(shape), shape)]
        else:
            objects[fqn] = encode_object(v, allow_pickle=allow_pickle, fqn=fqn)
            continue
        props = adapters[0].properties()
        tensors.append(
            LocalTensor(
                fqn,
                tuple(shape),
                dtype_name(adapters[0].dtype),
                adapters[0].dtype.itemsize,
                props.to_json(),
                box_list,
            )
        )
        sources[fqn] = adapters
    return tensors, sources, objects, skeleton


def _merge_skeletons(a: Any, b: Any) -> Any:
    """Union of two structure skeletons (ranks of a pipeline hold different parts)."""
    if isinstance(a, dict) and isinstance(b, dict) and "d" in a and "d" in b:
        items = {(kt, k): child for kt, k, child in a["d"]}
        for kt, k, child in b["d"]:
            items[(kt, k)] = _merge_skeletons(items[(kt, k)], child) if (kt, k) in items else child
        return {"d": [[kt, k, child] for (kt, k), child in items.items()]}
    return a


def _run(coord: Coordinator, fn: Any, *args: Any) -> Any:
    """Run ``fn`` on this rank; collectively raise if it failed on any rank."""
    result, error = None, None
    try:
        result = fn(*args)
    except Exception as exc:  # every error must reach the collective check
        error = exc
    coord.all_reduce_errors(error)
    return result


@dataclass(frozen=True, slots=True)
class ChunkAssignment:
    """One stored chunk that one rank writes: where it goes, and which of the rank's boxes holds it."""

    fqn: str
    name: str  # the tensor's array name
    coords: tuple[int, ...]  # grid coordinates of the chunk
    offsets: tuple[int, ...]  # of the chunk in the global tensor
    sizes: tuple[int, ...]
    stored: tuple[int, ...]  # stored (possibly padded) chunk shape
    box: int  # index of the box in the rank's ``LocalTensor.boxes`` of this tensor


def plan_tensors(
    locals_by_rank: Sequence[Sequence[LocalTensor]],
    *,
    chunk_bytes: int,
    portable: bool = False,
) -> tuple[list[TensorPlan], list[list[ChunkAssignment]]]:
    """The tensors of a distributed save, and each rank's chunks to write (pure data).

    Plans the chunk grids of every tensor from the boxes the ranks hold
    (:func:`gpuckpt.distributed.planner.plan_global`) and assigns each chunk
    to one rank holding it.
    """
    plans = plan_global(locals_by_rank, chunk_bytes=chunk_bytes, portable=portable)
    tensor_plans = []
    assignments: list[list[ChunkAssignment]] = [[] for _ in range(len(locals_by_rank))]
    for gp in plans:
        name = encode_name(gp.fqn)
        grid = gp.grid
        specs = grid.chunk_list()
        props = TensorProperties.from_json(gp.properties)
        tensor_plans.append(
            TensorPlan(gp.fqn, name, gp.global_shape, dtype_from_name(gp.dtype), grid, props, specs)
        )
        for spec in specs:
            rank, idx = gp.writers[spec.coords]
            assignments[rank].append(
                ChunkAssignment(
                    gp.fqn, name, spec.coords, spec.offsets, spec.sizes, grid.stored_chunk_shape(spec), idx
                )
            )
    return tensor_plans, assignments


def assigned_jobs(
    mine: Sequence[ChunkAssignment], source: Callable[[str, int], tuple[ArrayAdapter, tuple[int, ...]]]
) -> list[ChunkJob]:
    """The chunk jobs of one rank's assignments.

    ``source(fqn, box)`` gives the array holding box number ``box`` of tensor
    ``fqn`` on this rank, and the box's offsets in the global tensor.
    """
    jobs = []
    for a in mine:
        src, box_offsets = source(a.fqn, a.box)
        local = tuple(o - bo for o, bo in zip(a.offsets, box_offsets, strict=True))
        jobs.append(ChunkJob(a.name, a.coords, src, local, a.sizes, a.stored))
    return jobs


def distributed_save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    coordinator: Coordinator,
    *,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    allow_pickle: bool = False,
    sync: str = "auto",
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    portable: bool = False,
) -> Metadata:
    """Save one checkpoint from every rank of ``coordinator``; see the module docstring."""
    coord = coordinator
    if coord.world_size > 1 and scheme_of(path) != "file":
        raise UnsupportedValueError(
            "multi-rank saves go to a shared file system path; object stores are single-writer"
        )
    tensors, sources, objects, skeleton = _run(coord, _describe, state_dict, allow_pickle)
    gathered = coord.gather((tensors, objects, skeleton))
    writer: Any = None

    def plan_on_root() -> tuple[SavePlan, list[list[ChunkAssignment]], str]:
        nonlocal writer
        assert gathered is not None
        tensor_plans, assignments = plan_tensors(
            [g[0] for g in gathered], chunk_bytes=chunk_bytes, portable=portable
        )
        all_objects: dict[str, Any] = {}
        skel = gathered[0][2]
        for _, objs, sk in gathered:
            for k, v in objs.items():
                all_objects.setdefault(k, v)
            skel = _merge_skeletons(skel, sk)
        plan = SavePlan(tensor_plans, all_objects, skel)
        writer = open_writer(path, overwrite=overwrite, sync=sync, expected_files=plan.nfiles)
        with writing(writer):
            writer.begin()
            write_array_documents(plan, writer)
        return plan, assignments, getattr(writer, "token", "")

    root = _run(coord, plan_on_root) if coord.rank == 0 else _run(coord, lambda: None)
    plan, assignments, token = root if root is not None else (None, None, None)
    mine = coord.scatter(assignments, root=0)
    token = coord.broadcast(token, root=0)

    def write_mine() -> list[tuple[tuple[str, tuple[int, ...]], tuple[int, int]]]:
        w = writer if coord.rank == 0 else LocalWriter.attach(path, token)
        boxes = {t.fqn: t.boxes for t in tensors}
        jobs = assigned_jobs(mine, lambda fqn, idx: (sources[fqn][idx], boxes[fqn][idx][0]))
        sizes_crcs = write_chunks(jobs, w, threads=threads, staging_bytes=staging_bytes, progress=progress)
        return [((j.name, j.coords), r) for j, r in zip(jobs, sizes_crcs, strict=True)]

    try:
        results = _run(coord, write_mine)
        all_results = coord.gather(results)

        def commit_on_root() -> str:
            assert plan is not None and all_results is not None
            merged = {k: v for part in all_results for k, v in part}
            md = assemble_metadata(plan, merged, str(uuid.uuid4()))
            with writing(writer):
                writer.commit(root_document(md))
            return md.to_json()

        text = _run(coord, commit_on_root) if coord.rank == 0 else _run(coord, lambda: None)
    except BaseException:
        if coord.rank == 0 and writer is not None:
            writer.abort()
        raise
    text = coord.broadcast(text, root=0)
    return Metadata.from_json(text)
