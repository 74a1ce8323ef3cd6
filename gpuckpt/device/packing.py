"""Packing arrays into one device arena for a device-side snapshot (``staging="device"``).

A snapshot on the device should cost one device-to-device copy of the state,
not one allocation and one copy per tensor. :func:`plan_packing` takes the
memory extents of the arrays (address, bytes) and plans one arena: arrays
of one allocation that lie back to back (or overlap: views of one buffer) form
a *run*, copied as one block, keeping their distances, so that a state held in
one flat buffer is one copy (a copy never runs from one allocation into the
next, even where they lie back to back: CUDA refuses such a copy); runs are
placed one after another, aligned. Runs of :data:`DIRECT_MIN_BYTES` and more
are copied one copy each (``cudaMemcpyAsync`` moved 3.9-4.3 TB/s on an H200
where the batched kernel moved about 1.5); with many smaller runs, the back end
copies those with one batched copy (one kernel over a table of pieces) instead
of one copy each.

Pure data: no arrays, no device. Both back ends follow the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ARENA_ALIGN",
    "BATCH_MIN_RUNS",
    "DIRECT_MIN_BYTES",
    "PIECE_BYTES",
    "Packing",
    "Run",
    "plan_packing",
]

#: alignment of each run in the arena (CUDA allocations are 256-byte aligned)
ARENA_ALIGN = 256
#: from this many runs under DIRECT_MIN_BYTES on, they are copied by one batched copy
#: instead of one copy each
BATCH_MIN_RUNS = 4
#: runs of this many bytes and more are one copy each, never in the batched copy: a copy
#: engine's launch (a few us) is small against the bandwidth it gains on them
DIRECT_MIN_BYTES = 16 << 20
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
    def batched_runs(self) -> tuple[Run, ...]:
        """The runs copied together by one batched copy: those under :data:`DIRECT_MIN_BYTES`,
        when there are at least :data:`BATCH_MIN_RUNS` of them (else none)."""
        small = tuple(r for r in self.runs if r.nbytes < DIRECT_MIN_BYTES)
        return small if len(small) >= BATCH_MIN_RUNS else ()

    @property
    def direct_runs(self) -> tuple[Run, ...]:
        """The runs copied one copy each: the rest."""
        batched = set(self.batched_runs)
        return tuple(r for r in self.runs if r not in batched)

    @property
    def batched(self) -> bool:
        """Whether some runs are copied by one batched copy."""
        return bool(self.batched_runs)

    @property
    def copies(self) -> int:
        """Device-to-device copies this plan takes."""
        return len(self.direct_runs) + (1 if self.batched else 0)

    def pieces(
        self, arena: int, piece_bytes: int = PIECE_BYTES, runs: Sequence[Run] | None = None
    ) -> list[tuple[int, int, int]]:
        """``(source address, destination address, bytes)`` of the batched copy of ``runs``
        (:attr:`batched_runs` by default), each at most ``piece_bytes``, for an arena at
        address ``arena``."""
        out = []
        for r in self.batched_runs if runs is None else runs:
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
