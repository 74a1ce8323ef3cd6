"""The first half of a load: validate the metadata and check the chunk files.

Nothing in a checkpoint is trusted. Before a single array is allocated, every
tensor's grid, chunk list, keys and byte sizes are checked against each
other and against the sizes of the files on disk, so a checkpoint that
claims a huge shape fails fast instead of allocating it. The chunks are then
read by :mod:`gpuckpt.loading.chunk_reads` (a thread pool, straight into the
destination array where the layout allows, each chunk's CRC32C checked
against the chunk file and against the metadata).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from gpuckpt.errors import (
    CheckpointCorruptedError,
    MetadataError,
    MissingChunkError,
)
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.documents import chunk_file_key
from gpuckpt.format.entries import ChunkRead, TensorEntry, whole_chunk_key
from gpuckpt.format.records import BlockRows
from gpuckpt.runtime.workers import Workers
from gpuckpt.storage.base import CheckpointReader

__all__ = [
    "CLAIMS_LISTED_MIN",
    "ChunkRead",
    "Overclaim",
    "TensorEntry",
    "check_chunk_files",
    "checking_chunk_files",
    "chunk_column",
    "load_chunk_records",
    "overclaimed",
]


def load_chunk_records(reader: CheckpointReader, entries: Iterable[TensorEntry]) -> None:
    """Read the chunk records of ``entries`` that a chunk table holds (only the table chunks
    that hold their rows); raises :class:`~gpuckpt.errors.CheckpointCorruptedError` or
    :class:`~gpuckpt.errors.MissingChunkError` when the table is damaged."""
    for t in entries:
        if t.crcs is None and t.table is not None:
            t.crcs = t.table.tensor_rows(reader, "crc32c", t.row, t.nchunks)
        if t.codec is not None and t.sizes is None and t.table is not None:
            if "nbytes" not in t.table.columns:
                raise MetadataError(
                    f"tensor {t.fqn!r} is compressed but the chunk table has no nbytes column; the "
                    "checkpoint is damaged or was not written by gpuckpt"
                )
            sizes = np.asarray(t.table.tensor_rows(reader, "nbytes", t.row, t.nchunks))
            most = t.max_stored()
            if t.nchunks and (int(sizes.min()) <= CRC_BYTES or int(sizes.max()) > most):
                raise MetadataError(
                    f"tensor {t.fqn!r}: its chunk table rows give stored sizes from {int(sizes.min())} "
                    f"to {int(sizes.max())} bytes; its codec stores {CRC_BYTES + 1} to {most}; the "
                    "checkpoint is damaged or was not written by gpuckpt"
                )
            t.sizes = sizes


def chunk_column(reader: CheckpointReader, t: TensorEntry, name: str) -> np.ndarray | None:
    """Column ``name`` of the chunk records of ``t`` (one row per chunk, C order of grid
    coordinates) from whichever form holds them, or None when the checkpoint has no such
    column for ``t``; raises as :func:`load_chunk_records` when a chunk table is damaged."""
    if name == "crc32c":
        load_chunk_records(reader, [t])
        return t.crcs
    if t.table is not None:
        if name not in t.table.columns:
            return None
        return np.asarray(t.table.tensor_rows(reader, name, t.row, t.nchunks))
    return None if t.listed is None else t.listed.get(name)


#: tensors of several chunks that claim more chunks than this, together, have their arrays listed
#: before any record per chunk is made (see :func:`overclaimed`)
CLAIMS_LISTED_MIN = 1 << 16


@dataclass(frozen=True, slots=True)
class Overclaim:
    """A tensor whose array holds fewer chunk files (``held``) than it claims chunks; ``first``:
    the key of its first chunk, in C order of the grid, that has no file."""

    tensor: TensorEntry
    held: int
    first: str

    @property
    def problem(self) -> str:
        t = self.tensor
        return (
            f"tensor {t.fqn!r} claims {t.nchunks} chunks but its array {t.name} holds {self.held} chunk "
            f"files: {t.nchunks - self.held} are missing (the first: {self.first})"
        )

    def error(self) -> MissingChunkError:
        return MissingChunkError(
            f"{self.problem}; the checkpoint is damaged: restore it from a copy or use an earlier checkpoint"
        )


def overclaimed(reader: CheckpointReader, entries: Iterable[TensorEntry]) -> list[Overclaim]:
    """The tensors of ``entries`` whose arrays hold fewer chunk files than they claim chunks.

    A root document can claim any number of chunks (a chunk table of 2**32 rows costs a
    few KiB on a file system that stores it sparse); what a checkpoint pays for is its
    chunk files. So where the tensors of several chunks claim more than
    :data:`CLAIMS_LISTED_MIN` chunks together, each one's array is listed (its cost grows
    with the files there) and compared with its claim before any reader makes a record
    per chunk or reads the table's rows: a hostile claim costs what was written, and
    ends in a typed error (loads) or a line of damage (verify, inspect). Smaller claims
    cost at most that many records and are checked chunk by chunk as before. A store
    that cannot list (:meth:`~gpuckpt.storage.base.CheckpointReader.chunk_keys`) is not
    checked here."""
    many = [t for t in entries if not t.whole and t.nchunks > 1]
    if sum(t.nchunks for t in many) <= CLAIMS_LISTED_MIN:
        return []
    found = []
    for t in many:
        keys = reader.chunk_keys(t.name)
        if keys is not None and len(keys) < t.nchunks:
            found.append(Overclaim(t, len(keys), _first_missing(t, keys)))
    return found


def _first_missing(t: TensorEntry, held: set[str]) -> str:
    """The key of ``t``'s first chunk without a file in ``held`` (at most ``len(held) + 1`` keys made)."""
    shape = t.grid.grid_shape
    for flat in range(t.nchunks):
        key = chunk_file_key(tuple(int(c) for c in np.unravel_index(flat, shape)))
        if key not in held:
            return key
    raise AssertionError("a tensor that holds fewer chunk files than it has chunks misses one")


def check_chunk_files(reader: CheckpointReader, entries: Iterable[TensorEntry]) -> None:
    """Check that every chunk file exists with the size the metadata gives, before allocating
    (the chunk records a chunk table holds are read first, see :func:`load_chunk_records`)."""
    with checking_chunk_files(reader, entries) as check:
        check()


#: a check of at least this many chunk files asks for their sizes on a thread of its own
BACKGROUND_CHECK_MIN = 256
_check_threads = Workers(4, "gpuckpt-check")


@contextlib.contextmanager
def checking_chunk_files(
    reader: CheckpointReader, entries: Iterable[TensorEntry]
) -> Iterator[Callable[[], None]]:
    """:func:`check_chunk_files` begun now: the chunk records are read here, the file sizes
    asked for on another thread (a load of many small tensors prepares its reads meanwhile,
    while the file system answers in native code). Yields the call that waits for the sizes
    and raises what :func:`check_chunk_files` raises; leaving the block waits for the thread,
    whose error is then left to that call (an error of the block's own comes first).

    A large claim is compared with the chunk files there first (:func:`overclaimed`)."""
    entries = list(entries)
    for bad in overclaimed(reader, entries):
        raise bad.error()
    load_chunk_records(reader, entries)
    names: list[str] = []
    keys: list[str] = []
    expected: list[int] = []
    for t in entries:
        if t.whole and t.codec is None:
            # a tensor stored whole: its one chunk's key and size without its chunk record
            names.append(t.name)
            keys.append(whole_chunk_key(len(t.shape)))
            expected.append(t.nbytes + CRC_BYTES)
        elif isinstance(t.crcs, BlockRows):
            # records read as the chunks are: the files' keys and sizes come from the grid
            found, sizes = t.chunk_files()
            names.extend([t.name] * len(found))
            keys.extend(found)
            expected.extend(sizes)
        else:
            for c in t.chunks:
                names.append(t.name)
                keys.append(c.key)
                expected.append(c.nbytes)
    pending = (
        _check_threads.submit(reader.chunk_sizes, names, keys) if len(names) >= BACKGROUND_CHECK_MIN else None
    )

    def check() -> None:
        sizes = reader.chunk_sizes(names, keys) if pending is None else pending.result()
        if sizes != expected:  # compared as whole lists, not chunk by chunk
            _raise_first_mismatch(reader, entries, sizes)

    try:
        yield check
    finally:
        if pending is not None:
            concurrent.futures.wait([pending])


def _raise_first_mismatch(
    reader: CheckpointReader, entries: list[TensorEntry], sizes: list[int | None]
) -> None:
    """Raise the error of the first chunk of ``entries`` whose file size is not its record's."""
    chunks = [(t, c) for t in entries for c in t.chunks]
    for (t, c), size in zip(chunks, sizes, strict=True):
        if size != c.nbytes:
            if size is None:
                absence = reader.chunk_absence(t.name, c.key)
                what = "is missing" if absence == "missing" else f"cannot be read: its file {absence}"
                raise MissingChunkError(
                    f"chunk {c.key} of tensor {t.fqn!r} {what} (expected file {t.name}/{c.key}); "
                    "the checkpoint is damaged: restore it from a copy or use an earlier checkpoint"
                )
            raise CheckpointCorruptedError(
                f"chunk {c.key} of tensor {t.fqn!r} is {size} bytes, expected {c.nbytes} "
                f"(file {t.name}/{c.key} is truncated or overwritten); the checkpoint is damaged"
            )
