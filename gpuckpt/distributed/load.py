"""Resharding loads: fill any requested boxes from any saved chunking.

For each requested box (a :class:`~gpuckpt.distributed.sharded.ShardedArray`
target), the chunks of the stored grid that overlap it are found by
bisection on the grid's edges; each such chunk is read once per process,
verified against its CRC32C (which covers the whole chunk: a verified read
cannot be narrower), and the overlapping part of it is copied into every
target box that needs it. Chunks that overlap no requested box are never
read.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gpuckpt.device.backend import DeviceArray
from gpuckpt.distributed.planner import Box, intersect, overlapping_chunks
from gpuckpt.progress import ProgressCallback, ProgressCounter
from gpuckpt.reading import ChunkRead, TensorEntry, fetch_verified, read_chunk_into_box
from gpuckpt.storage.base import CheckpointReader
from gpuckpt.writing import IO_BATCH_BYTES, IO_BATCH_JOBS, default_threads

__all__ = ["read_boxes"]


def _slices(outer: tuple[int, ...], inner: Box) -> tuple[slice, ...]:
    return tuple(slice(o - base, o - base + s) for o, s, base in zip(inner[0], inner[1], outer, strict=True))


def _read_one(
    reader: CheckpointReader,
    t: TensorEntry,
    c: ChunkRead,
    targets: list[tuple[Any, Box]],
    counter: ProgressCounter,
) -> None:
    chunk_box: Box = (c.spec.offsets, c.spec.sizes)
    if len(targets) == 1 and not isinstance(targets[0][0], DeviceArray):
        adapter, box = targets[0]
        if intersect(chunk_box, box) == chunk_box:
            # the whole chunk goes to one host box: read it in place (straight into
            # the box where its layout allows), as an unsharded load does
            host = adapter.host_array()
            dest = host[_slices(box[0], chunk_box)] if host.ndim else host[...]
            read_chunk_into_box(reader, t, c, dest, counter)
            return
    scratch = np.empty(c.stored, dtype=t.dtype.newbyteorder("<"))
    fetch_verified(reader, t, c, [scratch.reshape(-1).view(np.uint8)])
    for adapter, box in targets:
        inter = intersect(chunk_box, box)
        if inter is None:
            continue
        part = scratch[_slices(c.spec.offsets, inter)]
        if isinstance(adapter, DeviceArray):
            block = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
            local_offsets = tuple(o - b for o, b in zip(inter[0], box[0], strict=True))
            adapter.backend.stage_in(block, adapter.data, local_offsets, inter[1]).wait()
        else:
            adapter.host_array()[_slices(box[0], inter)] = part
        counter.add(part.nbytes)


def _read_batch(
    reader: CheckpointReader,
    batch: list[tuple[TensorEntry, ChunkRead, list[tuple[Any, Box]]]],
    counter: ProgressCounter,
) -> None:
    for t, c, targets in batch:
        _read_one(reader, t, c, targets, counter)


def read_boxes(
    reader: CheckpointReader,
    requests: list[tuple[TensorEntry, list[tuple[Any, Box]]]],
    *,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
) -> None:
    """Fill every ``(adapter, box)`` of ``requests`` from the stored chunks that overlap it."""
    total = sum(math.prod(b[1]) * t.dtype.itemsize for t, boxes in requests for _, b in boxes)
    counter = ProgressCounter(progress, total)
    jobs: list[tuple[TensorEntry, ChunkRead, list[tuple[Any, Box]]]] = []
    for t, boxes in requests:
        by_coords = {c.spec.coords: c for c in t.chunks}
        wanted: dict[tuple[int, ...], list[tuple[Any, Box]]] = {}
        for adapter, box in boxes:
            for coords in overlapping_chunks(t.grid, box):
                wanted.setdefault(coords, []).append((adapter, box))
        jobs.extend((t, by_coords[coords], targets) for coords, targets in wanted.items())
    # small chunks go to the I/O threads in batches, as in an unsharded load: one task per
    # chunk would cost more than reading a few KiB
    batches: list[list[tuple[TensorEntry, ChunkRead, list[tuple[Any, Box]]]]] = []
    size = IO_BATCH_BYTES
    for job in jobs:
        if size >= IO_BATCH_BYTES or len(batches[-1]) >= IO_BATCH_JOBS:
            batches.append([])
            size = 0
        batches[-1].append(job)
        size += job[1].nbytes
    if len(batches) <= 1:
        for t, c, targets in jobs:
            _read_one(reader, t, c, targets, counter)
        return
    with ThreadPoolExecutor(
        max_workers=threads or default_threads(), thread_name_prefix="gpuckpt-reshard"
    ) as pool:
        futures = [pool.submit(_read_batch, reader, batch, counter) for batch in batches]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
