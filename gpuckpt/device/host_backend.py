"""Host memory standing in for a device: the pipelines' back end on machines without a GPU.

:class:`HostBackend` implements :class:`~gpuckpt.device.backend.DeviceBackend`
with NumPy arrays as "device" arrays and one worker thread as the copy
stream, optionally slowed down or failing on purpose. Arrays presented as
device memory of such a back end (:mod:`gpuckpt.testing.fakedevice`) go
through the whole staging pipeline (pool, ordering, back-pressure, overlap,
error propagation, snapshot semantics), so all of it is tested without a GPU.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from gpuckpt.device import _kernel_ref
from gpuckpt.device.arrays import HostMemory
from gpuckpt.device.backend import ChunkBox, Ticket
from gpuckpt.device.packing import ARENA_ALIGN, plan_packing
from gpuckpt.device.staging import HostAllocator
from gpuckpt.format import memory_format as mf
from gpuckpt.runtime.workers import Workers

__all__ = ["HostBackend"]


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


def _is_dense(array: Any) -> bool:
    """Dense in the physical order of its memory format: its memory image starts at its address."""
    fmt = mf.detect_memory_format(array.shape, array.strides, array.itemsize)
    return bool(array.transpose(mf.physical_order(array.ndim, fmt)).flags.c_contiguous)


def _allocation(array: np.ndarray) -> int:
    """A key of the buffer ``array`` views (the allocation, as the device back end asks the
    driver): views of one array share it; separate arrays never do, wherever they lie."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return id(array if array.base is None else array.base)


def _is_channels_last(array: Any) -> bool:
    fmt = mf.detect_memory_format(array.shape, array.strides, array.itemsize)
    return fmt in (mf.channels_last, mf.channels_last_3d)


class HostBackend:
    """Host memory standing in for a device (tests and machines without a GPU).

    Copies run in call order on one worker thread (the stream).
    ``bytes_per_second`` slows every copy down to that rate, to make overlap
    measurable; ``fail_after`` makes the n-th copy raise, to test error paths.
    ``gate``: copies wait until this event is set (tests hold the stream still
    to see what runs ahead of it).
    ``copies`` counts the copies run, ``max_in_flight`` the most queued at once;
    ``device_copies`` counts the device-to-device copies (snapshots);
    ``bytes_to_host`` the bytes copied to the host (staged out or snapshotted),
    ``hashed_chunks`` the chunks hashed in "device" memory (:meth:`hash_chunks`) and
    ``encoded_chunks`` those compressed there (:meth:`encode_chunks`; ``encodes=False``: a
    back end without a device codec).
    """

    name = "host"

    def __init__(
        self,
        *,
        bytes_per_second: float | None = None,
        fail_after: int | None = None,
        gate: threading.Event | None = None,
        encodes: bool = True,
    ) -> None:
        self.bytes_per_second = bytes_per_second
        self.encodes = encodes
        self.encoded_chunks = 0
        self.fail_after = fail_after
        self.gate = gate
        self.device_copies = 0
        self.copies = 0
        self.bytes_to_host = 0
        self.hashed_chunks = 0
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
                if self.gate is not None:
                    self.gate.wait()
                if self.fail_after is not None and n > self.fail_after:
                    raise RuntimeError(f"injected copy failure (copy {n})")
                if self.bytes_per_second:
                    time.sleep(nbytes / self.bytes_per_second)
                fn()
            finally:
                with self._lock:
                    self._in_flight -= 1

        return _FutureTicket(self._stream.submit(job))

    @property
    def in_flight(self) -> int:
        """Copies queued and not yet done."""
        with self._lock:
            return self._in_flight

    def stage_out(
        self, array: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], dest: np.ndarray
    ) -> Ticket:
        out = dest.view(array.dtype).reshape(sizes)

        def copy() -> None:
            with self._lock:
                self.bytes_to_host += out.nbytes
            if _is_channels_last(array):
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
            if _is_channels_last(array):
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

        def copy() -> None:
            with self._lock:
                self.bytes_to_host += physical.nbytes
            np.copyto(dest.view(array.dtype).reshape(physical.shape), physical)

        return self._run(copy, dest.nbytes)

    def wait_for_producers(self) -> None:
        """Host arrays have no pending producers."""

    def pinned_allocator(self) -> Any:
        # page-aligned, as page-locked memory is: cold loads read into it with O_DIRECT
        return HostAllocator()

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any], memory_format: Any) -> Any:
        return HostMemory().allocate(shape, dtype, memory_format)

    def copy_on_device(self, array: Any) -> Any:
        out = self.allocate(
            array.shape, array.dtype, mf.detect_memory_format(array.shape, array.strides, array.itemsize)
        )
        np.copyto(out, array)
        with self._lock:
            self.device_copies += 1
        return out

    def canonical_bools(self, array: Any) -> Any:
        out = self.allocate(
            array.shape, array.dtype, mf.detect_memory_format(array.shape, array.strides, array.itemsize)
        )
        done: Future[None] = self._stream.submit(
            lambda: np.minimum(array.view(np.uint8), 1, out=out.view(np.uint8))
        )
        done.result()
        with self._lock:
            self.device_copies += 1
        return out

    def canonicalize_bools(self, array: Any) -> None:
        raw = array.view(np.uint8)
        self._stream.submit(lambda: np.minimum(raw, 1, out=raw)).result()

    def copy_many_on_device(self, arrays: Sequence[Any]) -> list[Any]:
        dense = [i for i, a in enumerate(arrays) if _is_dense(a)]
        plan = plan_packing(
            [(int(arrays[i].ctypes.data), int(arrays[i].nbytes)) for i in dense],
            allocations=[_allocation(arrays[i]) for i in dense],  # as the device back end does
        )
        arena = HostAllocator()(plan.total + ARENA_ALIGN)  # page-aligned, as device allocations are
        out: list[Any] = [None] * len(arrays)
        for k, i in enumerate(dense):
            a = arrays[i]
            out[i] = np.ndarray(a.shape, a.dtype, buffer=arena, offset=plan.places[k], strides=a.strides)

        def copy_runs() -> None:
            for r in plan.runs:
                source = np.ctypeslib.as_array((ctypes.c_uint8 * r.nbytes).from_address(r.start))
                arena[r.offset : r.offset + r.nbytes] = source

        with self._lock:
            self.device_copies += plan.copies
        # one job on the stream: a batched copy, or the runs one after another
        self._run(copy_runs, plan.total)
        for i, a in enumerate(arrays):
            if out[i] is None:
                out[i] = self.copy_on_device(a)
        return out

    def synchronize(self) -> None:
        self._stream.submit(lambda: None).result()

    def hash_chunks(self, array: Any, chunks: Sequence[ChunkBox]) -> list[tuple[bytes, bytes]] | None:
        """The digests of ``chunks`` of ``array`` as stored, hashed in place ("device"
        memory) with the ``xxhash`` library, in order on the stream; None without it."""
        from gpuckpt.device.hashing import hash_host_chunks  # loaded by incremental saves only

        done: Future[list[tuple[bytes, bytes]] | None] = self._stream.submit(
            lambda: hash_host_chunks(array, chunks)
        )
        digests = done.result()
        if digests is not None:
            with self._lock:
                self.hashed_chunks += len(digests)
        return digests

    def encode_chunks(
        self, array: Any, chunks: Sequence[ChunkBox], codec_name: str
    ) -> list[np.ndarray] | None:
        """The stored block of each chunk compressed in place ("device" memory) into one zstd
        frame each (level 1, the ratio nvCOMP's zstd was measured at), in order on the stream;
        only the frames are counted as copied to the host. None for another codec, or with
        ``encodes=False``."""
        if not self.encodes or codec_name != "zstd":
            return None
        from numcodecs import zstd

        from gpuckpt.device.hashing import stored_block

        def encode() -> list[np.ndarray]:
            frames = [np.frombuffer(zstd.compress(stored_block(array, c), 1), np.uint8) for c in chunks]
            with self._lock:
                self.encoded_chunks += len(frames)
                self.bytes_to_host += sum(f.nbytes for f in frames)
            return frames

        done: Future[list[np.ndarray]] = self._stream.submit(encode)
        return done.result()
