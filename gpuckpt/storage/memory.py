"""Checkpoints held in this process's memory: the files of a published checkpoint as
buffers, read through the ordinary load pipeline under a ``mem://`` URL.

A local tier's restore receives a part from a peer's replica as the bytes of its files; it
loads them from memory (:func:`published`) instead of writing files and reading them back,
and writes the files afterwards. The files are named as in a checkpoint directory
(``zarr.json``, ``<array>/zarr.json``, ``<array>/<chunk key>``) and read with the same
checks as files: documents capped before they are parsed, chunks read only up to the sizes
the metadata gives, every chunk's CRC32C checked by the load.

A file is a buffer or a list of buffers (its bytes in order). A restore may receive a
chunk's bytes straight into the array the load fills: reading them "into" the same memory
then only checksums them.

A ``mem://`` name is this process's only, lives while its ``with published(...)`` block
runs, and is read-only: a save to one is refused.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gpuckpt.errors import CheckpointNotFoundError, UnsupportedValueError
from gpuckpt.format.checksum import crc32c
from gpuckpt.format.documents import (
    MAX_ARRAY_DOCUMENT_BYTES,
    MAX_ROOT_DOCUMENT_BYTES,
    ROOT_KEY,
    is_chunk_file_key,
    too_large,
)
from gpuckpt.storage.base import Capabilities, CheckpointReader
from gpuckpt.storage.local import crccopy
from gpuckpt.storage.local.fileio import buffer_address

__all__ = ["SCHEME", "MemoryReader", "memory_reader", "memory_writer", "published"]

SCHEME = "mem"

_published: dict[str, Mapping[str, Any]] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def published(files: Mapping[str, Any]) -> Iterator[str]:
    """The checkpoint whose files are ``files`` (relative name to a buffer or a list of
    buffers), readable under the returned ``mem://`` URL until the block ends. The buffers
    are read, never kept or changed."""
    name = secrets.token_hex(8)
    with _lock:
        _published[name] = files
    try:
        yield f"{SCHEME}://{name}"
    finally:
        with _lock:
            del _published[name]


class _File:
    """A file as one or more buffers, its bytes in their order."""

    __slots__ = ("nbytes", "pieces")

    def __init__(self, value: Any) -> None:
        parts = value if isinstance(value, (list, tuple)) else [value]
        self.pieces = [memoryview(p).cast("B") for p in parts]
        self.nbytes = sum(p.nbytes for p in self.pieces)

    def whole(self) -> bytearray:
        out = bytearray(self.nbytes)
        at = 0
        for p in self.pieces:
            out[at : at + p.nbytes] = p
            at += p.nbytes
        return out

    def copy_crc(self, at: int, dst: memoryview, value: int) -> int:
        """Copy the file's bytes from ``at`` into ``dst`` (which the file holds enough bytes
        for) and return their CRC32C continued from ``value``."""
        done = 0
        start = 0
        for p in self.pieces:
            if done == dst.nbytes:
                break
            end = start + p.nbytes
            if at + done < end:
                lo = at + done - start
                n = min(p.nbytes - lo, dst.nbytes - done)
                value = _copy_crc(p[lo : lo + n], dst[done : done + n], value)
                done += n
            start = end
        return value


class MemoryReader(CheckpointReader):
    """Reads the files of a checkpoint held as buffers (see the module docstring)."""

    capabilities = Capabilities(reads_ranges=True)

    def __init__(self, name: str, files: Mapping[str, Any]) -> None:
        self.name = name
        self._files = files

    def _file(self, rel: str) -> _File | None:
        value = self._files.get(rel)
        return None if value is None else _File(value)

    def _document(self, rel: str, limit: int, cap: str) -> bytearray:
        f = self._file(rel)
        if f is None:
            raise FileNotFoundError(f"{SCHEME}://{self.name}/{rel}")
        if f.nbytes > limit:
            raise too_large(f"{SCHEME}://{self.name}/{rel}", f.nbytes, limit, cap)
        return f.whole()

    def read_root(self) -> bytearray:
        try:
            return self._document(ROOT_KEY, MAX_ROOT_DOCUMENT_BYTES, "MAX_ROOT_DOCUMENT_BYTES")
        except FileNotFoundError:
            where = f"{SCHEME}://{self.name}"
            raise CheckpointNotFoundError(f"no checkpoint at {where}: it has no {ROOT_KEY}") from None

    def read_array_document(self, name: str) -> bytearray:
        return self._document(f"{name}/zarr.json", MAX_ARRAY_DOCUMENT_BYTES, "MAX_ARRAY_DOCUMENT_BYTES")

    def chunk_keys(self, name: str) -> set[str]:
        prefix = f"{name}/"
        return {
            rel[len(prefix) :]
            for rel in self._files
            if rel.startswith(prefix) and is_chunk_file_key(rel[len(prefix) :])
        }

    def chunk_nbytes(self, name: str, key: str) -> int | None:
        f = self._file(f"{name}/{key}")
        return None if f is None else f.nbytes

    def _chunk(self, name: str, key: str) -> _File:
        f = self._file(f"{name}/{key}")
        if f is None:
            raise FileNotFoundError(f"{SCHEME}://{self.name}/{name}/{key}")
        return f

    def read_chunk_into(self, name: str, key: str, dests: Sequence[Any]) -> int:
        return self.read_range_crcs(name, key, 0, dests)[0]

    def read_chunk_crc(self, name: str, key: str, dests: Sequence[Any]) -> tuple[int, int]:
        src = self._chunk(name, key)
        total = value = 0
        for i, d in enumerate(dests):
            dst = memoryview(d).cast("B")
            n = min(dst.nbytes, src.nbytes - total)
            crc = src.copy_crc(total, dst[:n], value)
            if i < len(dests) - 1:  # (the last buffer takes the trailer: not in the CRC)
                value = crc
            total += n
            if n < dst.nbytes:
                break
        return total, value

    def read_range_crcs(
        self, name: str, key: str, offset: int, dests: Sequence[Any]
    ) -> tuple[int, list[int]]:
        src = self._chunk(name, key)
        total, crcs = 0, []
        at = offset
        for d in dests:
            dst = memoryview(d).cast("B")
            n = max(0, min(dst.nbytes, src.nbytes - at))
            crcs.append(src.copy_crc(at, dst[:n], 0))
            total += n
            at += n
            if n < dst.nbytes:
                break
        return total, crcs


def _copy_crc(src: memoryview, dst: memoryview, value: int) -> int:
    """Copy ``src`` into ``dst`` and return the CRC32C continued from ``value``: in one pass
    where the native loop is built (:mod:`gpuckpt.storage.local.crccopy`). Bytes that are
    already where they are asked for (a restore received them into the load's target) are
    only checksummed."""
    if not src.nbytes:
        return value
    same = buffer_address(src) == buffer_address(dst)
    if crccopy.available():
        return crccopy.crc_copy(src, None if same else dst, value)
    if not same:
        dst[:] = src
    return crc32c(src, value)


def memory_reader(location: str, **_: Any) -> CheckpointReader:
    """The reader of the checkpoint published as ``mem://location`` (see :func:`published`)."""
    name = location.split("://", 1)[-1].rstrip("/")
    with _lock:
        files = _published.get(name)
    if files is None:
        raise CheckpointNotFoundError(
            f"no checkpoint at {SCHEME}://{name}: {SCHEME}:// names only checkpoints this process holds "
            "in memory while they are being read"
        )
    return MemoryReader(name, files)


def memory_writer(location: str, **_: Any) -> Any:
    raise UnsupportedValueError(
        f"{location!r}: {SCHEME}:// checkpoints are read-only (a restore's buffers); save to a directory "
        "or an s3:// URL"
    )
