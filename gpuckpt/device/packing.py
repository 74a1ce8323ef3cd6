"""Packing arrays into one device arena for a device-side snapshot (``staging="device"``).

A snapshot on the device should cost one device-to-device copy of the state,
not one allocation and one copy per tensor. :func:`plan_packing` takes the
memory extents of the arrays (address, bytes) and plans one arena: arrays
of one allocation that lie back to back (or overlap: views of one buffer) form
a *run*, copied as one block, keeping their distances, so that a state held in
one flat buffer is one copy (a copy never runs from one allocation into the
next, even where they lie back to back: CUDA refuses such a copy); runs are
placed one after another, aligned. With many runs, the back end copies them
all with one batched copy (one kernel over a table of pieces) instead of one
copy each.

Pure data: no arrays, no device. Both back ends follow the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ARENA_ALIGN", "BATCH_MIN_RUNS", "PIECE_BYTES", "Packing", "Run", "plan_packing"]

#: alignment of each run in the arena (CUDA allocations are 256-byte aligned)
ARENA_ALIGN = 256
#: from this many runs on, they are copied by one batched copy instead of one copy each
BATCH_MIN_RUNS = 4
#: a batched copy splits runs into pieces of at most this many bytes (one block of threads each)
PIECE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Run:
    """Bytes ``[start, start + nbytes)`` of source memory, copied to ``offset`` in the arena."""

    start: int
    nbytes: int
    offset: int


@dataclass(frozen=True, slots=True)
class Packing:
    """Where each array goes (``places[i]``: its offset in the arena) and what is copied."""

    runs: tuple[Run, ...]
    places: tuple[int, ...]
    total: int

    @property
    def batched(self) -> bool:
        """Whether the runs are copied by one batched copy (else one copy each)."""
        return len(self.runs) >= BATCH_MIN_RUNS

    @property
    def copies(self) -> int:
        """Device-to-device copies this plan takes."""
        return 1 if self.batched else len(self.runs)

    def pieces(self, arena: int, piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int, int]]:
        """``(source address, destination address, bytes)`` of the batched copy, each at most
        ``piece_bytes``, for an arena at address ``arena``."""
        out = []
        for r in self.runs:
            for at in range(0, r.nbytes, piece_bytes):
                out.append((r.start + at, arena + r.offset + at, min(piece_bytes, r.nbytes - at)))
        return out


def plan_packing(
    extents: Sequence[tuple[int, int]], align: int = ARENA_ALIGN, allocations: Sequence[int] | None = None
) -> Packing:
    """Plan the arena for arrays whose memory images are ``extents`` (address, bytes).

    Arrays of no bytes take no room (their place is 0). Arrays of one allocation
    (``allocations[i]``: a key of the allocation array ``i`` lies in, such as its
    base address; all one allocation when omitted) that touch or overlap form one
    run; their offsets within it are their distances in memory.
    """
    keys = [0] * len(extents) if allocations is None else list(allocations)
    if len(keys) != len(extents):
        raise ValueError(f"{len(keys)} allocations for {len(extents)} extents")
    order = sorted((i for i, (_, n) in enumerate(extents) if n > 0), key=lambda i: (keys[i], extents[i][0]))
    runs: list[Run] = []
    places = [0] * len(extents)
    total = 0
    run_start = run_end = -1
    members: list[int] = []

    def close() -> None:
        nonlocal total
        if not members:
            return
        offset = -(-total // align) * align
        runs.append(Run(run_start, run_end - run_start, offset))
        for i in members:
            places[i] = offset + extents[i][0] - run_start
        total = offset + run_end - run_start

    run_key = None
    for i in order:
        ptr, nbytes = extents[i]
        if members and keys[i] == run_key and ptr <= run_end:
            run_end = max(run_end, ptr + nbytes)
        else:
            close()
            members = []
            run_start, run_end, run_key = ptr, ptr + nbytes, keys[i]
        members.append(i)
    close()
    return Packing(tuple(runs), tuple(places), total)
