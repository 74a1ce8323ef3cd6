"""Staging memory: buffers allocated once and reused across saves and loads.

A :class:`StagingArena` is one reusable region, made of pieces of bounded
size (a single huge pinned allocation fails, and pinned allocation is slow,
so pieces are allocated once and kept). An arena hands out aligned byte
ranges until it is reset. :class:`ArenaPool` keeps arenas between saves so
that a steady training loop allocates nothing after its first save, and
bounds how many exist at once: a caller that needs one while all are busy
waits (back-pressure) instead of allocating more.

What memory backs the pieces is chosen by passing an allocator (host NumPy
memory here; page-locked memory in the GPU adapter).
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ArenaPool", "HostAllocator", "StagingArena"]

_ALIGN = 4096
DEFAULT_PIECE_BYTES = 256 << 20


class HostAllocator:
    """Ordinary (pageable) host memory, mapped directly from the system.

    Not ``np.empty``: NumPy asks for transparent huge pages on large
    allocations, and the partly used 2 MiB page at the end of each piece would
    then be resident in full (about 2 MiB per piece beyond the data staged in
    it). Anonymous mappings use huge pages only where the system enables them
    for all memory; copies into them measured as fast.
    """

    pinned = False

    def __call__(self, nbytes: int) -> np.ndarray:
        if nbytes <= 0:
            return np.empty(0, np.uint8)
        # the array keeps the mapping alive; it is unmapped when both are gone
        return np.frombuffer(mmap.mmap(-1, nbytes), np.uint8, nbytes)


class StagingArena:
    """A reusable set of pieces from which byte ranges are carved in order."""

    def __init__(self, allocator: Callable[[int], Any], piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
        self.allocator = allocator
        self.piece_bytes = piece_bytes
        self.pieces: list[np.ndarray] = []
        self._piece = 0
        self._offset = 0

    @property
    def capacity(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def reset(self) -> None:
        self._piece = 0
        self._offset = 0

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of staging memory (uint8), aligned to 4 KiB; grows the arena if needed."""
        need = max(nbytes, 1)
        while self._piece < len(self.pieces):
            piece = self.pieces[self._piece]
            base = piece.ctypes.data
            start = -(-(base + self._offset) // _ALIGN) * _ALIGN - base
            if start + need <= piece.nbytes:
                self._offset = start + need
                return piece[start : start + nbytes]
            self._piece += 1
            self._offset = 0
        piece = np.asarray(self.allocator(max(need, self.piece_bytes) + _ALIGN)).view(np.uint8).reshape(-1)
        self.pieces.append(piece)
        self._piece = len(self.pieces) - 1
        self._offset = 0
        return self.take(nbytes)

    def take_array(self, shape: tuple[int, ...], dtype: Any, order: tuple[int, ...]) -> np.ndarray:
        """An array of logical ``shape`` whose memory follows the axis ``order`` (outermost first)."""
        dt = np.dtype(dtype)
        physical = tuple(shape[a] for a in order)
        raw = self.take(math.prod(physical) * dt.itemsize)
        arr: np.ndarray = raw.view(dt).reshape(physical)
        return arr.transpose([order.index(a) for a in range(len(shape))])


class ArenaPool:
    """At most ``max_arenas`` arenas; :meth:`acquire` waits while all are in use."""

    def __init__(self, allocator: Callable[[int], Any] | None = None, *, max_arenas: int = 2) -> None:
        self.allocator = allocator or HostAllocator()
        self.max_arenas = max_arenas
        self._free: list[StagingArena] = []
        self._arenas: list[StagingArena] = []  # every arena of the pool, free or in use
        self._cond = threading.Condition()

    def acquire(self, nbytes_hint: int = 0, timeout: float | None = None, grace: float = 0.0) -> StagingArena:
        """A reset arena, preferably one already at least ``nbytes_hint`` large.

        ``grace``: when none is free but some are in use, wait up to that many seconds for
        one to come back before making another (a save that has just finished may release
        its arena a moment after its caller has seen it finish).
        """
        with self._cond:
            if grace > 0 and not self._free and self._arenas:
                self._cond.wait_for(lambda: bool(self._free), grace)
            while not self._free and len(self._arenas) >= self.max_arenas:
                if not self._cond.wait(timeout):
                    raise TimeoutError("no staging arena became free in time")
            if self._free:
                self._free.sort(key=lambda a: a.capacity)
                fits = [a for a in self._free if a.capacity >= nbytes_hint]
                arena = fits[0] if fits else self._free[-1]
                self._free.remove(arena)
            else:
                arena = StagingArena(self.allocator)
                self._arenas.append(arena)
        arena.reset()
        return arena

    def release(self, arena: StagingArena) -> None:
        with self._cond:
            self._free.append(arena)
            self._cond.notify()

    def clear(self) -> None:
        """Drop the free arenas (their memory goes back to the system)."""
        with self._cond:
            self._arenas = [a for a in self._arenas if all(a is not f for f in self._free)]
            self._free.clear()

    def reserved_bytes(self) -> int:
        """Bytes of staging memory the pool holds, in its free arenas and in those in use."""
        with self._cond:
            return sum(a.capacity for a in self._arenas)
