"""Cooperative loads: each stored chunk that several ranks need is read once for the whole job.

Every rank of a distributed load calls :func:`read_cooperative` with the boxes it
needs (the same requests as :func:`gpuckpt.distributed.load.read_boxes`). The
ranks gather each other's boxes once, and each makes the same
:class:`~gpuckpt.planning.cooperative.CooperativePlan` from them and the
checkpoint's metadata. Then, round by round (each of at most half the memory
budget, ``LoadOptions.staging_bytes``, per rank: the reads of one round run
while the round before sends its chunks, so a rank holds at most the budget; a
chunk a rank reads or receives straight into its targets takes none of it, so a
replicated state whose arrays take whole chunks travels in one round, with no
memory beyond the targets):

1. every reader reads the shared chunks it was given and checks each against its
   CRC32C, as any load does: straight into its own target where the chunk is a
   run of whole rows of one host array (as a load without a coordinator reads),
   else into memory of its own;
2. the ranks agree on the outcome (one small all-gather, after a barrier that
   waits without spinning, :meth:`~gpuckpt.distributed.coordinator.Coordinator.idle_barrier`:
   the readers end apart, and the first to end leave the CPU to the others
   where ranks share cores): if any read failed, every rank raises the error
   that rank met (a copy of it: a :class:`~gpuckpt.errors.ChecksumError` names
   the tensor and the chunk on every rank) before any byte of the round is sent;
3. the readers send each chunk's bytes to its receivers
   (:meth:`~gpuckpt.distributed.coordinator.Coordinator.exchange_buffers`: MPI
   or gloo point-to-point messages), straight into the receiver's target where
   the chunk is a run of whole rows of one host array (the replicas' usual case:
   no copy), else into memory of the round;
4. every rank copies the parts of the round's chunks that it holds in memory of
   the round and its boxes need into its targets.

The chunks that only one rank needs are read by that rank afterwards, as by
:func:`~gpuckpt.distributed.load.read_boxes`. What a failure leaves: a read that
fails (a damaged, missing or truncated chunk, an error of the store) fails the
load on every rank, and no byte of its round (or a later one) is sent: no rank
receives anything unchecked. As in any ``load`` into existing arrays, the
targets are not restored: each reader's targets may hold what it read in that
round (the failing chunk's bytes included), and every target the checked
chunks of earlier rounds; ``load_state_dict`` never returns partial results. A
rank that dies fails the others' next collective (a :class:`CoordinatorError`
naming the step); one that dies while the chunks of a round travel may leave
the receivers' targets holding part of that round (checked bytes).
"""

from __future__ import annotations

import ast
import functools
import itertools
import math
import pickle
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, HostArray
from gpuckpt.device.backend import Staging
from gpuckpt.distributed.coordinator import Coordinator, describe_error
from gpuckpt.distributed.load import BoxRead, canonicalize_bool_boxes, run_box_reads
from gpuckpt.errors import CoordinatorError, DistributedError, GpuckptError
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.loading.checks import ChunkRead, TensorEntry
from gpuckpt.loading.chunk_reads import decoded_chunk, fetch_verified, scratch
from gpuckpt.loading.ranged import segments_of
from gpuckpt.options import LoadOptions
from gpuckpt.planning.boxes import Box, intersect, overlapping_chunks
from gpuckpt.planning.cooperative import ChunkId, CooperativePlan, SharedChunk, plan_cooperative
from gpuckpt.progress import ProgressCounter
from gpuckpt.runtime.runner import run_all
from gpuckpt.runtime.workers import Workers

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


def _in_place(requests: Requests) -> dict[ChunkId, np.ndarray]:
    """The chunks this rank needs that it can read or receive straight into its targets, and where."""
    into: dict[ChunkId, np.ndarray] = {}
    for t, targets in requests:
        if t.codec is not None:  # compressed: travels as stored, then decoded
            continue
        for coords in _wanted(t, [b for _, b in targets]):
            memory = _target_memory(t, t.chunk(coords), targets)
            if memory is not None:
                into[(t.fqn, coords)] = memory
    return into


def _plan(
    reader: Any,
    tensors: Mapping[str, TensorEntry],
    requests: Requests,
    options: LoadOptions,
    coordinator: Coordinator,
    identity: str | None,
    direct: Mapping[ChunkId, np.ndarray],
) -> CooperativePlan:
    """Gather every rank's boxes and the chunks it can take straight into its targets (``direct``:
    for each tensor, True for all of them, else their coordinates), once, and make the plan
    every rank makes alike."""
    mine = []
    for entry, boxes in requests:
        wanted = _wanted(entry, [b for _, b in boxes])
        ready = tuple(c for c in wanted if (entry.fqn, c) in direct)
        every = bool(ready) and len(ready) == len(wanted)
        mine.append((entry.fqn, [box for _, box in boxes], True if every else ready))
    me = (socket.gethostname(), identity, mine)
    everyone = _transport("gathering the ranks' boxes", lambda: coordinator.all_gather(me))
    wants: list[list[ChunkId]] = []
    nbytes: dict[ChunkId, int] = {}
    # what differs between the ranks' checkpoints, as seen from this rank's (a few examples)
    differs: list[str] = []
    here = f"the checkpoint rank {coordinator.rank} opened"
    rows: dict[
        ChunkId, list[tuple[int, int]]
    ] = {}  # of chunks that can be read in part: who needs which rows
    free: list[set[ChunkId]] = []
    for rank, (_host, _id, theirs) in enumerate(everyone):
        ids: list[ChunkId] = []
        straight: set[ChunkId] = set()
        free.append(straight)
        for fqn, boxes, ready in theirs:
            t = tensors.get(fqn)
            if t is None:  # a rank that opened another checkpoint
                differs.append(f"rank {rank} asks for tensor {fqn!r}, which {here} does not hold")
                continue
            outside = [b for b in boxes if not _fits(b, t.shape)]
            if outside:  # the same name in another checkpoint, of another shape
                differs.append(
                    f"rank {rank} asks for {_box_text(outside[0])} of tensor {fqn!r}, which is "
                    f"{_shape_text(t.shape)} in {here}"
                )
                continue
            ranged = bool(t.shape) and reader.capabilities.reads_ranges and segments_of(t) is not None
            for coords in _wanted(t, boxes):
                cid = (fqn, coords)
                if cid not in nbytes:
                    nbytes[cid] = t.chunk(coords).nbytes
                ids.append(cid)
                if ready is True:
                    straight.add(cid)
                if ranged:
                    rows.setdefault(cid, []).append(_rows_of(t.chunk(coords), boxes))
            if ready is not True:
                straight.update((fqn, tuple(c)) for c in ready)
        wants.append(ids)
    error = _mismatch([i for _, i, _ in everyone], differs)
    _agree(coordinator, error)
    # a chunk whose needers need disjoint rows: each reads its own rows (ranged), none twice
    alone = {cid for cid, spans in rows.items() if len(spans) > 1 and _disjoint(spans)}
    # rounds of half the budget: the reads of one overlap the sends of the one before
    budget = max(1, options.staging_bytes // 2)
    nodes = [host for host, _, _ in everyone]
    # a reader (or a receiver into memory of the round) holds a chunk's data, not its trailer
    held = {cid: max(0, n - CRC_BYTES) for cid, n in nbytes.items()}
    return plan_cooperative(wants, nbytes, budget=budget, nodes=nodes, alone=alone, held=held, free=free)


def _mismatch(identities: Sequence[str | None], differs: Sequence[str]) -> CoordinatorError | None:
    """The error of ranks that opened different checkpoints, naming which rank opened which
    (``identities``: each rank's checkpoint and save ids, as the caller wrote them) and, from
    ``differs``, a few of the tensors that differ; None where they agree."""
    if len(set(identities)) <= 1 and not differs:
        return None
    groups: dict[str | None, list[int]] = {}
    for rank, identity in enumerate(identities):
        groups.setdefault(identity, []).append(rank)
    parts = []
    if len(groups) > 1:  # every rank sees every identity: all of them fail alike
        opened = "; ".join(f"{_ranks_text(r)}: {_identity_text(i)}" for i, r in groups.items())
        parts.append(f"the ranks opened different checkpoints ({opened})")
    if differs:
        more = f" (and {len(differs) - 3} more)" if len(differs) > 3 else ""
        parts.append("; ".join(differs[:3]) + more)
    return CoordinatorError(
        f"cooperative load: {'; '.join(parts)}. Every rank must load the same checkpoint: pass "
        "every rank the same path (or pass cooperative=False for ranks that load different ones)"
    )


def _identity_text(identity: str | None) -> str:
    """``checkpoint ID, save ID`` from the ids a caller recorded (the repr of the pair)."""
    if identity is None:
        return "a checkpoint that records no id"
    try:
        checkpoint_id, save_id = ast.literal_eval(identity)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return f"checkpoint {identity}"
    return f"checkpoint {checkpoint_id}" + ("" if save_id is None else f", save {save_id}")


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _shape_text(shape: Sequence[int]) -> str:
    """``4x1024`` (``()`` for a scalar)."""
    return "x".join(map(str, shape)) if len(shape) else "()"


def _box_text(box: Box) -> str:
    """``[0:4, 0:1024]``: the index ranges of ``box``."""
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(box[0], box[1], strict=True)) + "]"


def _fits(box: Box, shape: Sequence[int]) -> bool:
    return len(box[0]) == len(shape) and all(
        o >= 0 and o + n <= s for o, n, s in zip(box[0], box[1], shape, strict=True)
    )


def _rows_of(c: ChunkRead, boxes: Sequence[Box]) -> tuple[int, int]:
    """The rows (first axis, from the chunk's start) of chunk ``c`` that ``boxes`` need."""
    chunk_box: Box = (c.spec.offsets, c.spec.sizes)
    spans = (
        [i[0][0] for b in boxes if (i := intersect(chunk_box, b))],
        [i[0][0] + i[1][0] for b in boxes if (i := intersect(chunk_box, b))],
    )
    return min(spans[0]) - c.spec.offsets[0], max(spans[1]) - c.spec.offsets[0]


def _disjoint(spans: list[tuple[int, int]]) -> bool:
    ordered = sorted(spans)
    return all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))


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


def _chunk_memory(t: TensorEntry, stored: int) -> np.ndarray:
    """Memory of the round for a chunk of ``t`` of ``stored`` bytes: its data, not its trailer."""
    return scratch((stored - CRC_BYTES,), np.dtype(np.uint8), t, populate=True)


def _read_shared(
    reader: Any, t: TensorEntry, c: ChunkRead, buffers: dict[ChunkId, np.ndarray], cid: ChunkId
) -> None:
    """Read chunk ``c`` of ``t`` into ``buffers[cid]`` (its stored data bytes: this rank's target
    where it holds the chunk whole) or else into new memory, kept there, and check it. New
    memory is made here, in the read's own thread, so that mapping the pages of one chunk
    overlaps the reads of the others. A compressed chunk travels as stored (fewer bytes); its
    reader checks here that it decompresses, so that a hostile chunk fails the round before any
    rank receives it."""
    into = buffers.get(cid)
    if into is None:
        into = buffers[cid] = _chunk_memory(t, c.nbytes)
    fetch_verified(reader, t, c, [into])
    if t.codec is not None:
        decoded_chunk(t, c, into)


def _target_memory(
    t: TensorEntry, c: ChunkRead, targets: list[tuple[ArrayAdapter, Box]] | None
) -> np.ndarray | None:
    """The bytes of the one host target that chunk ``c`` lies in whole, where they are laid out
    as the chunk's stored bytes (a run of whole rows of a C-ordered array, no edge padding): the
    chunk is then read or received straight into them. None otherwise (into scratch, copied)."""
    if not targets or not c.spec.sizes or c.stored != c.spec.sizes:
        return None  # a 0-d tensor indexes to a scalar, not a view: into scratch
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
    if t.codec is not None:
        stored = decoded_chunk(t, c, data)
    else:
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
    direct: Mapping[ChunkId, np.ndarray]  # where this rank reads or receives chunks straight into its targets


@dataclass(slots=True)
class _Round:
    """One round on this rank: its chunks, their buffers, and its reads (running or done)."""

    mine: list[SharedChunk]
    buffers: dict[ChunkId, np.ndarray]
    direct: set[ChunkId]  # read or received straight into the target's memory
    reads: Future[None] | None
    error: BaseException | None = None
    nread: int = 0

    def wait(self) -> BaseException | None:
        """This rank's failure of the round's reads, once they are done (None: all checked)."""
        if self.reads is not None:
            try:
                self.reads.result()
            except Exception as exc:
                self.error = self.error or exc
            self.reads = None
        return self.error

    @property
    def held(self) -> int:
        """The bytes of memory of the round's chunks (its readers' included, made as they read)."""
        return sum(max(0, s.nbytes - CRC_BYTES) for s in self.mine if s.id not in self.direct)


def _read_all(reads: Sequence[Callable[[], None]], threads: int | None) -> None:
    run_all(reads, threads=threads, name="gpuckpt-coop-read")


def _start(job: _Job, chunks: list[SharedChunk], workers: Workers) -> _Round:
    """Start the reads of a round on ``workers`` (they run while the round before sends its
    chunks), each straight into this rank's target where it holds the chunk whole, and make the
    memory of the chunks it receives elsewhere. Nothing is received yet."""
    me, tensors = job.coordinator.rank, job.tensors
    state = _Round([s for s in chunks if s.reader == me or me in s.receivers], {}, set(), None)
    try:
        for s in state.mine:
            into = job.direct.get(s.id)  # as the plan counted it
            if into is not None:
                state.buffers[s.id] = into
                state.direct.add(s.id)
            elif s.reader != me:  # a read makes its own memory, as it starts
                state.buffers[s.id] = _chunk_memory(tensors[s.fqn], s.nbytes)
        reads = [
            functools.partial(
                _read_shared, job.reader, tensors[s.fqn], tensors[s.fqn].chunk(s.coords), state.buffers, s.id
            )
            for s in state.mine
            if s.reader == me
        ]
        state.nread = sum(s.nbytes for s in state.mine if s.reader == me)
        if reads:
            state.reads = workers.submit(_read_all, reads, job.options.threads)
    except Exception as exc:
        state.error = exc
    return state


def _finish(job: _Job, state: _Round) -> BaseException | None:
    """Send the round's chunks and copy what this rank needs into its targets (the ranks agreed
    that every read of the round succeeded). Returns this rank's failed copy, or None."""
    me = job.coordinator.rank
    sends: dict[int, list[np.ndarray]] = {}
    recvs: dict[int, list[np.ndarray]] = {}
    for s in state.mine:
        if s.reader == me:
            for r in s.receivers:
                sends.setdefault(r, []).append(state.buffers[s.id])
        else:
            recvs.setdefault(s.reader, []).append(state.buffers[s.id])
    _transport(
        "sending the chunks read",
        lambda: job.coordinator.exchange_buffers(sends, recvs),
        written="part of the round in progress (checked bytes, received straight into them)",
    )
    try:
        for s in state.mine:
            targets = job.boxes_of.get(s.fqn)
            if s.id in state.direct:
                job.counter.add(state.buffers[s.id].nbytes)
            elif targets:
                t = job.tensors[s.fqn]
                _copy_into(t, t.chunk(s.coords), state.buffers[s.id], targets, job.staging, job.counter)
    except Exception as exc:
        return exc
    return None


def _rounds(job: _Job, plan: CooperativePlan) -> tuple[int, int]:
    """Every round of ``plan``: the reads of each overlap the sends of the one before. Returns
    the stored bytes this rank read and the most bytes of shared chunks it held at once."""
    nread = held = 0
    pending: BaseException | None = None  # a failed copy, agreed on with the next round
    with Workers(1, "gpuckpt-coop-prefetch") as workers:
        state = _start(job, plan.in_round(0), workers) if plan.nrounds else None
        try:
            for k in range(plan.nrounds):
                assert state is not None
                error = pending or state.wait()
                _transport("waiting for the round's reads", job.coordinator.idle_barrier)
                _agree(job.coordinator, error)  # raises on every rank if any failed
                nread += state.nread
                current, state = state, None
                if k + 1 < plan.nrounds:
                    state = _start(job, plan.in_round(k + 1), workers)
                held = max(held, current.held + (state.held if state is not None else 0))
                pending = _finish(job, current)
                del current
        finally:
            if state is not None:
                state.wait()  # a round read ahead of a failure: its reads end before the buffers go
        if plan.nrounds:
            _agree(job.coordinator, pending)
    return nread, held


def read_cooperative(
    reader: Any,
    tensors: Mapping[str, TensorEntry],
    requests: Requests,
    options: LoadOptions,
    coordinator: Coordinator,
    identity: str | None = None,
) -> CooperativeReport:
    """Fill every ``(adapter, box)`` of ``requests``, each stored chunk read once for the whole job.

    A collective: every rank of ``coordinator`` calls it, with its own requests
    (possibly none). ``tensors`` holds every tensor of the checkpoint (the ranks
    name the tensors of each other's requests). Raises on every rank when a read
    of a shared chunk fails on any rank (the error that rank met); the chunks
    this rank alone needs are read last and their errors are this rank's (the
    caller agrees on them, as :func:`gpuckpt.load` does). ``identity``: what names the
    checkpoint (its recorded ids): ranks that pass different ones fail together.
    """
    direct = _in_place(requests)
    plan = _plan(reader, tensors, requests, options, coordinator, identity, direct)
    boxes_of: dict[str, list[tuple[ArrayAdapter, Box]]] = {t.fqn: boxes for t, boxes in requests}
    total = sum(math.prod(b[1]) * t.dtype.itemsize for t, boxes in requests for _, b in boxes)
    counter = ProgressCounter(options.progress, total)
    staging = Staging(
        ((a.backend, math.prod(b[1]) * t.dtype.itemsize) for t, boxes in requests for a, b in boxes),
        options.staging_bytes,
    )
    job = _Job(reader, tensors, boxes_of, options, coordinator, staging, counter, direct)
    shared_ids = {s.id for s in plan.shared}
    read_bytes, held = _rounds(job, plan)
    own: list[BoxRead] = []
    for t, boxes in requests:
        for coords in _wanted(t, [b for _, b in boxes]):
            if (t.fqn, coords) not in shared_ids:
                c = t.chunk(coords)
                own.append((t, c, [(a, b) for a, b in boxes if intersect((c.spec.offsets, c.spec.sizes), b)]))
                read_bytes += c.nbytes
    run_box_reads(reader, own, options, counter)
    canonicalize_bool_boxes(requests)
    return CooperativeReport(plan=plan, read_bytes=read_bytes, held_bytes=held)
