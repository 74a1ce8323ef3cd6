"""Page-cache state of files, observed without changing it.

A read of a page that is not cached, even a non-blocking ``preadv2(RWF_NOWAIT)`` that fails
with ``EAGAIN``, starts the kernel's readahead for it: a test that probes a file that way
warms the very pages it means to find cold, and on a disk with a large readahead window the
whole file. ``mincore(2)`` on a shared mapping of the file reports which pages are resident
and reads nothing (:func:`bench.compare.common.resident_fraction`), so tests decide "cold"
with it.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from pathlib import Path

from bench.compare.common import resident_fraction, resident_pages


def is_cold(path: str | os.PathLike[str]) -> bool:
    """Whether no page of ``path`` is in the page cache (False where that cannot be told)."""
    return resident_fraction([os.fspath(path)]) == 0.0


def is_cached(path: str | os.PathLike[str], offset: int = 0) -> bool:
    """Whether the page holding byte ``offset`` of ``path`` is in the page cache."""
    pages = resident_pages(os.fspath(path))
    assert pages is not None, f"mincore cannot tell the page-cache state of {path}"
    return bool(pages[offset // mmap.PAGESIZE])


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
