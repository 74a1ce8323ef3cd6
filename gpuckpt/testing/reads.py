"""Counting the bytes of chunk files a process reads, whatever store it reads them from.

:func:`count_chunk_reads` wraps the chunk reads of every
:class:`~gpuckpt.storage.base.CheckpointReader` class (whole chunks, batches,
ranges, checksum-only reads) for the duration of a block and adds up the bytes
each one read (its checksum trailer included): what a load took from the store,
for tests and benchmarks that check a load reads each byte once. A read made
inside another counted read (a batch read chunk by chunk) counts once.

Examples
--------
>>> with count_chunk_reads() as counted:  # doctest: +SKIP
...     gpuckpt.load(state, path)
>>> counted.nbytes  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.storage.base import CheckpointReader, ChunkReads, ReadStop

__all__ = ["ReadCount", "count_chunk_reads"]


class ReadCount:
    """Bytes of chunk files read (``nbytes``) and the reads that read them (``reads``)."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.reads = 0
        self._lock = threading.Lock()
        self._inside = threading.local()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.nbytes += nbytes
            self.reads += 1

    @contextlib.contextmanager
    def outermost(self) -> Iterator[bool]:
        depth = getattr(self._inside, "depth", 0)
        self._inside.depth = depth + 1
        try:
            yield depth == 0
        finally:
            self._inside.depth = depth


def _batch_bytes(batch: ChunkReads, stop: ReadStop | None) -> int:
    end = len(batch.buffers) if stop is None else stop.index
    pairs = zip(batch.buffers[:end], batch.pads[:end], strict=True)
    return sum(memoryview(b).nbytes + p + CRC_BYTES for b, p in pairs)


def _wrap(count: ReadCount, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        with count.outermost() as outer:
            result = fn(self, *args, **kwargs)
            if not outer:
                return result
            if name == "read_chunks":
                count.add(_batch_bytes(args[0], result))
            elif name == "chunk_read_jobs":
                batch, spans = args[0], args[1]
                return [_wrap_job(count, batch, span, job) for span, job in zip(spans, result, strict=True)]
            elif name == "read_chunk_into":
                count.add(int(result))
            else:  # read_chunk_crc, read_range_crcs, read_chunk_checksum: bytes read come first
                count.add(int(result[0]))
            return result

    return counted


def _wrap_job(
    count: ReadCount, batch: ChunkReads, span: tuple[int, int], job: Callable[[], ReadStop | None]
) -> Callable[[], ReadStop | None]:
    def run() -> ReadStop | None:
        with count.outermost():
            stop = job()
        start, end = span
        sub = batch.select(range(start, end))
        count.add(_batch_bytes(sub, None if stop is None else ReadStop(stop.index - start)))
        return stop

    return run


_METHODS = (
    "read_chunk_into",
    "read_chunk_crc",
    "read_chunks",
    "chunk_read_jobs",
    "read_range_crcs",
    "read_chunk_checksum",
)


def _classes() -> list[type]:
    seen: list[type] = []
    todo: list[type] = [CheckpointReader]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


@contextlib.contextmanager
def count_chunk_reads() -> Iterator[ReadCount]:
    """Count the chunk bytes every checkpoint reader of this process reads inside the block."""
    import gpuckpt.storage.stores  # noqa: F401 - every back end's reader class is defined

    count = ReadCount()
    saved: list[tuple[type, str, Any]] = []
    for cls in _classes():
        for name in _METHODS:
            if name in cls.__dict__:
                saved.append((cls, name, cls.__dict__[name]))
                setattr(cls, name, _wrap(count, name, cls.__dict__[name]))
    try:
        yield count
    finally:
        for cls, name, fn in reversed(saved):
            setattr(cls, name, fn)
