"""Incremental saves: chunks equal to those of an earlier checkpoint are not written again.

A save with ``base=`` (:attr:`gpuckpt.options.SaveOptions.base`) opens the base
checkpoint's metadata (:func:`open_base`, as untrusted as any load), keeps the
tensors whose array has the same name, FQN, shape, dtype, chunk grid and memory
format as in the new save (:meth:`BaseIndex.compatible`), and for each chunk
with a counterpart of the same stored size decides equality by size, CRC32C and
the content hash (:mod:`gpuckpt.storage.contenthash`) together, or, where the
base recorded no hash or ``xxhash`` is missing, by comparing bytes: never by the
CRC alone. An equal chunk is handed to the writer's
:meth:`~gpuckpt.storage.base.CheckpointWriter.reuse_chunk` (a hard link, a
reflink, a server-side copy); where that is refused the chunk is written as
usual. A base that cannot be used is a warning
(:class:`~gpuckpt.errors.IncrementalBaseWarning`), never a failed save.

Chunks in device memory are compared before they are staged: their device
computes their content hash and first-leaf hash
(:meth:`~gpuckpt.device.backend.DeviceBackend.hash_chunks`), and a chunk whose
two 128-bit digests equal its base chunk's is reused without crossing to the
host (:func:`reuse_by_digests`; its CRC32C is the base's record of the same
bytes). Only the others are staged, and written without being compared again.

Every checkpoint stays complete on its own: the metadata names no base, and a
reused chunk is an independent name for the same bytes.

The per-chunk fields of this feature (``xxh3t``, ``head``: 16 bytes each) are
columns of the chunk records (:data:`gpuckpt.storage.chunk_table.COLUMNS`), in
whichever form a checkpoint keeps them: listed in the metadata (format version
1) or in the chunk table (format version 2). A save reports them per chunk in
its :class:`ChunkResult`; :func:`hash_columns` makes the columns the writer
stores, and :func:`open_base` reads them back from a base of either form.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, HostArray, StagedIn, StagedOut
from gpuckpt.device.backend import ChunkBox, Ticket
from gpuckpt.errors import CheckpointWriteError, GpuckptError, IncrementalBaseWarning, InvalidOptionError
from gpuckpt.metadata import Metadata
from gpuckpt.options import SaveOptions
from gpuckpt.planning.plan import TensorPlan
from gpuckpt.reading import TensorEntry, chunk_column, load_chunk_records, validate_metadata
from gpuckpt.storage import contenthash
from gpuckpt.storage.base import BaseRef, CheckpointReader, CheckpointWriter, ChunkWrites
from gpuckpt.storage.checksum import CRC_BYTES, crc32c
from gpuckpt.storage.contenthash import LEAF, ChunkHasher
from gpuckpt.storage.layout import metadata_from_root_document
from gpuckpt.storage.stores import open_reader, scheme_of

__all__ = [
    "BaseIndex",
    "ChunkResult",
    "check_base_target",
    "content_hash_info",
    "digests_match",
    "hash_columns",
    "open_base",
    "open_base_for",
    "SharedChunk",
    "SharedWithBase",
    "reuse_by_digests",
    "share_unchanged",
    "write_hashed",
]

_ZEROS = bytes(LEAF)
_DIGEST_BYTES = 16


class ChunkResult(NamedTuple):
    """What writing (or reusing) one chunk of a hashing save gave: its stored size (trailer
    included), its CRC32C, its content hash and first-leaf hash (16 bytes each; None when
    not hashed), and whether it was reused from the base instead of written.

    A tuple whose first two items are those of the ``(stored bytes, CRC32C)`` pair an
    ordinary save reports per chunk."""

    nbytes: int
    crc32c: int
    xxh3t: bytes | None = None
    head: bytes | None = None
    reused: bool = False


# -- the per-chunk columns ------------------------------------------------------------------


def hash_columns(results: Sequence[tuple[int, int] | ChunkResult]) -> dict[str, np.ndarray]:
    """The ``xxh3t`` and ``head`` columns (``uint8``, one row of 16 bytes per result, in
    order) of the chunks ``results`` reports, when every one was hashed; else none.

    ``head`` is the first leaf's hash, which for a chunk of one leaf is its hash: every
    row has both, so that each column is complete (a column is read only when it is).
    """
    if not results or not isinstance(results[0], ChunkResult):
        return {}  # an ordinary save: (stored bytes, CRC32C) pairs
    values: list[bytes] = []
    heads: list[bytes] = []
    for r in results:
        if not isinstance(r, ChunkResult) or r.xxh3t is None or len(r.xxh3t) != _DIGEST_BYTES:
            return {}
        values.append(r.xxh3t)
        heads.append(r.head if r.head is not None and len(r.head) == _DIGEST_BYTES else r.xxh3t)
    n = len(results)
    return {
        "xxh3t": np.frombuffer(b"".join(values), np.uint8).reshape(n, _DIGEST_BYTES),
        "head": np.frombuffer(b"".join(heads), np.uint8).reshape(n, _DIGEST_BYTES),
    }


def content_hash_info() -> dict[str, Any]:
    """``storage_data["content_hash"]`` of a checkpoint whose chunks carry hashes."""
    return {"algorithm": contenthash.HASH_ALGORITHM, "leaf": LEAF}


# -- the base ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _BaseChunk:
    ref: BaseRef
    xxh3t: bytes | None
    head: bytes | None


class BaseIndex:
    """The chunks of a base checkpoint that a save may reuse, by array name and key."""

    def __init__(
        self,
        location: str,
        reader: CheckpointReader,
        tensors: Mapping[str, TensorEntry],
        chunks: Mapping[str, Mapping[str, _BaseChunk]],
    ) -> None:
        self.location = location
        self.reader = reader
        self._tensors = dict(tensors)  # by array name
        self._chunks = dict(chunks)

    def compatible(self, tensors: Iterable[TensorPlan]) -> set[str]:
        """Names of the arrays of ``tensors`` whose base array holds the same chunks: same
        name, FQN, shape, dtype, chunk grid and memory format."""
        names = set()
        for t in tensors:
            e = self._tensors.get(t.name)
            if (
                e is not None
                and e.fqn == t.fqn
                and e.shape == t.shape
                and e.dtype == t.dtype
                and e.grid.to_zarr_json() == t.grid.to_zarr_json()
                and e.metadata.properties.memory_format == t.properties.memory_format
            ):
                names.add(t.name)
        return names

    def arrays(self) -> list[str]:
        """The names of the arrays this index holds, sorted."""
        return sorted(self._tensors)

    def restrict(self, names: Iterable[str]) -> BaseIndex:
        """This index with only the arrays ``names``."""
        keep = set(names)
        return BaseIndex(
            self.location,
            self.reader,
            {n: t for n, t in self._tensors.items() if n in keep},
            {n: c for n, c in self._chunks.items() if n in keep},
        )

    def lookup(self, name: str, key: str, nbytes: int) -> _BaseChunk | None:
        """The base's chunk ``key`` of array ``name`` if it has the stored size ``nbytes``."""
        c = self._chunks.get(name, {}).get(key)
        return c if c is not None and c.ref.nbytes == nbytes else None

    def lookup_hashed(self, name: str, key: str, nbytes: int) -> _BaseChunk | None:
        """:meth:`lookup`, where the base recorded the chunk's content hash (and this process
        can compute it): a chunk that digests computed elsewhere (on a device) may match."""
        c = self.lookup(name, key, nbytes)
        return c if c is not None and c.xxh3t is not None and contenthash.available() else None


def check_base_target(path: str | os.PathLike[str], options: SaveOptions) -> None:
    """Refuse a ``base`` that is the checkpoint being saved (an overwrite would replace the
    base while its chunks are being reused)."""
    if options.base_location is None:
        return
    target, base = os.fspath(path), options.base_location
    same = target.rstrip("/") == base.rstrip("/")
    if not same and scheme_of(target) == scheme_of(base) == "file":
        same = os.path.realpath(target.removeprefix("file://")) == os.path.realpath(
            base.removeprefix("file://")
        )
    if same:
        raise InvalidOptionError(
            f"base={base!r} is the checkpoint being saved ({target!r}); pass an earlier checkpoint "
            "at another path as base (CheckpointManager(incremental=True) does this per step)"
        )


_warned_no_xxhash = False
_warn_lock = threading.Lock()


def _warn_no_hash_library() -> None:
    global _warned_no_xxhash
    with _warn_lock:
        if _warned_no_xxhash:
            return
        _warned_no_xxhash = True
    warnings.warn(
        "incremental save without the xxhash package: chunks are compared with the base by reading "
        "the base's bytes, and no content hash is recorded; pip install 'gpuckpt[incremental]' to hash",
        IncrementalBaseWarning,
        stacklevel=4,
    )


def _unusable(location: str, exc: BaseException) -> None:
    warnings.warn(
        f"base checkpoint {location!r} cannot be used for an incremental save: {exc}; "
        "this save writes every chunk (it is complete either way)",
        IncrementalBaseWarning,
        stacklevel=4,
    )


def _open_checkpoint(
    location: str, storage_options: Mapping[str, Any] | None
) -> tuple[CheckpointReader, Metadata, dict[str, TensorEntry]] | None:
    """The base's reader, metadata and validated tensors, or None (with a warning)."""
    if not contenthash.available():
        _warn_no_hash_library()
    try:
        reader = open_reader(location, storage_options=dict(storage_options or {}))
        where = f"{location.rstrip('/')}/zarr.json"
        md = metadata_from_root_document(reader.read_root(), where)
        tensors, _objects = validate_metadata(md)
    except (GpuckptError, OSError, ValueError) as exc:
        _unusable(location, exc)
        return None
    return reader, md, tensors


def _hashes(reader: CheckpointReader, t: TensorEntry) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The ``xxh3t`` and ``head`` columns of the base tensor ``t``, from its listed records
    or its rows of the chunk table; a column that is missing or cannot be read is none
    (its chunks are then compared by their bytes)."""
    try:
        values = chunk_column(reader, t, "xxh3t")
        heads = chunk_column(reader, t, "head") if values is not None else None
    except (GpuckptError, OSError):
        return None, None
    return values, heads


def _index(
    location: str,
    opened: tuple[CheckpointReader, Metadata, dict[str, TensorEntry]],
    arrays: Collection[str] | None,
) -> BaseIndex | None:
    """The index of the base's arrays ``arrays`` (None: all): their chunk records (read from
    the chunk table of a format-2 base) and, where recorded, their hashes."""
    reader, md, tensors = opened
    chosen = [t for t in tensors.values() if arrays is None or t.name in arrays]
    try:
        load_chunk_records(reader, chosen)
    except (GpuckptError, OSError) as exc:
        _unusable(location, exc)
        return None
    sd = md.storage_data
    info = sd.get("content_hash") if isinstance(sd, dict) else None
    hashed = isinstance(info, dict) and info.get("algorithm") == contenthash.HASH_ALGORITHM
    by_name: dict[str, TensorEntry] = {}
    chunks: dict[str, dict[str, _BaseChunk]] = {}
    for t in chosen:
        values, heads = _hashes(reader, t) if hashed else (None, None)
        by_name[t.name] = t
        mine = chunks[t.name] = {}
        for i, c in enumerate(t.chunks):
            ref = BaseRef(location, t.name, c.key, c.nbytes, c.crc)
            value = None if values is None else values[i].tobytes()
            head = None if heads is None else heads[i].tobytes()
            mine[c.key] = _BaseChunk(ref, value, head)
    return BaseIndex(location, reader, by_name, chunks)


def open_base(
    location: str, storage_options: Mapping[str, Any] | None = None, arrays: Collection[str] | None = None
) -> BaseIndex | None:
    """The index of the base checkpoint at ``location`` (of its arrays ``arrays``; None: all),
    or None (with a warning) when it cannot be used: missing, not a committed checkpoint,
    its root document damaged (its CRC does not verify), of a format version this gpuckpt
    does not read, inconsistent, or its chunk table damaged. Bases of format version 1
    (listed records) and 2 (chunk table) are read alike."""
    opened = _open_checkpoint(location, storage_options)
    return None if opened is None else _index(location, opened, arrays)


def open_base_for(options: SaveOptions, tensors: Iterable[TensorPlan]) -> BaseIndex | None:
    """:func:`open_base` of ``options.base_location`` with the arrays of ``tensors`` it can
    serve (:meth:`BaseIndex.compatible`), their records only read."""
    location = options.base_location
    if location is None:
        return None
    opened = _open_checkpoint(location, options.storage_options)
    if opened is None:
        return None
    whole = BaseIndex(location, opened[0], {t.name: t for t in opened[2].values()}, {})
    return _index(location, opened, whole.compatible(tensors))


# -- reuse decided by digests computed elsewhere ------------------------------------------------


def digests_match(b: _BaseChunk, digests: tuple[bytes, bytes]) -> bool:
    """Whether a chunk of the base chunk's stored size whose content hash and first-leaf hash
    are ``digests`` holds the base chunk's bytes: both 128-bit hashes equal the recorded
    ones (a base that recorded no head is decided by the whole hash). The CRC32C takes no
    part: it is never the deciding test."""
    value, head = digests
    return (
        b.xxh3t is not None
        and len(value) == _DIGEST_BYTES
        and value == b.xxh3t
        and (b.head is None or head == b.head)
    )


def reuse_by_digests(
    writer: CheckpointWriter, b: _BaseChunk, name: str, key: str, digests: tuple[bytes, bytes]
) -> ChunkResult | None:
    """Reuse base chunk ``b`` as chunk ``key`` of array ``name`` (whose document is written
    already) when ``digests`` (computed before the chunk was staged, on its device) show it
    holds the same bytes; the chunk's CRC32C is the base's record of those bytes. None when
    the digests differ or the writer refuses to share the chunk: the caller then stages and
    writes it."""
    if not digests_match(b, digests) or not writer.reuse_chunk(name, key, b.ref):
        return None
    value, head = digests
    return ChunkResult(b.ref.nbytes, b.ref.crc32c, value, head, reused=True)


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
        return HostArray(box).stage_out((0,) * len(sizes), tuple(sizes), staging)

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

    base: _BaseChunk
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


def _equal_bytes(reader: CheckpointReader, b: _BaseChunk, buf: np.ndarray, pad: int, crc: int) -> bool:
    """Whether the base chunk file holds exactly ``buf``, ``pad`` zeros and the trailer ``crc``."""
    ref = b.ref
    try:
        if reader.chunk_nbytes(ref.name, ref.key) != ref.nbytes:
            return False
        data = bytearray(ref.nbytes)
        if reader.read_chunk_into(ref.name, ref.key, [data]) != ref.nbytes:
            return False
    except OSError:
        return False
    got = np.frombuffer(data, np.uint8)
    n = buf.nbytes
    return (
        np.array_equal(got[:n], np.frombuffer(memoryview(buf).cast("B"), np.uint8))
        and not got[n : n + pad].any()
        and bytes(got[n + pad :]) == crc.to_bytes(CRC_BYTES, "little")
    )


def _compare(index: BaseIndex, b: _BaseChunk, buf: np.ndarray, pad: int) -> tuple[bool, _Known, int]:
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
    if crc != b.ref.crc32c or not _equal_bytes(index.reader, b, buf, pad, crc):
        return False, _Known(), 0
    if contenthash.available():
        value, head, _ = _hash_all(buf, pad, with_crc=False)
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
) -> list[ChunkResult]:
    """Write (or reuse) chunks, recording each one's content hash; see the module docstring.

    The arguments are those of a :class:`~gpuckpt.storage.base.ChunkWrites` batch;
    ``compared``: ``(array name, key)`` of chunks compared with ``base`` already (by
    digests computed on their device: :func:`reuse_by_digests`), which are written. Chunks
    of one leaf or less are hashed here and written in one batch of the writer's; larger
    ones are hashed while they are written, piece by piece (and, with a base, probed by
    their first leaf first, so that a changed chunk is not hashed twice).
    """
    hashing = contenthash.available()
    results: list[ChunkResult | None] = [None] * len(names)
    known: dict[int, _Known] = {}
    batch: list[int] = []
    docs = list(documents) or [None] * len(names)
    # compare first, then write the documents of the equal chunks' arrays in one batch of the
    # writer's (not one call each), then share them
    probed: dict[int, _Known] = {}
    equal: dict[int, tuple[_BaseChunk, int]] = {}
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
            results[i] = _write_large(writer, name, key, buf, pad, docs[i], k)
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
) -> ChunkResult:
    """Write one chunk of more than a leaf, its CRC32C and (unless known) its hash computed
    piece by piece as the writer streams it (while each piece is in the CPU cache)."""
    if document is not None:
        writer.write_array_document(name, document)
    hasher = ChunkHasher(k.head) if k.value is None else None
    crc = 0

    def digest(piece: Any) -> None:
        nonlocal crc
        crc = crc32c(piece, crc)
        if hasher is not None:
            hasher.update(piece)

    parts = [buf, bytes(pad)] if pad else [buf]
    writer.write_chunk_checked(name, key, parts, digest, lambda: crc.to_bytes(CRC_BYTES, "little"))
    value, head = hasher.digests() if hasher is not None else (k.value, k.head)
    return ChunkResult(buf.nbytes + pad + CRC_BYTES, crc, value, head)
