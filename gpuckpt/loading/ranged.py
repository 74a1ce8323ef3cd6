"""Reads of part of a chunk: only the segments that hold the rows a load needs, each one checked.

A resharding load (:mod:`gpuckpt.distributed.load`) that needs some rows of a
stored chunk (C order: rows along the first axis are contiguous bytes) reads
them with one ranged read of the segments that hold them, when the
checkpoint recorded the CRC32C of each segment of the chunk
(:mod:`gpuckpt.format.segments`), the store reads ranges
(:attr:`~gpuckpt.storage.base.Capabilities.reads_ranges`), and the
segments are fewer than the chunk's. Every fetched segment is checked
against its record before any of its bytes is used; the records themselves
are used only when they combine to the chunk's recorded CRC32C. A compressed
chunk (:mod:`gpuckpt.format.codecs`) has no segment records and is always read
whole. Otherwise
(:func:`fetch_rows` returns None) the caller reads the whole chunk and checks
it as before.
"""

from __future__ import annotations

import math

import numpy as np

from gpuckpt.errors import CheckpointCorruptedError, ChecksumError
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.segments import Segments
from gpuckpt.loading.checks import ChunkRead, TensorEntry
from gpuckpt.loading.chunk_reads import scratch, vanished
from gpuckpt.storage.base import CheckpointReader

__all__ = ["fetch_rows", "segments_of"]


def segments_of(t: TensorEntry) -> Segments | None:
    """The validated segment records of ``t``'s chunks, or None (parsed once, kept on ``t``)."""
    raw = t.segments
    if raw is None or isinstance(raw, Segments):
        return raw
    parsed = None
    if t.grid.kind == "regular" and t.nchunks:
        stored = math.prod(t.grid.chunk_shape) * t.dtype.itemsize  # every chunk's (edges padded)
        parsed = Segments.parse(raw, t.nchunks, stored, t.dtype.itemsize)
    t.segments = parsed
    return parsed


def _flat(coords: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for c, g in zip(coords, shape, strict=True):
        flat = flat * g + c
    return flat


def fetch_rows(
    reader: CheckpointReader, t: TensorEntry, c: ChunkRead, start: int, stop: int
) -> np.ndarray | None:
    """Rows ``[start, stop)`` (of the stored chunk's first axis) of chunk ``c``, read by one ranged
    read of the segments that hold them, each checked against its CRC32C record; None when
    that is not possible or would not read fewer bytes than the whole chunk (then read it whole).

    Raises :class:`~gpuckpt.errors.ChecksumError` when a fetched segment does not match its
    record, :class:`~gpuckpt.errors.CheckpointCorruptedError` when the object is shorter,
    :class:`~gpuckpt.errors.MissingChunkError` when it disappeared.
    """
    if not reader.capabilities.reads_ranges or not c.stored or not 0 <= start < stop <= c.stored[0]:
        return None
    if t.codec is not None:
        return None  # a compressed chunk is read whole: its rows are not byte ranges of the file
    seg = segments_of(t)
    if seg is None or seg.data_nbytes != c.nbytes - CRC_BYTES:
        return None
    row_bytes = math.prod(c.stored[1:]) * t.dtype.itemsize
    first, end = seg.span(start * row_bytes, stop * row_bytes)
    if end - first >= seg.data_nbytes:
        return None  # every segment: no saving
    crcs = seg.of_chunk(_flat(c.spec.coords, t.grid.grid_shape), c.crc)
    if crcs is None:
        return None  # records that do not add up to the chunk's checksum vouch for nothing
    size = seg.segment_bytes
    buf = scratch((end - first,), np.dtype(np.uint8), t)
    views = [buf[i : i + size] for i in range(0, end - first, size)]
    try:
        got, values = reader.read_range_crcs(t.name, c.key, first, views)
    except FileNotFoundError as exc:
        raise vanished(t, c, exc) from None
    if got != end - first:
        raise CheckpointCorruptedError(
            f"chunk {c.key} of tensor {t.fqn!r}: read {got} bytes from byte {first}, expected "
            f"{end - first}; the object is truncated, the checkpoint is damaged"
        )
    k0 = first // size
    for k, (value, expected) in enumerate(zip(values, crcs[k0 : k0 + len(views)].tolist(), strict=True)):
        if value != expected:
            at = (k0 + k) * size
            raise ChecksumError(
                f"chunk {c.key} of tensor {t.fqn!r} failed its CRC32C check in segment {k0 + k} (bytes "
                f"{at} to {at + views[k].nbytes}: computed {value:#010x}, recorded {expected:#010x}); "
                "the checkpoint is damaged, or was replaced by a concurrent save while loading (then "
                "load again): restore it from a copy or load an earlier checkpoint (arrays loaded in "
                "place may be partly overwritten)",
                fqn=t.fqn,
                key=c.key,
                computed=value,
                expected=expected,  # the segment's record; a segment has no trailer of its own
            )
    at = start * row_bytes - first
    rows = buf[at : at + (stop - start) * row_bytes].view(t.dtype.newbyteorder("<"))
    return rows.reshape((stop - start, *c.stored[1:]))
