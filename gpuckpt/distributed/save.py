"""Distributed saves: every rank writes its own chunks into one shared checkpoint.

The protocol, with a collective error check after every step so that a
failure on any rank fails the save on every rank and publishes nothing:

1. every rank describes its tensors (boxes, no data) and plain values
   (:func:`gpuckpt.sources.describe_state`);
2. rank 0 gathers the descriptions, plans the save
   (:func:`gpuckpt.planning.plan.plan_save`), begins it and writes the array
   documents, then scatters each rank's chunk assignments;
3. every rank writes its chunks (fsynced) into the shared temporary; in an
   incremental save (``base=``) each rank opens the base itself and decides
   reuse for its own chunks, among the arrays rank 0 found compatible;
4. rank 0 gathers the chunk sizes, checksums and hashes, assembles the global
   Metadata and commits atomically; every rank returns that Metadata.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from gpuckpt.distributed.coordinator import Coordinator
from gpuckpt.errors import UnsupportedValueError
from gpuckpt.incremental import BaseIndex, ChunkResult, open_base, open_base_for
from gpuckpt.metadata import Metadata
from gpuckpt.options import SaveOptions
from gpuckpt.planning.plan import ChunkAssignment, SavePlan, StateDescription, plan_save
from gpuckpt.sources import Source, describe_state
from gpuckpt.storage.layout import root_document
from gpuckpt.storage.stores import attach_writer, scheme_of
from gpuckpt.writing import (
    assemble_metadata,
    bind_jobs,
    open_save_writer,
    write_array_documents,
    write_chunks,
    writing,
)

__all__ = ["distributed_save", "save_described"]

#: what a rank saves: its state's description and the arrays behind it (see :mod:`gpuckpt.sources`)
Described = tuple[StateDescription, dict[str, tuple[Source, ...]]]


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
    state_dict: dict[str, Any], path: str | os.PathLike[str], coordinator: Coordinator, options: SaveOptions
) -> Metadata:
    """Save one checkpoint from every rank of ``coordinator``; see the module docstring."""
    return save_described(
        lambda: describe_state(state_dict, allow_pickle=options.allow_pickle), path, coordinator, options
    )


def save_described(
    describe: Callable[[], Described],
    path: str | os.PathLike[str],
    coordinator: Coordinator,
    options: SaveOptions,
) -> Metadata:
    """:func:`distributed_save` of the state ``describe()`` gives (called once, its error
    reported to every rank): a background save describes and snapshots its state first."""
    coord = coordinator
    if coord.world_size > 1 and scheme_of(path) != "file":
        raise UnsupportedValueError(
            "multi-rank saves go to a shared file system path; object stores are single-writer"
        )
    local, sources = _run(coord, describe)
    gathered = coord.gather(local)
    writer: Any = None

    base: BaseIndex | None = None

    def plan_on_root() -> tuple[SavePlan, list[tuple[ChunkAssignment, ...]], tuple[str, list[str] | None]]:
        nonlocal writer, base
        assert gathered is not None
        plan = plan_save(gathered, chunk_bytes=options.chunk_bytes, portable=options.portable)
        base = open_base_for(options, plan.tensors)
        # the arrays whose chunks may be reused: the other ranks know no plan to check them with
        reusable = None if base is None else sorted(base.compatible(plan.tensors))
        # the other ranks' writers attach without O_DIRECT: the root's writes alike
        writer = open_save_writer(path, options, expected_files=plan.nfiles, direct_io=False)
        with writing(writer):
            writer.begin()
            write_array_documents(plan, writer)
        return plan, list(plan.assignments), (writer.token, reusable)

    root = _run(coord, plan_on_root) if coord.rank == 0 else _run(coord, lambda: None)
    plan, assignments, shared = root if root is not None else (None, None, None)
    mine = coord.scatter(assignments, root=0)
    token, reusable = coord.broadcast(shared, root=0)

    def write_mine() -> list[tuple[tuple[str, tuple[int, ...]], ChunkResult]]:
        w = writer if coord.rank == 0 else attach_writer(path, token)
        mine_base = base
        if coord.rank != 0 and reusable is not None and options.base_location is not None:
            opened = open_base(options.base_location, options.storage_options)
            mine_base = None if opened is None else opened.restrict(reusable)
        jobs = bind_jobs(mine, sources)
        sizes_crcs = write_chunks(jobs, w, options, base=mine_base)
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
