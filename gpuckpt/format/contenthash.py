"""The content hash of a stored chunk: XXH3-128 over a one-level tree of 1 MiB leaves.

Incremental saves (:mod:`gpuckpt.saving.incremental`) decide that a chunk equals the
chunk of an earlier checkpoint by its size, its CRC32C and this hash together,
never by the CRC alone. The hash covers the chunk's stored bytes without the
CRC trailer (data and padding) and is defined so that a GPU can compute it
leaf by leaf in parallel (``kernels/xxh3_tree.cu``)::

    LEAF = 1 MiB
    chunk_hash(b) = xxh3_128(b)                                         if len(b) <= LEAF
                  = xxh3_128(concat(xxh3_128(leaf) for each LEAF of b))  otherwise

(digests in XXH3's canonical big-endian byte order, the last leaf possibly
short). The ``head`` of a chunk is the digest of its first leaf: a cheap probe
that tells most changed chunks from their base without hashing them whole.

XXH3-128 comes from the ``xxhash`` package (``pip install gpuckpt[incremental]``),
the fastest 128-bit hash measured (``bench/runs/RESULTS-hashes.md``). It is not a
cryptographic hash: it tells accidental equality from difference, which is the
question here (the base is the caller's own earlier checkpoint). Without the
package, :func:`available` is False and incremental saves compare bytes instead.
"""

from __future__ import annotations

import importlib
from typing import Any

_xxhash: Any
try:  # an optional dependency: gpuckpt[incremental]
    _xxhash = importlib.import_module("xxhash")
except ImportError:  # exercised where xxhash is not installed
    _xxhash = None

__all__ = [
    "HASH_ALGORITHM",
    "HASH_HEX_CHARS",
    "LEAF",
    "ChunkHasher",
    "available",
    "chunk_hash",
    "is_hash_hex",
    "leaf_digest",
]

#: bytes per leaf of the hash tree (equal to the piece size of local writes)
LEAF = 1 << 20
#: the name recorded in a checkpoint's ``storage_data["content_hash"]``
HASH_ALGORITHM = "xxh3_128-tree-1MiB"
#: a recorded hash: 32 lowercase hex characters (128 bits)
HASH_HEX_CHARS = 32
_ZEROS = bytes(LEAF)
_HEX = frozenset("0123456789abcdef")


def available() -> bool:
    """Whether the ``xxhash`` package is installed (else no hash can be computed)."""
    return _xxhash is not None


def is_hash_hex(value: Any) -> bool:
    """Whether ``value`` is a recorded hash as this module writes it (32 lowercase hex digits)."""
    return isinstance(value, str) and len(value) == HASH_HEX_CHARS and _HEX.issuperset(value)


def leaf_digest(data: Any) -> bytes:
    """XXH3-128 of ``data`` (a buffer), canonical bytes."""
    assert _xxhash is not None, "xxhash is not installed"
    return bytes(_xxhash.xxh3_128_digest(data))


class ChunkHasher:
    """The tree hash of bytes fed in order, in pieces of any size.

    ``head``: the digest of the first leaf when it is known already (a probe
    computed it), for chunks longer than one leaf: the first :data:`LEAF` bytes
    fed are then skipped, not hashed again, or, with ``skip=False``, the bytes
    fed are those after the first leaf.

    Examples
    --------
    >>> h = ChunkHasher()
    >>> h.update(b"abc"); h.update(b"def")
    >>> h.hexdigest() == chunk_hash([b"abcdef"]).hex()
    True
    """

    __slots__ = ("_cur", "_fill", "_leaves", "_skip", "_total")

    def __init__(self, head: bytes | None = None, *, skip: bool = True) -> None:
        assert _xxhash is not None, "xxhash is not installed"
        self._leaves: list[bytes] = []
        self._cur: Any = None  # the streaming state of a leaf fed in several pieces
        self._fill = 0  # bytes of the current leaf seen
        self._total = 0
        self._skip = 0
        if head is not None:
            self._leaves.append(head)
            if skip:
                self._skip = LEAF
            else:
                self._total = LEAF

    def update(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        n = view.nbytes
        self._total += n
        i = 0
        if self._skip:
            take = min(self._skip, n)
            self._skip -= take
            i = take
            if not self._skip:
                self._fill = 0  # the skipped head leaf is complete
            else:
                self._fill += take
        while i < n:
            take = min(LEAF - self._fill, n - i)
            if self._fill == 0 and take == LEAF:
                self._leaves.append(bytes(_xxhash.xxh3_128_digest(view[i : i + LEAF])))
            else:
                if self._cur is None:
                    self._cur = _xxhash.xxh3_128()
                self._cur.update(view[i : i + take])
                self._fill += take
                if self._fill == LEAF:
                    self._leaves.append(bytes(self._cur.digest()))
                    self._cur = None
                    self._fill = 0
            i += take

    def update_zeros(self, count: int) -> None:
        """Feed ``count`` zero bytes (the padding of an edge chunk)."""
        while count > 0:
            take = min(count, LEAF)
            self.update(_ZEROS[:take])
            count -= take

    def digests(self) -> tuple[bytes, bytes]:
        """``(hash, head)`` of everything fed."""
        leaves = list(self._leaves)
        if self._cur is not None:
            leaves.append(bytes(self._cur.digest()))
        elif not leaves or self._fill:
            leaves.append(bytes(_xxhash.xxh3_128_digest(b"")))
        if self._total <= LEAF:
            return leaves[0], leaves[0]
        return bytes(_xxhash.xxh3_128_digest(b"".join(leaves))), leaves[0]

    def hexdigest(self) -> str:
        return self.digests()[0].hex()


def chunk_hash(parts: Any) -> bytes:
    """The tree hash of the concatenation of the buffers ``parts`` (a reference for tests)."""
    h = ChunkHasher()
    for p in parts:
        h.update(p)
    return h.digests()[0]
