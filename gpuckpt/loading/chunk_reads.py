"""Reading the chunks of validated tensors: checksum-verified reads, batches of small
chunks, the load pipeline to a device, and the I/O threads of a load.

The tensors come from :func:`gpuckpt.loading.checks.validated_metadata` (every grid, chunk
list, key and byte size already checked against each other and against the files);
each chunk read here is checked against its CRC32C, in the chunk file and in the
metadata, before it is used.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, HostArray, StagedIn, canonicalize_loaded_bools
from gpuckpt.device.backend import Staging
from gpuckpt.device.staging import populated
from gpuckpt.device.upload import CopyQueue
from gpuckpt.errors import (
    CheckpointCorruptedError,
    CheckpointTooLargeError,
    ChecksumError,
    ChunkDecodeError,
    MissingChunkError,
)
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.chunks import is_prefix_box
from gpuckpt.format.codecs import CodecError, decode_into
from gpuckpt.format.entries import ChunkRead, TensorEntry, whole_chunk_key
from gpuckpt.options import LoadOptions
from gpuckpt.progress import ProgressCounter
from gpuckpt.runtime.runner import IO_BATCH_BYTES, IO_BATCH_JOBS, batches, default_threads, run_all
from gpuckpt.storage.base import CheckpointReader, ChunkReads, ReadStop

__all__ = [
    "COLD_SMALL_THREADS",
    "MANY_CHUNKS",
    "SMALL_CHUNK_BYTES",
    "checksum_verified",
    "decode_verified",
    "stored_chunk",
    "cold_small_threads",
    "fetch_verified",
    "read_chunk_into",
    "prepare_reads",
    "read_tensors",
    "run_reads",
    "scratch",
    "upload_chunk",
    "vanished",
]


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
            "an earlier checkpoint (arrays loaded in place may be partly overwritten)",
            fqn=t.fqn,
            key=c.key,
            computed=value,
            stored=stored_crc,
            expected=c.crc,
        )


def vanished(t: TensorEntry, c: ChunkRead, exc: FileNotFoundError) -> MissingChunkError:
    what = f"file {t.name}/{c.key} {exc.strerror}" if exc.strerror else "it disappeared"
    return MissingChunkError(
        f"chunk {c.key} of tensor {t.fqn!r} cannot be read while loading ({what}); the checkpoint "
        "was deleted or replaced by a concurrent save (load again), or is damaged"
    )


#: the smallest scratch buffer made as a populated map (NumPy asks for huge pages from 4 MiB on;
#: below, malloc's arenas serve it)
POPULATED_MIN_BYTES = 4 << 20


def scratch(
    shape: tuple[int, ...], dtype: np.dtype[Any], t: TensorEntry, *, populate: bool = False
) -> np.ndarray:
    """Scratch memory for a chunk of ``t`` (validation keeps it within the tensor's own size).

    ``populate``: from :data:`POPULATED_MIN_BYTES` on, its pages mapped when it is made
    (:func:`~gpuckpt.device.staging.populated`), for large buffers made many at a time (a
    cooperative load's share); smaller ones come from the allocator as any."""
    try:
        count = math.prod(shape)
        if populate and count * dtype.itemsize >= POPULATED_MIN_BYTES:
            return np.frombuffer(populated(count * dtype.itemsize), dtype, count).reshape(shape)
        return np.empty(shape, dtype)
    except (MemoryError, OSError):
        raise CheckpointTooLargeError(
            f"tensor {t.fqn!r}: a scratch buffer of shape {shape} ({math.prod(shape) * dtype.itemsize} "
            "bytes) for reading one of its chunks cannot be allocated; free memory and load again"
        ) from None


def checksum_verified(reader: CheckpointReader, t: TensorEntry, c: ChunkRead, piece: int) -> None:
    """Read chunk ``c`` through buffers of at most ``piece`` bytes and check its size and CRC32C.

    Nothing of the chunk is kept; ``c.nbytes`` must have been checked against the file first.
    """
    try:
        got, value, stored_crc = reader.read_chunk_checksum(t.name, c.key, c.nbytes, piece)
    except FileNotFoundError as exc:
        raise vanished(t, c, exc) from None
    if got != c.nbytes:
        raise CheckpointCorruptedError(
            f"chunk {c.key} of tensor {t.fqn!r}: read {got} bytes, expected {c.nbytes}; the file is truncated"
        )
    _check_crc(t, c, value, stored_crc)


def fetch_verified(reader: CheckpointReader, t: TensorEntry, c: ChunkRead, parts: list[Any]) -> None:
    """Read chunk ``c`` into the buffers ``parts`` (its stored bytes) and check its size and CRC32C."""
    crc_buf = bytearray(CRC_BYTES)
    try:
        got, value = reader.read_chunk_crc(t.name, c.key, [*parts, crc_buf])
    except FileNotFoundError as exc:
        raise vanished(t, c, exc) from None
    if got != c.nbytes:
        raise CheckpointCorruptedError(
            f"chunk {c.key} of tensor {t.fqn!r}: read {got} bytes, expected {c.nbytes}; the file is truncated"
        )
    _check_crc(t, c, value, int.from_bytes(crc_buf, "little"))


def read_chunk_into(
    reader: CheckpointReader,
    t: TensorEntry,
    c: ChunkRead,
    dest: ArrayAdapter,
    offsets: tuple[int, ...],
    staging: Staging,
    counter: ProgressCounter,
) -> None:
    """Read and verify chunk ``c`` into the box of ``dest`` at ``offsets`` (the chunk's extent).

    Straight into the box's memory where its layout allows (host boxes, or the
    staging buffer of a device box), else through scratch memory.
    """
    incoming = dest.stage_in(offsets, c.spec.sizes, staging)
    try:
        box = incoming.box
        _fill_box(reader, t, c, box)
        incoming.finish()
    finally:
        incoming.release()
    counter.add(box.nbytes)


def upload_chunk(
    reader: CheckpointReader,
    t: TensorEntry,
    c: ChunkRead,
    dest: ArrayAdapter,
    offsets: tuple[int, ...],
    staging: Staging,
    copies: CopyQueue,
    counter: ProgressCounter,
) -> None:
    """Read and verify chunk ``c`` into a staging buffer, then hand it to ``copies``, which
    moves it into the box of ``dest`` at ``offsets`` while this thread reads on.

    The buffer comes from the run's bounded pool (blocking while all are in flight:
    the pipeline's depth). A chunk that fails its check is never handed over.
    """
    incoming = dest.stage_in(offsets, c.spec.sizes, staging)
    try:
        box = incoming.box
        _fill_box(reader, t, c, box)
    except BaseException:
        incoming.release()
        raise
    copies.put(incoming)  # gives the buffer back itself, also when it fails
    counter.add(box.nbytes)


def _fill_box(reader: CheckpointReader, t: TensorEntry, c: ChunkRead, box: np.ndarray) -> None:
    """Read and verify chunk ``c`` into ``box``: straight into its memory where the layout
    allows (the stored bytes are the box's), else through scratch memory."""
    if t.codec is not None:
        _fill_compressed(reader, t, c, box)
    elif box.flags.c_contiguous and box.dtype.byteorder != ">" and is_prefix_box(c.spec.sizes, c.stored):
        # straight into the box; padding of an edge chunk goes to scratch
        data = box.reshape(-1).view(np.uint8)
        pad = c.nbytes - CRC_BYTES - data.nbytes
        fetch_verified(reader, t, c, [data, scratch((pad,), np.dtype(np.uint8), t)] if pad else [data])
    else:
        stored = scratch(c.stored, t.dtype.newbyteorder("<"), t)
        fetch_verified(reader, t, c, [stored.reshape(-1).view(np.uint8)])
        box[...] = stored[tuple(slice(0, s) for s in c.spec.sizes)]


def _fill_compressed(reader: CheckpointReader, t: TensorEntry, c: ChunkRead, box: np.ndarray) -> None:
    """Read chunk ``c`` of compressed tensor ``t`` whole into scratch memory of its stored size
    (checked against the file and bounded by its codec before), verify its CRC32C, and
    decompress it straight into ``box`` where the box is the whole stored chunk in C order,
    else into scratch copied into place. Raises :class:`~gpuckpt.errors.ChunkDecodeError` for a
    chunk that does not decompress to exactly its chunk's bytes."""
    assert t.codec is not None
    src = scratch((c.nbytes - CRC_BYTES,), np.dtype(np.uint8), t)
    fetch_verified(reader, t, c, [src])
    # ``box``: the chunk's box, or the whole stored (padded) chunk
    whole = box.flags.c_contiguous and box.dtype.byteorder != ">" and tuple(box.shape) == tuple(c.stored)
    if whole:
        _decoded(t, c, src, box.reshape(-1).view(np.uint8))
    else:
        stored = scratch(c.stored, t.dtype.newbyteorder("<"), t)
        _decoded(t, c, src, stored.reshape(-1).view(np.uint8))
        box[...] = stored[tuple(slice(0, s) for s in box.shape)]


def stored_chunk(reader: CheckpointReader, t: TensorEntry, c: ChunkRead) -> np.ndarray:
    """Chunk ``c`` of ``t`` as stored (its padded shape ``c.stored``, little-endian), read into
    scratch memory and verified (and decompressed, for a compressed tensor)."""
    stored = scratch(c.stored, t.dtype.newbyteorder("<"), t)
    if t.codec is not None:
        _fill_compressed(reader, t, c, stored)
    else:
        fetch_verified(reader, t, c, [stored.reshape(-1).view(np.uint8)])
    return stored


def decoded_chunk(t: TensorEntry, c: ChunkRead, data: np.ndarray) -> np.ndarray:
    """The chunk ``c`` of compressed tensor ``t`` whose checked stored bytes are ``data``,
    decompressed into scratch memory of its padded shape ``c.stored`` (little-endian); a
    :class:`~gpuckpt.errors.ChunkDecodeError` where the bytes do not decompress to it."""
    out = scratch(c.stored, t.dtype.newbyteorder("<"), t)
    _decoded(t, c, data, out.reshape(-1).view(np.uint8))
    return out


def decode_verified(reader: CheckpointReader, t: TensorEntry, c: ChunkRead) -> None:
    """Read chunk ``c`` of compressed tensor ``t``, check its CRC32C and that it decompresses to
    its chunk's bytes (kept nowhere: what verify asks of a compressed chunk)."""
    _fill_compressed(reader, t, c, scratch(c.stored, t.dtype.newbyteorder("<"), t))


def _decoded(t: TensorEntry, c: ChunkRead, src: np.ndarray, dest: np.ndarray) -> None:
    assert t.codec is not None
    try:
        decode_into(t.codec, memoryview(src), dest)
    except CodecError as exc:
        raise ChunkDecodeError(
            f"chunk {c.key} of tensor {t.fqn!r} passed its CRC32C check but does not decompress to the "
            f"chunk's {dest.nbytes} bytes ({exc}); the checkpoint is damaged or hostile, or was written "
            "wrongly: restore it from a copy or load an earlier checkpoint",
            fqn=t.fqn,
            key=c.key,
        ) from None


def _read_chunks(
    reader: CheckpointReader,
    reads: list[tuple[TensorEntry, ChunkRead, ArrayAdapter]],
    staging: Staging,
    copies: CopyQueue | None,
    counter: ProgressCounter,
) -> None:
    """Chunks of host targets as one batch of the reader's (native code for the small
    chunk files of a local checkpoint); chunks of device targets one by one, each
    read into a staging buffer and moved in by ``copies`` while the next is read."""
    host = [r for r in reads if r[2].backend is None and r[0].codec is None]
    if host:
        _read_host_batch(reader, host, staging, counter)
    for t, c, dest in reads:
        if dest.backend is None and t.codec is not None:
            read_chunk_into(reader, t, c, dest, c.spec.offsets, staging, counter)
        elif dest.backend is not None:
            assert copies is not None, "device targets need the run's copy queue"
            upload_chunk(reader, t, c, dest, c.spec.offsets, staging, copies, counter)


def _read_host_batch(
    reader: CheckpointReader,
    reads: list[tuple[TensorEntry, ChunkRead, ArrayAdapter]],
    staging: Staging,
    counter: ProgressCounter,
) -> None:
    """Read and verify chunks into their boxes of host arrays with one
    :meth:`~gpuckpt.storage.base.CheckpointReader.read_chunks`: straight into the box
    where the layout allows, else into scratch copied into place afterwards. Raises
    what :func:`fetch_verified` raises, for the first chunk that fails."""
    # a chunk that is the whole of a host array is read into the array itself, with no
    # box to stage (the common case of small tensors: one chunk each)
    incoming: list[StagedIn | None] = []
    boxes: list[np.ndarray] = []
    for t, c, dest in reads:
        if isinstance(dest, HostArray) and c.spec.sizes == t.shape:
            incoming.append(None)
            boxes.append(dest.array)
        else:
            into = dest.stage_in(c.spec.offsets, c.spec.sizes, staging)
            incoming.append(into)
            boxes.append(into.box)
    try:
        buffers: list[np.ndarray] = []
        pads: list[int] = []
        copies: list[tuple[int, np.ndarray]] = []
        for i, ((t, c, _dest), box) in enumerate(zip(reads, boxes, strict=True)):
            sizes = c.spec.sizes
            if (
                box.flags.c_contiguous
                and box.dtype.byteorder != ">"
                and (sizes == c.stored or is_prefix_box(sizes, c.stored))
            ):
                data = box.reshape(-1).view(np.uint8)
                buffers.append(data)
                pads.append(c.nbytes - CRC_BYTES - data.nbytes)
            else:
                stored = scratch(c.stored, t.dtype.newbyteorder("<"), t)
                buffers.append(stored.reshape(-1).view(np.uint8))
                pads.append(0)
                copies.append((i, stored))
        batch = ChunkReads(
            [t.name for t, _, _ in reads],
            [c.key for _, c, _ in reads],
            buffers,
            pads,
            [c.crc for _, c, _ in reads],
            checked=True,  # the files of checked tensors (check_chunk_files)
        )
        stop = reader.read_chunks(batch)
        done = len(reads) if stop is None else stop.index
        for i, stored in copies:
            if i < done:
                c = reads[i][1]
                boxes[i][...] = stored[tuple(slice(0, s) for s in c.spec.sizes)]
        for (t, c, _dest), staged in zip(reads[:done], incoming, strict=False):
            if staged is not None:
                staged.finish()
            counter.add(c.spec.nelem * t.dtype.itemsize)
    finally:
        for staged in incoming:
            if staged is not None:
                staged.release()
    if stop is not None:
        t, c, _ = reads[stop.index]
        _raise_stop(t, c, stop)


def _raise_stop(t: TensorEntry, c: ChunkRead, stop: ReadStop) -> None:
    """Raise the error of a batch that stopped at chunk ``c`` of ``t``."""
    if stop.error is not None:
        if isinstance(stop.error, FileNotFoundError):
            raise vanished(t, c, stop.error) from None
        raise stop.error
    if stop.got != c.nbytes:
        raise CheckpointCorruptedError(
            f"chunk {c.key} of tensor {t.fqn!r}: read {stop.got} bytes, expected {c.nbytes}; "
            "the file is truncated"
        )
    _check_crc(t, c, stop.crc, stop.stored)


def _whole_buffer(t: TensorEntry, dest: ArrayAdapter) -> np.ndarray | None:
    """The memory of host array ``dest`` when the one chunk of ``t`` (stored whole) can be
    read straight into it, else None: the array itself where NumPy exports its buffer (its
    own dtypes), its bytes otherwise (bfloat16 and other extension dtypes export none)."""
    if not (t.whole and t.codec is None and isinstance(dest, HostArray)):
        return None
    a = dest.array
    if not a.flags.c_contiguous or a.dtype.byteorder == ">":
        return None
    return a if a.dtype.isbuiltin == 1 else a.reshape(-1).view(np.uint8)


def _whole_jobs(
    reader: CheckpointReader, items: list[tuple[TensorEntry, np.ndarray]]
) -> list[Callable[[ProgressCounter], None]]:
    """Jobs that read the chunks of tensors stored whole straight into their host arrays: one
    batch of them all, which the reader prepares once (:meth:`CheckpointReader.chunk_read_jobs`),
    read in ranges of :func:`~gpuckpt.runtime.runner.batches`' size; no per-chunk records are made
    (names, keys, sizes and checksums are the tensors'). Each job is given the load's counter."""
    if not items:
        return []
    # the small tensors first, in their order, in batches of their own, then the large ones, a
    # job each (the reader reads a range holding a large chunk file by file). In the state's
    # order a batch closed at its first large tensor, so where large and small ones alternate
    # (a GPT-like state: a matrix, then its bias and norms) each batch held a large one and a
    # few small ones, all read file by file: 289 tensors in 95 batches, none native.
    small = [item for item in items if item[0].nbytes < IO_BATCH_BYTES]
    items = small + [item for item in items if item[0].nbytes >= IO_BATCH_BYTES]
    nsmall = len(small)
    batch = ChunkReads(
        [t.name for t, _ in items],
        [whole_chunk_key(len(t.shape)) for t, _ in items],
        [b for _, b in items],
        [0] * len(items),
        [int(t._crcs()[0]) for t, _ in items],
        checked=True,  # read_tensors reads the files of checked tensors (check_chunk_files)
    )
    spans = [(run[0], run[-1] + 1) for run in batches((i, items[i][0].nbytes) for i in range(nsmall))]
    spans += [(i, i + 1) for i in range(nsmall, len(items))]

    def run(read: Callable[[], ReadStop | None], start: int, end: int, counter: ProgressCounter) -> None:
        stop = read()
        counter.add(sum(t.nbytes for t, _ in items[start : end if stop is None else stop.index]))
        if stop is not None:
            t = items[stop.index][0]
            _raise_stop(t, t.chunks[0], stop)

    reads = reader.chunk_read_jobs(batch, spans)
    return [functools.partial(run, read, a, b) for read, (a, b) in zip(reads, spans, strict=True)]


#: a load of at least this many chunks averaging at most :data:`SMALL_CHUNK_BYTES` is "many small"
MANY_CHUNKS = 512
SMALL_CHUNK_BYTES = 1 << 20
#: I/O threads of a load of many small chunks that are not in the page cache: each thread
#: waits for one file at a time, so more of them keep more reads queued at the device
COLD_SMALL_THREADS = 16
_PROBES = 8


def cold_small_threads(reader: CheckpointReader, targets: list[tuple[TensorEntry, Any]]) -> int | None:
    """:data:`COLD_SMALL_THREADS` for a load of many small chunks of which a sample (a few
    spread over the load) is not in the page cache, else None (the default thread count).

    Measured here: 10,000 chunks of 4-64 KiB, cold, load in 0.54 s on 16 threads against
    0.75 s on 4; warm, 16 threads are slower (0.25 against 0.23 s), hence the probe.
    """
    n = sum(t.nchunks for t, _ in targets)
    if n < MANY_CHUNKS or sum(_file_bytes(t) for t, _ in targets) > SMALL_CHUNK_BYTES * n:
        return None
    step = n // _PROBES
    wanted = iter(range(step // 2, n, step)[:_PROBES])  # ascending
    i = next(wanted)
    at = 0  # the position of t's first chunk among all
    for t, _ in targets:
        end = at + t.nchunks
        while i < end:
            key = whole_chunk_key(len(t.shape)) if t.whole else t.chunks[i - at].key
            if reader.chunk_cached(t.name, key) is False:
                return max(COLD_SMALL_THREADS, default_threads())
            i = next(wanted, n)
        if i >= n:
            break
        at = end
    return None


def _file_bytes(t: TensorEntry) -> int:
    """The bytes of the chunk files of ``t`` (of a tensor stored whole: without its chunk record)."""
    if t.whole and t.codec is None:
        return t.nbytes + CRC_BYTES
    return sum(c.nbytes for c in t.chunks)


def run_reads(jobs: list[Any], copies: CopyQueue | None, *, threads: int | None, name: str) -> None:
    """Run a load's read jobs, then retire the device copies they queued on ``copies``; if a
    job fails, close the queue before raising, so that no copy still writes into the targets."""
    try:
        run_all(jobs, threads=threads, name=name)
    except BaseException:
        if copies is not None:
            with contextlib.suppress(Exception):
                copies.close()
        raise
    if copies is not None:
        copies.close()


def read_tensors(
    reader: CheckpointReader,
    targets: list[tuple[TensorEntry, ArrayAdapter]],
    options: LoadOptions,
) -> None:
    """Fill each target array (an adapter of any kind of memory) with its tensor's chunks, in parallel.

    Of ``options``, ``threads``, ``progress`` and ``staging_bytes`` (the
    staging budget of device targets) apply. Chunks go to the I/O threads in
    batches (small ones together). Host targets are read straight into their
    memory where the layout allows.
    Device targets go through a bounded pool of (page-locked) staging buffers:
    I/O threads read and verify chunks into buffers and queue their copies to
    the device on the back end's own stream without waiting for them
    (:class:`~gpuckpt.device.upload.CopyQueue`), so reads of the next chunks
    overlap the copies of earlier ones. When this returns or raises, no copy
    is in flight any more and every buffer is back in its pool.
    """
    prepare_reads(reader, targets, options)()


def prepare_reads(
    reader: CheckpointReader,
    targets: list[tuple[TensorEntry, ArrayAdapter]],
    options: LoadOptions,
) -> Callable[..., None]:
    """:func:`read_tensors` in two steps: what can be made before the load's chunk files are
    checked is made now (the batch of tensors stored whole that go straight into host
    arrays: no file is opened, nothing allocated, nothing reported to ``progress``); the
    call returned does the rest and reads (once), reporting to its own progress counter or to the
    one it is given (a load that also reads boxes reports both to one counter)."""
    # tensors stored whole, read into host arrays: batches of (tensor, bytes), no chunk records
    whole: list[tuple[TensorEntry, np.ndarray]] = []
    rest: list[tuple[TensorEntry, ArrayAdapter]] = []
    for t, dest in targets:
        buf = _whole_buffer(t, dest) if reader.capabilities.batches_chunks else None
        if buf is None:
            rest.append((t, dest))
        else:
            whole.append((t, buf))
    whole_jobs = _whole_jobs(reader, whole)

    def run(counter: ProgressCounter | None = None) -> None:
        threads, staging_bytes = options.threads, options.staging_bytes
        if threads is None:
            threads = cold_small_threads(reader, targets)
        if counter is None:
            counter = ProgressCounter(options.progress, sum(t.nbytes for t, _ in targets))
        staging = Staging(
            # host targets need no staging: only the boxes of device targets are listed
            (
                (dest.backend, c.spec.nelem * t.dtype.itemsize)
                for t, dest in rest
                if dest.backend is not None
                for c in t.chunks
            ),
            staging_bytes,
        )
        reads = (((t, c, dest), c.nbytes) for t, dest in rest for c in t.chunks)
        copies = CopyQueue() if staging.backends else None
        jobs = [
            *(functools.partial(job, counter) for job in whole_jobs),
            *(
                functools.partial(_read_chunks, reader, batch, staging, copies, counter)
                for batch in batches(
                    reads, max_items=IO_BATCH_JOBS if reader.capabilities.batches_chunks else 1
                )
            ),
        ]
        run_reads(jobs, copies, threads=threads, name="gpuckpt-read")
        for t, dest in targets:
            if t.dtype == np.bool_:
                canonicalize_loaded_bools(dest)

    return run
