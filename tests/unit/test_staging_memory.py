"""Host staging memory is resident only where data was staged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuckpt.device.staging import HostAllocator, StagingArena

MIB = 1 << 20


def _resident_bytes(address: int, nbytes: int) -> int:
    """Rss of the mappings that overlap [address, address + nbytes), from /proc/self/smaps."""
    total = 0
    overlaps = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            overlaps = lo < address + nbytes and address < hi
        elif overlaps and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def _thp_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps (Linux)")
@pytest.mark.skipif(_thp_always(), reason="transparent huge pages are on for all memory here")
def test_arena_pieces_are_resident_only_where_written() -> None:
    arena = StagingArena(HostAllocator(), piece_bytes=64 * MIB)
    sizes = [3 * MIB + 100, 5 * MIB + 7, 60 * MIB]  # the last one needs a second piece
    for n in sizes:
        arena.take(n)[:] = 1
    assert len(arena.pieces) == 2
    first, second = arena.pieces
    used_first = 3 * MIB + 100 + 5 * MIB + 7
    page = 4096
    # NumPy's own large allocations would round the end up to a whole 2 MiB huge page
    assert _resident_bytes(first.ctypes.data, first.nbytes) <= used_first + 3 * page
    assert _resident_bytes(second.ctypes.data, second.nbytes) <= 60 * MIB + 2 * page


def test_host_allocator_memory_is_writable_and_sized() -> None:
    a = HostAllocator()(12345)
    assert a.dtype == np.uint8 and a.nbytes == 12345 and a.flags.writeable
    a[:] = 7
    assert int(a.sum()) == 7 * 12345
    assert HostAllocator()(0).nbytes == 0


def test_arena_pool_reports_the_memory_it_holds() -> None:
    from gpuckpt.device.staging import ArenaPool

    small = 1 << 16
    pool = ArenaPool(lambda n: np.zeros(n, np.uint8), max_arenas=2)
    assert pool.reserved_bytes() == 0
    a = pool.acquire()
    a.take(small)
    b = pool.acquire()
    b.take(small)
    held = pool.reserved_bytes()
    assert held == a.capacity + b.capacity >= 2 * small  # in use counts too
    pool.release(a)
    pool.release(b)
    for _ in range(5):  # reuse: no growth
        c = pool.acquire(small)
        c.take(small)
        pool.release(c)
    assert pool.reserved_bytes() == held
    pool.clear()
    assert pool.reserved_bytes() == 0


def test_arena_pool_waits_a_grace_period_for_an_arena_in_use() -> None:
    """An arena released just after the request is reused rather than a second one made."""
    import threading

    from gpuckpt.device.staging import ArenaPool

    pool = ArenaPool(lambda n: np.zeros(n, np.uint8), max_arenas=2)
    first = pool.acquire()
    threading.Timer(0.05, pool.release, (first,)).start()
    assert pool.acquire(grace=5.0) is first
    pool.release(first)
    # without a grace period (or when it runs out) a second arena is made at once
    held = pool.acquire()
    other = pool.acquire(grace=0.01)
    assert other is not held and len({id(held), id(other)}) == 2


def test_pageable_arena_told_its_size_takes_one_piece_of_that_size() -> None:
    """An arena of pageable memory told what its user takes holds exactly that (plus one page of
    alignment) in one piece: bounded pieces left the tail of each unused whenever the next array
    did not fit there (1344 MiB held for a 1278 MiB state in 256 MiB pieces)."""
    from gpuckpt.device.staging import aligned_bytes

    page = 4096
    sizes = [40_000, 40_000, 40_001, 70_000, 5, 30_000]  # several would straddle a 64 KiB piece
    expected = sum(aligned_bytes(n) for n in sizes)
    arena = StagingArena(HostAllocator(), piece_bytes=1 << 16)
    for _ in range(3):  # reused as it is
        arena.reset(expected)
        for n in sizes:
            arena.take(n)[:] = 1
        assert len(arena.pieces) == 1 and arena.capacity == expected + page
    # page-locked memory (any other allocator) keeps pieces of at most piece_bytes
    calls: list[int] = []

    def pinned(n: int) -> np.ndarray:
        calls.append(n)
        return np.zeros(n, np.uint8)

    bounded = StagingArena(pinned, piece_bytes=1 << 16)
    bounded.reset(expected)
    for n in sizes:
        bounded.take(n)
    assert len(calls) > 1 and max(calls) <= max(1 << 16, max(aligned_bytes(n) for n in sizes)) + page


def test_host_arena_pool_is_the_pool_host_snapshots_take_their_memory_from(tmp_path: Path) -> None:
    import gpuckpt
    from gpuckpt.background import host_arena_pool

    pool = host_arena_pool()
    assert host_arena_pool() is pool
    pool.clear()  # (free arenas of earlier tests dropped: what the save takes is counted below)
    before = pool.reserved_bytes()
    state = {"w": np.arange(1 << 18, dtype=np.float32)}  # 1 MiB
    gpuckpt.async_save(state, tmp_path / "ck").result()
    assert pool.reserved_bytes() >= before + state["w"].nbytes
    taken = pool.acquire(state["w"].nbytes)  # the snapshot's arena, free again, of its size
    try:
        assert taken.capacity >= state["w"].nbytes
    finally:
        pool.release(taken)
