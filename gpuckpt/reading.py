"""Executing a load: validate the metadata, check the chunk files, then read.

Nothing in a checkpoint is trusted. Before a single array is allocated, every
tensor's grid, chunk list, keys and byte sizes are checked against each
other and against the sizes of the files on disk, so a checkpoint that
claims a huge shape fails fast instead of allocating it. Chunks are then read
by a thread pool, straight into the destination array where the layout
allows, and each one's CRC32C is checked against the chunk file and against
the metadata.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.device.backend import (
    DEFAULT_STAGING_BYTES,
    BufferPool,
    DeviceArray,
    buffer_pool,
    staging_buffer_bytes,
)
from gpuckpt.errors import (
    CheckpointCorruptedError,
    ChecksumError,
    MetadataError,
    MissingChunkError,
)
from gpuckpt.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from gpuckpt.planning import ChunkGrid, ChunkSpec
from gpuckpt.progress import ProgressCallback, ProgressCounter
from gpuckpt.storage.base import CheckpointReader
from gpuckpt.storage.chunkio import CRC_BYTES, is_prefix_box, stored_nbytes
from gpuckpt.storage.layout import chunk_file_key, is_chunk_file_key
from gpuckpt.storage.names import is_safe_name
from gpuckpt.writing import IO_BATCH_BYTES, IO_BATCH_JOBS, default_threads

__all__ = [
    "ChunkRead",
    "TensorEntry",
    "check_chunk_files",
    "paused_gc",
    "read_chunk_into_box",
    "read_tensors",
    "validate_metadata",
]


@dataclass(slots=True)
class ChunkRead:
    spec: ChunkSpec
    key: str
    nbytes: int
    crc: int
    stored: tuple[int, ...]


@dataclass(slots=True)
class TensorEntry:
    """A tensor of a validated checkpoint."""

    fqn: str
    name: str
    metadata: TensorStorageMetadata
    grid: ChunkGrid
    chunks: list[ChunkRead]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.metadata.size)

    @property
    def dtype(self) -> np.dtype[Any]:
        dt: np.dtype[Any] = np.dtype(self.metadata.properties.dtype)
        return dt

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


_MAX_EXTENT = 2**62


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a load.

    Parsing the metadata of a checkpoint with many tensors creates millions of
    small objects (the JSON tree, then the metadata objects); each collection
    walks all of them again, for nothing, since none is garbage until the load
    ends (a quarter of the time of a 10,000-tensor load). Reference counting still
    frees everything as usual; the collector resumes, if it was on, when the
    load returns or fails.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _bad(fqn: str, what: str) -> MetadataError:
    return MetadataError(
        f"metadata of tensor {fqn!r} is inconsistent: {what}; "
        "the checkpoint is damaged or was not written by gpuckpt"
    )


def validate_metadata(md: Metadata) -> tuple[dict[str, TensorEntry], dict[str, Any]]:
    """Cross-check ``state_dict_metadata`` with ``storage_data``; returns tensors and encoded objects."""
    sd = md.storage_data
    if (
        not isinstance(sd, dict)
        or not isinstance(sd.get("tensors"), dict)
        or not isinstance(sd.get("objects"), dict)
    ):
        raise MetadataError("metadata.storage_data must hold 'tensors' and 'objects' objects")
    pd = md.planner_data
    if not isinstance(pd, dict) or "structure" not in pd:
        raise MetadataError("metadata.planner_data must hold the state dict 'structure'")
    tensors: dict[str, TensorEntry] = {}
    objects: dict[str, Any] = {}
    names: set[str] = set()
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            if fqn not in sd["objects"]:
                raise MetadataError(f"value {fqn!r} is listed but not stored; the checkpoint is damaged")
            objects[fqn] = sd["objects"][fqn]
            continue
        assert isinstance(entry, TensorStorageMetadata)
        info = sd["tensors"].get(fqn)
        if not isinstance(info, dict):
            raise _bad(fqn, "no storage entry")
        name = info.get("name")
        if not isinstance(name, str) or not is_safe_name(name) or name in names:
            raise _bad(fqn, f"array name {name!r} is not a safe, unique path component")
        names.add(name)
        itemsize = np.dtype(entry.properties.dtype).itemsize
        if any(n >= _MAX_EXTENT for n in entry.size) or math.prod(entry.size) * itemsize >= _MAX_EXTENT:
            raise _bad(fqn, f"size {entry.size} is larger than any array can be")
        try:
            grid = ChunkGrid.from_zarr_json(entry.size, info.get("chunk_grid"))
        except ValueError as exc:
            raise _bad(fqn, f"chunk grid: {exc}") from None
        raw_chunks = info.get("chunks")
        if not isinstance(raw_chunks, list) or len(raw_chunks) != len(entry.chunks):
            raise _bad(fqn, "storage chunk list does not match the chunk metadata")
        expected_n = 0 if any(n == 0 for n in entry.size) else math.prod(grid.grid_shape)
        if expected_n != len(entry.chunks):
            raise _bad(fqn, f"{len(entry.chunks)} chunks listed, the grid has {expected_n}")
        chunks: list[ChunkRead] = []
        for i, (spec, cmeta, raw) in enumerate(zip(grid.chunk_list(), entry.chunks, raw_chunks, strict=True)):
            if tuple(cmeta.offsets) != spec.offsets or tuple(cmeta.sizes) != spec.sizes:
                raise _bad(fqn, f"chunk {i} box {cmeta} does not match the grid {spec}")
            if not isinstance(raw, dict):
                raise _bad(fqn, f"chunk {i} storage entry is not an object")
            key, nbytes, crc = raw.get("key"), raw.get("nbytes"), raw.get("crc32c")
            if not is_chunk_file_key(key) or key != chunk_file_key(spec.coords):
                raise _bad(fqn, f"chunk {i} key {key!r} is not {chunk_file_key(spec.coords)!r}")
            stored = grid.stored_chunk_shape(spec)
            if type(nbytes) is not int or nbytes != stored_nbytes(stored, itemsize):
                raise _bad(
                    fqn,
                    f"chunk {key} claims {nbytes!r} bytes, its shape needs {stored_nbytes(stored, itemsize)}",
                )
            if not isinstance(crc, int) or isinstance(crc, bool) or not 0 <= crc < 2**32:
                raise _bad(fqn, f"chunk {key} checksum {crc!r} is not a 32-bit value")
            chunks.append(ChunkRead(spec, key, nbytes, crc, tuple(stored)))
        tensors[fqn] = TensorEntry(fqn, name, entry, grid, chunks)
    return tensors, objects


def check_chunk_files(reader: CheckpointReader, entries: Iterable[TensorEntry]) -> None:
    """Check that every chunk file exists with the size the metadata gives, before allocating."""
    for t in entries:
        for c in t.chunks:
            size = reader.chunk_nbytes(t.name, c.key)
            if size is None:
                raise MissingChunkError(
                    f"chunk {c.key} of tensor {t.fqn!r} is missing (expected file {t.name}/{c.key}); "
                    "the checkpoint is damaged: restore it from a copy or use an earlier checkpoint"
                )
            if size != c.nbytes:
                raise CheckpointCorruptedError(
                    f"chunk {c.key} of tensor {t.fqn!r} is {size} bytes, expected {c.nbytes} "
                    f"(file {t.name}/{c.key} is truncated or overwritten); the checkpoint is damaged"
                )


def _check_crc(t: TensorEntry, c: ChunkRead, value: int, stored_crc: int) -> None:
    if value != stored_crc or value != c.crc:
        what = (
            "its bytes do not match their checksum"
            if value != stored_crc
            else "it is a valid chunk but not the one the metadata lists"
        )
        raise ChecksumError(
            f"chunk {c.key} of tensor {t.fqn!r} failed its CRC32C check ({what}: computed {value:#010x}, "
            f"chunk file {stored_crc:#010x}, metadata {c.crc:#010x}); the checkpoint is damaged, or was "
            "replaced by a concurrent save while loading (then load again): restore it from a copy or load "
            "an earlier checkpoint (arrays loaded in place may be partly overwritten)"
        )


def fetch_verified(reader: CheckpointReader, t: TensorEntry, c: ChunkRead, parts: list[Any]) -> None:
    """Read chunk ``c`` into the buffers ``parts`` (its stored bytes) and check its size and CRC32C."""
    crc_buf = bytearray(CRC_BYTES)
    try:
        got, value = reader.read_chunk_crc(t.name, c.key, [*parts, crc_buf])
    except FileNotFoundError:
        raise MissingChunkError(
            f"chunk {c.key} of tensor {t.fqn!r} disappeared while loading; the checkpoint was "
            "deleted or replaced by a concurrent save (load again), or is damaged"
        ) from None
    if got != c.nbytes:
        raise CheckpointCorruptedError(
            f"chunk {c.key} of tensor {t.fqn!r}: read {got} bytes, expected {c.nbytes}; the file is truncated"
        )
    _check_crc(t, c, value, int.from_bytes(crc_buf, "little"))


def _read_chunk(
    reader: CheckpointReader, t: TensorEntry, c: ChunkRead, dest: np.ndarray, counter: ProgressCounter
) -> None:
    read_chunk_into_box(reader, t, c, c.spec.view(dest), counter)


def read_chunk_into_box(
    reader: CheckpointReader, t: TensorEntry, c: ChunkRead, box: np.ndarray, counter: ProgressCounter
) -> None:
    """Read chunk ``c`` into ``box`` (host memory of the chunk's extent), verifying its CRC32C.

    Straight into ``box`` when it is C-contiguous, else through a scratch buffer.
    """
    direct = box.flags.c_contiguous and box.dtype.byteorder != ">" and is_prefix_box(c.spec.sizes, c.stored)
    if direct:
        # straight into the destination; padding of an edge chunk goes to scratch
        data = box.reshape(-1).view(np.uint8)
        pad = c.nbytes - CRC_BYTES - data.nbytes
        fetch_verified(reader, t, c, [data, np.empty(pad, np.uint8)] if pad else [data])
    else:
        scratch = np.empty(c.stored, dtype=t.dtype.newbyteorder("<"))
        fetch_verified(reader, t, c, [scratch.reshape(-1).view(np.uint8)])
        box[...] = scratch[tuple(slice(0, s) for s in c.spec.sizes)]
    counter.add(box.nbytes)


def _read_host_batch(
    reader: CheckpointReader,
    batch: list[tuple[TensorEntry, ChunkRead, np.ndarray]],
    counter: ProgressCounter,
) -> None:
    for t, c, dest in batch:
        _read_chunk(reader, t, c, dest, counter)


def _read_chunk_to_device(
    reader: CheckpointReader,
    t: TensorEntry,
    c: ChunkRead,
    dest: DeviceArray,
    pool: BufferPool,
    counter: ProgressCounter,
) -> None:
    """Read a chunk into a staging buffer, verify it, and copy its box into the device array."""
    buf = pool.acquire(c.nbytes - CRC_BYTES)
    try:
        stored = buf[: c.nbytes - CRC_BYTES]
        fetch_verified(reader, t, c, [stored])
        if is_prefix_box(c.spec.sizes, c.stored):
            block = stored[: c.spec.nelem * t.dtype.itemsize]
        else:
            full = stored.view(t.dtype.newbyteorder("<")).reshape(c.stored)
            block = (
                np.ascontiguousarray(full[tuple(slice(0, s) for s in c.spec.sizes)])
                .reshape(-1)
                .view(np.uint8)
            )
        dest.backend.stage_in(block, dest.data, c.spec.offsets, c.spec.sizes).wait()
    finally:
        pool.release(buf)
    counter.add(c.spec.nelem * t.dtype.itemsize)


def read_tensors(
    reader: CheckpointReader,
    targets: list[tuple[TensorEntry, Any]],
    *,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> None:
    """Fill each target (a host array or a :class:`DeviceArray`) with its tensor's chunks, in parallel.

    Host targets are read straight into their memory where the layout allows.
    Device targets go through a bounded pool of staging buffers: I/O threads
    read and verify chunks into buffers and queue the host-to-device copies,
    so reads of the next chunks overlap the copies of earlier ones.
    """
    counter = ProgressCounter(progress, sum(t.nbytes for t, _ in targets))
    jobs: list[tuple[Any, ...]] = []
    batch: list[tuple[TensorEntry, ChunkRead, np.ndarray]] = []
    batch_bytes = 0
    for t, dest in targets:
        if isinstance(dest, DeviceArray):
            if not t.chunks:
                continue
            largest = max(c.nbytes for c in t.chunks) - CRC_BYTES
            pool = buffer_pool(dest.backend, staging_buffer_bytes(largest), staging_bytes)
            jobs.extend((_read_chunk_to_device, reader, t, c, dest, pool, counter) for c in t.chunks)
            continue
        for c in t.chunks:
            # small host chunks go to the I/O threads in batches, as on save
            batch.append((t, c, dest))
            batch_bytes += c.nbytes
            if batch_bytes >= IO_BATCH_BYTES or len(batch) >= IO_BATCH_JOBS:
                jobs.append((_read_host_batch, reader, batch, counter))
                batch, batch_bytes = [], 0
    if batch:
        jobs.append((_read_host_batch, reader, batch, counter))
    if not jobs:
        return
    if len(jobs) == 1:
        jobs[0][0](*jobs[0][1:])
        return
    with ThreadPoolExecutor(
        max_workers=threads or default_threads(), thread_name_prefix="gpuckpt-read"
    ) as pool_:
        futures = [pool_.submit(*job) for job in jobs]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
