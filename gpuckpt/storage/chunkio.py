"""Bytes of one chunk: the Zarr v3 ``bytes`` + ``crc32c`` codec chain, done by hand.

A stored chunk is the chunk's elements in C order, little-endian, padded to
the grid's chunk shape on regular grids, followed by the CRC32C of all those
bytes as 4 little-endian bytes. zarr-python and TensorStore decode exactly
this; doing it here avoids their per-chunk overhead and lets a read land
straight in the destination array.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import crc32c as _crc32c
import numpy as np

__all__ = [
    "CRC_BYTES",
    "crc32c",
    "is_prefix_box",
    "padded_chunk",
    "read_exact",
    "stored_nbytes",
    "write_all",
]

CRC_BYTES = 4


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of ``data`` (any buffer), continuing from ``value``.

    The GIL is released for buffers of 64 KiB and more, so that I/O threads
    checksum in parallel.
    """
    return int(_crc32c.crc32c(data, value, gil_release_mode=1 if memoryview(data).nbytes >= 65536 else 0))


def is_prefix_box(sizes: Sequence[int], stored: Sequence[int]) -> bool:
    """True when a ``sizes`` box at the origin of a C-ordered ``stored`` block is a byte prefix of it.

    That holds when every axis after the first non-trivial stored axis is whole;
    then padding is a zero tail and the data can be written or read as one run.
    """
    k = next((i for i, s in enumerate(stored) if s > 1), len(stored))
    return all(sizes[j] == stored[j] for j in range(k + 1, len(stored)))


def padded_chunk(box: np.ndarray, stored: Sequence[int]) -> np.ndarray:
    """A C-contiguous array of shape ``stored`` with ``box`` at its origin, zeros elsewhere."""
    out = np.zeros(tuple(stored), dtype=box.dtype)
    out[tuple(slice(0, s) for s in box.shape)] = box
    return out


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


def stored_nbytes(stored: Sequence[int], itemsize: int) -> int:
    """Size in bytes of a stored chunk file, checksum included."""
    return math.prod(stored) * itemsize + CRC_BYTES
