"""Executing a save: a :class:`~gpuckpt.planning.plan.SavePlan` bound to arrays, written and published.

A plan (made by :func:`gpuckpt.planning.plan.plan_save`) says which chunks
this process writes; :func:`bind_jobs` binds them to the arrays holding them
(one :class:`ChunkJob` per stored chunk) when the save runs. Tensors become
Zarr arrays (:mod:`gpuckpt.format.documents`); chunk jobs run on a thread pool,
straight from host memory when a chunk is one contiguous byte run (the
common case, see :func:`gpuckpt.format.grid.plan_regular_grid`), or
through a bounded pool of staging buffers for device memory; the root
document carrying the metadata is written last by
:meth:`CheckpointWriter.commit`. Distributed saves
(:mod:`gpuckpt.distributed.save`) run the same jobs on every rank.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, StagedOut, device_backends
from gpuckpt.device.backend import ChunkBox, Staging
from gpuckpt.errors import CheckpointWriteError, GpuckptError
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.chunks import chunk_bytes, stored_nbytes
from gpuckpt.format.codecs import Codec, encode
from gpuckpt.format.documents import array_document, chunk_file_key
from gpuckpt.options import SaveOptions
from gpuckpt.planning.plan import ChunkAssignment, SavePlan, TensorPlan
from gpuckpt.progress import ProgressCounter
from gpuckpt.runtime import runner
from gpuckpt.runtime.runner import Batcher, Runner, default_threads, run_all
from gpuckpt.saving.commit import Written, result_columns
from gpuckpt.saving.device_encoding import DeviceEncoder, EncodedChunk
from gpuckpt.saving.incremental import (
    BaseIndex,
    digests_match,
    open_base_for,
    reuse_by_digests,
    warn_damaged_base,
)
from gpuckpt.saving.reuse import share_unchanged, write_hashed
from gpuckpt.saving.sources import Sources
from gpuckpt.storage.base import CheckpointWriter, ChunkWrites
from gpuckpt.storage.local.fsutil import failure_errno, failure_hint
from gpuckpt.storage.stores import open_writer

__all__ = [
    "ChunkJob",
    "written_rows",
    "bind_jobs",
    "shared_with_base",
    "open_save_writer",
    "array_document_of",
    "write_array_documents",
    "write_chunks",
]


@dataclass(slots=True)
class ChunkJob:
    """One stored chunk to write, bound to the array holding it (made by :func:`bind_jobs`).

    Work for the I/O threads, not part of the plan: a plain (not frozen) record,
    since a save makes one per chunk while the caller waits."""

    name: str
    coords: tuple[int, ...]
    source: ArrayAdapter
    offsets: tuple[int, ...]  # of the chunk's box within ``source``
    sizes: tuple[int, ...]
    stored: tuple[int, ...]
    row: int = 0  # of the chunk in the save's chunk table
    codec: Codec | None = None  # compressed by the I/O thread that writes it

    @property
    def key(self) -> str:
        return chunk_file_key(self.coords)

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.source.dtype.itemsize


def bind_jobs(assignments: Iterable[ChunkAssignment], sources: Sources) -> list[ChunkJob]:
    """Bind a process's chunk assignments to its arrays: ``sources[fqn][box]`` holds each chunk."""
    jobs = []
    for a in assignments:
        src = sources[a.fqn][a.box]
        local = (
            a.offsets
            if not any(src.offsets)
            else tuple(o - b for o, b in zip(a.offsets, src.offsets, strict=True))
        )
        jobs.append(ChunkJob(a.name, a.coords, src.array, local, a.sizes, a.stored, a.row, a.codec))
    return jobs


def open_save_writer(
    path: str | os.PathLike[str], options: SaveOptions, *, expected_files: int, direct_io: bool
) -> CheckpointWriter:
    """The writer of a save to ``path`` with ``options`` (``direct_io``: whether large chunk
    files go around the page cache, see :meth:`SaveOptions.use_direct_io`); touches no file."""
    return open_writer(
        path,
        overwrite=options.overwrite,
        sync=options.sync,
        expected_files=expected_files,
        storage_options=options.store_options(),
        direct_io=direct_io,
    )


def array_document_of(t: TensorPlan) -> bytes:
    return array_document(
        shape=t.shape,
        dtype=t.dtype,
        grid=t.grid,
        fqn=t.fqn,
        memory_format=t.properties.memory_format.name,
        codec=t.codec,
    )


def write_array_documents(
    plan: SavePlan, writer: CheckpointWriter, *, defer: Collection[str] = (), threads: int | None = None
) -> dict[str, bytes]:
    """Write the ``zarr.json`` of every array of ``plan`` but those named in ``defer``; returns
    the documents of those, by array name, for :func:`write_chunks` to write with their one chunk.

    The documents go to the writer in up to ``threads`` batches run in parallel
    (:meth:`~gpuckpt.storage.base.CheckpointWriter.write_array_documents`: one native call
    per batch on a local file system; one round trip per document on an object store,
    where hundreds of them one after the other would hold every rank of a distributed save)."""
    deferred = {}
    names: list[str] = []
    documents: list[bytes] = []
    for t in plan.tensors:
        if t.name in defer:
            deferred[t.name] = array_document_of(t)
        else:
            names.append(t.name)
            documents.append(array_document_of(t))
    groups = max(1, min(len(names), threads or default_threads()))
    cuts = [len(names) * g // groups for g in range(groups + 1)]
    jobs = [
        functools.partial(writer.write_array_documents, names[a:b], documents[a:b])
        for a, b in itertools.pairwise(cuts)
        if b > a
    ]
    run_all(jobs, threads=threads, name="gpuckpt-documents")
    return deferred


def write_chunks(
    jobs: Sequence[ChunkJob],
    writer: CheckpointWriter,
    options: SaveOptions,
    *,
    documents: dict[str, bytes] | None = None,
    base: BaseIndex | None = None,
    first: Sequence[Callable[[], None]] = (),
) -> list[Written]:
    """Write every job's chunk; returns ``(stored bytes, CRC32C)`` per job, in order (a
    :class:`~gpuckpt.saving.incremental.ChunkResult`, which adds the chunk's hashes, when hashing).

    Of ``options``, ``threads`` (I/O threads), ``staging_bytes`` (the staging
    budget of device sources), ``progress`` and ``content_hash`` apply;
    ``base`` (the base checkpoint of an incremental save, opened by the caller:
    :func:`~gpuckpt.saving.incremental.open_base_for`) makes chunks equal to its chunks
    reused instead of written, and every chunk hashed.

    ``documents`` maps array names whose directory does not exist yet to their
    ``zarr.json``; each such array must have exactly one job, which writes the
    document first (so that the many file-system operations of small tensors
    run on the I/O threads too).

    The calling thread stages every job's box out of its source (see
    :meth:`~gpuckpt.device.arrays.ArrayAdapter.stage_out`) and hands it to the
    I/O threads, which checksum and write it. Boxes readable at once (host
    memory) go in batches and are encoded straight from their memory; the
    others (device memory) hold a buffer of a bounded staging pool, so the
    calling thread queues the copies of the next chunks (blocking when the
    pool is exhausted) while the I/O threads wait for each copy, write its
    buffer and return it to the pool. The first error stops the run.

    ``first``: other writes (the array documents of a distributed save to a
    store that takes chunks before documents, see
    :attr:`~gpuckpt.storage.base.Capabilities.documents_first`) run on the
    same I/O threads, queued before the chunks.

    With a ``base``, the chunks of device memory are hashed on their device first
    (:meth:`~gpuckpt.device.arrays.ArrayAdapter.content_digests`); those equal to
    their base chunk are reused without being staged (:func:`_reuse_unstaged`), and
    only the others cross to the host.
    """
    sizes = [j.nbytes for j in jobs]
    threads, staging_bytes, progress = options.threads, options.staging_bytes, options.progress
    counter = ProgressCounter(progress, sum(sizes))
    docs = dict(documents or {})
    staging = Staging(((j.source.backend, n) for j, n in zip(jobs, sizes, strict=True)), staging_bytes)
    staging.wait_for_producers()
    done: dict[int, Written] = {}
    compared: frozenset[tuple[str, str]] = frozenset()
    if base is not None:
        done, compared = _reuse_unstaged(jobs, writer, base, docs, threads)
        for i in done:
            counter.add(sizes[i])
    # one call per chunk where each chunk is a request of its own (an object store)
    batch: Batcher[tuple[int, _Item]] = (
        Batcher() if writer.capabilities.batches_chunks else Batcher(max_items=1)
    )
    reuse = _Reuse(base, compared) if options.hashing or base is not None else None
    codecs = options.codecs
    # compression on the device: chunks compressed where they live, only their frames staged
    encoder = DeviceEncoder(jobs, staging_bytes) if codecs is not None and codecs.device else None
    #: the jobs of each group submitted, in the order of the runner's results
    submitted: list[list[int]] = []
    with Runner[list[Written]](threads, name="gpuckpt-write") as run:
        for write in first:
            run.submit(functools.partial(_no_results, write))
            submitted.append([])

        def submit(*groups: list[tuple[int, _Item]]) -> None:
            """One job per group, in order; what cannot be queued any more is released."""
            for i, group in enumerate(groups):
                if not group:
                    continue
                items = [item for _, item in group]
                try:
                    run.submit(
                        functools.partial(_write_items, writer, items, counter, reuse),
                        cancel=functools.partial(_release_all, items),
                    )
                except BaseException:
                    for rest in groups[i + 1 :]:
                        _release_all([item for _, item in rest])
                    raise
                submitted.append([k for k, _ in group])

        for i, (j, nbytes) in enumerate(zip(jobs, sizes, strict=True)):
            if i in done:
                continue  # reused without being staged
            run.check()
            # device memory: blocks while the staging budget is in use (back-pressure)
            encoded = encoder.take(i, done) if encoder is not None else None
            staged: StagedOut = (
                encoded if encoded is not None else j.source.stage_out(j.offsets, j.sizes, staging)
            )
            item = (i, (j, staged, docs.pop(j.name, None)))
            if not staged.ready:
                # it holds a staging buffer: queued at once, never held back in a batch
                submit(batch.take(), [item])
            elif nbytes >= batch.max_bytes:
                # a large chunk is a job of its own, and the small ones before it stay in their
                # batch: a model's small tensors (biases, norms) lie between its large ones, and
                # a batch cut at each large one would be a native call per small tensor
                submit([item])
            else:
                # small chunks go to the I/O threads in batches: one task per
                # chunk would cost more than writing a few KiB
                full = batch.add(item, nbytes)
                if full:
                    submit(full)
        submit(batch.take())
        results: dict[int, Written] = dict(done)
        for indices, written in zip(submitted, run.results(), strict=True):
            results.update(zip(indices, written, strict=True))
    if base is not None:
        warn_damaged_base(base, writer)
    return [results[i] for i in range(len(jobs))]


def _reuse_unstaged(
    jobs: Sequence[ChunkJob],
    writer: CheckpointWriter,
    base: BaseIndex,
    docs: dict[str, bytes],
    threads: int | None,
) -> tuple[dict[int, Written], frozenset[tuple[str, str]]]:
    """Hash the chunks of device memory that have a hashed counterpart in ``base`` on their
    device, each array's chunks in one call, and reuse those found equal before anything
    is staged; returns the results of the reused jobs by index, and ``(name, key)`` of
    every chunk compared so (those not reused are written without comparing again).

    The documents of matching single-chunk arrays are taken from ``docs`` and written first."""
    by_source: dict[int, list[int]] = {}
    found = {}
    for i, j in enumerate(jobs):
        b = base.lookup_hashed(j.name, j.key, stored_nbytes(j.stored, j.source.dtype.itemsize))
        if b is not None:
            found[i] = b
            by_source.setdefault(id(j.source), []).append(i)
    compared: set[tuple[str, str]] = set()
    reuses = []
    for members in by_source.values():
        source = jobs[members[0]].source
        digests = source.content_digests([(jobs[i].offsets, jobs[i].sizes, jobs[i].stored) for i in members])
        if digests is None:
            continue  # host memory (hashed while written), or a back end that cannot hash
        for i, d in zip(members, digests, strict=True):
            j = jobs[i]
            compared.add((j.name, j.key))
            if digests_match(found[i], d):
                reuses.append((i, functools.partial(reuse_by_digests, writer, found[i], j.name, j.key, d)))
    # the documents of the matching chunks' single-chunk arrays first, in one batch of the writer's
    first = [jobs[i].name for i, _ in reuses if jobs[i].name in docs]
    if first:
        writer.write_array_documents(first, [docs.pop(n) for n in first])
    results = run_all([r for _, r in reuses], threads=threads, name="gpuckpt-reuse")
    done: dict[int, Written] = {i: r for (i, _), r in zip(reuses, results, strict=True) if r is not None}
    return done, frozenset(compared)


def shared_with_base(
    plan: SavePlan, sources: Sources, options: SaveOptions
) -> dict[tuple[str, int], ArrayAdapter]:
    """For an asynchronous incremental save's snapshot: the device arrays of ``sources`` whose
    every chunk, hashed on its device now, equals its chunk in ``options.base``, as
    :class:`~gpuckpt.saving.reuse.SharedWithBase` stand-ins by ``(FQN, box)``; the snapshot
    need not copy them (none of their bytes crosses to the host). Empty without a base or
    device arrays. Runs in the caller's thread, before ``async_save`` returns: the digests
    are those of the values the call saves."""
    arrays = [s.array for held in sources.values() for s in held]
    backends = device_backends(arrays)
    if options.base_location is None or not backends:
        return {}
    base = open_base_for(options, plan.tensors)
    if base is None:
        return {}
    for b in backends:
        b.wait_for_producers()
    (mine,) = plan.assignments
    groups: dict[tuple[str, int], list[tuple[str, str, ChunkBox]]] = {}
    for a, j in zip(mine, bind_jobs(mine, sources), strict=True):
        if j.source.backend is not None:  # host memory: copying costs what hashing would
            groups.setdefault((a.fqn, a.box), []).append((j.name, j.key, (j.offsets, j.sizes, j.stored)))
    out: dict[tuple[str, int], ArrayAdapter] = {}
    for (fqn, box), chunks in groups.items():
        shared = share_unchanged(base, sources[fqn][box].array, chunks)
        if shared is not None:
            out[(fqn, box)] = shared
    return out


def _no_results(write: Callable[[], None]) -> list[Written]:
    write()
    return []


_Item = tuple[ChunkJob, StagedOut, bytes | None]


@dataclass(frozen=True, slots=True)
class _Reuse:
    """Chunks are hashed (and compared with ``base`` where given, unless ``compared`` names
    them: compared by their device's digests already): an incremental save."""

    base: BaseIndex | None
    compared: frozenset[tuple[str, str]] = frozenset()


def _write_items(
    writer: CheckpointWriter, items: Sequence[_Item], counter: ProgressCounter, reuse: _Reuse | None
) -> list[Written]:
    """Write staged chunks (with their array's document where given) as one batch of the
    writer's (:meth:`~gpuckpt.storage.base.CheckpointWriter.write_chunks`: native code
    for small chunk files of a local checkpoint), or, hashing, through
    :func:`~gpuckpt.saving.reuse.write_hashed`; returns a result for each."""
    try:
        buffers: list[np.ndarray] = []
        pads: list[int] = []
        for j, staged, _document in items:
            if isinstance(staged, EncodedChunk):  # compressed on its device already
                buffers.append(staged.wait())
                pads.append(0)
                continue
            data, pad = chunk_bytes(staged.wait(), j.stored)
            if j.codec is not None:
                # compressed here, on the I/O thread (the codecs release the GIL), never on every
                # core at once (runtime.runner.CpuSlots); the CRC32C and the content hashes of an
                # incremental save are those of the stored bytes
                with runner.compressing:
                    data, pad = encode(j.codec, data, pad), 0
            buffers.append(data)
            pads.append(pad)
        names = [j.name for j, _, _ in items]
        keys = [j.key for j, _, _ in items]
        documents = [document for _, _, document in items]
        # the caller's memory is copied once by the writer before it is checksummed and stored
        # (compressed bytes are the writer's own already)
        stable = all(staged.stable or j.codec is not None for j, staged, _ in items)
        results: list[Written]
        if reuse is not None:
            results = list(
                write_hashed(
                    writer, names, keys, buffers, pads, documents, reuse.base, reuse.compared, stable=stable
                )
            )
        else:
            crcs = writer.write_chunks(ChunkWrites(names, keys, buffers, pads, documents, stable))
            results = [(b.nbytes + p + CRC_BYTES, c) for b, p, c in zip(buffers, pads, crcs, strict=True)]
    finally:
        _release_all(items)  # staging buffers go back to their pool
    for j, _, _ in items:
        counter.add(j.nbytes)
    return results


def _release_all(items: Sequence[_Item]) -> None:
    for _, staged, _ in items:
        staged.release()


def written_rows(
    jobs: Sequence[ChunkJob], results: Sequence[Written]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """What a process reports of its writes: the chunk table rows of its jobs and their
    per-chunk columns (:func:`result_columns`)."""
    rows = np.fromiter((j.row for j in jobs), np.int64, len(jobs))
    return rows, result_columns(results)


@contextmanager
def writing(writer: CheckpointWriter) -> Iterator[None]:
    """Abort ``writer`` on any error; report system I/O errors as :class:`CheckpointWriteError`."""
    try:
        yield
    except GpuckptError:
        writer.abort()
        raise
    except OSError as exc:
        where = getattr(writer, "path", None)
        hint = failure_hint(
            exc, where if isinstance(where, (str, os.PathLike)) else None
        )  # (before the abort)
        writer.abort()
        code, text = failure_errno(exc)
        raise CheckpointWriteError(
            code,
            f"saving {where or 'the checkpoint'} failed: {text}; nothing was published and any earlier "
            f"checkpoint there is intact ({hint})",
        ) from exc
    except BaseException:
        writer.abort()
        raise
