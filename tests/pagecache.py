"""Page-cache state of files, observed without changing it.

A read of a page that is not cached, even a non-blocking ``preadv2(RWF_NOWAIT)`` that fails
with ``EAGAIN``, starts the kernel's readahead for it: a test that probes a file that way
warms the very pages it means to find cold, and on a disk with a large readahead window the
whole file. ``mincore(2)`` on a shared mapping of the file reports which pages are resident
and reads nothing, so tests decide "cold" with it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _raise(path: str | os.PathLike[str]) -> None:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), str(path))


def resident_pages(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages in all); (0, 0) for an empty file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, 0
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            _raise(path)
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vec) != 0:
                _raise(path)
            return sum(v & 1 for v in vec), pages
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def is_cold(path: str | os.PathLike[str]) -> bool:
    """Whether no page of ``path`` is in the page cache."""
    return resident_pages(path)[0] == 0


def evict(paths: Iterable[str | os.PathLike[str]], attempts: int = 3) -> list[Path]:
    """Write back and drop the cached pages of ``paths``; returns those that stay (partly)
    cached after ``attempts`` tries (pages in use or under writeback are kept: best-effort)."""
    left = [Path(p) for p in paths]
    for _ in range(attempts):
        os.sync()
        for p in left:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        left = [p for p in left if not is_cold(p)]
        if not left:
            break
    return left


def files_under(root: str | os.PathLike[str]) -> list[Path]:
    """Every regular file below ``root``."""
    return sorted(p for p in Path(root).rglob("*") if p.is_file())
