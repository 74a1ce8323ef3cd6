"""Bytes of one chunk: the Zarr v3 ``bytes`` + ``crc32c`` codec chain, done by hand.

A stored chunk is the chunk's elements in C order, little-endian, padded to
the grid's chunk shape on regular grids, followed by the CRC32C of all those
bytes as 4 little-endian bytes. zarr-python and TensorStore decode exactly
this; doing it here avoids their per-chunk overhead and lets a read land
straight in the destination array.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import crc32c as _crc32c
import numpy as np

__all__ = [
    "CRC_BYTES",
    "buffer_address",
    "crc32c",
    "crc32c_backend",
    "is_prefix_box",
    "padded_chunk",
    "read_exact",
    "read_exact_at",
    "stored_nbytes",
    "write_all",
]

CRC_BYTES = 4


_CHECK_VECTOR = (b"123456789", 0xE3069283)  # the standard check value of CRC-32C (Castagnoli)
_AWS_PIECE = 1 << 30  # the AWS C library takes an int length


def _crc_package(data: Any, value: int = 0) -> int:
    # the crc32c package: SSE4.2 / ARMv8 CRC instructions; releases the GIL from 64 KiB on
    return int(_crc32c.crc32c(data, value, gil_release_mode=1 if memoryview(data).nbytes >= 65536 else 0))


def _aws_function() -> Callable[[Any, int], int] | None:
    """awscrt's CRC32C (carry-less multiply folding with AVX-512 where the CPU has it,
    about twice the crc32c package's speed there), if it is installed and agrees with
    the reference on a self-test; ``None`` otherwise."""
    try:
        from awscrt import checksums
    except ImportError:
        return None
    aws = checksums.crc32c

    def crc(data: Any, value: int = 0) -> int:
        view = memoryview(data)
        if not view.c_contiguous:
            raise ValueError("CRC32C needs a C-contiguous buffer")
        if view.nbytes <= _AWS_PIECE:
            return int(aws(view, value))
        flat = view.cast("B")
        for i in range(0, flat.nbytes, _AWS_PIECE):
            value = int(aws(flat[i : i + _AWS_PIECE], value))
        return value

    # lengths around the vector code's thresholds, continued from a non-zero value
    sample = bytes(range(256)) * 80 + b"tail"
    for n in (0, 1, 9, 255, 256, 257, 1000, 4096, len(sample)):
        for start in (0, 0x12345678):
            if crc(sample[:n], start) != _crc_package(sample[:n], start):
                return None
    return crc if crc(_CHECK_VECTOR[0]) == _CHECK_VECTOR[1] else None


@functools.cache
def _backend() -> tuple[str, Callable[[Any, int], int]]:
    choice = os.environ.get("GPUCKPT_CRC32C", "auto")
    if choice not in ("auto", "awscrt", "crc32c"):
        raise ValueError(f"GPUCKPT_CRC32C={choice!r}; expected 'auto', 'awscrt' or 'crc32c'")
    if choice != "crc32c":
        aws = _aws_function()
        if aws is not None:
            return "awscrt", aws
        if choice == "awscrt":
            raise ImportError(
                "GPUCKPT_CRC32C=awscrt but awscrt is not installed or failed its self-test: "
                "pip install 'awscrt>=0.23', or unset GPUCKPT_CRC32C"
            )
    return "crc32c", _crc_package


def crc32c_backend() -> str:
    """The CRC32C implementation in use: ``"awscrt"`` (fastest) or ``"crc32c"``.

    ``auto`` (the default) takes awscrt when it is installed and passes a
    self-test against the crc32c package; the environment variable
    ``GPUCKPT_CRC32C`` (``auto``, ``awscrt``, ``crc32c``) forces a choice.
    Both compute the same checksum: the choice changes speed only.
    """
    return _backend()[0]


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of ``data`` (any C-contiguous buffer), continuing from ``value``.

    The GIL is released for large buffers, so that I/O threads checksum in parallel.
    """
    return _backend()[1](data, value)


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


def stored_nbytes(stored: Sequence[int], itemsize: int) -> int:
    """Size in bytes of a stored chunk file, checksum included."""
    return math.prod(stored) * itemsize + CRC_BYTES
