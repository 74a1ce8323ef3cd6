"""Interfaces between the checkpoint logic and where the bytes live."""

from __future__ import annotations

import errno
import functools
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gpuckpt.format.checksum import CRC_BYTES, crc32c
from gpuckpt.format.segments import SegmentDigest, crc32c_combine, segmented
from gpuckpt.storage.copies import own_copy

__all__ = [
    "Backend",
    "BaseRef",
    "Capabilities",
    "CheckpointReader",
    "CheckpointRoot",
    "CheckpointWriter",
    "ChunkDigest",
    "ChunkReads",
    "ChunkWrites",
    "CrcDigest",
    "NotRegularFileError",
    "ReadStop",
]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a store does differently, as the save and load pipelines ask it: one value per
    back end (:attr:`CheckpointWriter.capabilities`, :attr:`CheckpointReader.capabilities`),
    read where a pipeline decides, never a check of which back end it is.

    The defaults are those of a file system."""

    #: the I/O threads hand the store many small chunks per call (one :meth:`~CheckpointWriter.write_chunks`
    #: or :meth:`~CheckpointReader.read_chunks` batch: cheaper than a call per chunk where native code
    #: does the files); False where every chunk is a request of its own (an object store), so that
    #: small chunks go out in parallel on the I/O threads, not one after the other
    batches_chunks: bool = True
    #: an array's document must be written before any of its chunks (a file system: writing the
    #: document makes the array's directory); False where chunks may land first (an object store
    #: has no directories), which lets a distributed save start every rank's chunk writes while
    #: the documents are still being written
    documents_first: bool = True
    #: :meth:`CheckpointReader.read_range_crcs` reads part of a chunk (else only whole chunks are read)
    reads_ranges: bool = False


@dataclass(frozen=True, slots=True)
class Backend:
    """A storage back end as :mod:`gpuckpt.storage.stores` registers it, one per URL scheme
    (a plain path is ``file``). Every factory takes the location as the back end names it
    (:attr:`location`) and keyword arguments:

    * ``writer(location, *, overwrite, sync, expected_files, direct_io, storage_options)``;
    * ``reader(location, *, direct_io, storage_options)``;
    * ``attach(location, token, *, storage_options)``: a writer joining another process's
      save, or None where a save is written by the process that began it;
    * ``root(location, *, storage_options)``: a place of several checkpoints, or None.

    Options a back end has no use for are ignored (``sync`` and ``direct_io`` by an object
    store, ``storage_options`` by the file system)."""

    writer: Callable[..., CheckpointWriter]
    reader: Callable[..., CheckpointReader]
    attach: Callable[..., CheckpointWriter] | None = None
    root: Callable[..., CheckpointRoot] | None = None
    #: the path or URL text as the factories take it
    location: Callable[[str], str] = str
    #: bytes per second a save to this store is assumed to write, for the rule of
    #: ``compression="auto"`` (:mod:`gpuckpt.saving.compression`): a local NVMe or the page
    #: cache by default
    write_bytes_per_s: float = 2e9
    #: whether several processes reading the same bytes from ``location`` each cost the store
    #: a read (an object store, a network file system): a distributed load then reads each
    #: shared chunk once for the job by default (``cooperative=None``). None: every read
    #: after the first is served by the machine's page cache, no cost to the store
    shared_reads: Callable[[str], bool] | None = None


@dataclass(frozen=True, slots=True)
class ChunkWrites:
    """Chunk files to create in one call (for many small chunks): item ``i`` is chunk
    ``keys[i]`` of array ``names[i]``.

    Its stored bytes are ``buffers[i]`` (a C-contiguous buffer, little-endian)
    followed by ``pads[i]`` zero bytes (the padding of an edge chunk), then the
    CRC32C trailer. Where ``documents`` is given and ``documents[i]`` is not None,
    the array's directory and its document are created first (an array stored
    as one chunk). ``stable``: see :meth:`CheckpointWriter.write_chunk_checked`.
    """

    names: Sequence[str]
    keys: Sequence[str]
    buffers: Sequence[Any]
    pads: Sequence[int]
    documents: Sequence[bytes | None] = ()
    stable: bool = False

    def select(self, indices: Sequence[int]) -> ChunkWrites:
        """The items at ``indices``, in that order."""
        docs = self.documents
        return ChunkWrites(
            [self.names[i] for i in indices],
            [self.keys[i] for i in indices],
            [self.buffers[i] for i in indices],
            [self.pads[i] for i in indices],
            [docs[i] for i in indices] if docs else (),
            self.stable,
        )


class ChunkDigest(Protocol):
    """What a writer feeds a chunk's bytes to as it stores them
    (:meth:`CheckpointWriter.write_chunk_checked`)."""

    def update(self, piece: Any) -> None:
        """Take the next bytes of the chunk (a contiguous buffer)."""

    def update_crc(self, crc: int, nbytes: int) -> None:
        """Take the next ``nbytes`` bytes of the chunk by their CRC32C ``crc``, computed by a
        writer that copied them (never across a segment's boundary:
        :data:`~gpuckpt.format.segments.SEGMENT_BYTES`)."""

    def trailer(self) -> bytes:
        """The chunk's checksum trailer, once every byte was fed."""


class CrcDigest:
    """The CRC32C of a chunk's bytes as a :class:`ChunkDigest` (its ``value``)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, piece: Any) -> None:
        self.value = crc32c(piece, self.value)

    def update_crc(self, crc: int, nbytes: int) -> None:
        self.value = crc32c_combine(self.value, crc, nbytes)

    def trailer(self) -> bytes:
        return self.value.to_bytes(CRC_BYTES, "little")


@dataclass(frozen=True, slots=True)
class BaseRef:
    """A chunk of an earlier checkpoint (``location``: its path or URL) that a save may reuse:
    chunk ``key`` of array ``name`` there, ``nbytes`` long (trailer included), whose metadata
    records the CRC32C ``crc32c``."""

    location: str
    name: str
    key: str
    nbytes: int
    crc32c: int


@dataclass(frozen=True, slots=True)
class ChunkReads:
    """Chunk files to read and check in one call: item ``i`` is chunk ``keys[i]`` of array
    ``names[i]``, whose first bytes land in the writable C-contiguous ``buffers[i]``,
    followed by ``pads[i]`` bytes of padding (read, checksummed, dropped) and the CRC32C
    trailer; the CRC32C of data and padding must equal the trailer and ``expected[i]``.
    ``checked``: every file was found a regular file of the right size just before
    (:func:`gpuckpt.loading.checks.check_chunk_files`); a reader may then leave out the look
    before opening each one (never the checks of what it opened)."""

    names: Sequence[str]
    keys: Sequence[str]
    buffers: Sequence[Any]
    pads: Sequence[int]
    expected: Sequence[int]
    checked: bool = False

    def select(self, indices: Sequence[int]) -> ChunkReads:
        """The items at ``indices``, in that order."""
        return ChunkReads(
            [self.names[i] for i in indices],
            [self.keys[i] for i in indices],
            [self.buffers[i] for i in indices],
            [self.pads[i] for i in indices],
            [self.expected[i] for i in indices],
            self.checked,
        )


@dataclass(frozen=True, slots=True)
class ReadStop:
    """Where a :class:`ChunkReads` batch stopped: item ``index`` was not read whole and intact.

    ``error`` is the system error that stopped it (``FileNotFoundError`` for a
    missing chunk, :class:`NotRegularFileError` for one that is not a regular
    file), else ``got`` bytes were read (trailer included): fewer than the item
    needs means the file is truncated, otherwise ``crc`` (of data and padding)
    differs from the trailer's ``stored`` value or from the expected one.
    Items after ``index`` were not read.
    """

    index: int
    got: int = 0
    crc: int = 0
    stored: int = 0
    error: OSError | None = None


class CheckpointWriter(ABC):
    """Writes one checkpoint and publishes it atomically.

    A subclass should expect the following sequence of calls:

    1. :meth:`begin` once;
    2. :meth:`write_array_document` and :meth:`write_chunk` any number of
       times, concurrently from several threads, each key written once (or, for a
       chunk equal to one of an earlier checkpoint, :meth:`reuse_chunk` instead);
    3. :meth:`commit` once with the root document, which publishes
       everything or nothing; or :meth:`abort` after any failure, which
       removes what was written and never touches a published checkpoint.

    Checksums are of the bytes stored: a chunk's buffers may be the caller's
    memory, which another thread may change while a save runs, so a writer
    reads each byte of them once, into memory of its own, and checksums and
    stores that copy (:func:`gpuckpt.storage.copies.own_pieces`). A value torn
    by such a race is then stored with its own checksum; a chunk that contradicts
    its checksum is never published. Only buffers marked ``stable`` (gpuckpt's
    own snapshot or staging memory) may be stored without that copy.
    """

    #: what this store does differently (see :class:`Capabilities`)
    capabilities: Capabilities = Capabilities()

    def reuse_files_of(self, path: str | os.PathLike[str], maps: Any = None) -> None:
        """Before :meth:`begin`: the files of the directory ``path``, which the caller gives up,
        may be overwritten by this save's files of the same names, so that their storage is
        used again (on tmpfs, pages already allocated); whatever of them this save does not
        write is deleted at its commit or abort. A file another name shares (a hard link) is
        never written into. ``maps``: where the caller keeps memory maps of its files from
        save to save, for a store that writes through them
        (:class:`~gpuckpt.storage.local.filemaps.FileMaps`). A store that cannot reuse files
        ignores both (the default) and ``path`` stays as it is."""
        del path, maps  # (the default: nothing reused)

    @property
    def token(self) -> str | None:
        """What another process needs to write chunks into this save once it has begun
        (:func:`gpuckpt.storage.stores.attach_writer`); None where a store takes a save
        from one process only (the default)."""
        return None

    @abstractmethod
    def begin(self) -> None: ...

    @abstractmethod
    def write_array_document(self, name: str, document: bytes) -> None: ...

    def write_array_documents(self, names: Sequence[str], documents: Sequence[bytes]) -> None:
        """:meth:`write_array_document` of each array of ``names``, in order; stops at the first
        error, which it raises. The default writes them one by one; back ends may hand the
        whole batch to native code (the documents of the arrays an incremental save shares
        with its base: hundreds of small files and no chunk)."""
        for name, document in zip(names, documents, strict=True):
            self.write_array_document(name, document)

    @abstractmethod
    def write_chunk(self, name: str, key: str, parts: Sequence[Any]) -> None:
        """Store the concatenation of the buffers ``parts`` as chunk ``key`` of array ``name``."""

    def write_chunk_checked(
        self, name: str, key: str, parts: Sequence[Any], digest: ChunkDigest, *, stable: bool = False
    ) -> None:
        """Store ``parts`` followed by ``digest.trailer()``, feeding ``digest.update`` every byte of
        ``parts`` first.

        ``digest`` sees the data in order, and exactly the bytes that are stored; its
        trailer (the checksum) is asked for once all of it was digested. ``stable``:
        nothing changes ``parts`` until this returns (gpuckpt's own snapshot or staging
        memory), so they may be digested and stored from where they are; otherwise they
        are read once, into a copy that is digested and stored (see the class
        docstring). The default copies the whole chunk unless it is stable, digests it,
        then writes; back ends that stream copy, digest and write piece by piece, while
        each piece is still in the CPU cache.
        """
        if not stable:
            parts = [own_copy(parts)]
        for p in parts:
            digest.update(p)
        self.write_chunk(name, key, [*parts, digest.trailer()])

    def reuse_chunk(self, name: str, key: str, base: BaseRef) -> bool:
        """Make chunk ``key`` of array ``name`` the bytes of the earlier checkpoint's chunk
        ``base`` without writing them (an incremental save found them equal); the array's
        document is written already.

        True when the chunk is now in place. False when this store cannot share the
        chunk (another file system, no links, another bucket, the base chunk file
        missing or not of the size and trailer ``base`` gives): the caller then writes
        it as usual. Never raises because reuse is impossible, only for errors that
        would fail a write too. The default shares nothing.
        """
        return False

    #: why a base chunk was not shared, in the same words for every store (:meth:`note_base_mismatch`)
    BASE_MISSING = "missing"
    BASE_REWRITTEN = "written after the base was published"
    BASE_OTHER_TRAILER = "its checksum trailer is not its record's"

    @staticmethod
    def base_other_size(found: int, base: BaseRef) -> str:
        """Why a base chunk of ``found`` bytes was not shared."""
        return f"{found} bytes, its record gives {base.nbytes}"

    def note_base_mismatch(self, base: BaseRef, why: str) -> None:
        """For :meth:`reuse_chunk` implementations: the base chunk ``base`` is not as its
        checkpoint's records describe (``why``: missing, another size or trailer, written
        after the base was published), so it was not shared; :meth:`base_mismatches` lists it."""
        found: list[tuple[BaseRef, str]] = self.__dict__.setdefault("_base_mismatches", [])
        found.append((base, why))  # (list.append: safe from the I/O threads)

    def base_mismatches(self) -> list[tuple[BaseRef, str]]:
        """The base chunks :meth:`reuse_chunk` found damaged in this save, with why (see
        :meth:`note_base_mismatch`); empty where none was, or the store cannot tell."""
        return list(self.__dict__.get("_base_mismatches", ()))

    def rewrite_array_document(self, name: str, document: bytes) -> None:
        """Replace the ``zarr.json`` of array ``name``, written earlier in this save, before
        :meth:`commit` (for facts learnt only while the chunks were written, e.g. the memory
        format of tensors handed over by another framework's planner)."""
        raise NotImplementedError(f"{type(self).__name__} cannot rewrite an array document")

    def write_chunks(self, batch: ChunkWrites) -> list[int]:
        """Create the chunks of ``batch`` in order (each array's document first where given);
        returns the CRC32C of each chunk's bytes. Stops at the first error, which it raises.

        The default writes them one by one; back ends may hand the whole batch to
        native code.
        """
        crcs = []
        documents = batch.documents or [None] * len(batch.names)
        for name, key, buf, pad, document in zip(
            batch.names, batch.keys, batch.buffers, batch.pads, documents, strict=True
        ):
            if document is not None:
                self.write_array_document(name, document)
            parts = [buf, bytes(pad)] if pad else [buf]
            crcs.append(self._write_checked(name, key, parts, batch.stable))
        return crcs

    def _write_checked(self, name: str, key: str, parts: list[Any], stable: bool) -> int:
        """Write one chunk through :meth:`write_chunk_checked`; its CRC32C, which for a large
        chunk also carries its segments' (:class:`~gpuckpt.format.segments.ChunkCRC`, in the
        same pass: see :mod:`gpuckpt.format.segments`)."""
        if segmented(sum(memoryview(p).nbytes for p in parts)):
            seg = SegmentDigest()
            self.write_chunk_checked(name, key, parts, seg, stable=stable)
            return seg.result()
        crc = CrcDigest()
        self.write_chunk_checked(name, key, parts, crc, stable=stable)
        return crc.value

    @abstractmethod
    def commit(self, root_document: bytes) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...


class CheckpointReader(ABC):
    """Reads the files of one published checkpoint.

    Call :meth:`read_root` first; the other methods may then be called in
    any order and concurrently. Names and keys have been validated by the
    caller; implementations must still refuse to leave the checkpoint, and
    refuse documents over :data:`~gpuckpt.format.documents.MAX_ROOT_DOCUMENT_BYTES`
    and :data:`~gpuckpt.format.documents.MAX_ARRAY_DOCUMENT_BYTES` before reading them.
    """

    #: what this store does differently (see :class:`Capabilities`)
    capabilities: Capabilities = Capabilities()

    def read_range_crcs(
        self, name: str, key: str, offset: int, dests: Sequence[Any]
    ) -> tuple[int, list[int]]:
        """Fill the writable buffers ``dests`` in order from the chunk's bytes at ``offset`` on
        (one ranged read); returns ``(bytes read, the CRC32C of each buffer)``, each CRC
        meaningful only when its buffer was filled. Only where :attr:`reads_ranges`."""
        raise NotImplementedError(f"{type(self).__name__} reads whole chunks only")

    @abstractmethod
    def read_root(self) -> bytes | bytearray: ...

    @abstractmethod
    def read_array_document(self, name: str) -> bytes | bytearray: ...

    @abstractmethod
    def chunk_nbytes(self, name: str, key: str) -> int | None:
        """Size of a stored chunk, or None when it is missing."""

    def chunk_absence(self, name: str, key: str) -> str:
        """What stands where chunk ``key`` of array ``name`` should be, for a chunk that
        :meth:`chunk_nbytes` found absent: "missing", or, where the store can say, what is
        there instead ("is a socket, not a regular file"). Reports and errors use it."""
        return "missing"

    def chunk_sizes(self, names: Sequence[str], keys: Sequence[str]) -> list[int | None]:
        """:meth:`chunk_nbytes` of many chunks (chunk ``keys[i]`` of array ``names[i]``); back
        ends override it where one call for all of them is cheaper."""
        return [self.chunk_nbytes(n, k) for n, k in zip(names, keys, strict=True)]

    def chunk_keys(self, name: str) -> set[str] | None:
        """The keys of the chunk files array ``name`` holds (one listing of it: its cost grows with
        what is there, not with what the metadata claims; names that are not chunk keys left
        out), or None where this store cannot list. Readers compare it with a large claim
        before they make a record per chunk (see :func:`gpuckpt.loading.checks.overclaimed`)."""
        return None

    def chunk_cached(self, name: str, key: str) -> bool | None:
        """Whether the first bytes of a stored chunk are in memory (a read would not wait for
        the device); None when this store cannot tell. Loads use it to size their I/O."""
        return None

    def chunk_usage(self, name: str, key: str) -> tuple[int, int] | None:
        """``(size, bytes it takes on the device)`` of a stored chunk, or None when it is missing.

        The two differ for sparse files; the default takes the size for both.
        """
        size = self.chunk_nbytes(name, key)
        return None if size is None else (size, size)

    def chunk_shared(self, name: str, key: str) -> bool:
        """Whether the stored chunk's bytes are shared with another checkpoint (a hard link
        made by an incremental save: the file has more than one name). The default: no
        (object stores copy, and a copy is an object of its own)."""
        return False

    @abstractmethod
    def read_chunk_into(self, name: str, key: str, dests: Sequence[Any]) -> int:
        """Fill the writable buffers ``dests`` in order from the chunk; returns bytes read."""

    def read_chunk_crc(self, name: str, key: str, dests: Sequence[Any]) -> tuple[int, int]:
        """Like :meth:`read_chunk_into`, and the CRC32C of the bytes read into every buffer but the last.

        The last buffer receives the checksum trailer. Returns ``(bytes read,
        CRC32C)``; the CRC is meaningful only when every buffer was filled. The
        default reads, then checksums; back ends may fuse the two.
        """
        n = self.read_chunk_into(name, key, dests)
        value = 0
        for d in dests[:-1]:
            value = crc32c(d, value)
        return n, value

    def read_chunks(self, batch: ChunkReads) -> ReadStop | None:
        """Read and check the chunks of ``batch`` in order; None when every one was read
        whole and matched its checksum, else where it stopped (nothing is raised for a
        missing, truncated or damaged chunk: the caller names the tensor in its error).

        The default reads them one by one with :meth:`read_chunk_crc`; back ends may
        hand the whole batch to native code.
        """
        for i, (name, key, buf, pad, expected) in enumerate(
            zip(batch.names, batch.keys, batch.buffers, batch.pads, batch.expected, strict=True)
        ):
            trailer = bytearray(CRC_BYTES)
            dests = [buf, bytearray(pad), trailer] if pad else [buf, trailer]
            try:
                got, value = self.read_chunk_crc(name, key, dests)
            except OSError as exc:
                return ReadStop(i, error=exc)
            if got != memoryview(buf).nbytes + pad + CRC_BYTES:
                return ReadStop(i, got)
            stored = int.from_bytes(trailer, "little")
            if value != stored or value != expected:
                return ReadStop(i, got, value, stored)
        return None

    def chunk_read_jobs(
        self, batch: ChunkReads, spans: Sequence[tuple[int, int]]
    ) -> list[Callable[[], ReadStop | None]]:
        """Jobs that read the items of ``batch`` in ``spans`` (``[start, stop)`` ranges, one
        job each, any thread): each returns None, or where its range stopped, indexed into
        ``batch``, as :meth:`read_chunks` does. The default reads each range with
        :meth:`read_chunks`; a back end may prepare the whole batch once instead."""

        def job(start: int, stop: int) -> ReadStop | None:
            where = self.read_chunks(batch.select(range(start, stop)))
            return None if where is None else replace(where, index=start + where.index)

        return [functools.partial(job, a, b) for a, b in spans]

    def read_chunk_checksum(self, name: str, key: str, nbytes: int, piece: int) -> tuple[int, int, int]:
        """Read the ``nbytes`` of a chunk (checksum trailer included) without keeping them.

        Returns ``(bytes read, CRC32C of the bytes before the trailer, the trailer's value)``.
        Back ends that read at offsets stream the chunk through buffers of ``piece``
        bytes; the default reads it into one buffer of ``nbytes``, so callers check
        ``nbytes`` against :meth:`chunk_nbytes` first.
        """
        data = bytearray(max(0, nbytes - CRC_BYTES))
        trailer = bytearray(CRC_BYTES)
        n, value = self.read_chunk_crc(name, key, [data, trailer])
        return n, value, int.from_bytes(trailer, "little")

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release resources; the default does nothing."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symlink"),
)


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), f"of file type {stat.S_IFMT(mode):#o}")


class NotRegularFileError(FileNotFoundError):
    """A checkpoint file that is a FIFO, directory, device, socket or symlink: never read.

    A :class:`FileNotFoundError` (what is there is not the file the checkpoint
    needs); ``mode`` is the ``st_mode`` found.
    """

    def __init__(self, path: str, mode: int) -> None:
        super().__init__(errno.ENOENT, f"is {_kind(mode)}, not a regular file", path)
        self.mode = mode


class CheckpointRoot(ABC):
    """A place holding several checkpoints side by side, each under a child name (a directory
    of step checkpoints, or a prefix of an object store), as :class:`gpuckpt.CheckpointManager`
    uses it.

    A subclass should expect these calls: when the root is opened, :meth:`children`,
    :meth:`is_committed` of some of them (from several threads at once: a caller probes
    many children in parallel) and :meth:`cleanup` (given the children found not
    committed); then any of :meth:`children`, :meth:`is_committed`, :meth:`child` and
    :meth:`delete`, while saves write children through
    :func:`gpuckpt.storage.stores.open_writer` at :meth:`child`. A caller may remember
    that a child is committed while :meth:`children` keeps listing it: a child stops
    being committed only through a deletion, which ends by removing its name.
    """

    @abstractmethod
    def child(self, name: str) -> Any:
        """Where the checkpoint ``name`` is (a path or URL that :func:`open_writer` and
        :func:`open_reader` take)."""

    @abstractmethod
    def children(self) -> list[str]:
        """Names of the entries of the root that may be checkpoints (committed or not), not
        hidden ones; without reading inside them."""

    @abstractmethod
    def is_committed(self, name: str) -> bool:
        """Whether ``name`` holds a published gpuckpt checkpoint (damaged or not); safe to call
        from several threads at once."""

    @abstractmethod
    def delete(self, names: Sequence[str]) -> None:
        """Delete the committed checkpoints ``names``, in as few requests as the store allows.

        Each one disappears at once (it stops being committed before any of its other
        data goes); an interrupted deletion leaves what :meth:`cleanup` removes.
        """

    def refuse_inside_a_checkpoint(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Raise :class:`~gpuckpt.errors.InvalidPathError` when the root lies inside a published
        checkpoint (deleting that checkpoint would delete every step here); called once, when
        the root is opened. The default does nothing: a caller checks local paths itself."""

    def foreign_entries(self, name: str) -> list[str]:
        """Names under the child ``name`` that are not a gpuckpt checkpoint's (another program's
        files, beside which a save with ``overwrite=True`` would publish); none on a store whose
        checkpoints are prefixes of their own."""
        return []

    @abstractmethod
    def cleanup(self, candidates: Sequence[str] | None = None) -> list[str]:
        """Remove what dead saves and interrupted deletions left (never a live save's
        data, nor another program's); returns what was removed.

        ``candidates``: the children that may hold such leftovers, when the caller
        knows (those it found not committed: a committed child holds none); a root
        that must look inside each child to find them looks inside these only.
        None: every child."""
