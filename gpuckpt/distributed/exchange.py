"""The bookkeeping of the coordinators' point-to-point exchanges, shared by every transport.

:meth:`~gpuckpt.distributed.coordinator.Coordinator.exchange_objects` and
:meth:`~gpuckpt.distributed.coordinator.Coordinator.exchange_buffers` check their arguments,
match what each pair sends with what the receiver expects, copy where the transport is memory
(threads, a rank sending to itself), and report every mismatch in one error; the transports
(MPI, gloo, threads) only move the bytes.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuckpt.errors import CoordinatorError

__all__ = [
    "PACKED_MAX_BYTES",
    "BufferRound",
    "byte_view",
    "copy_buffers",
    "pack_small_buffers",
    "packed_indices",
    "count_mismatch",
    "dumps",
    "pick_mail",
    "raise_problems",
    "size_mismatch",
]


def dumps(obj: Any) -> bytes:
    """``obj`` pickled as the coordinators send it (the newest protocol)."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass(slots=True)
class BufferRound:
    """The messages one rank posts in one :meth:`Coordinator.exchange_buffers` (see ``_plan_buffer_round``).

    ``sends`` and ``recvs`` hold ``(peer, piece)``, each piece at most
    :data:`~gpuckpt.distributed.coordinator.PIECE_BYTES` long, in the order the pair's other side posts them;
    ``problems`` are the mismatches found so far.
    """

    sends: list[tuple[int, memoryview]] = field(default_factory=list)
    recvs: list[tuple[int, memoryview]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def finish(self) -> None:
        """Raise :class:`CoordinatorError` if a buffer did not match (call once every message arrived)."""
        raise_problems("exchange_buffers", self.problems)


#: Buffers smaller than this travel packed into one message where a caller asks for it
#: (:func:`pack_small_buffers`). A part of a local tier holds a document and a checksum trailer
#: per tensor: over MPI on a 2-vCPU VM (4 ranks, the ranks of one node sending a GPT-like part of
#: 289 tensors, 305 MiB, to those of the other), its 578 messages took 180-212 ms, the same bytes
#: with those under 64 KiB packed (98 messages) 122-125 ms. Read at each call.
PACKED_MAX_BYTES = 64 << 10


def packed_indices(sizes: Sequence[int]) -> list[int]:
    """Which of the buffers of these ``sizes`` (one pair's, in order) travel packed into one
    message: the non-empty ones under :data:`PACKED_MAX_BYTES`, where there are two or more.
    Sender and receiver choose from the sizes both know (the sender's, announced)."""
    limit = PACKED_MAX_BYTES
    chosen = [i for i, n in enumerate(sizes) if 0 < n < limit]
    return chosen if len(chosen) >= 2 else []


def pack_small_buffers(
    sends: Mapping[int, Sequence[Any]], recvs: Mapping[int, Sequence[Any]]
) -> tuple[dict[int, list[Any]], dict[int, list[Any]], Callable[[bool], None]]:
    """The buffers of one :meth:`~gpuckpt.distributed.coordinator.Coordinator.exchange_buffers`
    round with each pair's small ones (:func:`packed_indices`) packed into one buffer after the
    others: what to send, what to receive into, and ``finish(succeeded)``, to call once the round
    is over: it copies the packed buffers received out into their own where the round
    succeeded, and lets go of every view it holds of the callers' buffers either way.

    Both sides must pack (the pairs' buffer lists change); the receive buffers' sizes must be
    the sender's, as the round asks anyway (a small one of another size changes its pair's pack
    size, which the round reports as that buffer's mismatch). The packs cost a copy of the small
    buffers on each side, and their bytes in memory: for callers that move many small buffers
    (a part's documents and checksum trailers), not for rounds under a memory budget."""
    out: dict[int, list[Any]] = {}
    for dest, bufs in sends.items():
        views = [memoryview(b).cast("B") for b in bufs]
        chosen = packed_indices([v.nbytes for v in views])
        if chosen:
            views = _others_then(views, chosen, memoryview(b"".join(views[i] for i in chosen)))
        out[dest] = views
    unpack: list[tuple[memoryview, memoryview]] = []
    into: dict[int, list[Any]] = {}
    for src, bufs in recvs.items():
        views = [memoryview(b).cast("B") for b in bufs]
        chosen = packed_indices([v.nbytes for v in views])
        if chosen:
            pack = memoryview(bytearray(sum(views[i].nbytes for i in chosen)))
            at = 0
            for i in chosen:
                n = views[i].nbytes
                unpack.append((pack[at : at + n], views[i]))
                at += n
            views = _others_then(views, chosen, pack)
        into[src] = views

    def finish(succeeded: bool) -> None:
        try:
            if succeeded:
                for got, target in unpack:
                    target[:] = got
        finally:
            unpack.clear()
            out.clear()
            into.clear()

    return out, into, finish


def _others_then(views: list[memoryview], chosen: list[int], pack: memoryview) -> list[memoryview]:
    """A pair's buffer list as it travels: the views not ``chosen``, in order, then ``pack``."""
    picked = set(chosen)
    return [v for i, v in enumerate(views) if i not in picked] + [pack]


def byte_view(buf: Any, *, writable: bool, name: str) -> memoryview:
    """``buf`` as a flat ``memoryview`` of its bytes (no copy); ``name`` is where the caller passed it.

    Raises :class:`CoordinatorError` if ``buf`` has no buffer, is not C-contiguous, or is
    read-only where ``writable`` is asked.
    """
    try:
        view = memoryview(buf)
    except TypeError as exc:
        raise CoordinatorError(
            f"{name} is a {type(buf).__name__}, not a bytes-like object; pass bytes, a bytearray, a "
            "memoryview or a NumPy array (an array whose dtype has no buffer format: array.view(numpy.uint8))"
        ) from exc
    if not view.c_contiguous:
        raise CoordinatorError(
            f"{name} is not C-contiguous (shape {view.shape}, strides {view.strides}); pass a contiguous "
            "copy (numpy.ascontiguousarray)"
        )
    if writable and view.readonly:
        raise CoordinatorError(
            f"{name} is read-only; a receive buffer must be writable (a bytearray, an array)"
        )
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def copy_buffers(sent: Sequence[Any], targets: Sequence[memoryview], source: int, rank: int) -> list[str]:
    """Copy each buffer ``source`` sent into the matching buffer of ``targets`` on ``rank``.

    Copies the pairs whose sizes agree; returns what did not match (empty when all did).
    """
    problems = []
    if len(sent) != len(targets):
        problems.append(count_mismatch(source, rank, len(sent), len(targets)))
    for i, (data, target) in enumerate(zip(sent, targets, strict=False)):
        nbytes = memoryview(data).nbytes
        if nbytes != target.nbytes:
            problems.append(size_mismatch(source, rank, i, nbytes, target.nbytes))
        elif nbytes:
            np.copyto(np.frombuffer(target, np.uint8), np.frombuffer(data, np.uint8))
    return problems


def count_mismatch(source: int, rank: int, sent: int, expected: int) -> str:
    """The report of a pair whose sender sent ``sent`` buffers where the receiver gave ``expected``."""
    return f"rank {source} sent {sent} buffers to rank {rank}, which receives {expected} from it"


def size_mismatch(source: int, rank: int, index: int, sent: int, expected: int) -> str:
    """The report of buffer ``index`` from ``source`` to ``rank`` whose sizes differ."""
    return (
        f"buffer {index} from rank {source} to rank {rank} holds {sent} bytes, its receive buffer {expected}"
    )


def pick_mail(
    rank: int, sources: Sequence[int], mailboxes: Sequence[Mapping[int, Any]]
) -> tuple[dict[int, Any], list[str]]:
    """What each rank of ``sources`` left for ``rank`` in its mailbox (``mailboxes[src]``: dest -> mail).

    Returns the mail by source, and the pairs that do not match: a source
    that left nothing for ``rank``, or a rank that left mail ``rank`` does
    not receive.
    """
    received = {src: mailboxes[src][rank] for src in sources if rank in mailboxes[src]}
    problems = [
        f"rank {src} sent nothing to rank {rank}, which receives from it"
        for src in sources
        if src not in received
    ]
    expected = set(sources)
    problems += [
        f"rank {src} sent to rank {rank}, which does not receive from it"
        for src, mailbox in enumerate(mailboxes)
        if rank in mailbox and src not in expected
    ]
    return received, problems


def raise_problems(op: str, problems: list[str]) -> None:
    """Raise :class:`CoordinatorError` naming ``problems`` (the mismatches one rank found), if any."""
    if not problems:
        return
    shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
    contract = (
        "same pairs, same number of buffers of the same sizes, in the same order"
        if op == "exchange_buffers"
        else "same pairs"
    )
    raise CoordinatorError(f"{op}: {shown}; every rank's sends must match its receivers' ({contract})")
