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
from gpuckpt.storage.names import encode_name
from gpuckpt.storage.stores import attach_writer, open_writer, scheme_of
from gpuckpt.storage.values import encode_object
from gpuckpt.writing import (
    ChunkJob,
    SavePlan,
    TensorPlan,
    assemble_metadata,
    write_array_documents,
    write_chunks,
    writing,
)

__all__ = ["contains_sharded", "distributed_save", "is_leaf"]


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
        props = TensorProperties.from_array(adapters[0])
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

    def plan_on_root() -> tuple[SavePlan, list[list[tuple[Any, ...]]], str]:
        nonlocal writer
        assert gathered is not None
        plans = plan_global([g[0] for g in gathered], chunk_bytes=chunk_bytes, portable=portable)
        all_objects: dict[str, Any] = {}
        skel = gathered[0][2]
        for _, objs, sk in gathered:
            for k, v in objs.items():
                all_objects.setdefault(k, v)
            skel = _merge_skeletons(skel, sk)
        tensor_plans = []
        assignments: list[list[tuple[Any, ...]]] = [[] for _ in range(coord.world_size)]
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
                    (gp.fqn, name, spec.coords, spec.offsets, spec.sizes, grid.stored_chunk_shape(spec), idx)
                )
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
        w = writer if coord.rank == 0 else attach_writer(path, token)
        boxes = {t.fqn: t.boxes for t in tensors}
        jobs = []
        for fqn, name, coords, offsets, sizes, stored, idx in mine:
            src = sources[fqn][idx]
            box_offsets = boxes[fqn][idx][0]
            local = tuple(o - bo for o, bo in zip(offsets, box_offsets, strict=True))
            jobs.append(ChunkJob(name, tuple(coords), src, local, tuple(sizes), tuple(stored)))
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
