"""Asynchronous saves: snapshot the state into staging memory, write it in the background.

``async_save`` returns as soon as the state is copied into staging memory
that the library owns, so the caller may modify or free its arrays right
away without changing what is saved. The write, the durability barrier and
the atomic publication then run on one background thread: saves issued back
to back queue up in order instead of racing. Staging memory comes from an
:class:`~gpuckpt.device.staging.ArenaPool` and is reused by later saves, so a
training loop allocates it once; at most two snapshots exist at a time (one
being written, one being taken), and a third call waits for a free arena.

A returned future is a promise kept at exit: the interpreter's exit (the
main module ending, ``sys.exit``, an uncaught exception) first waits for
every queued save. A save that failed without anyone asking for its outcome
(``result()`` or ``exception()``) is reported on standard error, and the
process then exits with status 1. The threads involved are gpuckpt's own
(:mod:`gpuckpt.workers`), so nothing refuses the work during exit, and after
``fork()`` the child starts with empty queues and fresh locks: its own saves
run, the parent's saves stay the parent's.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from gpuckpt.device.arrays import HostArray
from gpuckpt.device.backend import DEFAULT_STAGING_BYTES, DeviceArray
from gpuckpt.device.staging import ArenaPool, StagingArena, aligned_bytes
from gpuckpt.errors import ForkedSaveError, InvalidOptionError
from gpuckpt.memory_format import physical_order, preserve_format
from gpuckpt.metadata import STATE_DICT_TYPE, Metadata
from gpuckpt.planning import DEFAULT_CHUNK_BYTES
from gpuckpt.progress import ProgressCallback
from gpuckpt.storage.local import direct_io_setting
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

__all__ = ["SaveFuture", "async_save", "wait_all"]

_lock = threading.Lock()
_executors: dict[int, Workers] = {}
_pools: dict[int, ArenaPool] = {}
_copy_threads = Workers(max(1, min(4, os.cpu_count() or 1)), "gpuckpt-snap")
_SLAB = 32 << 20

#: saves queued or running in this process, and saves that failed (kept until exit)
_inflight: set[SaveFuture] = set()
_failed: list[SaveFuture] = []
#: exit progress: the final drain has run (later saves run in the caller); a drain was interrupted
_exit = {"final": False, "interrupted": False}


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


def _writer_executor(coordinator: Any = None) -> Workers:
    """The background writer: one per process, and one per coordinator (rank) for distributed saves,
    so that ranks simulated by threads of one process do not queue behind each other."""
    key = 0 if coordinator is None else id(coordinator)
    with _lock:
        ex = _executors.get(key)
        if ex is None:
            ex = _executors[key] = Workers(1, "gpuckpt-async")
        return ex


class SaveFuture:
    """The result of :func:`async_save`: ``done()``, ``result(timeout)``, ``exception(timeout)``.

    Asking for the outcome (``result()`` or ``exception()``) takes charge of
    a failure; a failed save whose outcome nobody asked for is reported at
    exit, and makes the process exit with status 1.
    """

    def __init__(self, future: Future[Metadata], path: str) -> None:
        self._future = future
        self.path = path
        self._pid = os.getpid()
        self._observed = False
        self._reported = False

    def _outcome(self, timeout: float | None) -> BaseException | None:
        if os.getpid() != self._pid and not self._future.done():
            raise ForkedSaveError(
                f"the async save to {self.path} was started by process {self._pid} before it forked; "
                "it completes in that process only: wait for it there (this process saves on its own)"
            )
        try:
            # raises TimeoutError only while the save is unfinished (its own error may be a TimeoutError)
            exc = self._future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(f"async save to {self.path} not finished after {timeout} s") from None
        self._observed = True
        return exc

    def done(self) -> bool:
        """True once the checkpoint is published (or the save failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Metadata:
        """Wait for the save; returns its metadata or raises its error.

        Raises ``TimeoutError`` if it is not finished within ``timeout`` seconds.
        """
        self._outcome(timeout)
        return self._future.result()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save; returns its error, or None if it succeeded."""
        return self._outcome(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<SaveFuture {self.path} {state}>"


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
    ``result()``; a failed background save publishes nothing.

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
        return _submit(
            _writer_executor(coord),
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
        direct_io=direct_io_setting(True),
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
        return _submit(_writer_executor(), run, os.fspath(path))
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
        return _submit(_writer_executor(), run, os.fspath(path), hand_over)
    except BaseException:
        if not handed_over:  # never while the save may still be writing from it
            pool.release(arena)
        raise


def _submit(
    ex: Workers,
    fn: Callable[[], Metadata],
    path: str,
    handover: Callable[[Future[Metadata]], None] | None = None,
) -> SaveFuture:
    """Queue ``fn`` on ``ex`` (run it here once the exit drain is over) and track its future."""
    if _exit["final"]:
        # the interpreter is past its last drain: a queued save would be lost, so it runs now
        raw: Future[Metadata] = Future()
        raw.set_running_or_notify_cancel()
        try:
            raw.set_result(fn())
        except BaseException as exc:
            raw.set_exception(exc)
    else:
        raw = ex.submit(fn)
    fut = SaveFuture(raw, path)
    with _lock:
        _inflight.add(fut)
    if handover is not None:
        handover(raw)
    raw.add_done_callback(lambda _: _settled(fut))
    return fut


def _settled(fut: SaveFuture) -> None:
    """Runs once a save is done: it is no longer in flight; a failure is kept for the exit report."""
    failed = not fut._future.cancelled() and fut._future.exception() is not None
    with _lock:
        _inflight.discard(fut)
        if failed:
            _failed.append(fut)


def wait_all() -> None:
    """Block until every queued async save has finished (errors stay in their futures)."""
    _drain_all()


def release_staging() -> None:
    """Free the cached staging memory of finished saves."""
    with _lock:
        pools = list(_pools.values())
    for p in pools:
        p.clear()


def _drain_all() -> None:
    # loop: a save may be queued (or a writer created) while others are waited for
    while True:
        with _lock:
            executors = list(_executors.values())
        if not any(ex.pending() for ex in executors):
            return
        for ex in executors:
            ex.drain()


def _report(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass  # no usable stderr: nothing else to tell


def _unhandled_failures() -> list[SaveFuture]:
    with _lock:
        return [f for f in _failed if not f._observed]


def _drain_at_exit(final: bool) -> None:
    """Wait for every queued save before the interpreter goes (a return from async_save
    promised that the state would be written); report what could not be written.

    Runs twice: before the interpreter joins its threads (this also runs in a
    ``multiprocessing`` child, which skips ``atexit``) and, ``final``, from
    ``atexit``, after the program's own exit handlers, which may have saved too.
    """
    if not _exit["interrupted"]:
        try:
            _drain_all()
        except KeyboardInterrupt:
            _exit["interrupted"] = True
            with _lock:
                paths = sorted(f.path for f in _inflight)
            _report(
                "gpuckpt: interrupted while waiting for background saves at exit; not written: "
                f"{', '.join(paths) or '(none)'} (nothing was published for them; an earlier "
                "checkpoint at the same path is intact)\n"
            )
    if final:
        _exit["final"] = True
    failures = _unhandled_failures()
    for f in failures:
        if f._reported:
            continue
        f._reported = True
        exc = f._future.exception()
        assert exc is not None
        _report(
            f"gpuckpt: the background save to {f.path} failed and its result was never asked for; "
            "nothing was published there:\n" + "".join(traceback.format_exception(exc))
        )
    if final and (failures or _exit["interrupted"]):
        _report(
            "gpuckpt: exiting with status 1 because a background save did not complete (see above); "
            "call result() on the future async_save returns to handle its errors\n"
        )
        _exit_now(1)


def _exit_now(status: int) -> None:
    """End the process with ``status`` (Python's own exit status is fixed before exit handlers
    run): flush what would be flushed, then leave."""
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _after_fork_in_child() -> None:
    # the parent's saves (queued, running or failed) are the parent's to finish and report;
    # the worker pools and arena pools reset themselves
    global _lock
    _lock = threading.Lock()
    _inflight.clear()
    _failed.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# the final drain runs from atexit (registered now, at import: after handlers registered
# later, which may still save); the first, before the interpreter joins its threads
atexit.register(_drain_at_exit, True)
_register_before_thread_join = getattr(threading, "_register_atexit", None)
if _register_before_thread_join is not None:
    with contextlib.suppress(RuntimeError):  # imported while the interpreter is already exiting
        _register_before_thread_join(_drain_at_exit, False)
