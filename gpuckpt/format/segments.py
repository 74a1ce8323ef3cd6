"""CRC32C per segment of a large chunk: ranged reads that still check every byte they use.

A chunk's CRC32C (its Zarr ``crc32c`` trailer, and its record in the
metadata) covers the whole chunk, so a reader that needs a few rows of a
64 MiB chunk would have to fetch all of it to check any of it. A save
therefore also records the CRC32C of each *segment* of a large chunk: its
stored bytes (the trailer excluded) cut into pieces of ``segment_bytes``
(:data:`SEGMENT_BYTES`), the last one shorter. A reader fetches only the
segments that hold the bytes it needs (one ranged read), checks each one
against its record, and uses nothing it did not check.

Computed in the same pass as the chunk's CRC (:class:`SegmentDigest`): each
byte is checksummed once, into its segment's CRC, and the chunk's CRC is the
combination of the segments' (:func:`crc32c_combine`: the CRC32C of ``A + B``
from those of ``A`` and ``B`` and the length of ``B``). A reader combines the
recorded segment CRCs the same way and uses them only when they give the
chunk's recorded CRC32C (:meth:`Segments.of_chunk`), so segment records can
never vouch for bytes the chunk's own checksum would refuse.

Where they are stored: the tensor's ``storage_data`` entry (next to its
listed records or its chunk table rows) gets ::

    "segments": {"bytes": 1048576, "crc32c": "<base64>"}

``crc32c`` is the base64 of the little-endian ``uint32`` CRC32Cs of every
segment of every chunk, chunks in C order of their grid coordinates (the
order of the chunk records). A tensor has the entry only when each of its
chunks has at least two segments (:func:`segmented`) and every one was
recorded. The chunk bytes, the Zarr metadata and the format version are
unchanged: readers that do not know the entry ignore it, and a checkpoint
without it (older ones, incremental saves that hash their chunks) is read
whole chunk by whole chunk as before. An entry that is malformed, or whose
segments do not combine to the chunk's CRC32C, is not used (never an error:
the whole chunk is then read and checked as before).
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.format.checksum import crc32c

__all__ = [
    "SEGMENTS_KEY",
    "SEGMENT_BYTES",
    "ChunkCRC",
    "SegmentDigest",
    "Segments",
    "crc32c_combine",
    "nsegments",
    "segment_record",
    "segmented",
    "segments_entry",
]

#: segment size of new saves: the unit of a ranged read (1 MiB: a request's worth, 4 bytes of
#: record per MiB stored)
SEGMENT_BYTES = 1 << 20
#: the key of a tensor's ``storage_data`` entry that holds its segment records
SEGMENTS_KEY = "segments"
#: segment sizes a reader accepts (a power of two; any multiple of every element size)
_MIN_SEGMENT, _MAX_SEGMENT = 1 << 12, 1 << 32

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32C polynomial (reflected bit order: bit 31 is x^0)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


@functools.cache
def _x2n(k: int) -> int:
    """x^(2^k) modulo the polynomial."""
    return (1 << 30) if k == 0 else _multmodp(_x2n(k - 1), _x2n(k - 1))


@functools.lru_cache(maxsize=64)
def _x8n(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: shifting a CRC over ``nbytes`` zero bytes."""
    p, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_x2n(k), p)
        n >>= 1
        k += 1
    return p


@functools.lru_cache(maxsize=8)
def _shift_tables(nbytes: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Shifting a CRC over ``nbytes`` zero bytes as four tables, one per byte of the CRC:
    the shift is linear in the CRC, so it is the XOR of its bytes' shifts. Made from 32
    shifts of single bits; a segment's combination then costs four lookups."""
    x = _x8n(nbytes)
    tables = []
    for k in range(4):
        bits = [_multmodp(x, 1 << (8 * k + b)) for b in range(8)]
        t = [0] * 256
        for v in range(1, 256):
            low = v & -v
            t[v] = t[v ^ low] ^ bits[low.bit_length() - 1]
        tables.append(t)
    return tables[0], tables[1], tables[2], tables[3]


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32C of ``A + B`` from ``crc_a`` (of ``A``), ``crc_b`` (of ``B``) and ``len_b`` bytes."""
    if not len_b:
        return crc_a
    if len_b & (len_b - 1) == 0 and len_b >= _MIN_SEGMENT:  # a whole segment: by tables
        t0, t1, t2, t3 = _shift_tables(len_b)
        return t0[crc_a & 0xFF] ^ t1[(crc_a >> 8) & 0xFF] ^ t2[(crc_a >> 16) & 0xFF] ^ t3[crc_a >> 24] ^ crc_b
    return _multmodp(_x8n(len_b), crc_a) ^ crc_b


def nsegments(data_nbytes: int, segment_bytes: int) -> int:
    """Segments of a chunk of ``data_nbytes`` stored bytes (the trailer excluded)."""
    return -(-data_nbytes // segment_bytes)


def segmented(data_nbytes: int, segment_bytes: int = SEGMENT_BYTES) -> bool:
    """Whether a chunk of ``data_nbytes`` stored bytes gets segment records: two segments or more."""
    return data_nbytes >= 2 * segment_bytes


class ChunkCRC(int):
    """A chunk's CRC32C (an ``int``, as writers return it) with the CRC32Cs of its segments."""

    segments: tuple[int, ...]
    segment_bytes: int

    def __new__(cls, value: int, segments: Sequence[int], segment_bytes: int) -> ChunkCRC:
        obj = super().__new__(cls, value)
        obj.segments = tuple(segments)
        obj.segment_bytes = segment_bytes
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return ChunkCRC, (int(self), self.segments, self.segment_bytes)


class SegmentDigest:
    """Checksums a chunk's bytes fed in order (any piece sizes): each segment's CRC32C, and the
    chunk's as their combination, with every byte read once."""

    def __init__(self, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.segment_bytes = segment_bytes
        self._done: list[int] = []
        self._value = 0  # CRC32C of the finished segments
        self._current = 0  # CRC32C of the segment being fed
        self._filled = 0  # its bytes so far

    def update(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        while view.nbytes:
            n = min(view.nbytes, self.segment_bytes - self._filled)
            self._current = crc32c(view[:n], self._current)
            self._filled += n
            view = view[n:]
            if self._filled == self.segment_bytes:
                self._finish()

    def update_crc(self, crc: int, nbytes: int) -> None:
        """Take the next ``nbytes`` bytes by their CRC32C ``crc`` (within the current segment)."""
        if nbytes > self.segment_bytes - self._filled:
            raise ValueError(
                f"{nbytes} bytes by their CRC32C cross a segment boundary "
                f"({self._filled} of the segment's {self.segment_bytes} bytes are in)"
            )
        self._current = crc32c_combine(self._current, crc, nbytes) if self._filled else crc
        self._filled += nbytes
        if self._filled == self.segment_bytes:
            self._finish()

    def _finish(self) -> None:
        self._value = crc32c_combine(self._value, self._current, self._filled)
        self._done.append(self._current)
        self._current = self._filled = 0

    @property
    def value(self) -> int:
        """The CRC32C of every byte fed so far."""
        return crc32c_combine(self._value, self._current, self._filled)

    def trailer(self) -> bytes:
        """The chunk's CRC32C trailer (little-endian)."""
        return self.value.to_bytes(4, "little")

    def result(self) -> ChunkCRC:
        """The chunk's CRC32C with its segments' (the last one shorter when the size is not a multiple)."""
        segments = self._done + ([self._current] if self._filled else [])
        return ChunkCRC(self.value, segments, self.segment_bytes)


def segment_record(crc: int) -> tuple[int, tuple[int, ...]] | None:
    """``(segment bytes, segment CRC32Cs)`` of a chunk's CRC32C as a writer returned it, or None
    when it has none (a small chunk, or a writer that does not record them)."""
    segments = getattr(crc, "segments", None)
    return None if segments is None else (crc.segment_bytes, segments)  # type: ignore[attr-defined]


def segments_entry(records: Iterable[tuple[int, tuple[int, ...]] | None]) -> dict[str, Any] | None:
    """The ``storage_data`` entry of one tensor from its chunks' :func:`segment_record`, in chunk
    record order; None unless every chunk has one, of one segment size."""
    records = list(records)
    if not records or any(r is None for r in records) or len({r[0] for r in records if r}) != 1:
        return None
    flat = np.fromiter((c for r in records if r for c in r[1]), np.dtype("<u4"))
    size = records[0][0] if records[0] else 0
    return {"bytes": size, "crc32c": base64.b64encode(flat.tobytes()).decode("ascii")}


@dataclass(frozen=True, slots=True)
class Segments:
    """The segment records of one tensor (every chunk ``data_nbytes`` stored bytes), validated."""

    segment_bytes: int
    per_chunk: int
    crcs: np.ndarray  # uint32, nchunks * per_chunk
    data_nbytes: int

    @classmethod
    def parse(cls, raw: Any, nchunks: int, data_nbytes: int, itemsize: int) -> Segments | None:
        """The records of a ``storage_data`` entry (untrusted), or None when absent or not
        usable: then chunks are read whole, as without them."""
        if not isinstance(raw, dict) or nchunks < 1:
            return None
        size, text = raw.get("bytes"), raw.get("crc32c")
        if (
            type(size) is not int
            or not _MIN_SEGMENT <= size <= _MAX_SEGMENT
            or size & (size - 1)
            or size % itemsize
            or not isinstance(text, str)
            or not segmented(data_nbytes, size)
        ):
            return None
        per_chunk = nsegments(data_nbytes, size)
        if len(text) != 4 * -(-(4 * per_chunk * nchunks) // 3):
            return None  # not the length base64 of this many records has: nothing decoded
        try:
            blob = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            return None
        if len(blob) != 4 * per_chunk * nchunks:
            return None
        return cls(size, per_chunk, np.frombuffer(blob, np.dtype("<u4")), data_nbytes)

    def of_chunk(self, index: int, chunk_crc: int) -> np.ndarray | None:
        """The segment CRC32Cs of chunk ``index`` (C order), or None when they do not combine to
        ``chunk_crc`` (the chunk's recorded CRC32C): then they vouch for nothing."""
        crcs = self.crcs[index * self.per_chunk : (index + 1) * self.per_chunk]
        value, rest = 0, self.data_nbytes
        for c in crcs.tolist():
            n = min(self.segment_bytes, rest)
            value = crc32c_combine(value, c, n)
            rest -= n
        return crcs if value == chunk_crc else None

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The byte range ``[first, stop)`` of the segments that hold stored bytes ``[start, end)``."""
        first = start // self.segment_bytes * self.segment_bytes
        stop = min(-(-end // self.segment_bytes) * self.segment_bytes, self.data_nbytes)
        return first, stop
