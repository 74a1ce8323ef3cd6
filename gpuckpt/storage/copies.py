"""Chunk bytes read once from the caller's memory, into memory of the writer's own.

A save stores arrays straight from the caller's memory. If another thread
changes that memory while the save runs, two reads of it (one to checksum,
one to write) can see different bytes, and the checkpoint published would
hold a chunk that contradicts its own checksum: unloadable, and mistaken for
damage. Writers therefore read each byte of such memory once, into a buffer
of their own, and checksum and store that copy: what is stored always
matches its checksum (a value torn by the race is stored as torn; a save
needs its arrays left alone while it runs, see docs/GUARANTEES.md).

The copy costs little: it is made piece by piece into a per-thread buffer
that stays in the CPU cache (:data:`PIECE_BYTES`), where the checksum and the
write read it again, with the GIL released. Memory that nothing else can
change while it is written (gpuckpt's own snapshots and staging buffers) is
marked ``stable`` by the pipeline and stored from where it is.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from gpuckpt.storage.local.fileio import buffer_address

__all__ = ["PIECE_BYTES", "copy_into", "own_copy", "own_pieces"]

#: bytes copied, checksummed and written at a time (small enough to stay in the CPU cache)
PIECE_BYTES = 1 << 20
#: below this a copy is a plain slice assignment (releasing the GIL costs more than it saves)
_SMALL = 64 << 10

_local = threading.local()


def _bounce(nbytes: int) -> memoryview:
    """This thread's buffer, at least ``nbytes`` long (allocated once per thread, page-aligned)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.buf = mmap.mmap(-1, max(nbytes, PIECE_BYTES))
    return memoryview(buf)


def copy_into(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` for contiguous byte views of equal size, the GIL released for large ones."""
    n = src.nbytes
    if n != dst.nbytes:
        raise ValueError(f"copy of {n} bytes into a buffer of {dst.nbytes}")
    if n < _SMALL:
        dst[:] = src
    else:
        ctypes.memmove(buffer_address(dst), buffer_address(src), n)


def own_pieces(
    parts: Iterable[Any], *, stable: bool = False, piece: int = PIECE_BYTES
) -> Iterator[memoryview]:
    """The bytes of ``parts`` in order, in pieces of at most ``piece`` bytes, each a copy in this
    thread's buffer (valid until the next piece is asked for), or, where ``stable``, views of
    ``parts`` themselves. Checksum and write each piece before asking for the next."""
    for p in parts:
        view = memoryview(p).cast("B")
        for i in range(0, view.nbytes, piece):
            src = view[i : i + piece]
            if stable:
                yield src
                continue
            dst = _bounce(piece)[: src.nbytes]
            copy_into(dst, src)
            yield dst


def own_copy(parts: Iterable[Any]) -> bytearray:
    """One copy of the concatenation of ``parts``, for writers that hand a whole chunk on."""
    views = [memoryview(p).cast("B") for p in parts]
    out = bytearray(sum(v.nbytes for v in views))
    target = memoryview(out)
    at = 0
    for v in views:
        copy_into(target[at : at + v.nbytes], v)
        at += v.nbytes
    return out
