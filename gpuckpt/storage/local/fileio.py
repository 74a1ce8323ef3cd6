"""Every byte of a buffer to or from a file descriptor: the loops around ``os.write``,
``os.writev``, ``os.readv`` and ``os.preadv``, which may move fewer bytes than asked.

The local back end (:mod:`gpuckpt.storage.local.writer`, :mod:`gpuckpt.storage.local.direct`)
writes and reads chunk files through these.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuckpt.format.checksum import crc32c

__all__ = [
    "buffer_address",
    "read_crcs_at",
    "read_exact",
    "read_exact_at",
    "readv_exact",
    "write_all",
    "writev_all",
]


def write_all(fd: int, data: Any) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may write less than asked)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def read_exact(fd: int, dest: Any) -> int:
    """Fill the writable buffer ``dest`` from ``fd``; returns the number of bytes read (short at EOF)."""
    view = memoryview(dest).cast("B")
    total = 0
    while total < view.nbytes:
        n = os.readv(fd, [view[total:]])
        if n == 0:
            break
        total += n
    return total


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a contiguous buffer (0 when it is empty)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def read_exact_at(fd: int, dest: Any, offset: int) -> int:
    """Fill ``dest`` from ``fd`` at ``offset`` (the file position is not used); returns bytes read."""
    view = memoryview(dest).cast("B")
    total = 0
    while total < view.nbytes:
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes."""
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views = views[1:]
    if views and n:
        views = [views[0][n:], *views[1:]]
    return views


def writev_all(fd: int, buffers: Sequence[Any]) -> None:
    """Write every byte of ``buffers``, in order, with as few system calls as possible."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    while views:
        views = _advance(views, os.writev(fd, views))


def readv_exact(fd: int, buffers: Sequence[Any]) -> int:
    """Fill ``buffers`` in order from ``fd``; returns the number of bytes read (short at EOF)."""
    views = [memoryview(b).cast("B") for b in buffers]
    total = 0
    views = [v for v in views if v.nbytes]
    while views:
        n = os.readv(fd, views)
        if n == 0:
            break
        total += n
        views = _advance(views, n)
    return total


def read_crcs_at(fd: int, offset: int, dests: Sequence[Any]) -> tuple[int, list[int]]:
    """Fill ``dests`` in order from ``fd`` at ``offset`` on; ``(bytes read, CRC32C of each buffer)``
    (each checksummed right after it is read, while it is in the CPU cache)."""
    total, crcs = 0, []
    for d in dests:
        n = read_exact_at(fd, d, offset + total)
        total += n
        crcs.append(crc32c(memoryview(d).cast("B")[:n]))
        if n < memoryview(d).nbytes:
            break
    return total, crcs + [0] * (len(dests) - len(crcs))
