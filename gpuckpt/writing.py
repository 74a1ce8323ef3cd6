"""Executing a save: a :class:`~gpuckpt.planning.plan.SavePlan` bound to arrays, written and published.

A plan (made by :func:`gpuckpt.planning.plan.plan_save`) says which chunks
this process writes; :func:`bind_jobs` binds them to the arrays holding them
(one :class:`ChunkJob` per stored chunk) when the save runs. Tensors become
Zarr arrays (:mod:`gpuckpt.storage.layout`); chunk jobs run on a thread pool,
straight from host memory when a chunk is one contiguous byte run (the
common case, see :func:`gpuckpt.planning.grid.plan_regular_grid`), or
through a bounded pool of staging buffers for device memory; the root
document carrying the metadata is written last by
:meth:`CheckpointWriter.commit`. Distributed saves
(:mod:`gpuckpt.distributed.save`) run the same jobs on every rank.
"""

from __future__ import annotations

import errno
import functools
import math
import os
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, StagedOut
from gpuckpt.device.backend import DeviceBackend, Staging, distinct_backends
from gpuckpt.errors import CheckpointWriteError, GpuckptError
from gpuckpt.metadata import (
    FORMAT_VERSION,
    VERSION_LISTED,
    VERSION_WITH_TABLE,
    BytesStorageMetadata,
    GridTensorStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from gpuckpt.options import SaveOptions
from gpuckpt.planning.plan import ChunkAssignment, SavePlan, TensorPlan
from gpuckpt.progress import ProgressCounter
from gpuckpt.runner import Batcher, Runner, run_all
from gpuckpt.sources import Sources
from gpuckpt.storage.base import CheckpointWriter, ChunkWrites
from gpuckpt.storage.checksum import CRC_BYTES
from gpuckpt.storage.chunk_table import TABLE_KEY, TABLE_MIN_CHUNKS, listed_records, write_table
from gpuckpt.storage.chunks import chunk_bytes, stored_nbytes
from gpuckpt.storage.layout import array_document, chunk_file_key, root_document
from gpuckpt.storage.stores import open_writer

__all__ = [
    "ChunkJob",
    "assemble_metadata",
    "commit_save",
    "crc_column",
    "crc_column_of_results",
    "uses_table",
    "written_rows",
    "bind_jobs",
    "device_backends",
    "execute_save",
    "open_save_writer",
    "array_document_of",
    "write_array_documents",
    "write_chunks",
]


@dataclass(slots=True)
class ChunkJob:
    """One stored chunk to write, bound to the array holding it (made by :func:`bind_jobs`).

    Work for the I/O threads, not part of the plan: a plain (not frozen) record,
    since a save makes one per chunk while the caller waits."""

    name: str
    coords: tuple[int, ...]
    source: ArrayAdapter
    offsets: tuple[int, ...]  # of the chunk's box within ``source``
    sizes: tuple[int, ...]
    stored: tuple[int, ...]
    row: int = 0  # of the chunk in the save's chunk table

    @property
    def key(self) -> str:
        return chunk_file_key(self.coords)

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.source.dtype.itemsize


def bind_jobs(assignments: Iterable[ChunkAssignment], sources: Sources) -> list[ChunkJob]:
    """Bind a process's chunk assignments to its arrays: ``sources[fqn][box]`` holds each chunk."""
    jobs = []
    for a in assignments:
        src = sources[a.fqn][a.box]
        local = (
            a.offsets
            if not any(src.offsets)
            else tuple(o - b for o, b in zip(a.offsets, src.offsets, strict=True))
        )
        jobs.append(ChunkJob(a.name, a.coords, src.array, local, a.sizes, a.stored, a.row))
    return jobs


def open_save_writer(
    path: str | os.PathLike[str], options: SaveOptions, *, expected_files: int, direct_io: bool
) -> CheckpointWriter:
    """The writer of a save to ``path`` with ``options`` (``direct_io``: whether large chunk
    files go around the page cache, see :meth:`SaveOptions.use_direct_io`); touches no file."""
    return open_writer(
        path,
        overwrite=options.overwrite,
        sync=options.sync,
        expected_files=expected_files,
        storage_options=options.store_options(),
        direct_io=direct_io,
    )


def device_backends(arrays: Iterable[ArrayAdapter]) -> list[DeviceBackend]:
    """The distinct back ends of the device arrays among ``arrays``."""
    return distinct_backends(a.backend for a in arrays)


def array_document_of(t: TensorPlan) -> bytes:
    return array_document(
        shape=t.shape, dtype=t.dtype, grid=t.grid, fqn=t.fqn, memory_format=t.properties.memory_format.name
    )


def write_array_documents(
    plan: SavePlan, writer: CheckpointWriter, *, defer: Collection[str] = (), threads: int | None = None
) -> dict[str, bytes]:
    """Write the ``zarr.json`` of every array of ``plan`` but those named in ``defer``; returns
    the documents of those, by array name, for :func:`write_chunks` to write with their one chunk.

    The documents are written on up to ``threads`` threads (one round trip each on an object
    store: hundreds of them one after the other would hold every rank of a distributed save)."""
    deferred = {}
    jobs = []
    for t in plan.tensors:
        if t.name in defer:
            deferred[t.name] = array_document_of(t)
        else:
            jobs.append(functools.partial(writer.write_array_document, t.name, array_document_of(t)))
    run_all(jobs, threads=threads, name="gpuckpt-documents")
    return deferred


def write_chunks(
    jobs: Sequence[ChunkJob],
    writer: CheckpointWriter,
    options: SaveOptions,
    *,
    documents: dict[str, bytes] | None = None,
) -> list[tuple[int, int]]:
    """Write every job's chunk; returns ``(stored bytes, CRC32C)`` per job, in order.

    Of ``options``, ``threads`` (I/O threads), ``staging_bytes`` (the staging
    budget of device sources) and ``progress`` apply.

    ``documents`` maps array names whose directory does not exist yet to their
    ``zarr.json``; each such array must have exactly one job, which writes the
    document first (so that the many file-system operations of small tensors
    run on the I/O threads too).

    The calling thread stages every job's box out of its source (see
    :meth:`~gpuckpt.device.arrays.ArrayAdapter.stage_out`) and hands it to the
    I/O threads, which checksum and write it. Boxes readable at once (host
    memory) go in batches and are encoded straight from their memory; the
    others (device memory) hold a buffer of a bounded staging pool, so the
    calling thread queues the copies of the next chunks (blocking when the
    pool is exhausted) while the I/O threads wait for each copy, write its
    buffer and return it to the pool. The first error stops the run.
    """
    sizes = [j.nbytes for j in jobs]
    threads, staging_bytes, progress = options.threads, options.staging_bytes, options.progress
    counter = ProgressCounter(progress, sum(sizes))
    docs = dict(documents or {})
    staging = Staging(((j.source.backend, n) for j, n in zip(jobs, sizes, strict=True)), staging_bytes)
    staging.wait_for_producers()
    batch: Batcher[_Item] = Batcher()
    with Runner[list[tuple[int, int]]](threads, name="gpuckpt-write") as run:

        def submit(*groups: list[_Item]) -> None:
            """One job per group, in order; what cannot be queued any more is released."""
            for i, items in enumerate(groups):
                if not items:
                    continue
                try:
                    run.submit(
                        functools.partial(_write_items, writer, items, counter),
                        cancel=functools.partial(_release_all, items),
                    )
                except BaseException:
                    for rest in groups[i + 1 :]:
                        _release_all(rest)
                    raise

        for j, nbytes in zip(jobs, sizes, strict=True):
            run.check()
            # device memory: blocks while the staging budget is in use (back-pressure)
            staged = j.source.stage_out(j.offsets, j.sizes, staging)
            item = (j, staged, docs.pop(j.name, None))
            if staged.ready:
                # small chunks go to the I/O threads in batches: one task per
                # chunk would cost more than writing a few KiB
                full = batch.add(item, nbytes)
                if full:
                    submit(full)
            else:
                # it holds a staging buffer: queued at once, never held back in a batch
                submit(batch.take(), [item])
        submit(batch.take())
        return [r for rs in run.results() for r in rs]


_Item = tuple[ChunkJob, StagedOut, bytes | None]


def _write_items(
    writer: CheckpointWriter, items: Sequence[_Item], counter: ProgressCounter
) -> list[tuple[int, int]]:
    """Write staged chunks (with their array's document where given) as one batch of the
    writer's (:meth:`~gpuckpt.storage.base.CheckpointWriter.write_chunks`: native code
    for small chunk files of a local checkpoint); returns ``(stored bytes, CRC32C)`` each."""
    try:
        buffers: list[np.ndarray] = []
        pads: list[int] = []
        for j, staged, _document in items:
            data, pad = chunk_bytes(staged.wait(), j.stored)
            buffers.append(data)
            pads.append(pad)
        batch = ChunkWrites(
            [j.name for j, _, _ in items],
            [j.key for j, _, _ in items],
            buffers,
            pads,
            [document for _, _, document in items],
        )
        crcs = writer.write_chunks(batch)
    finally:
        _release_all(items)  # staging buffers go back to their pool
    for j, _, _ in items:
        counter.add(j.nbytes)
    return [(b.nbytes + p + CRC_BYTES, c) for b, p, c in zip(buffers, pads, crcs, strict=True)]


def _release_all(items: Sequence[_Item]) -> None:
    for _, staged, _ in items:
        staged.release()


def written_rows(
    jobs: Sequence[ChunkJob], results: Sequence[tuple[int, int]]
) -> tuple[np.ndarray, np.ndarray]:
    """What a process reports of its writes: the chunk table rows of its jobs and their CRC32Cs."""
    rows = np.fromiter((j.row for j in jobs), np.int64, len(jobs))
    crcs = np.fromiter((c for _, c in results), np.uint32, len(results))
    return rows, crcs


def crc_column(plan: SavePlan, parts: Iterable[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The CRC32C of every chunk of ``plan``, in chunk table order, from every process's
    :func:`written_rows`; raises unless each chunk was written exactly once."""
    n = plan.nchunks
    column = np.zeros(n, np.uint32)
    every = []
    for rows, crcs in parts:
        if len(rows) != len(crcs) or (len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= n)):
            raise GpuckptError(f"a process reported chunk rows outside the plan's {n} chunks")
        column[rows] = crcs
        every.append(rows)
    seen = np.bincount(np.concatenate(every) if every else np.zeros(0, np.int64), minlength=n)
    if len(seen) != n or (n and not (seen == 1).all()):
        bad = int(np.flatnonzero(seen != 1)[0])
        raise GpuckptError(
            f"chunk {bad} of the save's chunk table was written {int(seen[bad])} times, expected once; "
            "the processes did not run the same plan"
        )
    return column


def crc_column_of_results(
    plan: SavePlan, results: Mapping[tuple[str, tuple[int, ...]], tuple[int, int]]
) -> np.ndarray:
    """:func:`crc_column` from ``(array name, chunk coords) -> (stored bytes, CRC32C)``."""
    column = np.zeros(plan.nchunks, np.uint32)
    for t in plan.tensors:
        if t.nchunks:
            column[t.row : t.row + t.nchunks] = [results[(t.name, s.coords)][1] for s in t.specs]
    return column


def assemble_metadata(
    plan: SavePlan,
    crcs: np.ndarray | Mapping[tuple[str, tuple[int, ...]], tuple[int, int]],
    checkpoint_id: str | None,
    table: Mapping[str, Any] | None = None,
) -> Metadata:
    """The checkpoint's Metadata from the plan and every chunk's CRC32C, in chunk table order
    (:func:`crc_column`; or a mapping ``(array name, chunk coords) -> (stored bytes, CRC32C)``).

    ``table``: the ``storage_data`` entry of the chunk table written for the save
    (:func:`gpuckpt.storage.chunk_table.write_table`; format version 2), or None to list
    every chunk's record in the metadata (then the checkpoint is format version 1, which
    every release reads). Chunk lists are never built here: each tensor's chunks are its grid's
    (:class:`~gpuckpt.metadata.GridTensorStorageMetadata`).
    """
    if not isinstance(crcs, np.ndarray):
        crcs = crc_column_of_results(plan, crcs)
    state_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    tensors_sd: dict[str, Any] = {}
    listed = table is None
    for t in plan.tensors:
        state_md[t.fqn] = GridTensorStorageMetadata(t.properties, t.shape, grid=t.grid, listed=listed)
        info: dict[str, Any] = {"name": t.name, "chunk_grid": t.grid.to_zarr_json()}
        if listed:
            specs = t.specs
            itemsize = t.dtype.itemsize
            regular = t.grid.kind == "regular"
            info["chunks"] = listed_records(
                [chunk_file_key(s.coords) for s in specs],
                [stored_nbytes(t.grid.chunk_shape if regular else s.sizes, itemsize) for s in specs],
                {"crc32c": crcs[t.row : t.row + t.nchunks]},
            )
        else:
            info["rows"] = t.row
        tensors_sd[t.fqn] = info
    for fqn in plan.objects:
        state_md[fqn] = BytesStorageMetadata()
    storage_data: dict[str, Any] = {"tensors": tensors_sd, "objects": dict(plan.objects)}
    if table is not None:
        storage_data[TABLE_KEY] = dict(table)
    return Metadata(
        state_dict_metadata=state_md,
        planner_data={"structure": plan.skeleton},
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, modules=["gpuckpt"]),
        # a checkpoint that lists its chunks is a format version 1 checkpoint (older releases
        # read it); only the chunk table needs version 2
        version=VERSION_WITH_TABLE if table is not None else VERSION_LISTED,
    )


def uses_table(plan: SavePlan) -> bool:
    """Whether a save of ``plan`` keeps its per-chunk records in a chunk table (large saves)."""
    return plan.nchunks > TABLE_MIN_CHUNKS


def commit_save(
    plan: SavePlan,
    crcs: np.ndarray,
    writer: CheckpointWriter,
    checkpoint_id: str | None,
    *,
    table: bool | None = None,
) -> Metadata:
    """Write the chunk table (large saves), then publish the root document; returns the Metadata.

    ``table``: whether to write the chunk table; None (the default) decides by the
    number of chunks (:func:`uses_table`). Tests and fixtures force either form.
    """
    if table is None:
        table = uses_table(plan)
    entry = write_table(writer, {"crc32c": crcs}) if table and plan.nchunks else None
    metadata = assemble_metadata(plan, crcs, checkpoint_id, entry)
    writer.commit(root_document(metadata))
    return metadata


@contextmanager
def writing(writer: CheckpointWriter) -> Iterator[None]:
    """Abort ``writer`` on any error; report system I/O errors as :class:`CheckpointWriteError`."""
    try:
        yield
    except GpuckptError:
        writer.abort()
        raise
    except OSError as exc:
        writer.abort()
        where = getattr(writer, "path", "the checkpoint")
        raise CheckpointWriteError(
            exc.errno or errno.EIO,
            f"saving {where} failed: {exc.strerror or exc}; nothing was published and any earlier "
            "checkpoint there is intact (free space or fix the device, then save again)",
        ) from exc
    except BaseException:
        writer.abort()
        raise


def execute_save(
    plan: SavePlan,
    sources: Sources,
    writer: CheckpointWriter,
    options: SaveOptions,
    *,
    checkpoint_id: str | None = None,
    table: bool | None = None,
) -> Metadata:
    """Write the single-process ``plan`` from ``sources`` through ``writer`` and commit.

    Aborts the writer on any error. ``sources`` are the arrays the plan was
    described from, or a snapshot of them. ``table``: see :func:`commit_save`.
    """
    (mine,) = plan.assignments
    with writing(writer):
        writer.begin()
        # single-chunk arrays get their directory and document from the I/O thread
        # that writes their chunk; the others' must exist before any chunk lands
        single = write_array_documents(
            plan, writer, defer={t.name for t in plan.tensors if len(t.specs) == 1}, threads=options.threads
        )
        jobs = bind_jobs(mine, sources)
        sizes = write_chunks(jobs, writer, options, documents=single)
        crcs = crc_column(plan, [written_rows(jobs, sizes)])
        metadata = commit_save(plan, crcs, writer, checkpoint_id, table=table)
    metadata.version = metadata.version or FORMAT_VERSION
    return metadata
