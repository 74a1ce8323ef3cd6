"""Chunk files written and read around the page cache (``O_DIRECT``).

A :class:`DirectWriter` writes a whole large chunk file (:data:`DIRECT_MIN_BYTES`
and more) with ``O_DIRECT``: the bytes go from page-aligned memory (the
staging arena) or a page-aligned bounce buffer, checksummed there, straight to
the device. A background save then neither fills the page cache with dirty
pages that its durability barrier has to wait for, nor evicts what the
training process has cached. The unaligned tail of each file and the checksum
trailer go through the page cache. Where the file system refuses ``O_DIRECT``
(at the open, or at the first write) the writer turns itself off, and the
rest of the save is written buffered.

:class:`~gpuckpt.storage.local.writer.LocalWriter` decides which files go here and
keeps everything else (where files go, their durability, publication); whether
a save writes direct at all is the caller's choice
(:meth:`gpuckpt.options.SaveOptions.use_direct_io`: background saves by
default, ``GPUCKPT_DIRECT_IO`` forces it either way).

Reads: :func:`read_direct` reads the page-aligned head of a chunk that is not
in the page cache (a cold load) straight into page-aligned memory (the
pinned staging buffers of a load to a device), without a copy through the
page cache. Where the file system refuses, it reads nothing and says so; the
caller reads buffered.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

from gpuckpt.storage.base import ChunkDigest
from gpuckpt.storage.copies import copy_into
from gpuckpt.storage.local.fileio import buffer_address, write_all, writev_all

__all__ = ["DIRECT_MIN_BYTES", "DirectWriter", "available", "read_direct"]

#: chunk files of at least this size are written with O_DIRECT (where supported)
DIRECT_MIN_BYTES = 1 << 20
#: O_DIRECT offsets, lengths and buffer addresses are kept multiples of this
_DIRECT_ALIGN = 4096
#: bytes checksummed and written per system call (the bounce buffer's size)
_PIECE = 1 << 20
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def available() -> bool:
    """Whether this platform has ``O_DIRECT`` at all (a file system may still refuse it)."""
    return bool(_O_DIRECT)


def _open_direct(path: str) -> int:
    """Create ``path`` for writing with ``O_DIRECT`` (a seam for tests of the fallback)."""
    return os.open(path, _CREATE_FLAGS | _O_DIRECT, 0o644)


def _clear_direct(fd: int) -> None:
    import fcntl  # POSIX only; O_DIRECT exists only where it does

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


class DirectWriter:
    """Writes chunk files with ``O_DIRECT`` for one save, from any number of I/O threads.

    :attr:`enabled` turns False (for good) the first time the file system
    refuses; the caller then writes the rest buffered.
    """

    def __init__(self) -> None:
        self.enabled = available()
        self._bounce = threading.local()  # one aligned buffer per I/O thread

    def create(self, path: str) -> int | None:
        """The new file ``path`` opened with ``O_DIRECT``; None (and disabled from now on) where refused."""
        try:
            return _open_direct(path)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            self.enabled = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # created before the flag was refused
            return None

    def _bounce_buffer(self) -> memoryview:
        buf = getattr(self._bounce, "buf", None)
        if buf is None:
            buf = self._bounce.buf = mmap.mmap(-1, _PIECE)  # page-aligned
        return memoryview(buf)

    def write(self, fd: int, parts: Sequence[Any], digest: ChunkDigest, *, stable: bool = False) -> None:
        """Write ``parts`` then ``digest.trailer()`` to ``fd`` (from :meth:`create`), feeding
        ``digest.update`` each piece just before it is written: straight from page-aligned
        ``stable`` memory (a staging arena, a snapshot: nothing changes it meanwhile), else copied
        through the aligned bounce buffer (and checksummed there, so that the checksum is of the
        bytes written). The unaligned tail and the trailer go through the page cache. ``fd``
        stays open."""
        bounce = self._bounce_buffer()
        direct = True
        fill = 0
        for p in parts:
            view = memoryview(p).cast("B")
            i = 0
            if stable and fill == 0 and buffer_address(view) % _DIRECT_ALIGN == 0:
                # page-aligned memory of gpuckpt's own (a staging arena): written straight from it
                aligned = view.nbytes - view.nbytes % _DIRECT_ALIGN
                for i in range(0, aligned, _PIECE):
                    piece = view[i : min(aligned, i + _PIECE)]
                    digest.update(piece)
                    direct = self._write_aligned(fd, piece, direct)
                i = aligned
            while i < view.nbytes:
                take = min(_PIECE - fill, view.nbytes - i)
                copy_into(bounce[fill : fill + take], view[i : i + take])
                fill += take
                i += take
                if fill == _PIECE:
                    digest.update(bounce)
                    direct = self._write_aligned(fd, bounce, direct)
                    fill = 0
        if fill:
            digest.update(bounce[:fill])
        aligned = fill - fill % _DIRECT_ALIGN
        if aligned:
            direct = self._write_aligned(fd, bounce[:aligned], direct)
        if direct:
            _clear_direct(fd)
        writev_all(fd, [bounce[aligned:fill], digest.trailer()])

    def _write_aligned(self, fd: int, data: memoryview, direct: bool) -> bool:
        """Write aligned ``data``; returns whether ``fd`` is still in direct mode (a file system may
        accept the flag at open and refuse the write: the rest of this save is then buffered)."""
        if not direct:
            write_all(fd, data)
            return False
        at = os.lseek(fd, 0, os.SEEK_CUR)
        try:
            write_all(fd, data)
            return True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
        _clear_direct(fd)
        self.enabled = False
        os.lseek(fd, at, os.SEEK_SET)
        write_all(fd, data)
        return False


def _set_direct(fd: int) -> None:
    """Turn ``O_DIRECT`` on for the open file ``fd`` (a seam for tests of a file system that refuses)."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)


def read_direct(fd: int, dest: memoryview) -> int | None:
    """Read the file ``fd`` from offset 0 into ``dest`` with ``O_DIRECT``, as far as alignment allows.

    ``dest`` must start on a page boundary; the whole 4 KiB blocks of it are
    read (the caller reads the unaligned rest, and ``fd`` is left in buffered
    mode). Returns the bytes read (fewer at the end of the file), or None,
    having read nothing, where the platform or the file system refuses
    ``O_DIRECT`` (at the flag or at the first read).
    """
    aligned = dest.nbytes - dest.nbytes % _DIRECT_ALIGN
    if not _O_DIRECT or aligned == 0 or buffer_address(dest) % _DIRECT_ALIGN:
        return None
    try:
        _set_direct(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        return None
    total = 0
    try:
        while total < aligned:
            try:
                n = os.preadv(fd, [dest[total:aligned]], total)
            except OSError as exc:
                # accepted at the flag, refused at the read: nothing of this file counted
                if exc.errno == errno.EINVAL and total == 0:
                    return None
                raise
            if n == 0:
                break
            total += n
            if n % _DIRECT_ALIGN:
                break  # the end of the file
    finally:
        _clear_direct(fd)
    return total
