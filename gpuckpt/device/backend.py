"""Device backends and the staging buffers they move chunks through.

The save and load pipelines (:mod:`gpuckpt.writing`, :mod:`gpuckpt.reading`)
only speak to a :class:`DeviceBackend`: "copy this box of a device array into
this host buffer, asynchronously", "copy this host block into that box",
"allocate an array". Two backends exist:

* :class:`gpuckpt.device.cuda.CupyBackend` drives a real GPU: page-locked
  staging buffers, a dedicated copy stream, events, the channels-last
  kernels. It is the only code that needs a GPU.
* :class:`HostBackend` stands in for a device with host memory: "device"
  arrays are NumPy arrays and copies run in order on one worker thread (a
  stream), optionally slowed down. Everything else in the pipeline (pool,
  ordering, back-pressure, overlap, error propagation, snapshot semantics)
  is therefore tested on machines without a GPU.

:class:`BufferPool` holds the staging buffers: allocated once (in pieces of
bounded size), reused across saves and loads, never more than a byte budget.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gpuckpt import memory_format as mf
from gpuckpt.device import _kernel_ref
from gpuckpt.options import DEFAULT_STAGING_BYTES
from gpuckpt.workers import Workers

__all__ = [
    "BufferPool",
    "DeviceArray",
    "DeviceBackend",
    "HostBackend",
    "Ticket",
    "buffer_pool",
    "staging_buffer_bytes",
]


@runtime_checkable
class Ticket(Protocol):
    """A queued copy; ``wait()`` blocks until it is done and raises its error."""

    def wait(self) -> None: ...


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

    def synchronize(self) -> None: ...


@dataclass(slots=True)
class DeviceArray:
    """Adapter of an array in device memory."""

    data: Any
    backend: DeviceBackend
    dtype: np.dtype[Any]
    requires_grad: bool = False

    @property
    def is_device(self) -> bool:
        return True

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.data.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.data.strides)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def properties(self) -> Any:
        from gpuckpt.metadata import TensorProperties

        return TensorProperties(
            dtype=self.dtype,
            layout=mf.strided,
            requires_grad=self.requires_grad,
            memory_format=mf.detect_memory_format(self.shape, self.strides, self.dtype.itemsize),
            pin_memory=False,
        )

    def host_array(self) -> np.ndarray:
        raise TypeError("a device array has no host view; stage it through its backend")


class _FutureTicket:
    __slots__ = ("_future",)

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()


def _box(array: Any, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
    if not sizes:
        return array[...]
    return array[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


class HostBackend:
    """Host memory standing in for a device (tests and machines without a GPU).

    ``bytes_per_second`` slows every copy down to that rate, to make overlap
    measurable; ``fail_after`` makes the n-th copy raise, to test error paths.
    """

    name = "host"

    def __init__(self, *, bytes_per_second: float | None = None, fail_after: int | None = None) -> None:
        self.bytes_per_second = bytes_per_second
        self.fail_after = fail_after
        self.copies = 0
        self.max_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        self._stream = Workers(1, "gpuckpt-hoststream")

    def _run(self, fn: Any, nbytes: int) -> Ticket:
        with self._lock:
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)

        def job() -> None:
            try:
                with self._lock:
                    self.copies += 1
                    n = self.copies
                if self.fail_after is not None and n > self.fail_after:
                    raise RuntimeError(f"injected copy failure (copy {n})")
                if self.bytes_per_second:
                    time.sleep(nbytes / self.bytes_per_second)
                fn()
            finally:
                with self._lock:
                    self._in_flight -= 1

        return _FutureTicket(self._stream.submit(job))

    def stage_out(
        self, array: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], dest: np.ndarray
    ) -> Ticket:
        out = dest.view(array.dtype).reshape(sizes)

        def copy() -> None:
            if mf.detect_memory_format(array.shape, array.strides, array.itemsize) in (
                mf.channels_last,
                mf.channels_last_3d,
            ):
                # the same validation and box semantics as the device kernels
                _kernel_ref.channels_last_to_contiguous(array, out, box=(offsets, sizes))
            else:
                np.copyto(out, _box(array, offsets, sizes))

        return self._run(copy, dest.nbytes)

    def stage_in(
        self, src: np.ndarray, array: Any, offsets: tuple[int, ...], sizes: tuple[int, ...]
    ) -> Ticket:
        block = src.view(array.dtype).reshape(sizes)

        def copy() -> None:
            if mf.detect_memory_format(array.shape, array.strides, array.itemsize) in (
                mf.channels_last,
                mf.channels_last_3d,
            ):
                _kernel_ref.contiguous_to_channels_last(block, array, box=(offsets, sizes))
            else:
                _box(array, offsets, sizes)[...] = block

        return self._run(copy, src.nbytes)

    def snapshot_to_host(self, array: Any, dest: np.ndarray) -> Ticket:
        order = mf.physical_order(
            array.ndim, mf.detect_memory_format(array.shape, array.strides, array.itemsize)
        )
        physical = array.transpose(order)
        if not physical.flags.c_contiguous:
            raise ValueError(f"snapshot_to_host needs a dense array, got strides {array.strides}")
        return self._run(
            lambda: np.copyto(dest.view(array.dtype).reshape(physical.shape), physical), dest.nbytes
        )

    def wait_for_producers(self) -> None:
        """Host arrays have no pending producers."""

    def pinned_allocator(self) -> Any:
        return lambda nbytes: np.empty(nbytes, np.uint8)

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any], memory_format: Any) -> Any:
        from gpuckpt.device.arrays import HostMemory

        return HostMemory().allocate(shape, dtype, memory_format)

    def copy_on_device(self, array: Any) -> Any:
        out = self.allocate(
            array.shape, array.dtype, mf.detect_memory_format(array.shape, array.strides, array.itemsize)
        )
        np.copyto(out, array)
        return out

    def synchronize(self) -> None:
        self._stream.submit(lambda: None).result()


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
