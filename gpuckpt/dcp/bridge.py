"""Every call ``gpuckpt.dcp`` makes into gpuckpt's save and load machinery, in one module.

The DCP classes (:mod:`~gpuckpt.dcp.writer`, :mod:`~gpuckpt.dcp.reader`,
:mod:`~gpuckpt.dcp.stager`) use gpuckpt's internals only through the functions
here (besides the public metadata model, dtypes, memory formats, options and
errors), and these use the same entry points as gpuckpt's own distributed
save, resharding load and background snapshot: nothing of the save or load
logic is repeated. What they rely on:

- options: :class:`gpuckpt.options.SaveOptions` and
  :class:`~gpuckpt.options.LoadOptions` (made, and so checked, when the Writer
  or Reader is);
- planning: :func:`gpuckpt.planning.plan.plan_save` from one
  :class:`~gpuckpt.planning.plan.StateDescription` per rank (its
  :class:`~gpuckpt.planning.boxes.LocalTensor` boxes, as for ``ShardedArray``
  saves), whose :class:`~gpuckpt.planning.plan.ChunkAssignment` records say
  what each rank writes;
- writing: :func:`gpuckpt.saving.writing.open_save_writer`,
  :func:`gpuckpt.storage.stores.attach_writer` (ranks other than the
  coordinator), :func:`gpuckpt.saving.writing.write_array_documents` (its ``defer``),
  :func:`gpuckpt.saving.writing.bind_jobs` over :class:`gpuckpt.saving.sources.Source`
  records of :func:`gpuckpt.device.arrays.adapt`-ed tensors,
  :func:`gpuckpt.saving.writing.write_chunks` (its ``documents``),
  :func:`gpuckpt.saving.commit.assemble_metadata`, the ``writing`` abort guard,
  the chunk table in blocks (:func:`gpuckpt.planning.table.table_layout`,
  :mod:`gpuckpt.saving.table_blocks`: each rank stores its own rows and reports
  their checksums only),
  :func:`gpuckpt.format.values.encode_object` and
  :func:`gpuckpt.format.documents.root_document` with ``CheckpointWriter.commit``
  / ``abort``;
- reading: :func:`gpuckpt.loading.open.open_checkpoint` (its index's ``TensorEntry``
  values and metadata), ``is_committed``, ``check_chunk_files``, :func:`gpuckpt.distributed.load.read_boxes`,
  ``read_tensors`` (into adapters), :func:`gpuckpt.format.values.decode_object`
  and :func:`gpuckpt.state.unflatten_state_dict`;
- snapshots: :func:`gpuckpt.saving.sources.describe_state`,
  :func:`gpuckpt.background.snapshot` / ``snapshot_on_device`` /
  ``snapshot_bytes``, ``host_order`` / ``copy_host_arrays`` (host arrays laid
  out once, copied again) and the :class:`~gpuckpt.device.staging.ArenaPool`
  of staging memory (its ``hold``, ``reserved_bytes`` and ``grace``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.background import copy_host_arrays, host_order, snapshot_bytes, snapshot_on_device
from gpuckpt.background import snapshot as snapshot_to_arena
from gpuckpt.device.arrays import DeviceArray, HostArray, HostMemory, adapt, canonical_bools, device_backends
from gpuckpt.device.staging import ArenaPool, StagingArena, aligned_bytes, pool_for
from gpuckpt.distributed.cooperative import read_cooperative
from gpuckpt.distributed.coordinator import Coordinator
from gpuckpt.distributed.load import read_boxes
from gpuckpt.errors import StagingTimeoutError
from gpuckpt.format.dtypes import dtype_name
from gpuckpt.format.metadata import Metadata, TensorProperties
from gpuckpt.format.records import TABLE_MIN_CHUNKS
from gpuckpt.format.values import decode_object, encode_object
from gpuckpt.loading import open as load_open
from gpuckpt.loading.checks import TensorEntry, check_chunk_files, overclaimed
from gpuckpt.loading.chunk_reads import read_tensors
from gpuckpt.options import LoadOptions, SaveOptions
from gpuckpt.planning.boxes import Box, LocalTensor
from gpuckpt.planning.plan import ChunkAssignment, SavePlan, StateDescription, plan_save
from gpuckpt.planning.table import TableLayout, table_layout
from gpuckpt.planning.uniform import compact_description
from gpuckpt.runtime.collector import paused_gc
from gpuckpt.saving.commit import Written, as_columns, result_columns, table_columns
from gpuckpt.saving.compression import resolve_unsampled
from gpuckpt.saving.incremental import BaseIndex, ChunkResult, check_base_target, open_base_for
from gpuckpt.saving.incremental import open_base as _open_base
from gpuckpt.saving.session import SaveSession
from gpuckpt.saving.sources import Source, describe_state
from gpuckpt.saving.table_blocks import BlockReport, write_table_documents
from gpuckpt.saving.table_blocks import write_block as _write_block
from gpuckpt.saving.writing import (
    array_document_of,
    bind_jobs,
    open_save_writer,
    write_chunks,
    writing,
)
from gpuckpt.state import unflatten_state_dict
from gpuckpt.storage.base import CheckpointReader, CheckpointWriter
from gpuckpt.storage.stores import attach_writer, is_committed, scheme_of

__all__ = [
    "BaseIndex",
    "BlockReport",
    "Box",
    "ChunkAssignment",
    "ChunkResult",
    "HostLayout",
    "OpenCheckpoint",
    "OpenSave",
    "SavePlan",
    "Snapshot",
    "TableLayout",
    "Written",
    "abort_save",
    "attach",
    "begin_save",
    "commit_save",
    "host_layout",
    "is_checkpoint",
    "location_supported",
    "open_base",
    "open_checkpoint",
    "plan",
    "read_boxes_into",
    "read_value",
    "read_whole",
    "rebuild",
    "reported_rows",
    "reusable_arrays",
    "snapshot",
    "snapshot_host",
    "staged_bytes",
    "table_columns",
    "write_assigned",
    "write_block",
]

#: what one rank holds of one tensor: ``(fqn, global shape, dtype, properties, boxes)``
HeldTensor = tuple[str, tuple[int, ...], np.dtype[Any], TensorProperties, Sequence[Box]]


# save -----------------------------------------------------------------------


def plan(
    held_by_rank: Sequence[Sequence[HeldTensor]], options: SaveOptions, path: str | os.PathLike[str] = ""
) -> SavePlan:
    """The save plan (chunk grids, each rank's chunks) from the boxes each rank holds (``path``:
    where it goes, for ``compression="auto"``, which samples nothing here: see
    :func:`~gpuckpt.saving.compression.resolve_unsampled`).

    Plain values are not planned: DCP hands them over only in ``write_data``,
    and :func:`commit_save` adds them.
    """
    ranks = [
        StateDescription(
            tuple(
                LocalTensor(fqn, shape, dtype_name(dt), dt.itemsize, props, tuple(boxes))
                for fqn, shape, dt, props, boxes in held
            ),
            {},
            None,
        )
        for held in held_by_rank
    ]
    # every rank holding one box of the same tensors (FSDP, TP): planned per tensor, not per chunk
    compact = [compact_description(r.tensors, r.objects, r.skeleton) for r in ranks]
    compression = resolve_unsampled(path, options, (t for r in ranks for t in r.tensors))
    if all(c is not None and c.digest == compact[0].digest for c in compact):  # type: ignore[union-attr]
        return plan_save(
            [c for c in compact if c is not None],
            chunk_bytes=options.chunk_bytes,
            portable=options.portable,
            compression=compression,
        )
    return plan_save(
        ranks, chunk_bytes=options.chunk_bytes, portable=options.portable, compression=compression
    )


@dataclass(slots=True)
class OpenSave:
    """A save the coordinator has begun: its writer (holding the temporary), its plan, the
    array documents left to be written with their array's one chunk (``deferred``), and the
    layout of its chunk table where each rank stores its own rows (``layout``; None: the
    ranks report every chunk's records to the coordinator)."""

    path: str
    writer: CheckpointWriter
    plan: SavePlan
    token: str
    deferred: dict[str, bytes]
    session: SaveSession
    layout: TableLayout | None = None


def begin_save(
    path: str,
    plan: SavePlan,
    nobjects: int,
    options: SaveOptions,
    deferred: Collection[str] = (),
) -> OpenSave:
    """Open the writer of a new checkpoint, create its temporary and write the array documents.

    The documents of the arrays named in ``deferred`` (one chunk each, written by the
    coordinator) are not written here: they go to :func:`write_assigned` with that chunk,
    so that the I/O threads write them, as :func:`gpuckpt.save` does.
    """
    world_size = len(plan.assignments)
    # as a distributed save: the other ranks' writers attach without O_DIRECT, so the root's
    # writes alike; a single writer as gpuckpt.save (what is just written stays cached)
    writer = open_save_writer(
        path,
        options,
        expected_files=plan.nfiles + nobjects,
        direct_io=world_size == 1 and options.use_direct_io(False),
    )
    session, later = SaveSession.begin(plan, writer, options, defer=deferred)
    layout = table_layout(plan, min_chunks=TABLE_MIN_CHUNKS, hashing=options.hashing)
    if layout is not None and writer.capabilities.documents_first:
        write_table_documents(writer, layout)  # before any rank stores a chunk of its columns
    return OpenSave(path, writer, plan, writer.token or "", later, session, layout)


def reusable_arrays(path: str, plan: SavePlan, options: SaveOptions) -> tuple[str, ...] | None:
    """The arrays of ``plan`` whose chunks the base of an incremental save may serve (None:
    no base, or one that cannot be used: a warning); the coordinator decides, every rank
    then opens the base itself (:func:`open_base`)."""
    check_base_target(path, options)
    base = open_base_for(options, plan.tensors)
    return None if base is None else tuple(base.arrays())


def open_base(options: SaveOptions, reusable: Collection[str] | None) -> BaseIndex | None:
    """This rank's view of the base: only the arrays the coordinator found ``reusable``."""
    location = options.base_location
    if location is None or reusable is None:
        return None
    return _open_base(location, options.storage_options, reusable)


def attach(path: str, token: str, options: SaveOptions) -> CheckpointWriter:
    """The writer of a rank other than the coordinator, into the save the coordinator began."""
    return attach_writer(path, token, storage_options=options.store_options())


def write_assigned(
    writer: CheckpointWriter,
    mine: Sequence[ChunkAssignment],
    held: Mapping[str, Sequence[tuple[Any, tuple[int, ...]]]],
    options: SaveOptions,
    documents: Mapping[str, bytes] | None = None,
    base: BaseIndex | None = None,
) -> tuple[list[tuple[tuple[str, tuple[int, ...]], Written]], dict[str, Any]]:
    """Write this rank's chunks; ``held[fqn][box]`` is the tensor holding that box, and its offsets.

    ``documents``: array documents to write with their array's one chunk (see :func:`begin_save`);
    ``base``: the base of an incremental save (:func:`open_base`).

    Returns ``((array name, chunk coords), result)`` per chunk (stored bytes and CRC32C; a
    :class:`ChunkResult` with the chunk's hashes when hashing), and the memory format of each
    tensor as found in this rank's boxes.
    """
    sources = {
        fqn: tuple(Source(canonical_bools(adapt(tensor)), tuple(offsets)) for tensor, offsets in boxes)
        for fqn, boxes in held.items()
    }
    formats = {fqn: boxes[0].array.memory_format for fqn, boxes in sources.items() if boxes}
    jobs = bind_jobs(mine, sources)
    results = write_chunks(
        jobs, writer, options, documents=None if documents is None else dict(documents), base=base
    )
    return [((j.name, j.coords), r) for j, r in zip(jobs, results, strict=True)], formats


def reported_rows(
    rows: Sequence[int], results: Sequence[tuple[tuple[str, tuple[int, ...]], Written]]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """What a rank reports of the chunks of one write item: their chunk table ``rows`` and
    per-chunk columns (CRC32C, and the hashes of a hashing save), for :func:`table_columns`."""
    return np.asarray(rows, np.int64), result_columns([r for _, r in results])


def write_block(
    writer: CheckpointWriter,
    layout: TableLayout,
    rank: int,
    rows: Sequence[int],
    results: Sequence[tuple[tuple[str, tuple[int, ...]], Written]],
) -> BlockReport:
    """Store this rank's block of the chunk table from what it wrote (the plan's ``rows`` of
    its chunks and their results, as :func:`write_assigned` returns them); what it reports
    to the coordinator is the :class:`~gpuckpt.saving.table_blocks.BlockReport`."""
    rows_, columns = reported_rows(rows, results)
    return _write_block(writer, layout, rank, rows_, columns)


def commit_save(
    save: OpenSave,
    results: np.ndarray
    | Mapping[str, np.ndarray]
    | Mapping[tuple[str, tuple[int, ...]], Written]
    | Sequence[BlockReport],
    memory_formats: Mapping[str, Any],
    values: Mapping[str, bytes],
    skeleton: Any,
    planner_extra: Mapping[str, Any],
    checkpoint_id: str,
) -> Metadata:
    """Assemble the metadata of every rank's chunks and publish the checkpoint atomically.

    ``results``: every chunk's records in chunk table order (:func:`table_columns` of what
    the ranks report: the CRC32C column, and the hash columns of a hashing save; or the
    CRC32C column alone), or ``(array name, chunk coords) -> (stored bytes, CRC32C)`` (or
    :class:`ChunkResult`); a large save gets its chunk table here. Where the save has a
    ``layout``, ``results`` are every rank's :func:`write_block` reports instead. ``values`` are stored as
    opaque bytes entries; ``planner_extra`` is added to the metadata's ``planner_data``. On
    any error the save is aborted.
    """
    with writing(save.writer):
        tensors = tuple(
            dataclasses.replace(
                t, properties=dataclasses.replace(t.properties, memory_format=memory_formats[t.fqn])
            )
            if memory_formats.get(t.fqn, t.properties.memory_format) is not t.properties.memory_format
            else t
            for t in save.plan.tensors
        )
        # the array documents were written with the memory format DCP's planner reports
        # (always contiguous); a tensor found in another format gets its document again
        for planned, found in zip(save.plan.tensors, tensors, strict=True):
            if found.properties.memory_format is not planned.properties.memory_format:
                save.writer.rewrite_array_document(found.name, array_document_of(found))
        objects = {fqn: encode_object(blob, fqn=fqn) for fqn, blob in values.items()}
    done = dataclasses.replace(save.plan, tensors=tensors, objects=objects, skeleton=skeleton)
    if save.layout is not None:
        if isinstance(results, (np.ndarray, Mapping)):
            raise TypeError("a save whose ranks store their rows of the chunk table commits their reports")
        return save.session.commit_blocks(
            list(results), checkpoint_id, save.layout, plan=done, planner_extra=planner_extra
        )
    columns = as_columns(done, results)  # type: ignore[arg-type]  # not reports: no layout
    return save.session.commit(columns, checkpoint_id, plan=done, planner_extra=planner_extra)


def abort_save(save: OpenSave) -> None:
    """Remove the temporary of a save that will not be committed (published checkpoints are untouched)."""
    save.writer.abort()


# load -----------------------------------------------------------------------


@dataclass(slots=True)
class OpenCheckpoint:
    """A published checkpoint, its validated metadata, tensors and stored values."""

    path: str
    reader: CheckpointReader
    metadata: Metadata
    tensors: dict[str, TensorEntry]
    values: dict[str, Any]


@paused_gc()
def open_checkpoint(path: str, options: LoadOptions) -> OpenCheckpoint:
    """Open and validate the checkpoint at ``path`` (nothing but its root document is read;
    :func:`gpuckpt.loading.open.open_checkpoint`, whose shared index the metadata is: read only).

    DCP's metadata lists every chunk of every tensor, so a claim of more chunks than the
    arrays hold files is refused first (:func:`~gpuckpt.loading.checks.overclaimed`): a hostile
    chunk table costs what was written, not a record per claimed chunk."""
    ck = load_open.open_checkpoint(path, options.store_options(), direct_io=options.reads_direct())
    for bad in overclaimed(ck.reader, ck.index.tensors.values()):
        raise bad.error()
    return OpenCheckpoint(ck.location, ck.reader, ck.index.metadata(), ck.index.tensors, ck.index.objects)


def read_value(ck: OpenCheckpoint, fqn: str, allow_pickle: bool) -> Any:
    """A stored plain value, decoded (pickles only with ``allow_pickle``)."""
    return decode_object(ck.values[fqn], allow_pickle=allow_pickle, fqn=fqn)


def read_boxes_into(
    ck: OpenCheckpoint,
    requests: Mapping[str, list[tuple[Any, Box]]],
    options: LoadOptions,
    coordinator: Coordinator | None = None,
) -> None:
    """Fill each ``(array, box)`` of each tensor from the stored chunks that overlap the box.

    Arrays are any kind gpuckpt adapts (torch CPU or CUDA tensors included);
    each chunk read is verified against its CRC32C. With a ``coordinator`` (a
    collective: every rank calls it), each stored chunk that several ranks need
    is read once for the job (:mod:`gpuckpt.distributed.cooperative`); the ranks
    agree on the checks of the chunk files first.
    """
    if coordinator is None:
        check_chunk_files(ck.reader, [ck.tensors[fqn] for fqn in requests])
        read_boxes(
            ck.reader,
            [(ck.tensors[fqn], [(adapt(a), box) for a, box in targets]) for fqn, targets in requests.items()],
            options,
        )
        return
    error: Exception | None = None
    boxes = []
    try:
        check_chunk_files(ck.reader, [ck.tensors[fqn] for fqn in requests])
        boxes = [
            (ck.tensors[fqn], [(adapt(a), box) for a, box in targets]) for fqn, targets in requests.items()
        ]
    except Exception as exc:
        error = exc
    coordinator.all_reduce_errors(error)
    meta = ck.metadata.storage_meta
    identity = None if meta is None else repr((str(meta.checkpoint_id), meta.save_id))
    read_cooperative(ck.reader, ck.tensors, boxes, options, coordinator, identity)


def read_whole(ck: OpenCheckpoint, fqn: str, options: LoadOptions) -> np.ndarray:
    """A new host array holding tensor ``fqn`` (stored shape, dtype and memory format)."""
    t = ck.tensors[fqn]
    check_chunk_files(ck.reader, [t])
    dest: np.ndarray = HostMemory().allocate(t.shape, t.dtype, t.memory_format)
    read_tensors(ck.reader, [(t, HostArray(dest))], options)
    return dest


def rebuild(node: Any, values: Mapping[str, Any]) -> Any:
    """The container a structure ``node`` describes, its leaves taken from ``values`` by FQN."""
    return unflatten_state_dict({"d": [["s", "_", node]]}, values)["_"]


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Cheaply: a published checkpoint at a local ``path`` (its root document says so), or ``s3://``."""
    if not location_supported(path):
        return False
    return scheme_of(path) != "file" or is_committed(path)


def location_supported(path: str | os.PathLike[str]) -> bool:
    """Whether gpuckpt has a store for ``path`` (a local path, ``file://`` or ``s3://``)."""
    try:
        return scheme_of(path) in ("file", "s3")
    except TypeError:
        return False


# snapshots ------------------------------------------------------------------


@dataclass(slots=True)
class Snapshot:
    """Copies of arrays in staging memory; ``release`` frees it.

    ``arrays`` holds, in the order given, ``(copy, dtype, on_device)``: a NumPy
    array, or a CuPy array holding ``dtype`` (through integers of its size for
    types CuPy lacks). Until released, the arena is held by ``holder`` (the
    pool waits for it rather than report an arena nobody will give back).
    """

    arrays: list[tuple[Any, np.dtype[Any], bool]]
    pool: ArenaPool | None
    arena: StagingArena | None
    holder: Future[None] | None = None

    def release(self) -> None:
        if self.pool is not None and self.arena is not None:
            if self.holder is not None:
                self.holder.set_result(None)
            self.pool.release(self.arena)
            self.arena = None


def snapshot(
    arrays: Sequence[Any],
    pools: dict[int, ArenaPool],
    *,
    device: bool,
    max_arenas: int,
    timeout: float | None,
) -> Snapshot:
    """Copy ``arrays`` once, as ``gpuckpt.async_save`` does, into reusable staging memory.

    ``device=False``: into host staging arenas (page-locked where device arrays are
    involved), from ``pools`` (one per device backend, created here); the copies
    are NumPy arrays with the sources' memory layout. ``device=True``: device
    arrays are copied within device memory (the copies are CuPy arrays), host
    arrays into new host arrays. Raises :class:`~gpuckpt.errors.StagingTimeoutError`
    when no arena becomes free within ``timeout`` seconds.
    """
    keys = [str(i) for i in range(len(arrays))]
    local, sources = describe_state(dict(zip(keys, arrays, strict=True)), allow_pickle=False)
    pool = arena = holder = None
    if device:
        snap = snapshot_on_device(sources)
    else:
        backend = next(iter(device_backends(s.array for held in sources.values() for s in held)), None)
        pool = pool_for(pools, backend, max_arenas)
        arena = _acquire(pool, snapshot_bytes(sources), timeout)
        try:
            snap = snapshot_to_arena(local, sources, arena)
        except BaseException:
            pool.release(arena)
            raise
        # from here on the copies hold the arena, whichever thread lets go of them last
        holder = Future[None]()
        pool.hold(arena, holder)
    out = []
    for k in keys:
        a = snap[k][0].array
        if isinstance(a, DeviceArray):
            out.append((a.data, a.dtype, True))
        else:
            out.append((a.host_array(), a.dtype, False))
    return Snapshot(out, pool, arena, holder)


@dataclass(frozen=True, slots=True)
class HostLayout:
    """Where a snapshot puts copies of host arrays: each copy's physical axis order (as
    :func:`snapshot` lays it out), and the staging memory they take in all. Pure data,
    the same for arrays of the same shapes, dtypes and strides: a caller that snapshots
    the same arrays again keeps it instead of describing them again."""

    orders: tuple[tuple[int, ...], ...]
    nbytes: int


def host_layout(arrays: Sequence[np.ndarray]) -> HostLayout:
    """The :class:`HostLayout` of snapshots of ``arrays`` (host arrays)."""
    return HostLayout(tuple(host_order(a) for a in arrays), sum(aligned_bytes(a.nbytes) for a in arrays))


def snapshot_host(
    arrays: Sequence[np.ndarray],
    layout: HostLayout,
    pools: dict[int, ArenaPool],
    *,
    max_arenas: int,
    timeout: float | None,
) -> Snapshot:
    """:func:`snapshot` of host ``arrays`` (``device=False``) laid out as ``layout`` says,
    which must be :func:`host_layout` of arrays of the same shapes, dtypes and strides:
    the copies are those :func:`snapshot` makes, without describing the arrays again."""
    pool = pools.get(0)
    if pool is None:
        pool = pools[0] = ArenaPool(None, max_arenas=max_arenas)
    arena = _acquire(pool, layout.nbytes, timeout)
    try:
        copies = copy_host_arrays(arrays, layout.orders, arena)
    except BaseException:
        pool.release(arena)
        raise
    holder = Future[None]()
    pool.hold(arena, holder)
    return Snapshot([(c, c.dtype, False) for c in copies], pool, arena, holder)


_GRACE_S = 0.05


def _acquire(pool: ArenaPool, nbytes: int, timeout: float | None) -> StagingArena:
    """An arena; when all are taken, collect garbage once (a finished save's snapshot may be
    held only by a reference cycle), then wait up to ``timeout`` seconds for one to be released."""
    import gc

    try:
        # the snapshot of a save that just finished is released when the thread that ran
        # it lets go of the state dict: wait a moment for it rather than make a second arena
        return pool.acquire(nbytes, timeout=0, grace=_GRACE_S)
    except StagingTimeoutError:
        gc.collect()
        return pool.acquire(nbytes, timeout=timeout)


def staged_bytes(pools: Mapping[int, ArenaPool]) -> int:
    """Bytes of staging memory the pools hold (free and in use)."""
    return sum(pool.reserved_bytes() for pool in pools.values())
