"""Array adapters: one view of every array kind gpuckpt accepts.

An adapter reports plain facts about an array (shape, dtype, memory format,
whether it requires grad, is pinned, is writable) and says how its bytes are
staged out of it and into it, so that the save and load pipelines have one
path for every kind of memory and never check array types themselves:

* :class:`HostArray` (NumPy, and CPU arrays reachable through
  ``__array_interface__`` or DLPack) finishes at once: staging out hands out a
  view of its own memory, staging in a view to fill;
* :class:`DeviceArray` (device memory, with the
  :class:`~gpuckpt.device.backend.DeviceBackend` that copies it) queues copies
  through staging buffers of a :class:`~gpuckpt.device.backend.Staging`.

Adapters know nothing of the checkpoint format: :mod:`gpuckpt.format.metadata`
builds tensor properties from their facts.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gpuckpt.device.backend import (
    FINISHED,
    BufferPool,
    ChunkBox,
    DeviceBackend,
    Staging,
    Ticket,
    distinct_backends,
)
from gpuckpt.device.torch_dtypes import torch_dtype_view
from gpuckpt.errors import DeviceUnavailableError, UnsupportedValueError
from gpuckpt.format import memory_format as mf
from gpuckpt.format.metadata import register_array_view

__all__ = [
    "adapt_leaf",
    "overlaps_itself",
    "ArrayAdapter",
    "DeviceArray",
    "HostArray",
    "HostMemory",
    "StagedIn",
    "StagedOut",
    "adapt",
    "canonical_bools",
    "canonicalize_loaded_bools",
    "copy_all",
    "device_backends",
    "is_array",
]

_DLPACK_CPU = 1  # kDLCPU
_DLPACK_CUDA_HOST = 3  # kDLCUDAHost: page-locked host memory

#: ``host_copy(dst, src)``: a host-to-host copy that the caller runs (see :meth:`ArrayAdapter.copy_to_host`)
HostCopy = Callable[[np.ndarray, np.ndarray], None]


class StagedOut(Protocol):
    """A box of an array made readable in host memory (see :meth:`ArrayAdapter.stage_out`).

    Call order: :meth:`wait` (at most once, from any thread), then
    :meth:`release` (always, also when :meth:`wait` was never called or failed).
    """

    @property
    def ready(self) -> bool:
        """True when the box was readable at once and nothing is held (it may wait in a batch)."""
        ...

    @property
    def stable(self) -> bool:
        """True when the box is memory of gpuckpt's own that nothing changes until it is released
        (a staging buffer, a snapshot); False for the caller's memory, which writers copy once
        before they checksum and store it (see :class:`~gpuckpt.storage.base.CheckpointWriter`)."""
        ...

    def wait(self) -> np.ndarray:
        """The box in host memory (logical shape ``sizes``), once its copy is done."""
        ...

    def release(self) -> None:
        """Give back what the box holds (after its copy ended); later calls do nothing."""
        ...


class StagedIn(Protocol):
    """Host memory to fill with a box's values (see :meth:`ArrayAdapter.stage_in`).

    Call order: fill :attr:`box`, then :meth:`finish` (move it and wait) or
    :meth:`start` (queue the move; wait for its ticket), then :meth:`release`
    (always, also after a failure; after :meth:`start`, only once its ticket
    is done: the queued copy still reads the box until then).
    """

    @property
    def box(self) -> np.ndarray:
        """Writable host memory of the box (logical shape ``sizes``)."""
        ...

    def finish(self) -> None:
        """Move the filled box into the array and wait until it is there."""
        ...

    def start(self) -> Ticket:
        """Queue the move of the filled box into the array; the ticket says when it is there."""
        ...

    def release(self) -> None:
        """Give back what the box holds; later calls do nothing."""
        ...


@runtime_checkable
class ArrayAdapter(Protocol):
    """What the checkpoint logic reads from an array, and how its bytes move.

    Facts: :attr:`shape`, :attr:`dtype`, :attr:`memory_format`,
    :attr:`requires_grad`, :attr:`pinned`, :attr:`writable`, and
    :attr:`backend`, the device back end that stages the array (``None`` for
    host memory). Moving bytes, for any kind of memory: :meth:`stage_out`
    and :meth:`stage_in` (a box, through the run's :class:`Staging`),
    :meth:`copy_to_host` and :meth:`copy` (the whole array, for snapshots).
    """

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...

    @property
    def memory_format(self) -> mf.MemoryFormat: ...

    @property
    def requires_grad(self) -> bool: ...

    @property
    def pinned(self) -> bool: ...

    @property
    def writable(self) -> bool: ...

    @property
    def backend(self) -> DeviceBackend | None: ...

    def stage_out(self, offsets: tuple[int, ...], sizes: tuple[int, ...], staging: Staging) -> StagedOut:
        """Make the box ``(offsets, sizes)`` readable in host memory.

        Host memory: a view, at once. Device memory: takes a staging buffer
        (blocking while the run's budget is in use: back-pressure) and queues
        the copy into it.
        """
        ...

    def stage_in(self, offsets: tuple[int, ...], sizes: tuple[int, ...], staging: Staging) -> StagedIn:
        """Host memory to fill with the box ``(offsets, sizes)``, then move into the array.

        Host memory: a view of the array itself (finishing does nothing).
        Device memory: a staging buffer, copied into the array by ``finish()``.
        """
        ...

    def copy_to_host(self, dst: np.ndarray, host_copy: HostCopy) -> Ticket:
        """Start copying the whole array into the host array ``dst``.

        ``dst`` has the array's shape and dtype and is dense, in C order or in
        the array's own memory format. Device memory queues the copy on its
        back end and returns its ticket; host memory hands ``(dst, source)``
        to ``host_copy`` (the caller runs such copies, e.g. in parallel) and
        returns a finished ticket.
        """
        ...

    def copy(self) -> ArrayAdapter:
        """A copy in the same kind of memory, with the same facts (a snapshot of this array).

        The layout of a memory format (C order, channels-last) is kept; any
        other (e.g. Fortran order) may become C order on a device.

        A device copy is queued on its back end: synchronize the back end
        (see :func:`device_backends`) before the original may change.
        """
        ...

    def host_array(self) -> np.ndarray:
        """The array as a NumPy array without copying (host memory only; device memory raises TypeError)."""
        ...

    def content_digests(self, chunks: Sequence[ChunkBox]) -> list[tuple[bytes, bytes]] | None:
        """The content hash and first-leaf hash of each chunk ``(offsets, sizes, stored shape)``
        as stored, computed where the array lives before any of it is staged
        (:meth:`~gpuckpt.device.backend.DeviceBackend.hash_chunks`), or None where
        that gains nothing (host memory is hashed while it is written) or cannot be done."""
        ...

    def encode_chunks(self, chunks: Sequence[ChunkBox], codec_name: str) -> list[np.ndarray] | None:
        """Each chunk ``(offsets, sizes, stored shape)`` as stored, compressed where the array
        lives into a frame of the codec ``codec_name``, as host bytes
        (:meth:`~gpuckpt.device.backend.DeviceBackend.encode_chunks`), or None where that is
        not done there (host memory; a back end without a device codec)."""
        ...


def canonical_bools(a: ArrayAdapter) -> ArrayAdapter:
    """``a`` as a save stores it: a bool array holding a byte other than 0 and 1 (a ``uint8``
    array viewed as bool, a torch ``view(torch.bool)``) is replaced by a copy in the same
    memory and layout where every nonzero byte is 1, what ``bool(x)`` and ``astype`` read in
    it; TensorStore refuses a stored bool byte other than 0 and 1, and NumPy's comparisons and
    sums disagree with each other on one. Any other array is ``a`` itself. A host array is
    scanned (one pass over its bytes) and copied only where such a byte is found; a device
    array is copied on its device without a scan (a scan's answer would wait for the device)."""
    if a.dtype != np.bool_:
        return a
    if isinstance(a, HostArray):
        raw = a.array.view(np.uint8)
        if not _holds_other_bytes(raw):
            return a
        return HostArray(np.minimum(raw, 1).view(np.bool_), a.requires_grad, a.pinned, snapshot=True)
    if isinstance(a, DeviceArray):
        canonical = getattr(a.backend, "canonical_bools", None)  # back ends written before it: none
        if canonical is not None:
            return DeviceArray(canonical(a.data), a.backend, a.dtype, a.requires_grad)
    return a


def canonicalize_loaded_bools(a: ArrayAdapter) -> None:
    """After a load filled ``a``: where ``a`` is a bool array, every nonzero byte becomes 1, in
    place, as :func:`canonical_bools` stores them (a checkpoint holding other bytes in a bool
    chunk was saved before saves stored 0 and 1, or by another writer). A host array is
    scanned and written only where such a byte is found. Other arrays are left as they are."""
    if a.dtype != np.bool_:
        return
    if isinstance(a, HostArray):
        raw = a.array.view(np.uint8)
        if _holds_other_bytes(raw):
            np.minimum(raw, 1, out=raw)
    elif isinstance(a, DeviceArray):
        fix = getattr(a.backend, "canonicalize_bools", None)  # back ends written before it: none
        if fix is not None:
            fix(a.data)


def _holds_other_bytes(raw: np.ndarray) -> bool:
    """Whether the bytes ``raw`` of a bool array hold one other than 0 and 1 (one pass)."""
    return bool(raw.size) and int(np.max(raw)) > 1


def copy_all(arrays: Sequence[ArrayAdapter]) -> list[ArrayAdapter]:
    """Copies of ``arrays`` (see :meth:`ArrayAdapter.copy`), for a snapshot of a whole state.

    The device arrays of each back end are copied together
    (:meth:`~gpuckpt.device.backend.DeviceBackend.copy_many_on_device`: one device
    allocation, one copy per run of arrays back to back in memory, or one batched copy),
    not one by one. Queued: synchronize the back ends before the originals may change.
    """
    out: list[ArrayAdapter | None] = [None] * len(arrays)
    groups: dict[int, list[int]] = {}
    for i, a in enumerate(arrays):
        if isinstance(a, DeviceArray):
            groups.setdefault(id(a.backend), []).append(i)
        else:
            out[i] = a.copy()
    for members in groups.values():
        backend = arrays[members[0]].backend
        assert backend is not None
        copies = backend.copy_many_on_device([arrays[i].data for i in members])  # type: ignore[attr-defined]
        for i, data in zip(members, copies, strict=True):
            a = arrays[i]
            out[i] = DeviceArray(data, backend, a.dtype, a.requires_grad)
    return [a for a in out if a is not None]


def overlaps_itself(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether an array of ``shape`` and byte ``strides`` may hold two elements at one address (a
    broadcast view: a stride of 0, torch's ``expand``; or an ``as_strided`` view): a load into it
    would leave each shared element holding the last value written to it. The test sorts the
    axes by stride and asks each to step past everything the inner ones span; a layout that
    interleaves its axes without sharing memory fails it too, and none of NumPy's or torch's
    views does that. An array without elements shares nothing (whatever strides its exporter
    gave it: torch's empty tensors come through DLPack with strides of 0)."""
    if 0 in shape:
        return False
    span = itemsize
    for stride, n in sorted((abs(st), n) for n, st in zip(shape, strides, strict=True) if n > 1):
        if stride < span:
            return True
        span = stride * (n - 1) + span
    return False


def device_backends(arrays: Iterable[ArrayAdapter]) -> list[DeviceBackend]:
    """The distinct device back ends of ``arrays`` (host arrays have none)."""
    return distinct_backends(a.backend for a in arrays)


def _box(array: Any, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
    """The box of ``array`` as a view (an array even for 0-d arrays)."""
    if not sizes:
        return array[...]
    return array[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]


def is_array(value: Any) -> bool:
    """True for values stored as tensors (NumPy scalars and plain values are objects)."""
    if isinstance(value, np.ndarray):
        return True
    if isinstance(value, (np.generic, str, bytes, int, float, complex, bool, type(None), list, tuple, dict)):
        return False
    return any(
        _has_attribute(value, a)
        for a in ("__gpuckpt_adapter__", "__cuda_array_interface__", "__dlpack__", "__array_interface__")
    )


def _has_attribute(value: Any, name: str) -> bool:
    # hasattr runs properties: PyTorch's __cuda_array_interface__ raises
    # RuntimeError (not AttributeError) for a CUDA tensor that requires grad,
    # which means the attribute is there but refuses
    try:
        return hasattr(value, name)
    except Exception:
        return True


class _HostOut:
    """A box of host memory: readable at once, holding nothing."""

    __slots__ = ("_box", "stable")
    ready = True

    def __init__(self, box: np.ndarray, stable: bool) -> None:
        self._box = box
        self.stable = stable

    def wait(self) -> np.ndarray:
        return self._box

    def release(self) -> None:
        pass


class _HostIn:
    """A box of host memory filled in place."""

    __slots__ = ("box",)

    def __init__(self, box: np.ndarray) -> None:
        self.box = box

    def finish(self) -> None:
        pass

    def start(self) -> Ticket:
        return FINISHED

    def release(self) -> None:
        pass


@dataclass(slots=True)
class HostArray:
    """A host array viewed as a NumPy array, without copying.

    ``snapshot``: the array is gpuckpt's own copy (an asynchronous save's snapshot),
    which nothing changes while it is written (:attr:`StagedOut.stable`).
    """

    array: np.ndarray
    requires_grad: bool = False
    pinned: bool = False
    snapshot: bool = False

    @property
    def backend(self) -> None:
        return None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.array.dtype

    @property
    def memory_format(self) -> mf.MemoryFormat:
        a = self.array
        if a.flags.c_contiguous:
            # NumPy's flag is the same test (axes of one element may have any stride; an
            # empty array is contiguous), made when the array was: a fifth of the time
            return mf.contiguous_format
        return mf.detect_memory_format(a.shape, a.strides, a.itemsize)

    @property
    def writable(self) -> bool:
        return bool(self.array.flags.writeable)

    def stage_out(self, offsets: tuple[int, ...], sizes: tuple[int, ...], staging: Staging) -> StagedOut:
        return _HostOut(_box(self.array, offsets, sizes), self.snapshot)

    def stage_in(self, offsets: tuple[int, ...], sizes: tuple[int, ...], staging: Staging) -> StagedIn:
        return _HostIn(_box(self.array, offsets, sizes))

    def copy_to_host(self, dst: np.ndarray, host_copy: HostCopy) -> Ticket:
        host_copy(dst, self.array)
        return FINISHED

    def copy(self) -> HostArray:
        return HostArray(self.array.copy(order="K"), self.requires_grad, self.pinned, snapshot=True)

    def host_array(self) -> np.ndarray:
        return self.array

    def content_digests(self, chunks: Sequence[ChunkBox]) -> None:
        return None  # host memory is hashed while it is written, in the same pass as its CRC32C

    def encode_chunks(self, chunks: Sequence[ChunkBox], codec_name: str) -> None:
        return None  # host memory is compressed by the I/O thread that writes it


class _DeviceOut:
    """A box of device memory being copied into a staging buffer."""

    __slots__ = ("_buf", "_done", "_nbytes", "_pool", "_shape", "_ticket", "_type")
    ready = False
    stable = True  # a staging buffer of this save's

    def __init__(
        self,
        buf: np.ndarray,
        nbytes: int,
        dtype: np.dtype[Any],
        sizes: tuple[int, ...],
        ticket: Ticket,
        pool: BufferPool,
    ) -> None:
        self._buf: np.ndarray | None = buf
        self._nbytes = nbytes
        self._type = dtype
        self._shape = sizes
        self._ticket = ticket
        self._pool = pool
        self._done = False

    def wait(self) -> np.ndarray:
        assert self._buf is not None, "wait() after release()"
        self._ticket.wait()
        self._done = True
        return self._buf[: self._nbytes].view(self._type).reshape(self._shape)

    def release(self) -> None:
        buf, self._buf = self._buf, None
        if buf is None:
            return
        if not self._done:
            # the queued copy may still be writing into the buffer: never hand it
            # to the next box before the copy ended (its error is the job's to report)
            with contextlib.suppress(Exception):
                self._ticket.wait()
        self._pool.release(buf)


class _DeviceIn:
    """A staging buffer to fill, then copied into a box of device memory."""

    __slots__ = ("_array", "_buf", "_nbytes", "_offsets", "_pool", "_sizes", "box")

    def __init__(
        self, array: DeviceArray, offsets: tuple[int, ...], sizes: tuple[int, ...], pool: BufferPool
    ) -> None:
        self._nbytes = math.prod(sizes) * array.dtype.itemsize
        buf = pool.acquire(self._nbytes)
        self._buf: np.ndarray | None = buf
        self._pool = pool
        self._array = array
        self._offsets = offsets
        self._sizes = sizes
        self.box = buf[: self._nbytes].view(array.dtype).reshape(sizes)

    def finish(self) -> None:
        self.start().wait()

    def start(self) -> Ticket:
        assert self._buf is not None, "start() after release()"
        a = self._array
        return a.backend.stage_in(self._buf[: self._nbytes], a.data, self._offsets, self._sizes)

    def release(self) -> None:
        # finish() waited for its copy (after start(), the caller waited for its ticket)
        buf, self._buf = self._buf, None
        if buf is not None:
            self._pool.release(buf)


@dataclass(slots=True)
class DeviceArray:
    """An array in device memory, with the back end that copies it."""

    data: Any
    backend: DeviceBackend
    dtype: np.dtype[Any]
    requires_grad: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.data.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.data.strides)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def memory_format(self) -> mf.MemoryFormat:
        return mf.detect_memory_format(self.shape, self.strides, self.dtype.itemsize)

    @property
    def pinned(self) -> bool:
        return False

    @property
    def writable(self) -> bool:
        return True

    def stage_out(self, offsets: tuple[int, ...], sizes: tuple[int, ...], staging: Staging) -> StagedOut:
        nbytes = math.prod(sizes) * self.dtype.itemsize
        pool = staging.pool(self.backend)
        buf = pool.acquire(nbytes)  # blocks while the budget is in use: back-pressure
        try:
            ticket = self.backend.stage_out(self.data, offsets, sizes, buf[:nbytes])
        except BaseException:
            pool.release(buf)
            raise
        return _DeviceOut(buf, nbytes, self.dtype, sizes, ticket, pool)

    def stage_in(self, offsets: tuple[int, ...], sizes: tuple[int, ...], staging: Staging) -> StagedIn:
        return _DeviceIn(self, offsets, sizes, staging.pool(self.backend))

    def copy_to_host(self, dst: np.ndarray, host_copy: HostCopy) -> Ticket:
        fmt = self.memory_format
        physical = dst.transpose(mf.physical_order(dst.ndim, fmt))
        if fmt is not mf.preserve_format and physical.flags.c_contiguous:
            # the raw memory image, one copy; a channels-last layout stays as it is
            return self.backend.snapshot_to_host(self.data, physical.reshape(-1).view(np.uint8))
        if not dst.flags.c_contiguous:
            raise ValueError(
                f"copy_to_host needs a dense destination in C order or in the array's memory format "
                f"({fmt.name}), got strides {dst.strides} for shape {dst.shape}"
            )
        return self.backend.stage_out(self.data, (0,) * dst.ndim, self.shape, dst.reshape(-1).view(np.uint8))

    def copy(self) -> DeviceArray:
        return DeviceArray(
            self.backend.copy_on_device(self.data), self.backend, self.dtype, self.requires_grad
        )

    def host_array(self) -> np.ndarray:
        raise TypeError("a device array has no host view; stage it through its backend")

    def content_digests(self, chunks: Sequence[ChunkBox]) -> list[tuple[bytes, bytes]] | None:
        hash_chunks = getattr(self.backend, "hash_chunks", None)  # back ends written before it: none
        return None if hash_chunks is None else hash_chunks(self.data, chunks)

    def encode_chunks(self, chunks: Sequence[ChunkBox], codec_name: str) -> list[np.ndarray] | None:
        encode = getattr(self.backend, "encode_chunks", None)  # back ends written before it: none
        return None if encode is None else encode(self.data, chunks, codec_name)


def _dlpack_device(value: Any) -> tuple[int, int] | None:
    fn = getattr(value, "__dlpack_device__", None)
    if fn is None:
        return None
    try:
        dev_type, dev_id = fn()
        return int(dev_type), int(dev_id)
    except Exception:
        return None


def _is_device_object(value: Any, dev: tuple[int, int] | None) -> bool:
    if dev is not None:  # DLPack says where the memory is
        return dev[0] not in (_DLPACK_CPU, _DLPACK_CUDA_HOST)
    return _has_attribute(value, "__cuda_array_interface__")


def _host_pinned(arr: np.ndarray) -> bool:
    # host memory is page-locked through a CUDA library; where CuPy is not loaded
    # yet, loading it (tens of MB, for every save of plain NumPy arrays) to ask is
    # not worth it: such memory then reports as not pinned
    if arr.size == 0 or "cupy" not in sys.modules:
        return False
    from gpuckpt.device import cuda

    return cuda.gpu_available() and cuda.is_pinned_pointer(arr.ctypes.data)


def adapt_leaf(value: Any, fqn: str) -> ArrayAdapter:
    """:func:`adapt` of the state's entry ``fqn``: what cannot be adapted is an
    :class:`~gpuckpt.errors.UnsupportedValueError` that names the entry and what to pass instead."""
    try:
        return adapt(value)
    except UnsupportedValueError as exc:
        raise UnsupportedValueError(
            f"tensor {fqn!r}: {exc}; gpuckpt stores dense, strided arrays in host or device memory: "
            "pass x.to_dense(), x.dequantize() or a materialized tensor instead (or leave it out)"
        ) from exc


def adapt(value: Any) -> ArrayAdapter:
    """The adapter for ``value``; raises :class:`UnsupportedValueError` for non-arrays.

    Host arrays (NumPy, CPU tensors through DLPack) are viewed without a copy;
    device arrays (CuPy, CUDA tensors, ``__cuda_array_interface__`` and CUDA
    DLPack objects) go to the CuPy backend; objects with a
    ``__gpuckpt_adapter__()`` method supply their own adapter.
    """
    if isinstance(value, np.ndarray):
        return HostArray(value, pinned=_host_pinned(value))
    hook = getattr(value, "__gpuckpt_adapter__", None)
    if hook is not None:
        return hook()  # type: ignore[no-any-return]
    requires_grad = bool(getattr(value, "requires_grad", False))
    dev = _dlpack_device(value)
    if _is_device_object(value, dev):
        from gpuckpt.device import cuda

        if not cuda.gpu_available():
            raise DeviceUnavailableError(
                f"{type(value).__module__}.{type(value).__qualname__} lives in device memory, but no usable "
                "GPU was found (CuPy missing, or no driver/device); install CuPy for your CUDA version "
                "(pip install 'gpuckpt[gpu]') on a machine with an NVIDIA GPU"
            )
        data, dtype, requires_grad = cuda.as_device_array(value)
        return DeviceArray(data, cuda.backend_for_device(int(data.device.id)), dtype, requires_grad)
    try:
        if type(value).__module__.startswith("torch"):
            t = value.detach()
            # a lazily negated or conjugated view (z.conj(), z.conj().imag): its memory holds the
            # values before the negation, which DLPack would export as they lie (or refuse); a
            # save takes the values (a resolved copy), a load cannot fill such a view in place
            lazy = bool(t.is_neg() or t.is_conj())
            if lazy:
                t = t.resolve_conj().resolve_neg()
            dtype, view = torch_dtype_view(t)
            arr = np.from_dlpack(view).view(dtype)
            if lazy:
                arr.flags.writeable = False
            pinned = bool(value.is_pinned())
        elif dev is not None and hasattr(value, "__dlpack__"):
            arr = np.from_dlpack(value)
            pinned = dev[0] == _DLPACK_CUDA_HOST
        else:
            arr = np.asarray(value)
            pinned = False
    except (TypeError, ValueError, BufferError, RuntimeError) as exc:
        raise UnsupportedValueError(
            f"cannot view {type(value).__qualname__} as a host array without copying: {exc}"
        ) from exc
    if arr.dtype == object:
        raise UnsupportedValueError(
            f"{type(value).__qualname__} converts to an object array; it cannot be stored"
        )
    return HostArray(arr, requires_grad=requires_grad, pinned=pinned)


class HostMemory:
    """Allocates host arrays for loads (the default memory target)."""

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any], memory_format: Any) -> np.ndarray:
        """An uninitialised array with ``shape`` whose strides follow ``memory_format``."""
        if len(shape) < 4 or memory_format is mf.contiguous_format:
            # C order (every format of fewer than 4 axes): the array itself, owning its memory
            return np.empty(shape, dtype=dtype)
        order = mf.physical_order(len(shape), memory_format)
        physical = np.empty(tuple(shape[a] for a in order), dtype=dtype)
        inverse = [order.index(a) for a in range(len(shape))]
        return physical.transpose(inverse)


def _tensor_view(value: Any) -> ArrayAdapter:
    """:func:`adapt` of what a save stores as a tensor; anything else (a list, a string, a NumPy
    scalar: plain values to a save) is an :class:`UnsupportedValueError` saying so."""
    if not is_array(value):
        raise UnsupportedValueError(
            f"TensorProperties.create_from_tensor takes an array (NumPy, CuPy, torch or another DLPack "
            f"array), got {type(value).__qualname__}, which a save stores as a plain value; pass "
            "np.asarray(value) to describe it as a tensor"
        )
    return adapt(value)


# TensorProperties.create_from_tensor reads arrays of every kind through adapt (the format
# declares what it reads and imports nothing of this layer)
register_array_view(_tensor_view)
