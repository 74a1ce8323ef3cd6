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
import functools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, StagedOut, adapt, is_array
from gpuckpt.device.backend import DEFAULT_STAGING_BYTES, DeviceBackend, Staging, distinct_backends
from gpuckpt.errors import CheckpointWriteError, GpuckptError, InvalidOptionError
from gpuckpt.metadata import (
    FORMAT_VERSION,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from gpuckpt.options import SYNC_MODES, direct_io_from_env
from gpuckpt.planning import DEFAULT_CHUNK_BYTES, ChunkGrid, ChunkSpec, plan_regular_grid
from gpuckpt.progress import ProgressCallback, ProgressCounter
from gpuckpt.runner import Batcher, Runner
from gpuckpt.state import flatten_state_dict
from gpuckpt.storage.base import CheckpointWriter
from gpuckpt.storage.checksum import CRC_BYTES, crc32c
from gpuckpt.storage.chunks import is_prefix_box, padded_chunk
from gpuckpt.storage.layout import array_document, chunk_file_key, root_document
from gpuckpt.storage.names import encode_name
from gpuckpt.storage.values import encode_object

__all__ = [
    "ChunkJob",
    "SavePlan",
    "TensorPlan",
    "assemble_metadata",
    "build_save_plan",
    "check_save_options",
    "device_backends",
    "execute_save",
    "write_array_documents",
    "write_chunks",
]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_save_options(
    *,
    chunk_bytes: Any = DEFAULT_CHUNK_BYTES,
    sync: Any = "auto",
    threads: Any = None,
    staging_bytes: Any = DEFAULT_STAGING_BYTES,
    progress: Any = None,
) -> None:
    """Raise :class:`~gpuckpt.errors.InvalidOptionError` for a save option that cannot work.

    The entry points (save, async_save, the manager) call this before taking
    anything (staging memory, copies, files), so that a bad value fails at the
    call and leaves nothing behind. The ``GPUCKPT_DIRECT_IO`` environment
    variable is checked too.
    """
    if not _is_int(chunk_bytes) or chunk_bytes < 1:
        raise InvalidOptionError(
            f"chunk_bytes must be a positive integer (bytes per stored chunk), got {chunk_bytes!r}"
        )
    if not isinstance(sync, str) or sync not in SYNC_MODES:
        raise InvalidOptionError(
            f"sync={sync!r} is not a durability mode; expected one of {', '.join(map(repr, SYNC_MODES))} "
            "('file': fsync each file, 'fs': one syncfs, 'none': no durability, 'auto': choose)"
        )
    if threads is not None and (not _is_int(threads) or threads < 1):
        raise InvalidOptionError(f"threads must be an integer >= 1 or None (the default), got {threads!r}")
    if not _is_int(staging_bytes) or staging_bytes < 1:
        raise InvalidOptionError(
            f"staging_bytes must be a positive integer (bytes of staging memory), got {staging_bytes!r}"
        )
    if progress is not None and not callable(progress):
        raise InvalidOptionError(
            f"progress must be a callable progress(done_bytes, total_bytes) or None, got {progress!r}"
        )
    direct_io_from_env()


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
                    TensorProperties.from_array(arr),
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


def device_backends(plan: SavePlan) -> list[DeviceBackend]:
    """The distinct back ends of the plan's device arrays."""
    arrays = [*(j.source for j in plan.jobs()), *(t.array for t in plan.tensors if t.array is not None)]
    return distinct_backends(a.backend for a in arrays)


def _array_document(t: TensorPlan) -> bytes:
    return array_document(
        shape=t.shape, dtype=t.dtype, grid=t.grid, fqn=t.fqn, memory_format=t.properties.memory_format.name
    )


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
    """Write staged chunks one after the other (with their array's document where given)."""
    out = []
    try:
        for j, staged, document in items:
            if document is not None:
                writer.write_array_document(j.name, document)
            out.append(_write_box(writer, j.name, j.key, staged.wait(), j.stored))
            counter.add(j.nbytes)
    finally:
        _release_all(items)  # staging buffers go back to their pool
    return out


def _release_all(items: Sequence[_Item]) -> None:
    for _, staged, _ in items:
        staged.release()


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
