"""Reusing a base checkpoint's chunks while saving (see :mod:`gpuckpt.saving.incremental`).

:func:`write_hashed` writes one chunk of an incremental save: it hashes the chunk
(and compares bytes where the base recorded no hash), and where the chunk equals its
base counterpart hands it to the writer's
:meth:`~gpuckpt.storage.base.CheckpointWriter.reuse_chunk` instead of writing it.
:class:`SharedWithBase` and :func:`share_unchanged` decide, before an asynchronous
save's snapshot, which device arrays need no host copy at all because every chunk
equals the base's.
"""

from __future__ import annotations

import errno
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, HostArray, StagedIn, StagedOut
from gpuckpt.device.backend import ChunkBox, Ticket
from gpuckpt.errors import CheckpointWriteError
from gpuckpt.format import contenthash
from gpuckpt.format.checksum import CRC_BYTES, crc32c
from gpuckpt.format.contenthash import LEAF, ChunkHasher
from gpuckpt.saving.incremental import BaseChunk, BaseIndex, ChunkResult, digests_match
from gpuckpt.storage.base import CheckpointReader, CheckpointWriter, ChunkWrites, CrcDigest

__all__ = ["SharedChunk", "SharedWithBase", "share_unchanged", "write_hashed"]

#: a leaf of zeros: the padding of a chunk, hashed
_ZEROS = bytes(LEAF)


class SharedWithBase:
    """An array of an asynchronous incremental save's snapshot that was not copied: when the
    snapshot was taken, every chunk of it (a device array's, hashed on its device) had the
    digests of its base chunk, so the save shares those chunks.

    :meth:`content_digests` gives the digests computed then, and the save's writer shares
    the chunks without staging anything (:func:`reuse_by_digests`). A chunk the writer
    refuses to share is read back from the base by :meth:`stage_out` and checked against
    the same digests (and its CRC32C), so that the save writes the bytes the array held at
    the snapshot, or fails saying why. Nothing else reads it: no host view, no copy.
    """

    __slots__ = ("_chunks", "_dtype", "_format", "_reader", "_shape", "requires_grad")

    def __init__(
        self,
        like: ArrayAdapter,
        reader: CheckpointReader,
        chunks: Mapping[tuple[tuple[int, ...], tuple[int, ...]], SharedChunk],
    ) -> None:
        self._shape = like.shape
        self._dtype = like.dtype
        self._format = like.memory_format
        self.requires_grad = like.requires_grad
        self._reader = reader
        self._chunks = dict(chunks)  # by the chunk's box (offsets, sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def memory_format(self) -> Any:
        return self._format

    @property
    def pinned(self) -> bool:
        return False

    @property
    def writable(self) -> bool:
        return False

    @property
    def backend(self) -> None:
        return None

    def content_digests(self, chunks: Sequence[ChunkBox]) -> list[tuple[bytes, bytes]] | None:
        found = [self._chunks.get((tuple(o), tuple(s))) for o, s, _ in chunks]
        if any(f is None for f in found):
            return None
        return [f.digests for f in found if f is not None]

    def encode_chunks(self, chunks: Sequence[ChunkBox], codec_name: str) -> None:
        return None  # its chunks are the base's stored bytes already

    def stage_out(self, offsets: tuple[int, ...], sizes: tuple[int, ...], staging: Any) -> StagedOut:
        c = self._chunks.get((tuple(offsets), tuple(sizes)))
        if c is None:
            raise ValueError(f"box {offsets} + {sizes} is not a chunk of this snapshot's shared array")
        ref = c.base.ref
        where = f"{ref.location.rstrip('/')}/{ref.name}/{ref.key}"
        data = bytearray(ref.nbytes)
        problem = ""
        try:
            got = self._reader.read_chunk_into(ref.name, ref.key, [data])
        except OSError as exc:
            got, problem = -1, f"cannot be read: {exc}"
        body = memoryview(data)[: max(0, ref.nbytes - CRC_BYTES)]
        if not problem and (
            got != ref.nbytes or crc32c(body) != ref.crc32c or contenthash.chunk_hash([body]) != c.digests[0]
        ):
            problem = "its bytes changed since"
        if problem:
            raise CheckpointWriteError(
                errno.EIO,
                f"chunk {where} of the base held this save's chunk when async_save took its snapshot, "
                f"could not be shared, and {problem}; the save cannot write those bytes. Keep the "
                "base unchanged until the saves that use it are done (CheckpointManager does), "
                "or save without base",
            )
        n = int(np.prod(c.stored))
        block = np.frombuffer(data, self._dtype.newbyteorder("<"), n).reshape(c.stored)
        box = block[tuple(slice(0, s) for s in sizes)]
        return HostArray(box, snapshot=True).stage_out((0,) * len(sizes), tuple(sizes), staging)

    def stage_in(self, offsets: tuple[int, ...], sizes: tuple[int, ...], staging: Any) -> StagedIn:
        raise TypeError("an array shared with the base of an incremental save is only written")

    def copy_to_host(self, dst: np.ndarray, host_copy: Any) -> Ticket:
        raise TypeError("an array shared with the base of an incremental save has no copy")

    def copy(self) -> ArrayAdapter:
        raise TypeError("an array shared with the base of an incremental save has no copy")

    def host_array(self) -> np.ndarray:
        raise TypeError("an array shared with the base of an incremental save has no host view")


@dataclass(frozen=True, slots=True)
class SharedChunk:
    """A chunk of a :class:`SharedWithBase` array: its base chunk, its stored shape, and its
    ``(hash, head)`` computed when the snapshot was taken."""

    base: BaseChunk
    stored: tuple[int, ...]
    digests: tuple[bytes, bytes]


def share_unchanged(
    base: BaseIndex,
    array: ArrayAdapter,
    chunks: Sequence[tuple[str, str, ChunkBox]],
) -> SharedWithBase | None:
    """``array`` as a :class:`SharedWithBase` when every one of its ``chunks`` (``(array name,
    key, (offsets, sizes, stored shape))``) has a hashed base chunk of its stored size and,
    hashed where the array lives (:meth:`~gpuckpt.device.arrays.ArrayAdapter.content_digests`),
    the same digests; else None (the array is copied into the snapshot as usual)."""
    if not chunks:
        return None
    found = []
    for name, key, (_o, _s, stored) in chunks:
        b = base.lookup_hashed(name, key, int(np.prod(stored)) * array.dtype.itemsize + CRC_BYTES)
        if b is None:
            return None
        found.append(b)
    digests = array.content_digests([c for _, _, c in chunks])
    if digests is None or not all(digests_match(b, d) for b, d in zip(found, digests, strict=True)):
        return None
    return SharedWithBase(
        array,
        base.reader,
        {
            (c[0], c[1]): SharedChunk(b, c[2], d)
            for (_, _, c), b, d in zip(chunks, found, digests, strict=True)
        },
    )


# -- writing with hashes and reuse ------------------------------------------------------------


@dataclass(slots=True)
class _Known:
    """What comparing a chunk with its base found out before it was written."""

    value: bytes | None = None  # the whole hash
    head: bytes | None = None  # the first leaf's hash


def _pieces(buf: np.ndarray, pad: int, start: int = 0) -> Iterable[memoryview]:
    """The stored bytes (``buf`` then ``pad`` zeros) from ``start`` on, in pieces of at most a leaf."""
    view = memoryview(buf).cast("B")
    n = view.nbytes
    for i in range(start, n, LEAF):
        yield view[i : min(n, i + LEAF)]
    z = max(0, start - n)
    while z < pad:
        take = min(LEAF, pad - z)
        yield memoryview(_ZEROS)[:take]
        z += take


def _hash_all(buf: np.ndarray, pad: int, with_crc: bool) -> tuple[bytes, bytes, int]:
    h = ChunkHasher()
    crc = 0
    for p in _pieces(buf, pad):
        h.update(p)
        if with_crc:
            crc = crc32c(p, crc)
    value, head = h.digests()
    return value, head, crc


def _crc_all(buf: np.ndarray, pad: int) -> int:
    crc = 0
    for p in _pieces(buf, pad):
        crc = crc32c(p, crc)
    return crc


def _equal_bytes(
    reader: CheckpointReader, b: BaseChunk, buf: np.ndarray, pad: int, crc: int
) -> np.ndarray | None:
    """The base chunk file's stored bytes (its trailer excluded) when it holds exactly ``buf``,
    ``pad`` zeros and the trailer ``crc``; else None."""
    ref = b.ref
    try:
        if reader.chunk_nbytes(ref.name, ref.key) != ref.nbytes:
            return None
        data = bytearray(ref.nbytes)
        if reader.read_chunk_into(ref.name, ref.key, [data]) != ref.nbytes:
            return None
    except OSError:
        return None
    got = np.frombuffer(data, np.uint8)
    n = buf.nbytes
    equal = (
        np.array_equal(got[:n], np.frombuffer(memoryview(buf).cast("B"), np.uint8))
        and not got[n : n + pad].any()
        and bytes(got[n + pad :]) == crc.to_bytes(CRC_BYTES, "little")
    )
    return got[: n + pad] if equal else None


def _compare(index: BaseIndex, b: BaseChunk, buf: np.ndarray, pad: int) -> tuple[bool, _Known, int]:
    """Whether the chunk equals base chunk ``b`` (size, CRC32C and hash, or bytes), what was
    learnt on the way, and its CRC32C when it is equal."""
    size = buf.nbytes + pad
    if b.xxh3t is not None and contenthash.available():
        if size > LEAF:
            # the head probe: a changed chunk usually differs in its first leaf already
            first = next(iter(_pieces(buf, pad)))
            head = contenthash.leaf_digest(first)
            crc = crc32c(first)
            if b.head is not None and head != b.head:
                return False, _Known(head=head), 0
            h = ChunkHasher(head, skip=False)
            for p in _pieces(buf, pad, LEAF):
                h.update(p)
                crc = crc32c(p, crc)
            value, head = h.digests()
        else:
            value, head, _ = _hash_all(buf, pad, with_crc=False)
            if value != b.xxh3t:
                return False, _Known(value, head), 0
            crc = _crc_all(buf, pad)
        equal = value == b.xxh3t and crc == b.ref.crc32c
        return equal, _Known(value, head), crc
    crc = _crc_all(buf, pad)
    stored = _equal_bytes(index.reader, b, buf, pad, crc) if crc == b.ref.crc32c else None
    if stored is None:
        return False, _Known(), 0
    if contenthash.available():
        # the hash of the base file's bytes, which the reused chunk is (not a third read of buf)
        value, head, _ = _hash_all(stored, 0, with_crc=False)
        return True, _Known(value, head), crc
    return True, _Known(), crc


def write_hashed(
    writer: CheckpointWriter,
    names: Sequence[str],
    keys: Sequence[str],
    buffers: Sequence[np.ndarray],
    pads: Sequence[int],
    documents: Sequence[bytes | None],
    base: BaseIndex | None,
    compared: Collection[tuple[str, str]] = (),
    *,
    stable: bool = False,
) -> list[ChunkResult]:
    """Write (or reuse) chunks, recording each one's content hash; see the module docstring.

    The arguments are those of a :class:`~gpuckpt.storage.base.ChunkWrites` batch;
    ``compared``: ``(array name, key)`` of chunks compared with ``base`` already (by
    digests computed on their device: :func:`reuse_by_digests`), which are written. Chunks
    of one leaf or less are hashed here and written in one batch of the writer's; larger
    ones are hashed while they are written, piece by piece (and, with a base, probed by
    their first leaf first, so that a changed chunk is not hashed twice).

    Every digest recorded is of the bytes stored, also when another thread changes the
    buffers meanwhile (not ``stable``: the caller's memory): chunks of a leaf or less are
    copied once and compared, hashed and written from that copy; larger ones are hashed
    from the writer's own copy as it writes them, whatever their comparison found; a reused
    chunk records the digests of the base chunk it shares.
    """
    hashing = contenthash.available()
    if not stable:
        # one read of the caller's memory for the comparison, the hash, the checksum and the write
        buffers = [
            np.array(b, copy=True) if b.nbytes + p <= LEAF else b for b, p in zip(buffers, pads, strict=True)
        ]
    results: list[ChunkResult | None] = [None] * len(names)
    known: dict[int, _Known] = {}
    batch: list[int] = []
    docs = list(documents) or [None] * len(names)
    # compare first, then write the documents of the equal chunks' arrays in one batch of the
    # writer's (not one call each), then share them
    probed: dict[int, _Known] = {}
    equal: dict[int, tuple[BaseChunk, int]] = {}
    for i, (name, key, buf, pad) in enumerate(zip(names, keys, buffers, pads, strict=True)):
        stored = buf.nbytes + pad + CRC_BYTES
        b = base.lookup(name, key, stored) if base is not None and (name, key) not in compared else None
        if b is not None:
            assert base is not None
            same, probed[i], crc = _compare(base, b, buf, pad)
            if same:
                equal[i] = (b, crc)
    first = [i for i in equal if docs[i] is not None]
    if first:
        writer.write_array_documents([names[i] for i in first], [docs[i] for i in first])  # type: ignore[misc]
        for i in first:
            docs[i] = None
    for i, (name, key, buf, pad) in enumerate(zip(names, keys, buffers, pads, strict=True)):
        size = buf.nbytes + pad
        k = probed.get(i, _Known())
        if i in equal:
            b, crc = equal[i]
            if writer.reuse_chunk(name, key, b.ref):
                results[i] = ChunkResult(size + CRC_BYTES, crc, k.value, k.head, reused=True)
                continue
        if hashing and size <= LEAF:
            if k.value is None:
                k.value, k.head, _ = _hash_all(buf, pad, with_crc=False)
            known[i] = k
            batch.append(i)
        elif hashing:
            # what the comparison learnt may be of other bytes than the writer's copy
            fresh = k if stable else _Known()
            results[i] = _write_large(writer, name, key, buf, pad, docs[i], fresh, stable=stable)
        else:
            known[i] = k
            batch.append(i)
    if batch:
        crcs = writer.write_chunks(
            ChunkWrites(
                [names[i] for i in batch],
                [keys[i] for i in batch],
                [buffers[i] for i in batch],
                [pads[i] for i in batch],
                [docs[i] for i in batch],
                # this call's own copies when hashed here; else the writer copies
                stable=stable or hashing,
            )
        )
        for i, c in zip(batch, crcs, strict=True):
            k = known[i]
            results[i] = ChunkResult(buffers[i].nbytes + pads[i] + CRC_BYTES, c, k.value, k.head)
    out = [r for r in results if r is not None]
    assert len(out) == len(names)
    return out


def _write_large(
    writer: CheckpointWriter,
    name: str,
    key: str,
    buf: np.ndarray,
    pad: int,
    document: bytes | None,
    k: _Known,
    *,
    stable: bool,
) -> ChunkResult:
    """Write one chunk of more than a leaf, its CRC32C and (unless known) its hash computed
    piece by piece as the writer streams it (while each piece is in the CPU cache)."""
    if document is not None:
        writer.write_array_document(name, document)
    hasher = ChunkHasher(k.head) if k.value is None else None
    digest = _HashingDigest(hasher)
    parts = [buf, bytes(pad)] if pad else [buf]
    writer.write_chunk_checked(name, key, parts, digest, stable=stable)
    crc = digest.value
    value, head = hasher.digests() if hasher is not None else (k.value, k.head)
    return ChunkResult(buf.nbytes + pad + CRC_BYTES, crc, value, head)


class _HashingDigest(CrcDigest):
    """The CRC32C of a chunk and, where it is not known already, its content hash, fed the
    bytes the writer stores."""

    __slots__ = ("_hasher",)

    def __init__(self, hasher: ChunkHasher | None) -> None:
        super().__init__()
        self._hasher = hasher

    def update(self, piece: Any) -> None:
        super().update(piece)
        if self._hasher is not None:
            self._hasher.update(piece)
