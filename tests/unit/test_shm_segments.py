"""gpuckpt.testing.shm: which shared-memory segments a killed MPI job left behind."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from gpuckpt.testing.shm import orphaned_segments


def _segment(shm: Path, name: str, age_s: float) -> Path:
    f = shm / name
    f.write_bytes(b"\0" * 4096)
    then = time.time() - age_s
    os.utime(f, (then, then))
    return f


def test_an_unmapped_segment_made_during_the_run_is_orphaned(tmp_path: Path) -> None:
    start = time.time() - 60
    old = _segment(tmp_path, "mpich_shm_old_0", 30)
    _segment(tmp_path, "mpich_shm_young_0", 0)  # a job may have just made it
    _segment(tmp_path, "mpich_shm_before_0", 120)  # before the run: not ours to remove
    _segment(tmp_path, "other_30", 30)  # not MPICH's
    assert orphaned_segments(start, shm=tmp_path) == [old]


def test_a_segment_a_live_process_maps_is_not_orphaned(tmp_path: Path) -> None:
    start = time.time() - 60
    used = _segment(tmp_path, "mpich_shm_used_0", 30)
    free = _segment(tmp_path, "mpich_shm_free_0", 30)
    with open(used, "r+b") as f, mmap.mmap(f.fileno(), 4096) as m:
        m[0] = 1
        os.utime(used, (time.time() - 30, time.time() - 30))
        assert orphaned_segments(start, shm=tmp_path) == [free]
    assert orphaned_segments(start, shm=tmp_path) == [free, used]
