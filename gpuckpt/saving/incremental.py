"""Incremental saves: chunks equal to those of an earlier checkpoint are not written again.

A save with ``base=`` (:attr:`gpuckpt.options.SaveOptions.base`) opens the base
checkpoint's metadata (:func:`open_base`, as untrusted as any load), keeps the
tensors whose array has the same name, FQN, shape, dtype, chunk grid and memory
format as in the new save (:meth:`BaseIndex.compatible`), and for each chunk
with a counterpart of the same stored size decides equality by size, CRC32C and
the content hash (:mod:`gpuckpt.format.contenthash`) together, or, where the
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
columns of the chunk records (:data:`gpuckpt.format.records.COLUMNS`), in
whichever form a checkpoint keeps them: listed in the metadata (format version
1) or in the chunk table (format version 2). A save reports them per chunk in
its :class:`ChunkResult`; :func:`hash_columns` makes the columns the writer
stores, and :func:`open_base` reads them back from a base of either form.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from gpuckpt.errors import GpuckptError, IncrementalBaseWarning, InvalidOptionError
from gpuckpt.format import contenthash
from gpuckpt.format.contenthash import LEAF
from gpuckpt.loading.checks import TensorEntry, chunk_column, load_chunk_records, overclaimed
from gpuckpt.loading.open import OpenCheckpoint, open_checkpoint
from gpuckpt.options import SaveOptions
from gpuckpt.planning.plan import TensorPlan
from gpuckpt.storage.base import BaseRef, CheckpointReader, CheckpointWriter
from gpuckpt.storage.stores import scheme_of

__all__ = [
    "BaseChunk",
    "BaseIndex",
    "check_base_target",
    "ChunkResult",
    "content_hash_info",
    "digests_match",
    "hash_columns",
    "open_base",
    "open_base_for",
    "reuse_by_digests",
    "warn_damaged_base",
]

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
class BaseChunk:
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
        chunks: Mapping[str, Mapping[str, BaseChunk]],
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

    def lookup(self, name: str, key: str, nbytes: int) -> BaseChunk | None:
        """The base's chunk ``key`` of array ``name`` if it has the stored size ``nbytes``."""
        c = self._chunks.get(name, {}).get(key)
        return c if c is not None and c.ref.nbytes == nbytes else None

    def lookup_hashed(self, name: str, key: str, nbytes: int) -> BaseChunk | None:
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


_warned_no_xxhash: set[str] = set()
_warn_lock = threading.Lock()

_NO_HASH_LIBRARY = {
    "base": "incremental save without the xxhash package: chunks are compared with the base by reading "
    "the base's bytes, and no content hash is recorded; pip install 'gpuckpt[incremental]' to hash",
    "content_hash": "content_hash=True without the xxhash package: this checkpoint records no content "
    "hash (a later incremental save on it compares bytes instead); pip install 'gpuckpt[incremental]'",
}


def _warn_no_hash_library(why: str) -> None:
    """Warn, once per process for each ``why`` of :data:`_NO_HASH_LIBRARY`, that nothing is hashed."""
    with _warn_lock:
        if why in _warned_no_xxhash:
            return
        _warned_no_xxhash.add(why)
    warnings.warn(_NO_HASH_LIBRARY[why], IncrementalBaseWarning, stacklevel=4)


def _unusable(location: str, exc: BaseException) -> None:
    warnings.warn(
        f"base checkpoint {location!r} cannot be used for an incremental save: {exc}; "
        "this save writes every chunk (it is complete either way)",
        IncrementalBaseWarning,
        stacklevel=4,
    )


def warn_damaged_base(base: BaseIndex, writer: CheckpointWriter) -> None:
    """Warn where ``writer`` found chunks of ``base`` unlike its records while sharing them
    (:meth:`~gpuckpt.storage.base.CheckpointWriter.base_mismatches`): those were written in
    full, so this save is complete, but the base is damaged and its owner should know."""
    found = writer.base_mismatches()
    if not found:
        return
    ref, why = found[0]
    warnings.warn(
        f"base checkpoint {base.location!r} is damaged: {len(found)} of the chunks this save could "
        f"share are not as its records describe (first: chunk {ref.key!r} of array {ref.name!r}, "
        f"{why}); this save wrote them in full and is complete, the base is not: run "
        f"`gpuckpt verify {base.location}` to see what it can still restore",
        IncrementalBaseWarning,
        stacklevel=2,
    )


def _open_base(location: str, storage_options: Mapping[str, Any] | None) -> OpenCheckpoint | None:
    """The base checkpoint, opened, or None (with a warning)."""
    if not contenthash.available():
        _warn_no_hash_library("base")
    try:
        return open_checkpoint(location, storage_options)
    except (GpuckptError, OSError, ValueError) as exc:
        _unusable(location, exc)
        return None


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
    opened: OpenCheckpoint,
    arrays: Collection[str] | None,
) -> BaseIndex | None:
    """The index of the base's arrays ``arrays`` (None: all): their chunk records (read from
    the chunk table of a format-2 base) and, where recorded, their hashes."""
    reader, tensors = opened.reader, opened.index.tensors
    chosen = [t for t in tensors.values() if arrays is None or t.name in arrays]
    try:
        for bad in overclaimed(reader, chosen):  # a claim larger than the files: no record per chunk
            raise bad.error()
        load_chunk_records(reader, chosen)
    except (GpuckptError, OSError) as exc:
        _unusable(location, exc)
        return None
    sd = opened.index.document.get("storage_data")
    info = sd.get("content_hash") if isinstance(sd, dict) else None
    hashed = isinstance(info, dict) and info.get("algorithm") == contenthash.HASH_ALGORITHM
    by_name: dict[str, TensorEntry] = {}
    chunks: dict[str, dict[str, BaseChunk]] = {}
    for t in chosen:
        values, heads = _hashes(reader, t) if hashed else (None, None)
        by_name[t.name] = t
        mine = chunks[t.name] = {}
        for i, c in enumerate(t.chunks):
            ref = BaseRef(location, t.name, c.key, c.nbytes, c.crc)
            value = None if values is None else values[i].tobytes()
            head = None if heads is None else heads[i].tobytes()
            mine[c.key] = BaseChunk(ref, value, head)
    return BaseIndex(location, reader, by_name, chunks)


def open_base(
    location: str, storage_options: Mapping[str, Any] | None = None, arrays: Collection[str] | None = None
) -> BaseIndex | None:
    """The index of the base checkpoint at ``location`` (of its arrays ``arrays``; None: all),
    or None (with a warning) when it cannot be used: missing, not a committed checkpoint,
    its root document damaged (its CRC does not verify), of a format version this gpuckpt
    does not read, inconsistent, or its chunk table damaged. Bases of format version 1
    (listed records) and 2 (chunk table) are read alike."""
    opened = _open_base(location, storage_options)
    return None if opened is None else _index(location, opened, arrays)


def open_base_for(options: SaveOptions, tensors: Iterable[TensorPlan]) -> BaseIndex | None:
    """:func:`open_base` of ``options.base_location`` with the arrays of ``tensors`` it can
    serve (:meth:`BaseIndex.compatible`), their records only read. (Without a base, a warning
    where ``content_hash`` asks for hashes this process cannot compute.)"""
    location = options.base_location
    if location is None:
        if options.content_hash and not contenthash.available():
            _warn_no_hash_library("content_hash")
        return None
    opened = _open_base(location, options.storage_options)
    if opened is None:
        return None
    whole = BaseIndex(location, opened.reader, {t.name: t for t in opened.index.tensors.values()}, {})
    return _index(location, opened, whole.compatible(tensors))


# -- reuse decided by digests computed elsewhere ------------------------------------------------


def digests_match(b: BaseChunk, digests: tuple[bytes, bytes]) -> bool:
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
    writer: CheckpointWriter, b: BaseChunk, name: str, key: str, digests: tuple[bytes, bytes]
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
