"""The chunk content hash (XXH3-128 over 1 MiB leaves) and its per-chunk columns in listed records."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gpuckpt.errors import MetadataError
from gpuckpt.format import records as ct
from gpuckpt.format.contenthash import LEAF, ChunkHasher, chunk_hash, is_hash_hex
from gpuckpt.saving.incremental import ChunkResult, hash_columns

xxhash = pytest.importorskip("xxhash")


def reference(b: bytes) -> bytes:
    if len(b) <= LEAF:
        return bytes(xxhash.xxh3_128_digest(b))
    leaves = [xxhash.xxh3_128_digest(b[i : i + LEAF]) for i in range(0, len(b), LEAF)]
    return bytes(xxhash.xxh3_128_digest(b"".join(leaves)))


@pytest.mark.parametrize("n", [0, 1, 240, LEAF - 1, LEAF, LEAF + 1, 3 * LEAF, 3 * LEAF + 5])
def test_tree_hash_whatever_the_pieces(n: int) -> None:
    data = os.urandom(n)
    for piece in (1 << 12, 7777, LEAF, LEAF + 3, max(n, 1)):
        h = ChunkHasher()
        for i in range(0, n, piece):
            h.update(data[i : i + piece])
        value, head = h.digests()
        assert value == reference(data), (n, piece)
        assert head == xxhash.xxh3_128_digest(data[:LEAF])
    h = ChunkHasher()
    h.update(data[: n // 2])
    h.update_zeros(0)
    h.update(data[n // 2 :])
    assert h.digests()[0] == chunk_hash([data])


def test_a_known_head_is_not_hashed_again() -> None:
    data = os.urandom(2 * LEAF + 9)
    head = xxhash.xxh3_128_digest(data[:LEAF])
    skipping = ChunkHasher(head)  # fed everything, skips the first leaf
    for i in range(0, len(data), 5000):
        skipping.update(data[i : i + 5000])
    following = ChunkHasher(head, skip=False)  # fed what comes after the first leaf
    following.update(data[LEAF:])
    assert skipping.digests() == following.digests() == (reference(data), head)


def test_padding_is_hashed_as_zeros() -> None:
    data = os.urandom(1000)
    h = ChunkHasher()
    h.update(data)
    h.update_zeros(LEAF + 24)
    assert h.digests()[0] == reference(data + bytes(LEAF + 24))


KEYS = ["c.0", "c.1"]
NBYTES = [10, 2 << 20]
CRCS = np.array([7, 8], np.uint32)
H0, H1, HEAD1 = b"\xab" * 16, b"\x01" * 16, b"\xcd" * 16


def _records() -> list[dict[str, object]]:
    """Listed records of a hashed save: a chunk of one leaf (its head is its hash), one of two."""
    cols = hash_columns([ChunkResult(10, 7, H0, H0), ChunkResult(2 << 20, 8, H1, HEAD1)])
    return ct.listed_records(KEYS, NBYTES, {"crc32c": CRCS, **cols})


def test_hash_columns_round_trip_through_the_listed_records() -> None:
    records = _records()
    # every record has both fields, so that each column is read back whole
    assert records[0] == {"key": "c.0", "nbytes": 10, "crc32c": 7, "xxh3t": "ab" * 16, "head": "ab" * 16}
    assert records[1]["xxh3t"] == "01" * 16 and records[1]["head"] == "cd" * 16
    back = ct.parse_listed(records, KEYS, NBYTES, MetadataError)
    assert back["xxh3t"].tobytes() == H0 + H1 and back["head"].tobytes() == H0 + HEAD1
    # a record without a head (as one-leaf chunks were listed before the chunk table) takes its hash
    del records[0]["head"]
    assert ct.parse_listed(records, KEYS, NBYTES, MetadataError)["head"].tobytes() == H0 + HEAD1
    # not hashed: (stored bytes, CRC32C) pairs, or results without hashes, give no column
    assert hash_columns([(10, 7), (2 << 20, 8)]) == {}
    assert hash_columns([ChunkResult(10, 7), ChunkResult(2 << 20, 8, H1, HEAD1)]) == {}


@pytest.mark.parametrize(
    "value",
    [None, 5, "AB" * 16, "ab" * 15, "zz" * 16, ["ab" * 16]],  # upper case: not what gpuckpt writes
)
def test_untrusted_hash_fields_are_no_hash(value: object) -> None:
    records = _records()
    records[1]["xxh3t"] = value
    assert "xxh3t" not in ct.parse_listed(records, KEYS, NBYTES, MetadataError)
    del records[1]["xxh3t"]
    assert "xxh3t" not in ct.parse_listed(records, KEYS, NBYTES, MetadataError)


def test_bad_head_is_no_head() -> None:
    records = _records()
    records[1]["head"] = "xyz"
    cols = ct.parse_listed(records, KEYS, NBYTES, MetadataError)
    assert set(cols) == {"crc32c", "xxh3t"} and cols["xxh3t"].tobytes() == H0 + H1
    assert not is_hash_hex("ab" * 17) and is_hash_hex("0f" * 16)
