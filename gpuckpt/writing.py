"""Executing a save: from flattened leaves to a published checkpoint.

A save is a list of :class:`ChunkJob` (one per stored chunk this process
writes) plus the documents around them. Tensors become Zarr arrays
(:mod:`gpuckpt.storage.layout`); chunk jobs run on a thread pool, straight
from host memory when a chunk is one contiguous byte run (the common case,
see :func:`gpuckpt.planning.plan_regular_grid`), or through a bounded pool of
staging buffers for device memory; the root document carrying the metadata
is written last by :meth:`CheckpointWriter.commit`. Distributed saves
(:mod:`gpuckpt.distributed.save`) run the same jobs on every rank.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, adapt, is_array
from gpuckpt.device.backend import (
    DEFAULT_STAGING_BYTES,
    BufferPool,
    DeviceArray,
    Ticket,
    buffer_pool,
    staging_buffer_bytes,
)
from gpuckpt.errors import CheckpointWriteError, GpuckptError
from gpuckpt.metadata import (
    FORMAT_VERSION,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from gpuckpt.planning import DEFAULT_CHUNK_BYTES, ChunkGrid, ChunkSpec, plan_regular_grid
from gpuckpt.progress import ProgressCallback, ProgressCounter
from gpuckpt.state import flatten_state_dict
from gpuckpt.storage.base import CheckpointWriter
from gpuckpt.storage.chunkio import CRC_BYTES, crc32c, is_prefix_box, padded_chunk
from gpuckpt.storage.layout import array_document, chunk_file_key, root_document
from gpuckpt.storage.names import encode_name
from gpuckpt.storage.objects import encode_object

__all__ = [
    "IO_BATCH_BYTES",
    "IO_BATCH_JOBS",
    "ChunkJob",
    "SavePlan",
    "TensorPlan",
    "array_documents",
    "assemble_metadata",
    "build_save_plan",
    "default_threads",
    "device_backends",
    "execute_save",
    "write_array_documents",
    "write_chunks",
]


#: host chunks go to the I/O threads in batches of about this many bytes or chunks
IO_BATCH_BYTES = 1 << 20
IO_BATCH_JOBS = 64


def default_threads() -> int:
    """I/O threads: enough to overlap checksums, writes and fsyncs on small machines."""
    return max(2, min(8, (os.cpu_count() or 2) * 2))


@dataclass(slots=True)
class ChunkJob:
    """One stored chunk to write: where its data is, and its stored shape."""

    name: str
    coords: tuple[int, ...]
    source: ArrayAdapter
    offsets: tuple[int, ...]  # of the chunk's box within ``source``
    sizes: tuple[int, ...]
    stored: tuple[int, ...]

    @property
    def key(self) -> str:
        return chunk_file_key(self.coords)

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.source.dtype.itemsize


@dataclass(slots=True)
class TensorPlan:
    """One tensor of a save: its global description and the chunk jobs of this process."""

    fqn: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    grid: ChunkGrid
    properties: TensorProperties
    specs: list[ChunkSpec] = field(default_factory=list)
    jobs: list[ChunkJob] = field(default_factory=list)
    array: ArrayAdapter | None = None  # the whole tensor, for single-process saves

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(slots=True)
class SavePlan:
    tensors: list[TensorPlan]
    objects: dict[str, Any]
    skeleton: Any

    @property
    def nfiles(self) -> int:
        return sum(1 + len(t.specs) for t in self.tensors) + 1

    def jobs(self) -> list[ChunkJob]:
        return [j for t in self.tensors for j in t.jobs]


def whole_tensor_jobs(
    name: str, array: ArrayAdapter, grid: ChunkGrid, specs: Sequence[ChunkSpec]
) -> list[ChunkJob]:
    return [ChunkJob(name, s.coords, array, s.offsets, s.sizes, grid.stored_chunk_shape(s)) for s in specs]


def build_save_plan(
    state_dict: dict[str, Any],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    allow_pickle: bool = False,
) -> SavePlan:
    """Flatten ``state_dict``, plan every tensor's chunks and encode every object."""
    leaves, skeleton = flatten_state_dict(state_dict, is_array)
    tensors: list[TensorPlan] = []
    objects: dict[str, Any] = {}
    for fqn, leaf in leaves.items():
        if is_array(leaf.value):
            arr = adapt(leaf.value)
            grid = plan_regular_grid(arr.shape, arr.dtype.itemsize, chunk_bytes)
            specs = grid.chunk_list()
            name = encode_name(fqn)
            tensors.append(
                TensorPlan(
                    fqn,
                    name,
                    arr.shape,
                    arr.dtype,
                    grid,
                    arr.properties(),
                    specs,
                    whole_tensor_jobs(name, arr, grid, specs),
                    arr,
                )
            )
        else:
            objects[fqn] = encode_object(leaf.value, allow_pickle=allow_pickle, fqn=fqn)
    return SavePlan(tensors, objects, skeleton)


def _write_box(
    writer: CheckpointWriter, name: str, key: str, box: np.ndarray, stored: tuple[int, ...]
) -> tuple[int, int]:
    """Write one stored chunk holding ``box``; returns its total size and its CRC32C."""
    if box.dtype.byteorder == ">":
        box = box.astype(box.dtype.newbyteorder("<"))
    if is_prefix_box(box.shape, stored):
        data = np.ascontiguousarray(box).reshape(-1).view(np.uint8)
        pad = (math.prod(stored) - box.size) * box.dtype.itemsize
        parts: list[Any] = [data, np.zeros(pad, np.uint8)] if pad else [data]
    else:
        parts = [padded_chunk(box, stored).reshape(-1).view(np.uint8)]
    state = [0]

    def digest(piece: Any) -> None:
        state[0] = crc32c(piece, state[0])

    writer.write_chunk_checked(name, key, parts, digest, lambda: state[0].to_bytes(CRC_BYTES, "little"))
    return sum(p.nbytes for p in parts) + CRC_BYTES, state[0]


def device_backends(plan: SavePlan) -> list[Any]:
    """The distinct backends of the plan's device arrays."""
    seen: dict[int, Any] = {}
    for j in plan.jobs():
        if isinstance(j.source, DeviceArray):
            seen.setdefault(id(j.source.backend), j.source.backend)
    for t in plan.tensors:
        if isinstance(t.array, DeviceArray):
            seen.setdefault(id(t.array.backend), t.array.backend)
    return list(seen.values())


class _Failure:
    """Lets the producer stop queueing work once any I/O job has failed."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def _array_document(t: TensorPlan) -> bytes:
    return array_document(
        shape=t.shape,
        dtype=t.dtype,
        grid=t.grid,
        attributes={"gpuckpt": {"fqn": t.fqn, "memory_format": t.properties.memory_format.name}},
    )


def array_documents(tensors: Iterable[TensorPlan]) -> dict[str, bytes]:
    """The ``zarr.json`` of each tensor's array, by array name."""
    return {t.name: _array_document(t) for t in tensors}


def write_array_documents(plan: SavePlan, writer: CheckpointWriter) -> None:
    for t in plan.tensors:
        writer.write_array_document(t.name, _array_document(t))


def write_chunks(
    jobs: Sequence[ChunkJob],
    writer: CheckpointWriter,
    *,
    threads: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    progress: ProgressCallback | None = None,
    documents: dict[str, bytes] | None = None,
) -> list[tuple[int, int]]:
    """Write every job's chunk; returns ``(stored bytes, CRC32C)`` per job, in order.

    ``documents`` maps array names whose directory does not exist yet to their
    ``zarr.json``; each such array must have exactly one job, which writes the
    document first (so that the many file-system operations of small tensors
    run on the I/O threads too).

    Host sources are encoded straight from their memory by the I/O threads.
    Device sources stream through a bounded pool of staging buffers: the
    calling thread queues device-to-host copies of the next chunks (blocking
    when the pool is exhausted) while the I/O threads wait for each copy,
    checksum and write its buffer, and return it to the pool.
    """
    counter = ProgressCounter(progress, sum(j.nbytes for j in jobs))
    docs = dict(documents or {})
    failure = _Failure()
    for backend in {
        id(j.source.backend): j.source.backend for j in jobs if isinstance(j.source, DeviceArray)
    }.values():
        backend.wait_for_producers()
    pools: dict[int, BufferPool] = {}
    with ThreadPoolExecutor(
        max_workers=threads or default_threads(), thread_name_prefix="gpuckpt-write"
    ) as io:
        pending: list[Future[list[tuple[int, int]]]] = []
        batch: list[tuple[ChunkJob, bytes | None]] = []
        batch_bytes = 0

        def submit(fn: Any, *args: Any) -> None:
            def job() -> list[tuple[int, int]]:
                try:
                    return fn(*args)  # type: ignore[no-any-return]
                except BaseException as exc:
                    failure.error = failure.error or exc
                    raise

            pending.append(io.submit(job))

        def flush() -> None:
            nonlocal batch, batch_bytes
            if batch:
                submit(_write_host_batch, writer, batch, counter)
                batch, batch_bytes = [], 0

        for j in jobs:
            failure.check()
            src = j.source
            if not isinstance(src, DeviceArray):
                # small host chunks go to the I/O threads in batches: one task per
                # chunk would cost more than writing a few KiB
                batch.append((j, docs.pop(j.name, None)))
                batch_bytes += j.nbytes
                if batch_bytes >= IO_BATCH_BYTES or len(batch) >= IO_BATCH_JOBS:
                    flush()
            else:
                flush()
                pool = pools.get(id(src.backend))
                if pool is None:
                    largest = max(k.nbytes for k in jobs if isinstance(k.source, DeviceArray))
                    pool = pools[id(src.backend)] = buffer_pool(
                        src.backend, staging_buffer_bytes(largest), staging_bytes
                    )
                buf = pool.acquire(j.nbytes)  # blocks while the budget is in use: back-pressure
                try:
                    ticket = src.backend.stage_out(src.data, j.offsets, j.sizes, buf[: j.nbytes])
                except BaseException:
                    pool.release(buf)
                    raise
                submit(_write_staged_chunk, writer, j, buf, ticket, pool, counter, docs.pop(j.name, None))
        flush()
        try:
            return [r for f in pending for r in f.result()]
        except BaseException:
            for f in pending:
                f.cancel()
            raise


def _write_host_batch(
    writer: CheckpointWriter, batch: Sequence[tuple[ChunkJob, bytes | None]], counter: ProgressCounter
) -> list[tuple[int, int]]:
    """Write host chunks one after the other (with their array's document where given)."""
    out = []
    for j, document in batch:
        if document is not None:
            writer.write_array_document(j.name, document)
        host = j.source.host_array()
        box = (
            host[...]
            if not j.sizes
            else host[tuple(slice(o, o + s) for o, s in zip(j.offsets, j.sizes, strict=True))]
        )
        out.append(_write_box(writer, j.name, j.key, box, j.stored))
        counter.add(j.nbytes)
    return out


def _write_staged_chunk(
    writer: CheckpointWriter,
    j: ChunkJob,
    buf: np.ndarray,
    ticket: Ticket,
    pool: BufferPool,
    counter: ProgressCounter,
    document: bytes | None = None,
) -> list[tuple[int, int]]:
    try:
        if document is not None:
            writer.write_array_document(j.name, document)
        ticket.wait()
        box = buf[: j.nbytes].view(j.source.dtype).reshape(j.sizes)
        result = _write_box(writer, j.name, j.key, box, j.stored)
    finally:
        pool.release(buf)
    counter.add(j.nbytes)
    return [result]


def assemble_metadata(
    plan: SavePlan, results: dict[tuple[str, tuple[int, ...]], tuple[int, int]], checkpoint_id: str | None
) -> Metadata:
    """The checkpoint's Metadata from the plan and every chunk's ``(stored bytes, CRC32C)``."""
    state_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    tensors_sd: dict[str, Any] = {}
    for t in plan.tensors:
        infos = []
        for s in t.specs:
            nbytes, crc = results[(t.name, s.coords)]
            infos.append({"key": chunk_file_key(s.coords), "nbytes": nbytes, "crc32c": crc})
        state_md[t.fqn] = TensorStorageMetadata(
            properties=t.properties,
            size=t.shape,
            chunks=[ChunkStorageMetadata(offsets=s.offsets, sizes=s.sizes) for s in t.specs],
        )
        tensors_sd[t.fqn] = {"name": t.name, "chunk_grid": t.grid.to_zarr_json(), "chunks": infos}
    for fqn in plan.objects:
        state_md[fqn] = BytesStorageMetadata()
    return Metadata(
        state_dict_metadata=state_md,
        planner_data={"structure": plan.skeleton},
        storage_data={"tensors": tensors_sd, "objects": plan.objects},
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, modules=["gpuckpt"]),
        version=None,
    )


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
    writer: CheckpointWriter,
    *,
    threads: int | None = None,
    checkpoint_id: str | None = None,
    progress: ProgressCallback | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> Metadata:
    """Write ``plan`` through ``writer`` and commit; aborts the writer on any error."""
    with writing(writer):
        writer.begin()
        # single-chunk arrays get their directory and document from the I/O thread
        # that writes their chunk; the others' must exist before any chunk lands
        single = {t.name: _array_document(t) for t in plan.tensors if len(t.jobs) == 1}
        for t in plan.tensors:
            if t.name not in single:
                writer.write_array_document(t.name, _array_document(t))
        jobs = plan.jobs()
        sizes = write_chunks(
            jobs, writer, threads=threads, staging_bytes=staging_bytes, progress=progress, documents=single
        )
        results = {(j.name, j.coords): r for j, r in zip(jobs, sizes, strict=True)}
        metadata = assemble_metadata(plan, results, checkpoint_id)
        writer.commit(root_document(metadata))
    metadata.version = metadata.version or FORMAT_VERSION
    return metadata
