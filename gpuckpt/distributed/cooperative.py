"""Cooperative loads: each stored chunk that several ranks need is read once for the whole job.

Every rank of a distributed load calls :func:`read_cooperative` with the boxes it
needs (the same requests as :func:`gpuckpt.distributed.load.read_boxes`). The
ranks gather each other's boxes once, and each makes the same
:class:`~gpuckpt.planning.cooperative.CooperativePlan` from them and the
checkpoint's metadata. Then, round by round (each within the memory budget,
``LoadOptions.staging_bytes`` per rank):

1. every reader reads the shared chunks it was given into memory of its own and
   checks each against its CRC32C, as any load does;
2. the ranks agree on the outcome (one small all-gather): if any read failed,
   every rank raises the error that rank met (a copy of it: a
   :class:`~gpuckpt.errors.ChecksumError` names the tensor and the chunk on every
   rank) before any byte of the round reaches a target;
3. the readers send each chunk's bytes to its receivers
   (:meth:`~gpuckpt.distributed.coordinator.Coordinator.exchange_buffers`: MPI
   or gloo point-to-point messages), straight into the receiver's target where
   the chunk is a run of whole rows of one host array (the replicas' usual case:
   no copy), else into memory of the round;
4. every rank copies the parts of the round's chunks that its boxes need into its
   targets.

The chunks that only one rank needs are read by that rank afterwards, as by
:func:`~gpuckpt.distributed.load.read_boxes`. What a failure leaves: a read that
fails (a damaged, missing or truncated chunk, an error of the store) fails the
load on every rank before its round writes anything; targets then hold the
chunks of the earlier rounds (checked bytes) and nothing of the failing round or
later ones, so a load whose shared chunks fit the budget (one round) writes no
shared chunk at all. A rank that dies fails the others' next collective (a
:class:`CoordinatorError` naming the step); one that dies while the chunks of a
round travel may leave the receivers' targets holding part of that round
(checked bytes).
"""

from __future__ import annotations

import functools
import math
import pickle
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, HostArray
from gpuckpt.device.backend import Staging
from gpuckpt.distributed.coordinator import Coordinator, describe_error
from gpuckpt.distributed.load import BoxRead, run_box_reads
from gpuckpt.errors import CoordinatorError, DistributedError, GpuckptError
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.loading.checks import ChunkRead, TensorEntry
from gpuckpt.loading.chunk_reads import fetch_verified, scratch
from gpuckpt.options import LoadOptions
from gpuckpt.planning.boxes import Box, intersect, overlapping_chunks
from gpuckpt.planning.cooperative import ChunkId, CooperativePlan, SharedChunk, plan_cooperative
from gpuckpt.progress import ProgressCounter
from gpuckpt.runtime.runner import run_all

__all__ = ["CooperativeReport", "read_cooperative"]

_T = TypeVar("_T")
Requests = list[tuple[TensorEntry, list[tuple[ArrayAdapter, Box]]]]


@dataclass(frozen=True, slots=True)
class CooperativeReport:
    """What one rank did in a cooperative load: the plan, the stored bytes of the chunks this
    rank read (shared and its own; a ranged read of one of its own chunks reads less), and the
    most bytes of shared chunks it held at once."""

    plan: CooperativePlan
    read_bytes: int
    held_bytes: int


def _slices(outer: tuple[int, ...], inner: Box) -> tuple[slice, ...]:
    return tuple(slice(o - base, o - base + s) for o, s, base in zip(inner[0], inner[1], outer, strict=True))


def _wanted(t: TensorEntry, boxes: Sequence[Box]) -> list[tuple[int, ...]]:
    seen: dict[tuple[int, ...], None] = {}
    for box in boxes:
        for coords in overlapping_chunks(t.grid, box):
            seen[coords] = None
    return list(seen)


def _plan(
    tensors: Mapping[str, TensorEntry], requests: Requests, options: LoadOptions, coordinator: Coordinator
) -> CooperativePlan:
    """Gather every rank's boxes (once) and make the plan every rank makes alike."""
    mine = [(t.fqn, [box for _, box in boxes]) for t, boxes in requests]
    me = (socket.gethostname(), mine)
    everyone = _transport("gathering the ranks' boxes", lambda: coordinator.all_gather(me))
    wants: list[list[ChunkId]] = []
    nbytes: dict[ChunkId, int] = {}
    error: Exception | None = None
    for rank, (_host, theirs) in enumerate(everyone):
        ids: list[ChunkId] = []
        for fqn, boxes in theirs:
            t = tensors.get(fqn)
            if t is None:  # a rank that opened another checkpoint
                error = error or CoordinatorError(
                    f"cooperative load: rank {rank} asks for tensor {fqn!r}, which the checkpoint rank "
                    f"{coordinator.rank} opened does not hold; every rank must load the same checkpoint "
                    "(or pass cooperative=False)"
                )
                continue
            for coords in _wanted(t, boxes):
                cid = (fqn, coords)
                if cid not in nbytes:
                    nbytes[cid] = t.chunk(coords).nbytes
                ids.append(cid)
        wants.append(ids)
    _agree(coordinator, error)
    return plan_cooperative(wants, nbytes, budget=options.staging_bytes, nodes=[host for host, _ in everyone])


def _transport(step: str, fn: Callable[[], _T], *, written: str = "nothing of the round in progress") -> _T:
    """``fn()``, a collective step; a failure of the transport itself (a rank died, a connection
    broke: MPI's or gloo's own error) becomes a :class:`CoordinatorError` naming the step and
    what the targets may hold."""
    try:
        return fn()
    except GpuckptError:
        raise
    except Exception as exc:
        raise CoordinatorError(
            f"cooperative load: {step} failed ({type(exc).__name__}: {exc}); another rank of the job "
            f"died or its transport broke: the targets hold {written} (and the checked chunks of "
            "earlier rounds); load again once every rank runs, or pass cooperative=False"
        ) from exc


def _agree(coordinator: Coordinator, error: BaseException | None) -> None:
    """Every rank raises (a copy of) the first error any rank met, or every rank goes on.

    An error that does not pickle travels as a :class:`DistributedError` naming it."""
    report: bytes | None = None
    if error is not None:
        try:
            report = pickle.dumps(error)
        except Exception:
            report = pickle.dumps(DistributedError({coordinator.rank: describe_error(error)}))
    reports = _transport("agreeing on the reads", lambda: coordinator.all_gather(report))
    for rank, found in enumerate(reports):
        if found is not None:
            if rank == coordinator.rank and error is not None:
                raise error
            raise pickle.loads(found)


def _read_shared(reader: Any, t: TensorEntry, c: ChunkRead, into: np.ndarray) -> None:
    """Read chunk ``c`` of ``t`` into ``into`` (its stored data bytes) and check it."""
    fetch_verified(reader, t, c, [into])


def _target_memory(
    t: TensorEntry, c: ChunkRead, targets: list[tuple[ArrayAdapter, Box]] | None
) -> np.ndarray | None:
    """The bytes of the one host target that chunk ``c`` lies in whole, where they are laid out
    as the chunk's stored bytes (a run of whole rows of a C-ordered array, no edge padding): the
    chunk is then received straight into them. None otherwise (received into scratch, copied)."""
    if not targets or c.stored != c.spec.sizes:
        return None
    chunk_box: Box = (c.spec.offsets, c.spec.sizes)
    hits = [(a, b) for a, b in targets if intersect(chunk_box, b)]
    if len(hits) != 1:
        return None
    adapter, box = hits[0]
    if not isinstance(adapter, HostArray) or intersect(chunk_box, box) != chunk_box:
        return None
    view = adapter.array[_slices(box[0], chunk_box)]
    if not view.flags.c_contiguous or view.dtype.byteorder == ">" or view.dtype.itemsize != t.dtype.itemsize:
        return None
    data: np.ndarray = view.reshape(-1).view(np.uint8)
    return data


def _copy_into(
    t: TensorEntry,
    c: ChunkRead,
    data: np.ndarray,
    targets: list[tuple[ArrayAdapter, Box]],
    staging: Staging,
    counter: ProgressCounter,
) -> None:
    """The parts of chunk ``c`` (its stored bytes ``data``) that ``targets`` need, copied into them."""
    stored = data.view(t.dtype.newbyteorder("<")).reshape(c.stored)
    chunk_box: Box = (c.spec.offsets, c.spec.sizes)
    for adapter, box in targets:
        inter = intersect(chunk_box, box)
        if inter is None:
            continue
        part = stored[_slices(c.spec.offsets, inter)]
        local = tuple(o - b for o, b in zip(inter[0], box[0], strict=True))
        incoming = adapter.stage_in(local, inter[1], staging)
        try:
            incoming.box[...] = part
            incoming.finish()
        finally:
            incoming.release()
        counter.add(part.nbytes)


@dataclass(frozen=True, slots=True)
class _Job:
    """What every round of one rank's cooperative load uses."""

    reader: Any
    tensors: Mapping[str, TensorEntry]
    boxes_of: Mapping[str, list[tuple[ArrayAdapter, Box]]]
    options: LoadOptions
    coordinator: Coordinator
    staging: Staging
    counter: ProgressCounter


def _round(
    job: _Job, chunks: list[SharedChunk], pending: BaseException | None
) -> tuple[BaseException | None, int, int]:
    """One round: read, agree, send, copy. ``pending``: this rank's failure of the round before
    (agreed on here, so that it fails every rank). Returns this round's failed copy (or None),
    the stored bytes read and held; the round's buffers are gone when it returns."""
    me, tensors, coordinator = job.coordinator.rank, job.tensors, job.coordinator
    mine = [s for s in chunks if s.reader == me or me in s.receivers]
    buffers: dict[ChunkId, np.ndarray] = {}
    direct: set[ChunkId] = set()  # received straight into the target's memory
    error, nread = pending, 0
    try:
        for s in mine:
            t = tensors[s.fqn]
            into = None if s.reader == me else _target_memory(t, t.chunk(s.coords), job.boxes_of.get(s.fqn))
            if into is None:
                buffers[s.id] = scratch((s.nbytes - CRC_BYTES,), np.dtype(np.uint8), t)
            else:
                buffers[s.id] = into
                direct.add(s.id)
        reads = [
            functools.partial(
                _read_shared, job.reader, tensors[s.fqn], tensors[s.fqn].chunk(s.coords), buffers[s.id]
            )
            for s in mine
            if s.reader == me
        ]
        if error is None:
            run_all(reads, threads=job.options.threads, name="gpuckpt-coop-read")
            nread = sum(s.nbytes for s in mine if s.reader == me)
    except Exception as exc:
        error = error or exc
    _agree(coordinator, error)  # raises on every rank if any failed: nothing of the round is copied
    sends: dict[int, list[np.ndarray]] = {}
    recvs: dict[int, list[np.ndarray]] = {}
    for s in mine:
        if s.reader == me:
            for r in s.receivers:
                sends.setdefault(r, []).append(buffers[s.id])
        else:
            recvs.setdefault(s.reader, []).append(buffers[s.id])
    _transport(
        "sending the chunks read",
        lambda: coordinator.exchange_buffers(sends, recvs),
        written="part of the round in progress (checked bytes, received straight into them)",
    )
    failed: BaseException | None = None
    try:
        for s in mine:
            targets = job.boxes_of.get(s.fqn)
            if s.id in direct:
                job.counter.add(buffers[s.id].nbytes)
            elif targets:
                t = tensors[s.fqn]
                _copy_into(t, t.chunk(s.coords), buffers[s.id], targets, job.staging, job.counter)
    except Exception as exc:
        failed = exc
    return failed, nread, sum(b.nbytes for cid, b in buffers.items() if cid not in direct)


def read_cooperative(
    reader: Any,
    tensors: Mapping[str, TensorEntry],
    requests: Requests,
    options: LoadOptions,
    coordinator: Coordinator,
) -> CooperativeReport:
    """Fill every ``(adapter, box)`` of ``requests``, each stored chunk read once for the whole job.

    A collective: every rank of ``coordinator`` calls it, with its own requests
    (possibly none). ``tensors`` holds every tensor of the checkpoint (the ranks
    name the tensors of each other's requests). Raises on every rank when a read
    of a shared chunk fails on any rank (the error that rank met); the chunks
    this rank alone needs are read last and their errors are this rank's (the
    caller agrees on them, as :func:`gpuckpt.load` does).
    """
    plan = _plan(tensors, requests, options, coordinator)
    boxes_of: dict[str, list[tuple[ArrayAdapter, Box]]] = {t.fqn: boxes for t, boxes in requests}
    total = sum(math.prod(b[1]) * t.dtype.itemsize for t, boxes in requests for _, b in boxes)
    counter = ProgressCounter(options.progress, total)
    staging = Staging(
        ((a.backend, math.prod(b[1]) * t.dtype.itemsize) for t, boxes in requests for a, b in boxes),
        options.staging_bytes,
    )
    job = _Job(reader, tensors, boxes_of, options, coordinator, staging, counter)
    shared_ids = {s.id for s in plan.shared}
    read_bytes = held = 0
    pending: BaseException | None = None  # a failed copy of the previous round, agreed on with the next
    for k in range(plan.nrounds):
        pending, nread, nheld = _round(job, plan.in_round(k), pending)
        read_bytes += nread
        held = max(held, nheld)
    if plan.nrounds:
        _agree(coordinator, pending)
    own: list[BoxRead] = []
    for t, boxes in requests:
        for coords in _wanted(t, [b for _, b in boxes]):
            if (t.fqn, coords) not in shared_ids:
                c = t.chunk(coords)
                own.append((t, c, [(a, b) for a, b in boxes if intersect((c.spec.offsets, c.spec.sizes), b)]))
                read_bytes += c.nbytes
    run_box_reads(reader, own, options, counter)
    return CooperativeReport(plan=plan, read_bytes=read_bytes, held_bytes=held)
