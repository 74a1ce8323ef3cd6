"""Bytes of one chunk: the Zarr v3 ``bytes`` + ``crc32c`` codec chain, done by hand.

A stored chunk is the chunk's elements in C order, little-endian, padded to
the grid's chunk shape on regular grids, followed by the CRC32C of all those
bytes as 4 little-endian bytes (:mod:`gpuckpt.format.checksum`). zarr-python
and TensorStore decode exactly this; doing it here avoids their per-chunk
overhead and lets a read land straight in the destination array.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from gpuckpt.format.checksum import CRC_BYTES

__all__ = ["chunk_bytes", "is_prefix_box", "padded_chunk", "stored_nbytes"]


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


def stored_nbytes(stored: Sequence[int], itemsize: int) -> int:
    """Size in bytes of a stored chunk file, checksum included."""
    return math.prod(stored) * itemsize + CRC_BYTES


def chunk_bytes(box: np.ndarray, stored: Sequence[int]) -> tuple[np.ndarray, int]:
    """The stored bytes of a chunk holding ``box`` at its origin, without the checksum:
    ``(C-contiguous little-endian bytes, zero bytes that follow them)``.

    When ``box`` is a byte prefix of the stored block (:func:`is_prefix_box`) its own
    memory is used where it is already C-contiguous and little-endian, and the rest
    of the block is the zero tail; otherwise the block is assembled with its padding.
    """
    if box.dtype.byteorder == ">":
        box = box.astype(box.dtype.newbyteorder("<"))
    if is_prefix_box(box.shape, stored):
        data = np.ascontiguousarray(box).reshape(-1).view(np.uint8)
        return data, (math.prod(stored) - box.size) * box.dtype.itemsize
    return padded_chunk(box, stored).reshape(-1).view(np.uint8), 0
