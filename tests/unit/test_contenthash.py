"""The chunk content hash (XXH3-128 over 1 MiB leaves) and the per-chunk metadata fields."""

from __future__ import annotations

import os

import pytest

from gpuckpt.incremental import ChunkResult, chunk_entry, entry_hashes
from gpuckpt.storage.contenthash import LEAF, ChunkHasher, chunk_hash, is_hash_hex

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


def test_chunk_entry_fields_round_trip() -> None:
    r = ChunkResult(10, 7, "ab" * 16, "cd" * 16)
    entry = chunk_entry("c.0", r)
    assert entry == {"key": "c.0", "nbytes": 10, "crc32c": 7, "xxh3t": "ab" * 16, "head": "cd" * 16}
    assert entry_hashes(entry) == (bytes.fromhex("ab" * 16), bytes.fromhex("cd" * 16))
    # one leaf: no head field, the head is the hash
    one = chunk_entry("c.0", ChunkResult(10, 7, "ab" * 16, "ab" * 16))
    assert "head" not in one and entry_hashes(one) == (bytes.fromhex("ab" * 16),) * 2
    # not hashed: the format-1 entry, unchanged
    assert chunk_entry("c.0", ChunkResult(10, 7)) == {"key": "c.0", "nbytes": 10, "crc32c": 7}


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {"xxh3t": None},
        {"xxh3t": 5},
        {"xxh3t": "AB" * 16},  # upper case: not what gpuckpt writes
        {"xxh3t": "ab" * 15},
        {"xxh3t": "zz" * 16},
        {"xxh3t": ["ab" * 16]},
    ],
)
def test_untrusted_hash_fields_are_no_hash(raw: dict[str, object]) -> None:
    assert entry_hashes(raw) == (None, None)


def test_bad_head_is_no_head() -> None:
    assert entry_hashes({"xxh3t": "ab" * 16, "head": "xyz"}) == (bytes.fromhex("ab" * 16), None)
    assert not is_hash_hex("ab" * 17) and is_hash_hex("0f" * 16)
