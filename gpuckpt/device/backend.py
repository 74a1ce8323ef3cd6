"""Device backends and the staging buffers they move chunks through.

A :class:`DeviceBackend` is what the array adapters of device memory
(:class:`gpuckpt.device.arrays.DeviceArray`) stage through: "copy this box
of a device array into this host buffer, asynchronously", "copy this host
block into that box", "allocate an array". Two backends exist:

* :class:`gpuckpt.device.cuda.CupyBackend` drives a real GPU: page-locked
  staging buffers, a dedicated copy stream, events, the channels-last
  kernels. It is the only code that needs a GPU.
* :class:`gpuckpt.device.host_backend.HostBackend` stands in for a device
  with host memory, so that the whole pipeline is tested without a GPU.

:class:`BufferPool` holds the staging buffers: allocated once (in pieces of
bounded size), reused across saves and loads, never more than a byte budget.
:class:`Staging` gives one pipeline run the pool of each back end it uses.
This module knows nothing of array adapters (they import it).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gpuckpt.options import DEFAULT_STAGING_BYTES

__all__ = [
    "FINISHED",
    "BufferPool",
    "ChunkBox",
    "DeviceBackend",
    "Staging",
    "Ticket",
    "buffer_pool",
    "distinct_backends",
    "staging_buffer_bytes",
]


#: one chunk of an array as stored: ``(offsets, sizes)`` of its box in the array, and the shape
#: of its stored block (the chunk grid's chunk shape; the box sits at its origin, zeros elsewhere)
ChunkBox = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@runtime_checkable
class Ticket(Protocol):
    """A queued copy; ``wait()`` blocks until it is done and raises its error."""

    def wait(self) -> None: ...


class _Finished:
    """The ticket of work that was done at once."""

    __slots__ = ()

    def wait(self) -> None:
        pass


#: A ticket that is already done (host memory needs no queued copy).
FINISHED: Ticket = _Finished()


@runtime_checkable
class DeviceBackend(Protocol):
    """What the pipelines need from a device.

    Copies are queued in call order on one stream per backend; the returned
    tickets complete in that order. Boxes are given as ``(offsets, sizes)``
    in logical coordinates; host blocks are C-ordered.
    """

    name: str

    def stage_out(
        self, array: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], dest: np.ndarray
    ) -> Ticket:
        """Queue a copy of ``array[box]`` in logical C order into the host buffer ``dest``."""
        ...

    def stage_in(
        self, src: np.ndarray, array: Any, offsets: tuple[int, ...], sizes: tuple[int, ...]
    ) -> Ticket:
        """Queue a copy of the C-ordered host block ``src`` into ``array[box]``."""
        ...

    def snapshot_to_host(self, array: Any, dest: np.ndarray) -> Ticket:
        """Queue a copy of the memory image of a dense ``array`` (C or channels-last order) into ``dest``."""
        ...

    def wait_for_producers(self) -> None:
        """Order the backend's stream after work already queued by the caller (its current stream)."""
        ...

    def pinned_allocator(self) -> Any:
        """Callable ``(nbytes) -> uint8 ndarray`` of host memory suited to fast copies."""
        ...

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any], memory_format: Any) -> Any:
        """An uninitialised device array whose strides follow ``memory_format``."""
        ...

    def copy_on_device(self, array: Any) -> Any:
        """A device-side copy with the same strides (for ``staging="device"``)."""
        ...

    def copy_many_on_device(self, arrays: Sequence[Any]) -> list[Any]:
        """Device-side copies of ``arrays`` with the same strides, for a snapshot of a state.

        Dense arrays are packed into one device allocation as
        :func:`gpuckpt.device.packing.plan_packing` plans it: one copy per run of
        arrays that lie back to back in one allocation, or one batched copy of many
        small runs; others are copied one by one. Queued on the back end's stream: call
        :meth:`synchronize` before the originals may change.
        """
        ...

    def synchronize(self) -> None: ...

    def hash_chunks(self, array: Any, chunks: Sequence[ChunkBox]) -> list[tuple[bytes, bytes]] | None:
        """The content hash and first-leaf hash (16 bytes each, the tree hash of
        :mod:`gpuckpt.format.contenthash`) of each chunk of ``array`` as it is stored,
        computed where the array lives, before any copy to the host.

        A chunk is ``(offsets, sizes, stored)``: its box in the array, and the shape of
        its stored block (the box in logical C order at the block's origin, zeros
        elsewhere, little-endian; see :func:`gpuckpt.device.hashing.stored_block`).
        Ordered after work already queued on the back end's stream (call
        :meth:`wait_for_producers` first). None when this back end cannot hash (the
        hash library or kernel is missing): the chunks are then staged and hashed on
        the host. An incremental save reuses a chunk whose digests equal its base's
        without staging it (:func:`gpuckpt.saving.writing.write_chunks`).
        """
        ...

    def canonical_bools(self, array: Any) -> Any:
        """A copy of the bool device ``array`` (same strides) whose every byte is 0 or 1: a
        nonzero byte becomes 1, as a bool conversion reads it. Queued after the caller's work,
        like its own kernels (no synchronization). A save stores this copy, so that readers
        which accept only 0 and 1 (TensorStore) read the chunks; back ends without it store
        the bytes as they are."""
        ...

    def canonicalize_bools(self, array: Any) -> None:
        """Make every nonzero byte of the bool device ``array`` 1, in place, after the copies
        already queued on the back end's stream, and wait for it: what a load does to a target
        it filled from a checkpoint whose bool chunks hold other bytes."""
        ...

    def encode_chunks(
        self, array: Any, chunks: Sequence[ChunkBox], codec_name: str
    ) -> list[np.ndarray] | None:
        """The stored block of each chunk of ``array`` (as :meth:`hash_chunks` takes them)
        compressed where the array lives into a frame of the Zarr codec ``codec_name``
        (``"zstd"``: one zstd frame announcing its size), as host ``uint8`` arrays: only the
        compressed bytes cross to the host. Ordered after work already queued on the back
        end's stream (call :meth:`wait_for_producers` first). None when this back end cannot
        (no device codec library, another codec): the chunks are then staged and compressed on
        the host (a save with ``compression={"codec": "zstd", "device": True}``)."""
        ...


class BufferPool:
    """Staging buffers of ``buffer_bytes`` each, at most ``budget_bytes`` in all.

    Buffers are allocated on first need and kept for later saves and loads.
    :meth:`acquire` blocks while the budget is exhausted (back-pressure): the
    producer cannot run ahead of the consumers by more than the budget.
    """

    def __init__(self, allocator: Any, buffer_bytes: int, budget_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        if buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
        self.allocator = allocator
        self.buffer_bytes = buffer_bytes
        self.max_buffers = max(1, budget_bytes // buffer_bytes)
        self.allocated = 0
        self.peak_in_use = 0
        self._in_use = 0
        self._free: list[np.ndarray] = []
        self._cond = threading.Condition()

    @property
    def budget_bytes(self) -> int:
        return self.max_buffers * self.buffer_bytes

    def acquire(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` (a one-off allocation if larger than the buffer size)."""
        if nbytes > self.buffer_bytes:
            raise ValueError(
                f"a {nbytes}-byte chunk does not fit staging buffers of {self.buffer_bytes} bytes; "
                "use a smaller chunk_bytes or larger staging buffers"
            )
        with self._cond:
            while not self._free and self.allocated >= self.max_buffers:
                self._cond.wait()
            if self._free:
                buf = self._free.pop()
            else:
                self.allocated += 1
                buf = None
            self._in_use += 1
            self.peak_in_use = max(self.peak_in_use, self._in_use)
        if buf is None:
            try:
                buf = np.asarray(self.allocator(self.buffer_bytes)).view(np.uint8).reshape(-1)
            except BaseException:
                with self._cond:
                    self.allocated -= 1
                    self._in_use -= 1
                    self._cond.notify()
                raise
        return buf

    def release(self, buf: np.ndarray) -> None:
        with self._cond:
            self._free.append(buf)
            self._in_use -= 1
            self._cond.notify()


_pools: weakref.WeakKeyDictionary[Any, dict[tuple[int, int], BufferPool]] = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # buffers in use belong to the parent's transfers; the child starts new pools under a new lock
    global _pools, _pools_lock
    _pools = weakref.WeakKeyDictionary()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def staging_buffer_bytes(largest_chunk: int) -> int:
    """Buffer size for a pipeline whose largest chunk is ``largest_chunk`` bytes.

    A power of two (at least 4 KiB), so that saves of similar states share a pool.
    """
    return max(4096, 1 << max(0, largest_chunk - 1).bit_length())


def buffer_pool(
    backend: DeviceBackend, buffer_bytes: int, budget_bytes: int = DEFAULT_STAGING_BYTES
) -> BufferPool:
    """The shared pool of ``backend`` for this buffer size and budget (created once, then reused)."""
    with _pools_lock:
        pools = _pools.setdefault(backend, {})
        pool = pools.get((buffer_bytes, budget_bytes))
        if pool is None:
            pool = pools[(buffer_bytes, budget_bytes)] = BufferPool(
                backend.pinned_allocator(), buffer_bytes, max(budget_bytes, buffer_bytes)
            )
        return pool


def distinct_backends(backends: Iterable[DeviceBackend | None]) -> list[DeviceBackend]:
    """The distinct back ends among ``backends`` (``None``, host memory, left out), in first-seen order."""
    seen: dict[int, DeviceBackend] = {}
    for b in backends:
        if b is not None:
            seen.setdefault(id(b), b)
    return list(seen.values())


class Staging:
    """The staging buffers of one pipeline run: the shared pool of each device back end it uses.

    ``needs`` lists ``(backend, nbytes)`` for every box the run moves
    (``backend`` None for host memory, which needs no staging); each back end's
    pool has buffers of a size that fits its largest box, at most
    ``budget_bytes`` of them. Made once per run, before any job starts.
    """

    def __init__(
        self, needs: Iterable[tuple[DeviceBackend | None, int]], budget_bytes: int = DEFAULT_STAGING_BYTES
    ) -> None:
        largest: dict[int, tuple[DeviceBackend, int]] = {}
        for backend, nbytes in needs:
            if backend is not None:
                _, most = largest.get(id(backend), (backend, 0))
                largest[id(backend)] = (backend, max(most, nbytes))
        self.backends = [b for b, _ in largest.values()]
        self._pools = {
            key: buffer_pool(b, staging_buffer_bytes(n), budget_bytes) for key, (b, n) in largest.items()
        }

    def wait_for_producers(self) -> None:
        """Order every back end's copies after the work its caller already queued."""
        for b in self.backends:
            b.wait_for_producers()

    def pool(self, backend: DeviceBackend) -> BufferPool:
        """The pool of ``backend``; it must be one of the back ends named in ``needs``."""
        try:
            return self._pools[id(backend)]
        except KeyError:
            raise ValueError(
                f"no staging was planned for back end {getattr(backend, 'name', backend)!r}; "
                "list every box the run moves in Staging(needs)"
            ) from None
