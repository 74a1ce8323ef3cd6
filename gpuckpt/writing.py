"""Executing a save: from flattened leaves to a published checkpoint.

Tensors become Zarr arrays (:mod:`gpuckpt.storage.layout`), their chunks are
encoded and written by a thread pool straight from the arrays' memory when
a chunk is one contiguous byte run (the common case: see
:func:`gpuckpt.planning.plan_regular_grid`), and the root document carrying
the metadata is written last by :meth:`CheckpointWriter.commit`.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor
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
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from gpuckpt.planning import DEFAULT_CHUNK_BYTES, ChunkGrid, ChunkSpec, plan_regular_grid
from gpuckpt.progress import ProgressCallback, ProgressCounter
from gpuckpt.state import flatten_state_dict
from gpuckpt.storage.base import CheckpointWriter
from gpuckpt.storage.chunkio import CRC_BYTES, crc32c, is_prefix_box, padded_chunk, zeros_crc
from gpuckpt.storage.layout import array_document, chunk_file_key, root_document
from gpuckpt.storage.names import encode_name
from gpuckpt.storage.objects import encode_object

__all__ = ["TensorPlan", "build_save_plan", "default_threads", "execute_save"]


def default_threads() -> int:
    """I/O threads: enough to overlap checksums, writes and fsyncs on small machines."""
    return max(2, min(8, (os.cpu_count() or 2) * 2))


@dataclass(slots=True)
class TensorPlan:
    """One tensor to write."""

    fqn: str
    name: str
    array: ArrayAdapter
    grid: ChunkGrid
    properties: TensorProperties
    specs: list[ChunkSpec] = field(default_factory=list)


@dataclass(slots=True)
class SavePlan:
    tensors: list[TensorPlan]
    objects: dict[str, Any]
    skeleton: Any

    @property
    def nfiles(self) -> int:
        return sum(1 + len(t.specs) for t in self.tensors) + 1


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
            props = arr.properties()
            grid = plan_regular_grid(arr.shape, arr.dtype.itemsize, chunk_bytes)
            tensors.append(TensorPlan(fqn, encode_name(fqn), arr, grid, props, list(grid.chunks())))
        else:
            objects[fqn] = encode_object(leaf.value, allow_pickle=allow_pickle, fqn=fqn)
    return SavePlan(tensors, objects, skeleton)


def _encode_box(box: np.ndarray, grid: ChunkGrid, spec: ChunkSpec) -> tuple[list[Any], int, int]:
    """Buffers making up one stored chunk holding ``box``, its total size and its CRC32C."""
    if box.dtype.byteorder == ">":
        box = box.astype(box.dtype.newbyteorder("<"))
    stored = grid.stored_chunk_shape(spec)
    itemsize = box.dtype.itemsize
    if is_prefix_box(spec.sizes, stored):
        data = np.ascontiguousarray(box).reshape(-1).view(np.uint8)
        pad = (int(np.prod(stored, dtype=np.int64)) - box.size) * itemsize
        crc = zeros_crc(crc32c(data), pad)
        parts: list[Any] = [data]
        if pad:
            parts.append(np.zeros(pad, np.uint8))
    else:
        data = padded_chunk(box, stored).reshape(-1).view(np.uint8)
        crc = crc32c(data)
        parts = [data]
        pad = 0
    parts.append(crc.to_bytes(CRC_BYTES, "little"))
    return parts, data.nbytes + pad + CRC_BYTES, crc


class _Failure:
    """Lets the producer stop queueing work once any I/O job has failed."""

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def execute_save(
    plan: SavePlan,
    writer: CheckpointWriter,
    *,
    threads: int | None = None,
    checkpoint_id: str | None = None,
    progress: ProgressCallback | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> Metadata:
    """Write ``plan`` through ``writer`` and commit; aborts the writer on any error.

    Host tensors are encoded straight from their memory by the I/O threads.
    Device tensors stream through a bounded pool of staging buffers: the
    calling thread queues device-to-host copies of the next chunks (blocking
    when the pool is exhausted) while the I/O threads wait for each copy,
    checksum and write its buffer, and return it to the pool.
    """
    counter = ProgressCounter(progress, sum(_nbytes(t) for t in plan.tensors))
    state_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    tensors_sd: dict[str, Any] = {}
    failure = _Failure()
    try:
        writer.begin()
        with ThreadPoolExecutor(
            max_workers=threads or default_threads(), thread_name_prefix="gpuckpt-write"
        ) as io:
            pending: list[tuple[dict[str, Any], Future[tuple[int, int]]]] = []

            def submit(info: dict[str, Any], fn: Any, *args: Any) -> None:
                def job() -> tuple[int, int]:
                    try:
                        return fn(*args)  # type: ignore[no-any-return]
                    except BaseException as exc:
                        failure.error = failure.error or exc
                        raise

                pending.append((info, io.submit(job)))

            for backend in device_backends(plan):
                backend.wait_for_producers()
            for t in plan.tensors:
                failure.check()
                writer.write_array_document(
                    t.name,
                    array_document(
                        shape=t.array.shape,
                        dtype=t.array.dtype,
                        grid=t.grid,
                        attributes={
                            "gpuckpt": {"fqn": t.fqn, "memory_format": t.properties.memory_format.name}
                        },
                    ),
                )
                infos = []
                for spec in t.specs:
                    info: dict[str, Any] = {"key": chunk_file_key(spec.coords)}
                    infos.append(info)
                    if t.array.is_device:
                        failure.check()
                        _queue_device_chunk(submit, info, writer, t, spec, staging_bytes, counter)
                    else:
                        submit(
                            info,
                            _write_host_chunk,
                            writer,
                            t.name,
                            info["key"],
                            t.array.host_array(),
                            t.grid,
                            spec,
                            counter,
                        )
                state_md[t.fqn] = TensorStorageMetadata(
                    properties=t.properties, size=t.array.shape, chunks=[s.as_metadata() for s in t.specs]
                )
                tensors_sd[t.fqn] = {"name": t.name, "chunk_grid": t.grid.to_zarr_json(), "chunks": infos}
            try:
                for info, fut in pending:
                    info["nbytes"], info["crc32c"] = fut.result()
            except BaseException:
                for _, fut in pending:
                    fut.cancel()
                raise
        for fqn in plan.objects:
            state_md[fqn] = BytesStorageMetadata()
        metadata = Metadata(
            state_dict_metadata=state_md,
            planner_data={"structure": plan.skeleton},
            storage_data={"tensors": tensors_sd, "objects": plan.objects},
            storage_meta=StorageMeta(checkpoint_id=checkpoint_id, modules=["gpuckpt"]),
        )
        writer.commit(root_document(metadata))
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
    metadata.version = metadata.to_json_dict()["version"]
    return metadata


def device_backends(plan: SavePlan) -> list[Any]:
    """The distinct backends of the plan's device tensors."""
    seen: dict[int, Any] = {}
    for t in plan.tensors:
        if isinstance(t.array, DeviceArray):
            seen.setdefault(id(t.array.backend), t.array.backend)
    return list(seen.values())


def _nbytes(t: TensorPlan) -> int:
    return int(np.prod(t.array.shape, dtype=np.int64)) * t.array.dtype.itemsize


def _write_host_chunk(
    writer: CheckpointWriter,
    name: str,
    key: str,
    host: np.ndarray,
    grid: ChunkGrid,
    spec: ChunkSpec,
    counter: ProgressCounter,
) -> tuple[int, int]:
    parts, nbytes, crc = _encode_box(spec.view(host), grid, spec)
    writer.write_chunk(name, key, parts)
    counter.add(spec.nelem * host.dtype.itemsize)
    return nbytes, crc


def _queue_device_chunk(
    submit: Any,
    info: dict[str, Any],
    writer: CheckpointWriter,
    t: TensorPlan,
    spec: ChunkSpec,
    staging_bytes: int,
    counter: ProgressCounter,
) -> None:
    dev = t.array
    assert isinstance(dev, DeviceArray)
    nbytes = spec.nelem * dev.dtype.itemsize
    largest = max(s.nelem for s in t.specs) * dev.dtype.itemsize
    pool = buffer_pool(dev.backend, staging_buffer_bytes(largest), staging_bytes)
    buf = pool.acquire(nbytes)  # blocks while the budget is in use: back-pressure
    try:
        ticket = dev.backend.stage_out(dev.data, spec.offsets, spec.sizes, buf[:nbytes])
    except BaseException:
        pool.release(buf)
        raise
    submit(
        info,
        _write_staged_chunk,
        writer,
        t.name,
        info["key"],
        buf,
        nbytes,
        dev.dtype,
        t.grid,
        spec,
        ticket,
        pool,
        counter,
    )


def _write_staged_chunk(
    writer: CheckpointWriter,
    name: str,
    key: str,
    buf: np.ndarray,
    nbytes: int,
    dtype: np.dtype[Any],
    grid: ChunkGrid,
    spec: ChunkSpec,
    ticket: Ticket,
    pool: BufferPool,
    counter: ProgressCounter,
) -> tuple[int, int]:
    try:
        ticket.wait()
        box = buf[:nbytes].view(dtype).reshape(spec.sizes)
        parts, total, crc = _encode_box(box, grid, spec)
        writer.write_chunk(name, key, parts)
    finally:
        pool.release(buf)
    counter.add(nbytes)
    return total, crc
