"""Segment CRC32Cs of large chunks: combination, the one-pass digest, and parsing untrusted records."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuckpt.format import segments
from gpuckpt.format.checksum import crc32c
from gpuckpt.format.segments import (
    SegmentDigest,
    Segments,
    crc32c_combine,
    segment_record,
    segmented,
    segments_entry,
)
from gpuckpt.storage.base import CrcDigest


@given(st.binary(max_size=300), st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_combine_gives_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_combine_over_long_runs() -> None:
    rng = random.Random(3)
    for n in (1 << 20, (1 << 20) + 17, 5_000_001):
        a, b = rng.randbytes(100), rng.randbytes(n)
        assert crc32c_combine(crc32c(a), crc32c(b), n) == crc32c(a + b)


@pytest.mark.parametrize("n", [1 << 12, 1 << 16, 1 << 20, 1 << 26])
def test_combine_over_whole_segments_by_tables_matches_the_bitwise_shift(n: int) -> None:
    """Lengths of whole segments go through shift tables; random CRCs on both paths agree."""
    rng = random.Random(n)
    for _ in range(200):
        a, b = rng.getrandbits(32), rng.getrandbits(32)
        assert crc32c_combine(a, b, n) == segments._multmodp(segments._x8n(n), a) ^ b


@given(st.integers(0, 5 * 4096 + 100), st.lists(st.integers(1, 9000), max_size=8))
@settings(max_examples=100, deadline=None)
def test_digest_gives_each_segment_and_the_whole_crc_for_any_pieces(size: int, cuts: list[int]) -> None:
    data = random.Random(size).randbytes(size)
    d = SegmentDigest(4096)
    at = 0
    for c in cuts:
        d.update(data[at : at + c])
        at = min(size, at + c)
    d.update(data[at:])
    got = d.result()
    assert got == crc32c(data)
    assert got.segments == tuple(crc32c(data[i : i + 4096]) for i in range(0, size, 4096))


@given(st.integers(0, 5 * 4096 + 100), st.lists(st.integers(1, 9000), max_size=8))
@settings(max_examples=100, deadline=None)
def test_pieces_given_by_their_crcs_equal_pieces_given_by_their_bytes(size: int, cuts: list[int]) -> None:
    """What a writer that copies with the checksum feeds (``update_crc``, pieces cut at every
    segment boundary), mixed with bytes, gives what the bytes alone give."""
    data = random.Random(size).randbytes(size)
    by_bytes, by_crcs = SegmentDigest(4096), SegmentDigest(4096)
    by_bytes.update(data)
    at, k = 0, 0
    for c in [*cuts, size]:
        end = min(size, at + c)
        while at < end:
            n = min(end - at, 4096 - at % 4096)
            if k % 3 == 2:
                by_crcs.update(data[at : at + n])
            else:
                by_crcs.update_crc(crc32c(data[at : at + n]), n)
            at, k = at + n, k + 1
    assert by_crcs.result() == by_bytes.result() and by_crcs.result().segments == by_bytes.result().segments
    assert by_crcs.trailer() == by_bytes.trailer()


def test_a_plain_digest_takes_crcs_of_any_pieces() -> None:
    data = random.Random(9).randbytes(10_000)
    d = CrcDigest()
    for a, b in [(0, 1), (1, 4096), (4096, 4096), (4096, 10_000)]:
        d.update_crc(crc32c(data[a:b]), b - a)
    assert d.value == crc32c(data) and d.trailer() == crc32c(data).to_bytes(4, "little")


def test_a_crc_across_a_segment_boundary_is_refused() -> None:
    d = SegmentDigest(4096)
    d.update(bytes(100))
    with pytest.raises(ValueError, match="cross a segment boundary"):
        d.update_crc(0, 4000)


def test_a_chunk_crc_with_segments_is_an_int_and_survives_pickling() -> None:
    import pickle

    d = SegmentDigest(4096)
    d.update(bytes(range(256)) * 40)
    got = d.result()
    back = pickle.loads(pickle.dumps(got))
    assert back == got == crc32c(bytes(range(256)) * 40) and back.segments == got.segments
    assert segment_record(back) == (4096, got.segments)


def _entry(per_chunk: int, nchunks: int, size: int = 4096) -> tuple[dict[str, object], bytes]:
    data = random.Random(1).randbytes(per_chunk * size)
    d = SegmentDigest(size)
    d.update(data)
    rec = segment_record(d.result())
    entry = segments_entry([rec] * nchunks)
    assert entry is not None
    return entry, data


def test_records_round_trip_and_must_combine_to_the_chunk_crc() -> None:
    entry, data = _entry(3, 2)
    seg = Segments.parse(entry, 2, len(data), 4)
    assert seg is not None and seg.per_chunk == 3
    crcs = seg.of_chunk(1, crc32c(data))
    assert crcs is not None and crcs.tolist() == [crc32c(data[i : i + 4096]) for i in (0, 4096, 8192)]
    assert seg.of_chunk(1, crc32c(data) ^ 1) is None  # another chunk CRC: the records vouch for nothing
    assert seg.span(5000, 5001) == (4096, 8192) and seg.span(0, len(data)) == (0, len(data))


def test_small_chunks_and_mixed_records_get_no_entry() -> None:
    assert not segmented(2 * 4096 - 1, 4096) and segmented(2 * 4096, 4096)
    assert segment_record(12345) is None
    d = SegmentDigest(4096)
    d.update(bytes(3 * 4096))
    assert segments_entry([segment_record(d.result()), None]) is None


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e.update(bytes=4095),  # not a power of two
        lambda e: e.update(bytes=1024),  # below the smallest segment accepted
        lambda e: e.update(bytes=True),
        lambda e: e.update(crc32c=e["crc32c"][:-4]),  # too few records
        lambda e: e.update(crc32c="!" * len(e["crc32c"])),  # not base64
        lambda e: e.update(crc32c=7),
        lambda e: e.pop("bytes"),
    ],
)
def test_malformed_records_are_not_used(change: object) -> None:
    entry, data = _entry(3, 2)
    assert Segments.parse(dict(entry), 2, len(data), 4) is not None
    bad = dict(entry)
    change(bad)  # type: ignore[operator]
    assert Segments.parse(bad, 2, len(data), 4) is None
    assert Segments.parse(entry, 3, len(data), 4) is None  # records of 2 chunks for 3
    assert Segments.parse(entry, 2, len(data), 3) is None  # segments not a multiple of the element
    assert Segments.parse(["x"], 2, len(data), 4) is None


def test_records_are_little_endian_uint32_in_chunk_order() -> None:
    entry, data = _entry(2, 1)
    raw = np.frombuffer(base64.b64decode(str(entry["crc32c"])), "<u4")
    assert raw.tolist() == [crc32c(data[:4096]), crc32c(data[4096:])]
