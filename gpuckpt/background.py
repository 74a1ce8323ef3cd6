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

import math
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, HostArray, copy_all, device_backends
from gpuckpt.device.staging import ArenaPool, HostAllocator, StagingArena, aligned_bytes, pool_for
from gpuckpt.distributed.coordinator import Coordinator, SingleProcessCoordinator, check_coordinator
from gpuckpt.distributed.save import Described, save_described
from gpuckpt.format.memory_format import physical_order
from gpuckpt.format.metadata import STATE_DICT_TYPE, Metadata
from gpuckpt.options import DEFAULT_CHUNK_BYTES, DEFAULT_STAGING_BYTES, SaveOptions
from gpuckpt.pending import SaveFuture, submit, wait_all, writer_executor
from gpuckpt.planning.plan import PlanMemo, SavePlan, StateDescription, plan_save
from gpuckpt.progress import ProgressCallback
from gpuckpt.runtime.collector import paused_gc
from gpuckpt.runtime.workers import Workers
from gpuckpt.saving.compression import resolve as resolve_compression
from gpuckpt.saving.incremental import check_base_target
from gpuckpt.saving.session import execute_save
from gpuckpt.saving.sources import Source, contains_sharded, describe_state
from gpuckpt.saving.writing import open_save_writer, shared_with_base

__all__ = [
    "SaveFuture",
    "async_save",
    "async_save_with_options",
    "copy_host_arrays",
    "host_order",
    "snapshot",
    "snapshot_bytes",
    "snapshot_on_device",
    "wait_all",
]

#: a local state of at least this many tensors is planned by the background save
BACKGROUND_PLAN_MIN = 256

_lock = threading.Lock()
_pools: dict[int, ArenaPool] = {}
_copy_threads = Workers(max(1, min(4, os.cpu_count() or 1)), "gpuckpt-snap")
_SLAB = 32 << 20
_writer_executor = writer_executor  # the name tests use to occupy the writer


def _arrays(sources: dict[str, tuple[Source, ...]]) -> Iterable[ArrayAdapter]:
    return (s.array for held in sources.values() for s in held)


def _pool_of(backend: Any) -> ArenaPool:
    with _lock:
        return pool_for(_pools, backend, max_arenas=2)


def _arena_pool(sources: dict[str, tuple[Source, ...]]) -> ArenaPool:
    """The arena pool for this state: page-locked memory when device arrays are involved."""
    return _pool_of(next(iter(device_backends(_arrays(sources))), None))


def host_arena_pool() -> ArenaPool:
    """The pool that snapshots of host arrays take their staging memory from (a benchmark's
    ceiling copies into that very memory: two allocations of the same size need not copy as
    fast on a virtual machine)."""
    return _pool_of(None)


def snapshot_bytes(sources: dict[str, tuple[Source, ...]]) -> int:
    """What a snapshot of ``sources`` takes of an arena."""
    return sum(aligned_bytes(math.prod(a.shape) * a.dtype.itemsize) for a in _arrays(sources))


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


def snapshot(
    local: StateDescription,
    sources: dict[str, tuple[Source, ...]],
    arena: StagingArena,
    shared: Mapping[tuple[str, int], ArrayAdapter] | None = None,
) -> dict[str, tuple[Source, ...]]:
    """Copies in ``arena`` (host memory) of the arrays of the state described by ``local``:
    the sources a save of it is bound to. ``shared``: stand-ins, by ``(FQN, box)``, of
    arrays not copied because the save shares every chunk of them with its base
    (:func:`~gpuckpt.saving.writing.shared_with_base`).

    Host arrays are copied keeping their memory layout (slabs in parallel);
    dense device arrays are copied as their raw memory image, one
    device-to-host copy each, so a channels-last tensor is transposed later,
    by the background writer, not while the caller waits.
    """
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    tickets = []
    for b in device_backends(_arrays(sources)):
        b.wait_for_producers()
    out: dict[str, tuple[Source, ...]] = {}

    def host_copy(d: np.ndarray, a: np.ndarray) -> None:
        copies.extend(_copy_slabs(d, a))

    # (once per array of a state of thousands: nothing made per array that one will do)
    stand_ins = shared or {}
    take_array = arena.take_array
    try:
        for t in local.tensors:
            held = sources[t.fqn]
            snap = []
            for box, s in enumerate(held):
                stand_in = stand_ins.get((t.fqn, box)) if stand_ins else None
                if stand_in is not None:
                    snap.append(Source(stand_in, s.offsets))
                    continue
                src = s.array
                # a tensor held whole has the description's layout; ShardedArray boxes each their own
                fmt = t.properties.memory_format if len(held) == 1 else src.memory_format
                shape = src.shape
                dst = take_array(shape, src.dtype, physical_order(len(shape), fmt))
                # device memory: one queued copy of the raw image; host memory: slabs copied in parallel
                tickets.append(src.copy_to_host(dst, host_copy))
                snap.append(Source(HostArray(dst, snapshot=True), s.offsets))
            out[t.fqn] = tuple(snap)
        _run_copies(copies)
    finally:
        # also when taking memory failed half-way: no copy may still write into the arena
        _wait_for_all([ticket.wait for ticket in tickets])
    return out


def host_order(array: np.ndarray) -> tuple[int, ...]:
    """The physical axis order a snapshot gives its copy of host ``array`` (that of the
    array's memory format: C order unless it is channels-last)."""
    return physical_order(array.ndim, HostArray(array).memory_format)


def copy_host_arrays(
    arrays: Sequence[np.ndarray], orders: Sequence[tuple[int, ...]], arena: StagingArena
) -> list[np.ndarray]:
    """Copies in ``arena`` of host ``arrays``, each laid out in its physical axis order
    (:func:`host_order`), as :func:`snapshot` copies host arrays (slabs in parallel):
    what a snapshot of plain host arrays costs, without describing them as a state."""
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    out = []
    for a, order in zip(arrays, orders, strict=True):
        dst = arena.take_array(a.shape, a.dtype, order)
        copies.extend(_copy_slabs(dst, a))
        out.append(dst)
    _run_copies(copies)
    return out


def snapshot_on_device(sources: dict[str, tuple[Source, ...]]) -> dict[str, tuple[Source, ...]]:
    """Copies of every source array: device arrays within device memory (``staging="device"``),
    host arrays in host memory."""
    backends = device_backends(_arrays(sources))
    for b in backends:
        b.wait_for_producers()
    # all arrays of a back end in one device allocation, in one (batched) copy or one per run
    flat = [(fqn, s) for fqn, held in sources.items() for s in held]
    copies = copy_all([s.array for _, s in flat])
    out: dict[str, list[Source]] = {fqn: [] for fqn in sources}
    for (fqn, s), copied in zip(flat, copies, strict=True):
        out[fqn].append(Source(copied, s.offsets))
    for b in backends:
        b.synchronize()
    return {fqn: tuple(snap) for fqn, snap in out.items()}


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
    base: str | os.PathLike[str] | None = None,
    content_hash: bool = False,
    compression: str | dict[str, Any] | None = None,
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
    A distributed save's snapshot is taken into memory of its own (ranks
    simulated by threads of one process must not wait for each other's
    arenas), and what fails on one rank, in the snapshot too, fails the save
    on every rank, from ``result()``.

    Examples
    --------
    >>> import numpy as np, gpuckpt, tempfile, os
    >>> w = np.ones(4)
    >>> fut = gpuckpt.async_save({"w": w}, os.path.join(tempfile.mkdtemp(), "ckpt"))
    >>> w[:] = 0  # does not change what is saved
    >>> fut.result().state_dict_metadata["w"].size
    (4,)
    """
    # every option is checked before anything is taken (staging memory, copies, files)
    options = SaveOptions(
        overwrite=overwrite,
        chunk_bytes=chunk_bytes,
        allow_pickle=allow_pickle,
        sync=sync,
        threads=threads,
        progress=progress,
        staging=staging,
        staging_bytes=staging_bytes,
        storage_options=storage_options,
        portable=portable,
        base=base,
        content_hash=content_hash,
        compression=compression,
    )
    return async_save_with_options(state_dict, path, options, coordinator)


@paused_gc()
def async_save_with_options(
    state_dict: STATE_DICT_TYPE,
    path: str | os.PathLike[str],
    options: SaveOptions,
    coordinator: Coordinator | None = None,
    *,
    writer_thread: Workers | None = None,
    reuse_files_of: str | os.PathLike[str] | None = None,
    file_maps: Any = None,
    described: tuple[StateDescription, dict[str, tuple[Source, ...]]] | None = None,
    plans: PlanMemo | None = None,
) -> SaveFuture:
    """:func:`async_save` with its options made (what :class:`~gpuckpt.CheckpointManager` calls).

    The cyclic garbage collector is paused until it returns (describing, planning and
    the snapshot: the caller's wait), not while the save writes in the background.
    ``writer_thread``: the thread that writes a single process's save (default: the
    process's writer thread); a local tier passes its own.
    ``reuse_files_of``: a directory the caller gives up, whose files the save's files of the
    same names may overwrite (:meth:`~gpuckpt.storage.base.CheckpointWriter.reuse_files_of`;
    a single process's save to a local directory; a local tier passes the part it retires),
    and ``file_maps``, where the caller keeps maps of those files to write through them (a
    tier on tmpfs: :class:`~gpuckpt.storage.local.filemaps.FileMaps`).
    ``described``: ``describe_state(state_dict, allow_pickle=options.allow_pickle)``, where the
    caller made it already (a local tier, which digests the part's layout from it); a state
    of a single process, no ShardedArray. ``plans``: where the caller keeps the last plan of
    the same tensors (:class:`~gpuckpt.planning.plan.PlanMemo`)."""
    check_coordinator(coordinator)
    check_base_target(path, options)
    if described is None and (coordinator is not None or contains_sharded(state_dict)):
        return _async_distributed(state_dict, path, options, coordinator or SingleProcessCoordinator())
    if described is not None and coordinator is not None:
        raise ValueError("async_save_with_options: a description is for a single process's save")
    local, sources = (
        describe_state(state_dict, allow_pickle=options.allow_pickle) if described is None else described
    )

    # the plan of a state of many tensors is made by the save, in the background (a tenth of
    # a second for 10,000 tensors, more than their copy); an incremental save needs it now,
    # to leave out the arrays it shares with its base. A process's whole arrays plan without
    # error: what could be wrong with them was found by describe_state.
    compression = resolve_compression(path, options, local, sources)

    def make_plan() -> SavePlan:
        if plans is not None:
            return plans.plan_save(
                local, chunk_bytes=options.chunk_bytes, portable=options.portable, compression=compression
            )
        return plan_save(
            [local], chunk_bytes=options.chunk_bytes, portable=options.portable, compression=compression
        )

    later = options.base is None and len(local.tensors) >= BACKGROUND_PLAN_MIN
    plan = None if later else make_plan()
    # opening the writer checks the path's scheme and the writer's options; it touches no file.
    # Large chunks go straight from the snapshot to the device: no dirty page cache next to
    # the training process. (Without the plan: at least a document per tensor and the root's.)
    writer = open_save_writer(
        path,
        options,
        expected_files=len(local.tensors) + 1 if plan is None else plan.nfiles,
        direct_io=options.use_direct_io(True),
    )
    if reuse_files_of is not None:
        writer.reuse_files_of(reuse_files_of, file_maps)

    def run(snap: dict[str, tuple[Source, ...]]) -> Callable[[], Metadata]:
        def save() -> Metadata:
            planned = plan if plan is not None else make_plan()
            return execute_save(planned, snap, writer, options, checkpoint_id=str(uuid.uuid4()))

        return save

    ex = writer_thread if writer_thread is not None else writer_executor()
    if options.staging == "device":
        return submit(ex, run(snapshot_on_device(sources)), os.fspath(path))
    pool = _arena_pool(sources)
    arena = pool.acquire(snapshot_bytes(sources))
    handed_over = False

    def hand_over(raw: Future[Metadata]) -> None:
        # from here on the arena belongs to the save, and is released when it is done
        nonlocal handed_over
        pool.hold(arena, raw)
        raw.add_done_callback(lambda _: pool.release(arena))
        handed_over = True

    try:
        # an incremental save hashes device arrays now, on their device: arrays whose every
        # chunk equals the base's are not copied (the save shares their chunks)
        snap = snapshot(
            local, sources, arena, None if plan is None else shared_with_base(plan, sources, options)
        )
        return submit(ex, run(snap), os.fspath(path), hand_over)
    except BaseException:
        if not handed_over:  # never while the save may still be writing from it
            pool.release(arena)
        raise


def _async_distributed(
    state_dict: STATE_DICT_TYPE, path: str | os.PathLike[str], options: SaveOptions, coord: Coordinator
) -> SaveFuture:
    """A distributed save of a snapshot of this rank's state, on the rank's writer thread."""
    described: Described | None = None
    error: Exception | None = None
    try:
        local, sources = describe_state(state_dict, allow_pickle=options.allow_pickle)
        if options.staging == "device":
            snap = snapshot_on_device(sources)
        else:
            # memory of this save's own: pooled arenas would make ranks that are threads of one
            # process wait for each other's saves, which need every rank to finish
            backend = next(iter(device_backends(_arrays(sources))), None)
            arena = StagingArena(backend.pinned_allocator() if backend is not None else HostAllocator())
            arena.reset(snapshot_bytes(sources))
            snap = snapshot(local, sources, arena)
        described = (local, snap)
    except Exception as exc:  # the other ranks learn of it in the save's first collective step
        error = exc

    def describe() -> Described:
        if error is not None:
            raise error
        assert described is not None
        return described

    return submit(
        writer_executor(coord), lambda: save_described(describe, path, coord, options), os.fspath(path)
    )


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # it may have been held by a thread the child does not have


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
