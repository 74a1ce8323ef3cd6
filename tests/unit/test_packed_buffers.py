"""``pack_small_buffers``: a pair's small buffers travel packed into one message after the others,
and land in their own receive buffers once the round succeeded (the local tier's exchanges use it
for a part's documents and checksum trailers). The transport here is a copy of each buffer the
sender lists into the receive buffer at the same place, as every coordinator's round pairs them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpuckpt.distributed import exchange as exchange_module
from gpuckpt.distributed.exchange import PACKED_MAX_BYTES, pack_small_buffers, packed_indices


def _round(sends: list[Any], recvs: list[Any]) -> None:
    """A pair's round: the i-th buffer sent lands in the i-th receive buffer (sizes must agree)."""
    assert [memoryview(s).nbytes for s in sends] == [memoryview(r).nbytes for r in recvs]
    for s, r in zip(sends, recvs, strict=True):
        memoryview(r).cast("B")[:] = memoryview(s).cast("B")


def _buffers(sizes: list[int], seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def test_the_small_buffers_travel_as_one_message_after_the_others_and_land_in_their_own() -> None:
    sizes = [5, 70_000, 0, 65_535, PACKED_MAX_BYTES, 4, 3 << 20, 700]
    data = _buffers(sizes, 1)
    # receive buffers of every kind a tier gives: bytearrays, arrays (a restore's), empty ones
    targets: list[Any] = [bytearray(n) if i % 2 else np.zeros(n, np.uint8) for i, n in enumerate(sizes)]
    sends, recvs, finish = pack_small_buffers({1: data}, {0: targets})
    packed = [0, 3, 5, 7]  # non-empty and under 64 KiB
    assert packed_indices(sizes) == packed
    assert [v.nbytes for v in sends[1]] == [70_000, 0, PACKED_MAX_BYTES, 3 << 20, 5 + 65_535 + 4 + 700]
    assert bytes(sends[1][-1]) == b"".join(data[i] for i in packed)
    _round(sends[1], recvs[0])
    finish(True)
    assert [bytes(t) for t in targets] == data
    assert sends == {} and recvs == {}  # (no view of the caller's buffers is kept)


def test_a_single_small_buffer_or_none_travels_as_it_is() -> None:
    for sizes in ([3 << 20, 17, 2 << 20], [0, 1 << 20], []):
        data = _buffers(sizes, 2)
        targets = [bytearray(n) for n in sizes]
        sends, recvs, finish = pack_small_buffers({3: data}, {3: targets})
        assert [v.nbytes for v in sends[3]] == sizes and [v.nbytes for v in recvs[3]] == sizes
        _round(sends[3], recvs[3])
        finish(True)
        assert [bytes(t) for t in targets] == data


def test_a_failed_round_writes_nothing_into_the_small_buffers() -> None:
    data = _buffers([10, 20, 30], 3)
    targets = [bytearray(b"x" * n) for n in (10, 20, 30)]
    sends, recvs, finish = pack_small_buffers({0: data}, {0: targets})
    _round(sends[0], recvs[0])  # (the bytes arrived, but the round then failed)
    finish(False)
    assert [bytes(t) for t in targets] == [b"x" * n for n in (10, 20, 30)]


def test_a_small_receive_buffer_of_another_size_makes_the_packs_sizes_differ() -> None:
    """The round compares the packs' sizes: a receiver expecting 19 bytes where 20 come sees its
    pair's last buffer mismatch, as the coordinators report it, and nothing is copied out."""
    sends, _, _ = pack_small_buffers({0: _buffers([10, 20, 30], 4)}, {})
    _, recvs, finish = pack_small_buffers({}, {0: [bytearray(10), bytearray(19), bytearray(30)]})
    assert (sends[0][-1].nbytes, recvs[0][-1].nbytes) == (60, 59)
    finish(False)


def test_the_limit_is_read_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exchange_module, "PACKED_MAX_BYTES", 0)
    sends, _, finish = pack_small_buffers({0: _buffers([1, 2, 3], 5)}, {})
    assert [v.nbytes for v in sends[0]] == [1, 2, 3]
    finish(True)
