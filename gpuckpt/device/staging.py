"""Staging memory: buffers allocated once and reused across saves and loads.

A :class:`StagingArena` is one reusable region, made of pieces allocated
once and kept (page-locked pieces are of bounded size: a single huge pinned
allocation fails, and pinned allocation is slow; pageable memory told what
its user will take comes in one piece of that size). An arena hands out aligned byte
ranges until it is reset. :class:`ArenaPool` keeps arenas between saves so
that a steady training loop allocates nothing after its first save, and
bounds how many exist at once: a caller that needs one while all are busy
waits (back-pressure) instead of allocating more, but never for an arena
that no live holder will give back (that raises
:class:`~gpuckpt.errors.StagingTimeoutError`). An arena is sized to what
its user said it would take, not to a fixed piece size, so a small state
reserves little memory; memory that cannot be had raises
:class:`~gpuckpt.errors.StagingMemoryError`.

What memory backs the pieces is chosen by passing an allocator (host NumPy
memory here; page-locked memory in the GPU adapter).
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from gpuckpt.errors import StagingMemoryError, StagingTimeoutError
from gpuckpt.format.memory_format import natural_order

__all__ = ["ArenaPool", "HostAllocator", "StagingArena", "pool_for", "populated"]

_ALIGN = 4096
DEFAULT_PIECE_BYTES = 256 << 20
#: how often a caller waiting for an arena checks that the busy ones still have live holders
_CHECK_SECONDS = 0.5


def aligned_bytes(nbytes: int) -> int:
    """What :meth:`StagingArena.take` of ``nbytes`` uses up at most: whole 4 KiB blocks."""
    return -(-max(nbytes, 1) // _ALIGN) * _ALIGN


def populated(nbytes: int) -> mmap.mmap:
    """Anonymous memory of ``nbytes`` (at least 1), its pages mapped when it is made.

    One ``mmap`` with ``MAP_POPULATE``: the pages are faulted in by one system
    call, not one fault at a time later, and they are base pages (not the
    transparent huge pages NumPy asks for, which a VM that returns freed memory
    to its host may take seconds per GiB to fault in after mass deletions).
    For buffers of some MiB and more that are filled once and let go.
    """
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(-1, max(nbytes, 1), flags=flags)


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
        # pieces are bounded unless the allocator says its memory is pageable (HostAllocator)
        self._bounded = getattr(allocator, "pinned", True) is not False
        self.pieces: list[np.ndarray] = []
        self._bases: list[int] = []  # the address of each piece
        self._piece = 0
        self._offset = 0
        self._expected = 0
        self._taken = 0

    @property
    def capacity(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def reset(self, expected_bytes: int = 0) -> None:
        """Start over; ``expected_bytes``: about how much the next user will take in all
        (sum of :func:`aligned_bytes`), so that new pieces are sized to it, not to ``piece_bytes``."""
        self._piece = 0
        self._offset = 0
        self._expected = max(0, expected_bytes)
        self._taken = 0
        if not self._bounded and self._expected > self.capacity:
            # pageable memory comes in one piece of the state's size: pieces of smaller states
            # kept beside it would each stay held (a state growing from 20 MiB to 260 MiB in
            # 13 steps had held 1.8 GiB); no user holds them now, the arena being handed out
            self.pieces.clear()
            self._bases = []

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of staging memory (uint8), aligned to 4 KiB; grows the arena if needed.

        Raises :class:`~gpuckpt.errors.StagingMemoryError` if the memory cannot be allocated.
        """
        piece, start = self._take_at(nbytes)
        return piece[start : start + nbytes]

    def _take_at(self, nbytes: int) -> tuple[np.ndarray, int]:
        """:meth:`take` as the piece and the offset in it (no view made)."""
        need = max(nbytes, 1)
        if len(self._bases) != len(self.pieces):
            self._bases = [p.ctypes.data for p in self.pieces]  # (asking NumPy each time costs ~1 us)
        while self._piece < len(self.pieces):
            piece = self.pieces[self._piece]
            base = self._bases[self._piece]
            start = -(-(base + self._offset) // _ALIGN) * _ALIGN - base
            if start + need <= piece.nbytes:
                self._offset = start + need
                self._taken += aligned_bytes(need)
                return piece, start
            self._piece += 1
            self._offset = 0
        # a piece holds what is still expected: at most piece_bytes of page-locked memory (one
        # huge pinned allocation fails), all of it in one piece of pageable memory (bounded
        # pieces leave the tail of each unused when the next array does not fit there: 5% of
        # a 1.3 GB state in 256 MiB pieces); a fixed large piece would reserve memory a small
        # state never uses
        if self._expected:
            rest = self._expected - self._taken
            size = max(need, min(self.piece_bytes, rest) if self._bounded else rest)
        else:
            size = max(need, self.piece_bytes)
        try:
            piece = np.asarray(self.allocator(size + _ALIGN)).view(np.uint8).reshape(-1)
        except (MemoryError, OSError) as exc:
            raise StagingMemoryError(
                f"cannot allocate {size + _ALIGN} bytes of staging memory for a snapshot "
                f"({self.capacity} bytes already held by this arena): {exc}; free memory or raise "
                "the process's memory limit (ulimit -v), or save with gpuckpt.save, which needs "
                "no snapshot of host arrays"
            ) from exc
        self.pieces.append(piece)
        self._piece = len(self.pieces) - 1
        self._offset = 0
        return self._take_at(nbytes)

    def take_array(self, shape: tuple[int, ...], dtype: Any, order: tuple[int, ...]) -> np.ndarray:
        """An array of logical ``shape`` whose memory follows the axis ``order`` (outermost first)."""
        dt = np.dtype(dtype)
        if order == natural_order(len(shape)):
            # (a snapshot takes one per array: made in one call, not a slice, a view and a reshape)
            piece, start = self._take_at(math.prod(shape) * dt.itemsize)
            return np.ndarray(shape, dt, piece, start)
        physical = tuple(shape[a] for a in order)
        raw = self.take(math.prod(physical) * dt.itemsize)
        arr: np.ndarray = raw.view(dt).reshape(physical)
        if order == tuple(range(len(shape))):
            return arr
        return arr.transpose([order.index(a) for a in range(len(shape))])


class ArenaPool:
    """At most ``max_arenas`` arenas; :meth:`acquire` waits while all are in use.

    Each arena in use has a holder: the thread that acquired it, or the future
    it was handed to (:meth:`hold`) and that releases it when done. A caller
    waits only while some busy arena has a holder that can still release it:
    an arena held by the waiting thread itself, by a thread that has ended or
    by a finished future would never come back, and waiting for it raises
    :class:`~gpuckpt.errors.StagingTimeoutError` instead of blocking forever.
    """

    def __init__(self, allocator: Callable[[int], Any] | None = None, *, max_arenas: int = 2) -> None:
        self.allocator = allocator or HostAllocator()
        self.max_arenas = max_arenas
        self._free: list[StagingArena] = []
        self._arenas: list[StagingArena] = []  # every arena of the pool, free or in use
        self._holders: dict[int, threading.Thread | Future[Any]] = {}
        self._cond = threading.Condition()
        #: the back end the pool's memory is for (see :func:`pool_for`)
        self.owner: Any = None
        _all_pools.add(self)

    def _can_come_back(self) -> bool:
        """Whether a busy arena has a holder that may still release it: a running thread
        other than the caller (who cannot release anything while it waits), or a future
        not yet done."""
        me = threading.current_thread()
        return any(
            (h.is_alive() and h is not me) if isinstance(h, threading.Thread) else not h.done()
            for h in self._holders.values()
        )

    def acquire(
        self, nbytes_hint: int = 0, timeout: float | None = None, *, grace: float = 0.0
    ) -> StagingArena:
        """A reset arena, preferably one already at least ``nbytes_hint`` large.

        Waits while all arenas are in use, at most ``timeout`` seconds (None:
        as long as their holders may release them). Raises
        :class:`~gpuckpt.errors.StagingTimeoutError` when none becomes free.

        ``grace``: when none is free but fewer than ``max_arenas`` exist, wait up
        to that many seconds for one in use to come back before making another
        (the holder of a save that has just finished may release its arena a
        moment after its caller has seen it finish).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        lost = 0
        with self._cond:
            if grace > 0 and not self._free and self._arenas:
                self._cond.wait_for(lambda: bool(self._free), grace)
            while not self._free and len(self._arenas) >= self.max_arenas:
                wait = _CHECK_SECONDS
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise StagingTimeoutError(
                            f"no staging arena became free within {timeout} s (all {self.max_arenas} "
                            "are in use by saves in flight); wait for them or pass a longer timeout"
                        )
                if self._cond.wait(wait):
                    continue
                # two checks in a row: a finished holder's release may have been on its way
                lost = 0 if self._can_come_back() else lost + 1
                if lost >= 2:
                    raise StagingTimeoutError(
                        f"all {self.max_arenas} staging arenas are held by no save in flight (an "
                        "earlier failure did not give them back) and none will become free; this "
                        "is a bug in gpuckpt: please report it. gpuckpt.save still works"
                    )
            if self._free:
                self._free.sort(key=lambda a: a.capacity)
                fits = [a for a in self._free if a.capacity >= nbytes_hint]
                arena = fits[0] if fits else self._free[-1]
                self._free.remove(arena)
            else:
                arena = StagingArena(self.allocator)
                self._arenas.append(arena)
            self._holders[id(arena)] = threading.current_thread()
        arena.reset(nbytes_hint)
        return arena

    def hold(self, arena: StagingArena, future: Future[Any]) -> None:
        """Hand ``arena`` over to ``future``, which must :meth:`release` it when done."""
        with self._cond:
            self._holders[id(arena)] = future

    def release(self, arena: StagingArena) -> None:
        """Give ``arena`` back (once; a second release of the same arena changes nothing)."""
        with self._cond:
            if any(a is arena for a in self._free):
                return
            self._holders.pop(id(arena), None)
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

    def _after_fork(self) -> None:
        # arenas in use belong to the parent's saves: forget them (the parent releases
        # its own); the free ones stay usable, under a fresh lock
        self._cond = threading.Condition()
        self._holders = {}
        self._arenas = list(self._free)


_all_pools: weakref.WeakSet[ArenaPool] = weakref.WeakSet()


def pool_for(pools: dict[int, ArenaPool], backend: Any, max_arenas: int) -> ArenaPool:
    """The pool in ``pools`` for ``backend`` (None: host memory), made on first use with its
    page-locked allocator. Keyed by the back end's ``id``, the pool holds the back end itself:
    its id is never reused for another back end while the pool, made for it, is kept (a pool
    found under a back end's id was made for that very back end)."""
    key = id(backend) if backend is not None else 0
    pool = pools.get(key)
    if pool is None or pool.owner is not backend:
        allocator = backend.pinned_allocator() if backend is not None else None
        pool = pools[key] = ArenaPool(allocator, max_arenas=max_arenas)
        pool.owner = backend
    return pool


def _after_fork_in_child() -> None:
    for pool in list(_all_pools):
        pool._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
