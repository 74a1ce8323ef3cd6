"""Asynchronous saves: snapshot the state into staging memory, write it in the background.

``async_save`` returns as soon as the state is copied into staging memory
that the library owns, so the caller may modify or free its arrays right
away without changing what is saved. The write, the durability barrier and
the atomic publication then run on one background thread: saves issued back
to back queue up in order instead of racing. Staging memory comes from an
:class:`~gpuckpt.device.staging.ArenaPool` and is reused by later saves, so a
training loop allocates it once; at most two snapshots exist at a time (one
being written, one being taken), and a third call waits for a free arena.

The returned future is a promise kept at exit, and a forked child saves on
its own: see :mod:`gpuckpt.pending`.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from gpuckpt.device.arrays import DeviceArray, HostArray
from gpuckpt.device.backend import DEFAULT_STAGING_BYTES
from gpuckpt.device.staging import ArenaPool, StagingArena, aligned_bytes
from gpuckpt.errors import InvalidOptionError
from gpuckpt.memory_format import physical_order, preserve_format
from gpuckpt.metadata import STATE_DICT_TYPE, Metadata
from gpuckpt.options import SaveOptions
from gpuckpt.pending import SaveFuture, submit, wait_all, writer_executor
from gpuckpt.planning import DEFAULT_CHUNK_BYTES
from gpuckpt.progress import ProgressCallback
from gpuckpt.storage.stores import open_writer
from gpuckpt.workers import Workers
from gpuckpt.writing import (
    SavePlan,
    TensorPlan,
    build_save_plan,
    check_save_options,
    device_backends,
    execute_save,
)

__all__ = ["SaveFuture", "async_save", "release_staging", "wait_all"]

_lock = threading.Lock()
_pools: dict[int, ArenaPool] = {}
_copy_threads = Workers(max(1, min(4, os.cpu_count() or 1)), "gpuckpt-snap")
_SLAB = 32 << 20
_writer_executor = writer_executor  # the name tests use to occupy the writer


def _arena_pool(plan: SavePlan) -> ArenaPool:
    """The arena pool for this state: page-locked memory when device arrays are involved."""
    backend = next(iter(device_backends(plan)), None)
    key = id(backend) if backend is not None else 0
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            allocator = backend.pinned_allocator() if backend is not None else None
            pool = _pools[key] = ArenaPool(allocator, max_arenas=2)
        return pool


def _copy_slabs(dst: np.ndarray, src: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split a copy into slabs along the outermost physical axis, for parallel copying."""
    if dst.ndim == 0 or dst.nbytes <= _SLAB or dst.shape[0] < 2:
        return [(dst, src)]
    rows = max(1, _SLAB // max(1, dst.nbytes // dst.shape[0]))
    return [(dst[i : i + rows], src[i : i + rows]) for i in range(0, dst.shape[0], rows)]


def _copy_all(copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for d, s in copies:
        np.copyto(d, s)


def _run_copies(copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Run the copies on the copy threads in tasks of about one slab each: small
    tensors are gathered into slab-sized batches (one task per tensor would cost
    thousands of small tensors more than their copies), and slab-sized tasks keep
    the threads evenly loaded when one of them is slowed down."""
    total = sum(d.nbytes for d, _ in copies)
    if len(copies) <= 1 or total <= _SLAB:
        _copy_all(copies)
        return
    batches: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    size = 0
    for c in copies:
        if size >= _SLAB:
            batches.append([])
            size = 0
        batches[-1].append(c)
        size += c[0].nbytes
    # NumPy releases the GIL for plain copies: batches copy in parallel
    _wait_for_all([f.result for f in [_copy_threads.submit(_copy_all, b) for b in batches]])


def _wait_for_all(waits: list[Callable[[], Any]]) -> None:
    """Call every wait, even after one failed or was interrupted, then raise the first error.

    The arena is given back when a snapshot fails: no copy may still be writing
    into it then (it would write into the next snapshot). An interrupted wait
    is retried; a copy ends soon.
    """
    error: BaseException | None = None
    for wait in waits:
        while True:
            try:
                wait()
            except KeyboardInterrupt as exc:
                error = error or exc
                continue
            except BaseException as exc:
                error = error or exc
            break
    if error is not None:
        raise error


def _rebind(t: TensorPlan, array: Any) -> None:
    t.array = array
    for j in t.jobs:
        j.source = array


def snapshot(plan: SavePlan, arena: StagingArena) -> None:
    """Copy every tensor of ``plan`` into ``arena`` (host memory) and point the plan at the copies.

    Host tensors are copied keeping their memory layout (slabs in parallel);
    dense device tensors are copied as their raw memory image, one
    device-to-host copy each, so a channels-last tensor is transposed later,
    by the background writer, not while the caller waits.
    """
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    tickets = []
    for b in device_backends(plan):
        b.wait_for_producers()
    for t in plan.tensors:
        fmt = t.properties.memory_format
        order = physical_order(len(t.shape), fmt)
        dst = arena.take_array(t.shape, t.dtype, order)
        src = t.array
        assert src is not None, "snapshots are taken of single-process plans"
        if isinstance(src, DeviceArray):
            dev = src
            raw = dst.transpose(order).reshape(-1).view(np.uint8)
            if fmt is preserve_format:
                tickets.append(dev.backend.stage_out(dev.data, (0,) * dst.ndim, dst.shape, raw))
            else:
                tickets.append(dev.backend.snapshot_to_host(dev.data, raw))
        else:
            copies.extend(_copy_slabs(dst, src.host_array()))
        _rebind(t, HostArray(dst, requires_grad=t.properties.requires_grad, pinned=t.properties.pin_memory))
    try:
        _run_copies(copies)
    finally:
        _wait_for_all([ticket.wait for ticket in tickets])


def snapshot_on_device(plan: SavePlan) -> None:
    """Copy every device tensor of ``plan`` within device memory (``staging="device"``)."""
    backends = device_backends(plan)
    for b in backends:
        b.wait_for_producers()
    for t in plan.tensors:
        src = t.array
        assert src is not None, "snapshots are taken of single-process plans"
        if isinstance(src, DeviceArray):
            copy = src.backend.copy_on_device(src.data)
            _rebind(t, DeviceArray(copy, src.backend, src.dtype, src.requires_grad))
        else:
            _rebind(
                t, HostArray(src.host_array().copy(), t.properties.requires_grad, t.properties.pin_memory)
            )
    for b in backends:
        b.synchronize()


def _copy_array(value: Any) -> Any:
    from gpuckpt.device.arrays import adapt

    a = adapt(value)
    if isinstance(a, DeviceArray):
        copy = a.backend.copy_on_device(a.data)
        a.backend.synchronize()
        return _Adapted(DeviceArray(copy, a.backend, a.dtype, a.requires_grad))
    return a.host_array().copy(order="K")


class _Adapted:
    """A snapshot copy that keeps its adapter (dtype, requires_grad) for the save."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self.shape = adapter.shape

    def __gpuckpt_adapter__(self) -> Any:
        return self.adapter


def _copy_state(value: Any, depth: int = 0) -> Any:
    """A copy of a state dict whose arrays (and ShardedArray locals) are snapshots."""
    import copy

    from gpuckpt.device.arrays import is_array
    from gpuckpt.distributed.sharded import ShardedArray

    if isinstance(value, ShardedArray):
        return ShardedArray(_copy_array(value.local), value.offsets, value.global_shape)
    if is_array(value):
        return _copy_array(value)
    if isinstance(value, dict):
        return {k: _copy_state(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_state(v, depth + 1) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_state(v, depth + 1) for v in value)
    return copy.deepcopy(value)


def async_save(
    state_dict: STATE_DICT_TYPE,
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    allow_pickle: bool = False,
    sync: str = "auto",
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    staging: str = "host",
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    storage_options: dict[str, Any] | None = None,
    coordinator: Any = None,
    portable: bool = False,
) -> SaveFuture:
    """Snapshot ``state_dict`` and save it to ``path`` in the background.

    Returns once the snapshot is taken: the caller may then change or free
    its arrays. Options are those of :func:`gpuckpt.save`. Errors (including
    an existing ``path`` without ``overwrite``) surface from the future's
    ``result()``; a failed background save publishes nothing. Invalid
    options raise :class:`~gpuckpt.errors.InvalidOptionError` from the call
    itself, before anything is taken; staging memory that cannot be had
    raises :class:`~gpuckpt.errors.StagingMemoryError`.

    The process does not exit before the saves it queued are written; a save
    that failed without its ``result()`` or ``exception()`` being asked for is
    reported on standard error at exit and makes the exit status 1.

    ``staging="host"`` (default) snapshots into reusable host memory
    (page-locked for device arrays): the call blocks for about one
    device-to-host copy of the state. ``staging="device"`` snapshots device
    arrays into spare device memory (about one device-to-device copy) and
    drains them to storage through the pinned staging pipeline in the
    background; it needs free device memory the size of the state.

    With a ``coordinator`` (a distributed save), every rank snapshots its own
    arrays and the collective save runs on the background thread: the
    application must not use the same communicator until ``result()`` returns
    (with MPI, or use an ``MPI_THREAD_MULTIPLE`` build and a separate communicator).

    Examples
    --------
    >>> import numpy as np, gpuckpt, tempfile, os
    >>> w = np.ones(4)
    >>> fut = gpuckpt.async_save({"w": w}, os.path.join(tempfile.mkdtemp(), "ckpt"))
    >>> w[:] = 0  # does not change what is saved
    >>> fut.result().state_dict_metadata["w"].size
    (4,)
    """
    if staging not in ("host", "device"):
        raise InvalidOptionError(
            f"staging={staging!r} is not a staging mode; expected 'host' (snapshot into host memory) "
            "or 'device' (snapshot into spare device memory)"
        )
    # every option is checked before anything is taken (staging memory, copies, files)
    check_save_options(
        chunk_bytes=chunk_bytes, sync=sync, threads=threads, staging_bytes=staging_bytes, progress=progress
    )
    from gpuckpt.distributed.save import contains_sharded, distributed_save

    if coordinator is not None or contains_sharded(state_dict):
        from gpuckpt.distributed.coordinator import SingleProcessCoordinator

        copied = _copy_state(state_dict)
        coord = coordinator or SingleProcessCoordinator()
        return submit(
            writer_executor(coord),
            lambda: distributed_save(
                copied,
                path,
                coord,
                overwrite=overwrite,
                chunk_bytes=chunk_bytes,
                allow_pickle=allow_pickle,
                sync=sync,
                threads=threads,
                progress=progress,
                staging_bytes=staging_bytes,
                portable=portable,
            ),
            os.fspath(path),
        )
    plan = build_save_plan(state_dict, chunk_bytes=chunk_bytes, allow_pickle=allow_pickle)
    # opening the writer checks the path's scheme and the writer's options; it touches no file
    writer = open_writer(
        path,
        overwrite=overwrite,
        sync=sync,
        expected_files=plan.nfiles,
        storage_options=storage_options,
        # straight from the arena to the device: no dirty page cache next to the training process
        direct_io=SaveOptions().use_direct_io(True),
    )

    def run() -> Metadata:
        return execute_save(
            plan,
            writer,
            threads=threads,
            checkpoint_id=str(uuid.uuid4()),
            progress=progress,
            staging_bytes=staging_bytes,
        )

    if staging == "device":
        snapshot_on_device(plan)
        return submit(writer_executor(), run, os.fspath(path))
    pool = _arena_pool(plan)
    arena = pool.acquire(sum(aligned_bytes(t.nbytes) for t in plan.tensors))
    handed_over = False

    def hand_over(raw: Future[Metadata]) -> None:
        # from here on the arena belongs to the save, and is released when it is done
        nonlocal handed_over
        pool.hold(arena, raw)
        raw.add_done_callback(lambda _: pool.release(arena))
        handed_over = True

    try:
        snapshot(plan, arena)
        return submit(writer_executor(), run, os.fspath(path), hand_over)
    except BaseException:
        if not handed_over:  # never while the save may still be writing from it
            pool.release(arena)
        raise


def release_staging() -> None:
    """Free the cached staging memory of finished saves."""
    with _lock:
        pools = list(_pools.values())
    for p in pools:
        p.clear()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # it may have been held by a thread the child does not have


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
