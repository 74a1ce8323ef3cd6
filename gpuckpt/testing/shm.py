"""Shared-memory segments that killed MPI jobs leave in ``/dev/shm``.

The ranks of an MPICH job on one machine share a segment there (``mpich_shm_*``, 2-4 MiB),
which MPICH removes when the job ends; a job whose ranks are killed with SIGKILL leaves it
behind. :func:`orphaned_segments` finds the ones no live process maps any more, so that a
test run that kills jobs on purpose can remove what it left.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["MPICH_PREFIX", "orphaned_segments"]

MPICH_PREFIX = "mpich_shm_"


def _mapped_files(shm: Path) -> set[str]:
    """The files under ``shm`` that some live process whose maps this user may read maps
    (MPI jobs are this user's; the maps of a container's init are unreadable even to root)."""
    mapped = set()
    marker = str(shm) + "/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text()
        except OSError:  # ended meanwhile, or not this user's
            continue
        for line in maps.splitlines():
            at = line.find(marker)
            if at >= 0:
                mapped.add(line[at:].removesuffix(" (deleted)"))
    return mapped


def orphaned_segments(
    since: float, *, prefix: str = MPICH_PREFIX, min_age_s: float = 1.0, shm: Path = Path("/dev/shm")
) -> list[Path]:
    """The files ``shm/prefix*`` of this user last modified after ``since`` (a ``time.time()``)
    and at least ``min_age_s`` ago, that no live process maps. A younger segment is left out:
    a job starting now may have made it and not mapped it yet (MPICH maps it within
    milliseconds of making it)."""
    if not shm.is_dir():
        return []
    now = time.time()
    candidates = []
    for f in shm.glob(prefix + "*"):
        try:
            st = f.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == os.getuid() and since <= st.st_mtime <= now - min_age_s:
            candidates.append(f)
    if not candidates:
        return []
    mapped = _mapped_files(shm)
    return sorted(f for f in candidates if str(f) not in mapped)
