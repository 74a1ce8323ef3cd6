"""Every call ``gpuckpt.dcp`` makes into gpuckpt's save and load machinery, in one module.

The DCP classes (:mod:`~gpuckpt.dcp.writer`, :mod:`~gpuckpt.dcp.reader`,
:mod:`~gpuckpt.dcp.stager`) use gpuckpt's internals only through the functions
here (besides the public metadata model, dtypes, memory formats and errors),
and these use the same entry points as gpuckpt's own distributed save,
resharding load and background snapshot: nothing of the save or load logic is
repeated. What they rely on:

- options: the names and checks of :func:`gpuckpt.save`'s options
  (:class:`SaveOptions` here until gpuckpt has one options value);
- planning: :func:`gpuckpt.distributed.save.plan_tensors` (box grids and
  per-rank :class:`~gpuckpt.distributed.save.ChunkAssignment` records, as for
  ``ShardedArray`` saves, from :class:`~gpuckpt.distributed.planner.LocalTensor`
  descriptions) and :func:`gpuckpt.distributed.save.assigned_jobs`;
- writing: :func:`gpuckpt.storage.stores.open_writer` (with
  ``direct_io_setting``), ``LocalWriter.attach`` (ranks other than the
  coordinator), :func:`gpuckpt.writing.array_documents`,
  :func:`gpuckpt.writing.write_chunks` (its ``documents`` argument),
  :func:`gpuckpt.writing.assemble_metadata`, the ``writing`` abort guard,
  :func:`gpuckpt.storage.objects.encode_object` and
  :func:`gpuckpt.storage.layout.root_document` with ``CheckpointWriter.commit``
  / ``abort``; arrays through :func:`gpuckpt.device.arrays.adapt`;
- reading: :func:`gpuckpt.storage.stores.open_reader`,
  :func:`gpuckpt.storage.layout.metadata_from_root_document`,
  :func:`gpuckpt.reading.validate_metadata` (its ``TensorEntry`` values),
  ``check_chunk_files``, :func:`gpuckpt.distributed.load.read_boxes`,
  ``read_tensors``, :func:`gpuckpt.storage.objects.decode_object` and
  :func:`gpuckpt.state.unflatten_state_dict`;
- snapshots: :func:`gpuckpt.writing.build_save_plan` and ``device_backends``,
  :func:`gpuckpt.background.snapshot` / ``snapshot_on_device`` and the
  :class:`~gpuckpt.device.staging.ArenaPool` of staging memory (its
  ``reserved_bytes`` and ``grace``).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.device.arrays import HostMemory, adapt
from gpuckpt.device.backend import DEFAULT_STAGING_BYTES, DeviceArray
from gpuckpt.device.staging import ArenaPool, StagingArena
from gpuckpt.distributed.planner import LocalTensor
from gpuckpt.distributed.save import ChunkAssignment, assigned_jobs, plan_tensors
from gpuckpt.dtypes import dtype_name
from gpuckpt.errors import UnsupportedValueError
from gpuckpt.metadata import FORMAT_VERSION, Metadata
from gpuckpt.planning import DEFAULT_CHUNK_BYTES
from gpuckpt.progress import ProgressCallback
from gpuckpt.reading import TensorEntry, check_chunk_files, paused_gc, read_tensors, validate_metadata
from gpuckpt.storage.base import CheckpointReader, CheckpointWriter
from gpuckpt.storage.layout import metadata_from_root_document, root_document
from gpuckpt.storage.local import SYNC_MODES, LocalWriter, direct_io_setting
from gpuckpt.storage.objects import decode_object, encode_object
from gpuckpt.storage.stores import open_reader, open_writer, scheme_of
from gpuckpt.writing import (
    SavePlan,
    TensorPlan,
    array_documents,
    assemble_metadata,
    build_save_plan,
    device_backends,
    write_chunks,
    writing,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_STAGING_BYTES",
    "Box",
    "ChunkAssignment",
    "OpenCheckpoint",
    "OpenSave",
    "ProgressCallback",
    "SaveOptions",
    "Snapshot",
    "attach",
    "begin_save",
    "commit_save",
    "is_checkpoint",
    "open_checkpoint",
    "plan_save",
    "read_boxes_into",
    "read_value",
    "read_whole",
    "rebuild",
    "abort_save",
    "location_supported",
    "snapshot",
    "staged_bytes",
    "write_assigned",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]


# options ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SaveOptions:
    """The options of a save through DCP, validated when the Writer is made (field names as in
    :func:`gpuckpt.save`)."""

    overwrite: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    sync: str = "auto"
    threads: int | None = None
    progress: ProgressCallback | None = None
    staging_bytes: int = DEFAULT_STAGING_BYTES
    storage_options: Mapping[str, Any] | None = None
    portable: bool = False

    def __post_init__(self) -> None:
        for name in ("overwrite", "portable"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("chunk_bytes", "staging_bytes", "threads"):
            v = getattr(self, name)
            if (v is not None or name != "threads") and (
                not isinstance(v, int) or isinstance(v, bool) or v < 1
            ):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync={self.sync!r}; expected one of {', '.join(map(repr, SYNC_MODES))}")
        if self.progress is not None and not callable(self.progress):
            raise ValueError(
                f"progress must be a callable(done_bytes, total_bytes) or None, got {self.progress!r}"
            )
        if self.storage_options is not None:
            if not isinstance(self.storage_options, Mapping):
                raise ValueError(f"storage_options must be a dict or None, got {self.storage_options!r}")
            object.__setattr__(self, "storage_options", dict(self.storage_options))


# save -----------------------------------------------------------------------


def plan_save(
    locals_by_rank: Sequence[Sequence[tuple[str, tuple[int, ...], np.dtype[Any], dict[str, Any], list[Box]]]],
    options: SaveOptions,
) -> tuple[list[TensorPlan], list[list[ChunkAssignment]]]:
    """Chunk grids of every tensor and each rank's chunks, from the boxes each rank holds.

    Each rank's entries are ``(fqn, global shape, dtype, JSON properties, boxes)``.
    """
    described = [
        [
            LocalTensor(fqn, shape, dtype_name(dt), dt.itemsize, props, list(boxes))
            for fqn, shape, dt, props, boxes in rank
        ]
        for rank in locals_by_rank
    ]
    return plan_tensors(described, chunk_bytes=options.chunk_bytes, portable=options.portable)


@dataclass(slots=True)
class OpenSave:
    """A save the coordinator has begun: its writer (holding the temporary), its tensors, and the
    array documents left to be written with their array's one chunk (``deferred``)."""

    path: str
    writer: CheckpointWriter
    tensors: list[TensorPlan]
    token: str
    deferred: dict[str, bytes]


def begin_save(
    path: str,
    tensors: list[TensorPlan],
    nobjects: int,
    world_size: int,
    options: SaveOptions,
    deferred: Collection[str] = (),
) -> OpenSave:
    """Open the writer of a new checkpoint, create its temporary and write the array documents.

    The documents of the arrays named in ``deferred`` (one chunk each, written by the
    coordinator) are not written here: they go to :func:`write_assigned` with that chunk,
    so that the I/O threads write them, as :func:`gpuckpt.save` does.
    """
    if world_size > 1 and scheme_of(path) != "file":
        raise UnsupportedValueError(
            f"{path}: saves from {world_size} ranks go to a shared file system path; object stores take "
            "a single writer for now (save from one process, or to a shared directory)"
        )
    plan = SavePlan(tensors, {}, None)
    writer = open_writer(
        path,
        overwrite=options.overwrite,
        sync=options.sync,
        expected_files=plan.nfiles + nobjects,
        storage_options=None if options.storage_options is None else dict(options.storage_options),
        direct_io=direct_io_setting(False),  # as gpuckpt.save: what is just written stays cached
    )
    documents = array_documents(tensors)
    later = {name: documents.pop(name) for name in deferred}
    with writing(writer):
        writer.begin()
        for name, document in documents.items():
            writer.write_array_document(name, document)
    return OpenSave(path, writer, tensors, getattr(writer, "token", ""), later)


def attach(path: str, token: str) -> CheckpointWriter:
    """The writer of a rank other than the coordinator, into the save the coordinator began."""
    return LocalWriter.attach(path, token)


def write_assigned(
    writer: CheckpointWriter,
    mine: Sequence[ChunkAssignment],
    source: Callable[[str, int], tuple[Any, tuple[int, ...]]],
    options: SaveOptions,
    documents: Mapping[str, bytes] | None = None,
) -> tuple[list[tuple[tuple[str, tuple[int, ...]], tuple[int, int]]], dict[str, Any]]:
    """Write this rank's chunks; ``source(fqn, box)`` gives the tensor holding that box and its offsets.

    ``documents``: array documents to write with their array's one chunk (see :func:`begin_save`).

    Returns ``((array name, chunk coords), (stored bytes, CRC32C))`` per chunk, and
    the memory format of each tensor as found in this rank's boxes.
    """
    adapters: dict[tuple[str, int], Any] = {}
    formats: dict[str, Any] = {}

    def adapted(fqn: str, box: int) -> tuple[Any, tuple[int, ...]]:
        if (fqn, box) not in adapters:
            tensor, offsets = source(fqn, box)
            a = adapt(tensor)
            adapters[(fqn, box)] = (a, offsets)
            formats.setdefault(fqn, a.properties().memory_format)
        return adapters[(fqn, box)]  # type: ignore[no-any-return]

    jobs = assigned_jobs(mine, adapted)
    results = write_chunks(
        jobs,
        writer,
        threads=options.threads,
        staging_bytes=options.staging_bytes,
        progress=options.progress,
        documents=None if documents is None else dict(documents),
    )
    return [((j.name, j.coords), r) for j, r in zip(jobs, results, strict=True)], formats


def commit_save(
    save: OpenSave,
    results: Mapping[tuple[str, tuple[int, ...]], tuple[int, int]],
    memory_formats: Mapping[str, Any],
    values: Mapping[str, bytes],
    skeleton: Any,
    planner_extra: Mapping[str, Any],
    checkpoint_id: str,
) -> Metadata:
    """Assemble the metadata of every rank's chunks and publish the checkpoint atomically.

    ``values`` are stored as opaque bytes entries; ``planner_extra`` is added to
    the metadata's ``planner_data``. On any error the save is aborted.
    """
    with writing(save.writer):
        tensors = [
            dataclasses.replace(
                t,
                properties=dataclasses.replace(t.properties, memory_format=memory_formats[t.fqn])
                if t.fqn in memory_formats
                else t.properties,
            )
            for t in save.tensors
        ]
        objects = {fqn: encode_object(blob, fqn=fqn) for fqn, blob in values.items()}
        md = assemble_metadata(SavePlan(tensors, objects, skeleton), dict(results), checkpoint_id)
        md.planner_data = {**md.planner_data, **planner_extra}
        save.writer.commit(root_document(md))
    md.version = md.version or FORMAT_VERSION
    return md


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
def open_checkpoint(path: str, storage_options: Mapping[str, Any] | None = None) -> OpenCheckpoint:
    """Open and validate the checkpoint at ``path`` (nothing but its root document is read)."""
    reader = open_reader(path, storage_options=None if storage_options is None else dict(storage_options))
    md = metadata_from_root_document(reader.read_root(), f"{os.fspath(path).rstrip('/')}/zarr.json")
    tensors, values = validate_metadata(md)
    return OpenCheckpoint(os.fspath(path), reader, md, tensors, values)


def read_value(ck: OpenCheckpoint, fqn: str, allow_pickle: bool) -> Any:
    """A stored plain value, decoded (pickles only with ``allow_pickle``)."""
    return decode_object(ck.values[fqn], allow_pickle=allow_pickle, fqn=fqn)


def read_boxes_into(
    ck: OpenCheckpoint, requests: Mapping[str, list[tuple[Any, Box]]], threads: int | None = None
) -> None:
    """Fill each ``(array, box)`` of each tensor from the stored chunks that overlap the box.

    Arrays are any kind gpuckpt adapts (torch CPU or CUDA tensors included);
    each chunk read is verified against its CRC32C.
    """
    from gpuckpt.distributed.load import read_boxes

    entries = [ck.tensors[fqn] for fqn in requests]
    check_chunk_files(ck.reader, entries)
    read_boxes(
        ck.reader,
        [(ck.tensors[fqn], [(adapt(a), box) for a, box in targets]) for fqn, targets in requests.items()],
        threads=threads,
    )


def read_whole(ck: OpenCheckpoint, fqn: str, threads: int | None = None) -> np.ndarray:
    """A new host array holding tensor ``fqn`` (stored shape, dtype and memory format)."""
    t = ck.tensors[fqn]
    check_chunk_files(ck.reader, [t])
    dest: np.ndarray = HostMemory().allocate(t.shape, t.dtype, t.metadata.properties.memory_format)
    read_tensors(ck.reader, [(t, dest)], threads=threads)
    return dest


def rebuild(node: Any, values: Mapping[str, Any]) -> Any:
    """The container a structure ``node`` describes, its leaves taken from ``values`` by FQN."""
    from gpuckpt.state import unflatten_state_dict

    return unflatten_state_dict({"d": [["s", "_", node]]}, values)["_"]


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Cheaply: a published checkpoint at a local ``path`` (its root document exists), or an ``s3://`` URL."""
    if not location_supported(path):
        return False
    if scheme_of(path) != "file":
        return True
    root = os.path.join(os.fspath(path).removeprefix("file://"), "zarr.json")
    try:
        # non-blocking and regular files only: a FIFO planted there must not hang the check
        fd = os.open(root, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, 4096)
    finally:
        os.close(fd)
    # the root group's attributes carry gpuckpt's metadata (the full check is the load's)
    return b'"gpuckpt"' in head


# snapshots ------------------------------------------------------------------


@dataclass(slots=True)
class Snapshot:
    """Copies of arrays in staging memory; ``release`` frees it.

    ``arrays`` holds, in the order given, ``(copy, dtype, on_device)``: a NumPy
    array, or a CuPy array holding ``dtype`` (through integers of its size for
    types CuPy lacks).
    """

    arrays: list[tuple[Any, np.dtype[Any], bool]]
    pool: ArenaPool | None
    arena: StagingArena | None

    def release(self) -> None:
        if self.pool is not None and self.arena is not None:
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
    arrays into new host arrays.
    """
    from gpuckpt.background import snapshot as snapshot_to_arena
    from gpuckpt.background import snapshot_on_device

    keys = [str(i) for i in range(len(arrays))]
    plan = build_save_plan(dict(zip(keys, arrays, strict=True)), chunk_bytes=1 << 62)
    pool = arena = None
    if device:
        snapshot_on_device(plan)
    else:
        backend = next(iter(device_backends(plan)), None)
        pool = pools.get(id(backend) if backend is not None else 0)
        if pool is None:
            allocator = backend.pinned_allocator() if backend is not None else None
            pool = pools[id(backend) if backend is not None else 0] = ArenaPool(
                allocator, max_arenas=max_arenas
            )
        arena = _acquire(pool, sum(t.nbytes for t in plan.tensors), timeout)
        try:
            snapshot_to_arena(plan, arena)
        except BaseException:
            pool.release(arena)
            raise
    by_key = {t.fqn: t.array for t in plan.tensors}
    out = []
    for k in keys:
        a = by_key[k]
        if isinstance(a, DeviceArray):
            out.append((a.data, a.dtype, True))
        else:
            assert a is not None
            out.append((a.host_array(), a.dtype, False))
    return Snapshot(out, pool, arena)


_GRACE_S = 0.05


def _acquire(pool: ArenaPool, nbytes: int, timeout: float | None) -> StagingArena:
    """An arena; when all are taken, collect garbage once (a finished save's snapshot may be
    held only by a reference cycle), then wait up to ``timeout`` seconds for one to be released
    (``TimeoutError`` after that)."""
    import gc

    try:
        # the snapshot of a save that just finished is released when the thread that ran
        # it lets go of the state dict: wait a moment for it rather than make a second arena
        return pool.acquire(nbytes, timeout=0, grace=_GRACE_S)
    except TimeoutError:
        gc.collect()
        return pool.acquire(nbytes, timeout=timeout)


def staged_bytes(pools: Mapping[int, ArenaPool]) -> int:
    """Bytes of staging memory the pools hold (free and in use)."""
    return sum(pool.reserved_bytes() for pool in pools.values())


def location_supported(path: str | os.PathLike[str]) -> bool:
    """Whether gpuckpt has a store for ``path`` (a local path, ``file://`` or ``s3://``)."""
    try:
        return scheme_of(path) in ("file", "s3")
    except TypeError:
        return False
