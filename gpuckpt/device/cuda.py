"""The CuPy back end of the pipelines: device memory, pinned staging, copy streams.

The modules of :mod:`gpuckpt.device` are the ones that touch a GPU: this one
(memory and copies), the kernel launchers (:mod:`~gpuckpt.device.kernels`,
:mod:`~gpuckpt.device.kernel_source`, :mod:`~gpuckpt.device.batched_copy`) and the
device content hash (:mod:`~gpuckpt.device.hashing`); outside it, only the
command line's device benchmark does. All of them import CuPy lazily, inside
functions, so ``import gpuckpt`` never touches a GPU.

Detection never crashes: CuPy that is installed without a driver or device
raises ``CUDARuntimeError`` on first use, which :func:`gpu_available` turns into ``False``. A GPU feature used
without CuPy or without a device raises
:class:`~gpuckpt.errors.DeviceUnavailableError` with an install hint.

What this module provides to the pipelines (see
:mod:`gpuckpt.device.backend`): page-locked staging memory allocated in
bounded pieces, asynchronous copies on a dedicated non-blocking stream with
events, the channels-last kernels, and conversion of PyTorch, JAX and other
DLPack / ``__cuda_array_interface__`` objects into CuPy views without copies.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuckpt.device.torch_dtypes import torch_dtype_view
from gpuckpt.errors import DeviceUnavailableError, UnsupportedValueError
from gpuckpt.format import memory_format as mf

__all__ = [
    "CupyBackend",
    "as_device_array",
    "backend_for_device",
    "gpu_available",
    "import_cupy",
    "is_pinned_pointer",
]

_INSTALL_HINT = (
    "install CuPy for your CUDA version (pip install 'gpuckpt[gpu]') on a machine with an NVIDIA GPU"
)


def import_cupy() -> Any:
    """The ``cupy`` module, or :class:`DeviceUnavailableError` with an install hint."""
    try:
        import cupy
    except ImportError as exc:
        raise DeviceUnavailableError(
            f"device arrays need CuPy, which is not installed: {_INSTALL_HINT}"
        ) from exc
    return cupy


@functools.cache
def _device_count() -> int:
    # asked once per process: a failed import is not cached by Python, and
    # this is asked for every array of a save
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # ImportError, CUDARuntimeError (no driver), ...
        return 0


def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device answers."""
    return _device_count() > 0


def is_pinned_pointer(ptr: int) -> bool:
    """Whether host address ``ptr`` is page-locked, from CUDA pointer attributes."""
    if not gpu_available():
        return False
    cupy = import_cupy()
    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(ptr)
    except Exception:
        return False
    # cudaMemoryTypeHost == 1: registered or cudaHostAlloc'ed memory
    return int(getattr(attrs, "type", 0)) == 1


def as_device_array(value: Any) -> tuple[Any, np.dtype[Any], bool]:
    """A zero-copy CuPy view of ``value``, its logical dtype and ``requires_grad``.

    PyTorch bfloat16/float8 tensors are viewed through integers of the same
    size (CuPy has no such dtypes); the logical dtype is kept separately.
    """
    cupy = import_cupy()
    if isinstance(value, cupy.ndarray):
        return value, np.dtype(value.dtype), False
    requires_grad = bool(getattr(value, "requires_grad", False))
    if type(value).__module__.startswith("torch"):
        t = value.detach()
        if t.is_neg() or t.is_conj():  # (its memory holds the values before the negation)
            raise UnsupportedValueError(
                "a lazily negated or conjugated CUDA tensor (z.conj(), z.conj().imag) holds in its "
                "memory the values before the negation: pass t.resolve_conj().resolve_neg()"
            )
        dtype, view = torch_dtype_view(t)
        return cupy.from_dlpack(view), dtype, requires_grad
    try:
        has_cai = hasattr(value, "__cuda_array_interface__")
    except Exception:  # present, but refuses (e.g. a tensor that requires grad)
        has_cai = False
    if has_cai:
        arr = cupy.asarray(value)
        return arr, np.dtype(arr.dtype), requires_grad
    arr = cupy.from_dlpack(value)
    return arr, np.dtype(arr.dtype), requires_grad


class _EventTicket:
    __slots__ = ("_event", "_keep")

    def __init__(self, event: Any, keep: Any = None) -> None:
        self._event = event
        self._keep = keep  # device scratch must outlive the queued copy

    def wait(self) -> None:
        self._event.synchronize()
        self._keep = None


class CupyBackend:
    """One CUDA device: a non-blocking copy stream, pinned staging, kernels."""

    def __init__(self, device_id: int = 0) -> None:
        cupy = import_cupy()
        if not gpu_available():
            raise DeviceUnavailableError(f"no usable CUDA device: {_INSTALL_HINT}")
        self.cupy = cupy
        self.device_id = device_id
        self.name = f"cuda:{device_id}"
        with cupy.cuda.Device(device_id):
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._lock = threading.Lock()
        self._keep: list[Any] = []  # device scratch that queued work still reads

    def _view(self, array: Any) -> Any:
        return array if isinstance(array, self.cupy.ndarray) else as_device_array(array)[0]

    def _contiguous_box(self, arr: Any, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        """The box as a C-contiguous device array: a view when possible, else a copy on ``stream``."""
        from gpuckpt.device import kernels

        box = arr[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] if sizes else arr[...]
        if box.flags.c_contiguous:
            return box
        fmt = mf.detect_memory_format(arr.shape, arr.strides, arr.itemsize)
        if fmt in (mf.channels_last, mf.channels_last_3d) and arr.itemsize in (1, 2, 4, 8):
            return kernels.channels_last_to_contiguous(arr, box=(offsets, sizes))
        return self.cupy.ascontiguousarray(box)

    def stage_out(
        self, array: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], dest: np.ndarray
    ) -> Any:
        cupy = self.cupy
        with cupy.cuda.Device(self.device_id), self.stream:
            src = self._contiguous_box(self._view(array), offsets, sizes)
            nbytes = src.nbytes
            cupy.cuda.runtime.memcpyAsync(
                dest.ctypes.data, src.data.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToHost, self.stream.ptr
            )
            event = self.stream.record()
        return _EventTicket(event, src)

    def stage_in(self, src: np.ndarray, array: Any, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        from gpuckpt.device import kernels

        cupy = self.cupy
        arr = self._view(array)
        with cupy.cuda.Device(self.device_id), self.stream:
            box = (
                arr[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                if sizes
                else arr[...]
            )
            direct = box.flags.c_contiguous
            tmp = box if direct else cupy.empty(sizes, dtype=arr.dtype)
            cupy.cuda.runtime.memcpyAsync(
                tmp.data.ptr,
                src.ctypes.data,
                src.nbytes,
                cupy.cuda.runtime.memcpyHostToDevice,
                self.stream.ptr,
            )
            if not direct:
                fmt = mf.detect_memory_format(arr.shape, arr.strides, arr.itemsize)
                if fmt in (mf.channels_last, mf.channels_last_3d) and arr.itemsize in (1, 2, 4, 8):
                    kernels.contiguous_to_channels_last(tmp, arr, box=(offsets, sizes))
                else:
                    box[...] = tmp
            event = self.stream.record()
        return _EventTicket(event, tmp)

    def snapshot_to_host(self, array: Any, dest: np.ndarray) -> Any:
        cupy = self.cupy
        arr = self._view(array)
        order = mf.physical_order(arr.ndim, mf.detect_memory_format(arr.shape, arr.strides, arr.itemsize))
        if not arr.transpose(order).flags.c_contiguous:
            raise ValueError(f"snapshot_to_host needs a dense array, got strides {arr.strides}")
        with cupy.cuda.Device(self.device_id):
            # dense with positive strides: the memory image starts at data.ptr
            cupy.cuda.runtime.memcpyAsync(
                dest.ctypes.data,
                arr.data.ptr,
                arr.nbytes,
                cupy.cuda.runtime.memcpyDeviceToHost,
                self.stream.ptr,
            )
            event = self.stream.record()
        return _EventTicket(event, arr)

    def wait_for_producers(self) -> None:
        cupy = self.cupy
        with cupy.cuda.Device(self.device_id):
            self.stream.wait_event(cupy.cuda.get_current_stream().record())

    def pinned_allocator(self) -> Any:
        cupy = self.cupy

        def alloc(nbytes: int) -> np.ndarray:
            with cupy.cuda.Device(self.device_id):
                mem = cupy.cuda.alloc_pinned_memory(nbytes)
            # the ndarray keeps the PinnedMemoryPointer alive through its base
            return np.frombuffer(mem, np.uint8, nbytes)

        return alloc

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any], memory_format: Any) -> Any:
        cupy = self.cupy
        order = mf.physical_order(len(shape), memory_format)
        store = _cupy_dtype(dtype)
        with cupy.cuda.Device(self.device_id):
            physical = cupy.empty(tuple(shape[a] for a in order), dtype=store)
        return physical.transpose([order.index(a) for a in range(len(shape))])

    def copy_on_device(self, array: Any) -> Any:
        arr = self._view(array)
        fmt = mf.detect_memory_format(arr.shape, arr.strides, arr.itemsize)
        with self.cupy.cuda.Device(self.device_id), self.stream:
            out = self.allocate(arr.shape, arr.dtype, fmt)
            out[...] = arr
        return out

    def canonical_bools(self, array: Any) -> Any:
        arr = self._view(array)
        cupy = self.cupy
        with cupy.cuda.Device(self.device_id):  # on the caller's stream, after its own kernels
            out = self.allocate(
                arr.shape, arr.dtype, mf.detect_memory_format(arr.shape, arr.strides, arr.itemsize)
            )
            cupy.minimum(arr.view(cupy.uint8), 1, out=out.view(cupy.uint8))
        return out

    def canonicalize_bools(self, array: Any) -> None:
        raw = self._view(array).view(self.cupy.uint8)
        with self.cupy.cuda.Device(self.device_id), self.stream:
            self.cupy.minimum(raw, 1, out=raw)
        self.stream.synchronize()

    def copy_many_on_device(self, arrays: Sequence[Any]) -> list[Any]:
        from gpuckpt.device.batched_copy import launch_batched_copy
        from gpuckpt.device.packing import plan_packing

        cupy = self.cupy
        views = [self._view(a) for a in arrays]
        dense = [i for i, v in enumerate(views) if _is_dense(v)]
        starts = [int(views[i].data.ptr) for i in dense]
        out: list[Any] = [None] * len(views)
        with cupy.cuda.Device(self.device_id), self.stream:
            plan = plan_packing(
                [(p, int(views[i].nbytes)) for p, i in zip(starts, dense, strict=True)],
                allocations=allocation_bases(starts),  # the driver answers in the device's context
            )
            arena = cupy.empty(max(1, plan.total), dtype=cupy.uint8)  # from CuPy's pool: reused
            base = int(arena.data.ptr)
            if plan.batched:
                pieces = plan.pieces(base)
                table = cupy.asarray(np.asarray(pieces, dtype=np.uint64).reshape(-1))
                launch_batched_copy(self.device_id, table, len(pieces))
                self._keep.append(table)  # until the stream has run the kernel
            for r in plan.direct_runs:
                cupy.cuda.runtime.memcpyAsync(
                    base + r.offset,
                    r.start,
                    r.nbytes,
                    cupy.cuda.runtime.memcpyDeviceToDevice,
                    self.stream.ptr,
                )
            for k, i in enumerate(dense):
                v = views[i]
                out[i] = cupy.ndarray(v.shape, v.dtype, arena.data + plan.places[k], strides=v.strides)
        for i, v in enumerate(views):
            if out[i] is None:
                out[i] = self.copy_on_device(v)
        return out

    def synchronize(self) -> None:
        self.stream.synchronize()
        self._keep.clear()

    def hash_chunks(
        self, array: Any, chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
    ) -> list[tuple[bytes, bytes]]:  # chunks: gpuckpt.device.backend.ChunkBox
        """The digests of ``chunks`` of ``array`` as stored, computed by the kernels of
        ``kernels/xxh3_tree.cu`` on the copy stream (after the work the caller queued:
        :meth:`wait_for_producers`); only 32 bytes per chunk come back."""
        from gpuckpt.device.hashing import hash_device_boxes

        with self.cupy.cuda.Device(self.device_id), self.stream:
            return hash_device_boxes(self._view(array), chunks)

    def encode_chunks(
        self,
        array: Any,
        chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]],
        codec_name: str,
    ) -> list[Any] | None:  # chunks: gpuckpt.device.backend.ChunkBox
        """The chunks compressed by nvCOMP on the device (:mod:`gpuckpt.device.compress`), after
        the work on the copy stream; None without nvCOMP or for a codec it does not write."""
        from gpuckpt.device.compress import encode_device_chunks

        with self.cupy.cuda.Device(self.device_id), self.stream:
            return encode_device_chunks(self._view(array), chunks, codec_name)


@functools.cache
def _address_range() -> Any:
    """The driver's ``cuMemGetAddressRange_v2`` through ctypes (None where it cannot be loaded):
    CuPy does not expose it."""
    import ctypes

    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64)
    fn.restype = ctypes.c_int
    return fn


def allocation_bases(pointers: Sequence[int]) -> list[int]:
    """The base address of the device allocation each of ``pointers`` lies in (the pointer itself
    where the driver cannot say: an allocation of its own). A copy must not run from one
    allocation into the next, even where they lie back to back in the address space
    (``cudaErrorInvalidValue``), so the snapshot packs runs per allocation."""
    import ctypes

    fn = _address_range()
    if fn is None:
        return list(pointers)
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    out = []
    for p in pointers:
        out.append(base.value if fn(ctypes.byref(base), ctypes.byref(size), p) == 0 else p)
    return out


def _is_dense(arr: Any) -> bool:
    """Dense in the physical order of its memory format: its memory image starts at ``data.ptr``."""
    order = mf.physical_order(arr.ndim, mf.detect_memory_format(arr.shape, arr.strides, arr.itemsize))
    return bool(arr.transpose(order).flags.c_contiguous)


def _cupy_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """CuPy has no bfloat16/float8: such tensors live as integers of the same size."""
    dt = np.dtype(dtype)
    if dt.kind == "V" or dt.type.__module__.startswith("ml_dtypes"):
        return np.dtype(f"u{dt.itemsize}")
    return dt


_backends: dict[int, CupyBackend] = {}
_backends_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    global _backends_lock
    _backends_lock = threading.Lock()  # it may have been held by a thread that the child does not have


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)


def backend_for_device(device_id: int) -> CupyBackend:
    """The (cached) backend of CUDA device ``device_id``."""
    with _backends_lock:
        b = _backends.get(device_id)
        if b is None:
            b = _backends[device_id] = CupyBackend(device_id)
        return b
