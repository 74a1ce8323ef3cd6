"""The bookkeeping of the coordinators' point-to-point exchanges, shared by every transport.

:meth:`~gpuckpt.distributed.coordinator.Coordinator.exchange_objects` and
:meth:`~gpuckpt.distributed.coordinator.Coordinator.exchange_buffers` check their arguments,
match what each pair sends with what the receiver expects, copy where the transport is memory
(threads, a rank sending to itself), and report every mismatch in one error; the transports
(MPI, gloo, threads) only move the bytes.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuckpt.errors import CoordinatorError

__all__ = [
    "BufferRound",
    "byte_view",
    "copy_buffers",
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
    #: ``(received, target)``: small buffers that arrived packed in one message, each copied
    #: out into its receive buffer by :meth:`finish`
    unpack: list[tuple[memoryview, memoryview]] = field(default_factory=list)

    def finish(self) -> None:
        """Copy the buffers that arrived packed into their receive buffers, then raise
        :class:`CoordinatorError` if a buffer did not match (call once every message arrived)."""
        for got, target in self.unpack:
            target[:] = got
        self.unpack.clear()
        raise_problems("exchange_buffers", self.problems)


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
