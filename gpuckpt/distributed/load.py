"""Resharding loads: fill any requested boxes from any saved chunking.

For each requested box (a :class:`~gpuckpt.device.sharded.ShardedArray`
target), the chunks of the stored grid that overlap it are found by
bisection on the grid's edges; each such chunk is read once per process,
verified against its CRC32C, and the overlapping part of it is copied into
every target box that needs it; where the checkpoint recorded the CRC32C of
each segment of a large chunk and the store reads ranges (``s3://``, local), only
the segments holding the rows the boxes need are read, each one checked
(:mod:`gpuckpt.loading.ranged`); a chunk that lies whole inside the one box that
needs it is read straight into that box, and small chunks are read in
batches, as by an unsharded load. Chunks that overlap no requested box are
never read.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, canonicalize_loaded_bools
from gpuckpt.device.backend import Staging
from gpuckpt.device.upload import CopyQueue
from gpuckpt.loading.checks import ChunkRead, TensorEntry
from gpuckpt.loading.chunk_reads import read_chunk_into, run_reads, stored_chunk, upload_chunk
from gpuckpt.loading.ranged import fetch_rows
from gpuckpt.options import LoadOptions
from gpuckpt.planning.boxes import Box, intersect, overlapping_chunks
from gpuckpt.progress import ProgressCounter
from gpuckpt.runtime.runner import IO_BATCH_JOBS, batches
from gpuckpt.storage.base import CheckpointReader

__all__ = ["BoxRead", "box_bytes", "canonicalize_bool_boxes", "read_boxes", "run_box_reads"]

#: one stored chunk of a resharding load and the ``(adapter, box)`` targets it fills
BoxRead = tuple[TensorEntry, ChunkRead, list[tuple[ArrayAdapter, Box]]]


def _slices(outer: tuple[int, ...], inner: Box) -> tuple[slice, ...]:
    return tuple(slice(o - base, o - base + s) for o, s, base in zip(inner[0], inner[1], outer, strict=True))


def _read_one(
    reader: CheckpointReader,
    t: TensorEntry,
    c: ChunkRead,
    targets: list[tuple[ArrayAdapter, Box]],
    staging: Staging,
    copies: CopyQueue | None,
    counter: ProgressCounter,
) -> None:
    chunk_box: Box = (c.spec.offsets, c.spec.sizes)
    if len(targets) == 1 and intersect(chunk_box, targets[0][1]) == chunk_box:
        # the whole chunk goes to one box: read in place, as an unsharded load does
        adapter, box = targets[0]
        at = tuple(o - b for o, b in zip(c.spec.offsets, box[0], strict=True))
        if copies is not None and adapter.backend is not None:
            upload_chunk(reader, t, c, adapter, at, staging, copies, counter)
        else:
            read_chunk_into(reader, t, c, adapter, at, staging, counter)
        return
    inters = [(adapter, box, inter) for adapter, box in targets if (inter := intersect(chunk_box, box))]
    # the rows any box needs: only the segments holding them are read where the checkpoint
    # recorded segment checksums and the store reads ranges
    stored, origin = None, c.spec.offsets
    if c.stored and inters:
        start = min(inter[0][0] for _, _, inter in inters) - origin[0]
        stored = fetch_rows(reader, t, c, start, max(i[0][0] + i[1][0] for _, _, i in inters) - origin[0])
    if stored is None:
        stored = stored_chunk(reader, t, c)  # decompressed where the tensor is compressed
    else:
        origin = (origin[0] + start, *origin[1:])
    for adapter, box, inter in inters:
        part = stored[_slices(origin, inter)]
        local_offsets = tuple(o - b for o, b in zip(inter[0], box[0], strict=True))
        incoming = adapter.stage_in(local_offsets, inter[1], staging)
        if copies is not None and adapter.backend is not None:
            # device memory: the copy is queued, this thread goes on reading
            try:
                incoming.box[...] = part
            except BaseException:
                incoming.release()
                raise
            copies.put(incoming)
        else:
            try:
                incoming.box[...] = part
                incoming.finish()
            finally:
                incoming.release()
        counter.add(part.nbytes)


def _read_batch(
    reader: CheckpointReader,
    reads: list[BoxRead],
    staging: Staging,
    copies: CopyQueue | None,
    counter: ProgressCounter,
) -> None:
    for t, c, targets in reads:
        _read_one(reader, t, c, targets, staging, copies, counter)


def box_bytes(requests: list[tuple[TensorEntry, list[tuple[ArrayAdapter, Box]]]]) -> int:
    """Bytes that :func:`read_boxes` fills for ``requests`` (what its progress counts)."""
    return sum(math.prod(b[1]) * t.dtype.itemsize for t, boxes in requests for _, b in boxes)


def read_boxes(
    reader: CheckpointReader,
    requests: list[tuple[TensorEntry, list[tuple[ArrayAdapter, Box]]]],
    options: LoadOptions,
    counter: ProgressCounter | None = None,
) -> None:
    """Fill every ``(adapter, box)`` of ``requests`` from the stored chunks that overlap it.

    ``box`` is the adapter's place in the tensor (offsets, sizes); each stored
    chunk that overlaps any requested box is read and verified once, by one
    job, and its overlap with each box is staged into that box's adapter. Of
    ``options``, ``threads``, ``progress`` and ``staging_bytes`` apply; ``counter``, where
    given, takes the progress instead (its total counts :func:`box_bytes`).
    """
    if counter is None:
        counter = ProgressCounter(options.progress, box_bytes(requests))
    reads: list[BoxRead] = []
    for t, boxes in requests:
        wanted: dict[tuple[int, ...], list[tuple[ArrayAdapter, Box]]] = {}
        for adapter, box in boxes:
            for coords in overlapping_chunks(t.grid, box):
                wanted.setdefault(coords, []).append((adapter, box))
        reads.extend((t, t.chunk(coords), targets) for coords, targets in wanted.items())
    run_box_reads(reader, reads, options, counter)
    canonicalize_bool_boxes(requests)


def canonicalize_bool_boxes(
    requests: Sequence[tuple[TensorEntry, Sequence[tuple[ArrayAdapter, Box]]]],
) -> None:
    """Every bool box filled: 0 and 1 only (:func:`~gpuckpt.device.arrays.canonicalize_loaded_bools`)."""
    for t, boxes in requests:
        if t.dtype == np.bool_:
            for adapter, _ in boxes:
                canonicalize_loaded_bools(adapter)


def run_box_reads(
    reader: CheckpointReader, reads: list[BoxRead], options: LoadOptions, counter: ProgressCounter
) -> None:
    """Read each chunk of ``reads`` (once, verified) and fill its targets, on the load's I/O threads."""
    if not reads:
        return
    threads, staging_bytes = options.threads, options.staging_bytes
    # an overlap is at most the chunk's box
    staging = Staging(
        ((a.backend, c.spec.nelem * t.dtype.itemsize) for t, c, targets in reads for a, _ in targets),
        staging_bytes,
    )
    # small chunks go to the I/O threads in batches, as in an unsharded load
    copies = CopyQueue("gpuckpt-reshard-upload") if staging.backends else None
    per_job = IO_BATCH_JOBS if reader.capabilities.batches_chunks else 1  # an object store: one request each
    jobs = [
        functools.partial(_read_batch, reader, batch, staging, copies, counter)
        for batch in batches(((r, r[1].nbytes) for r in reads), max_items=per_job)
    ]
    run_reads(jobs, copies, threads=threads, name="gpuckpt-reshard")
