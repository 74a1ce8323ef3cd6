"""Raw file I/O baselines: the throughput ceiling gpuckpt is measured against.

* ``raw-files``: one file per tensor, plain ``os.write`` of the tensor's bytes, then ``fsync``
  of every file and of the directory; load with ``readinto`` into preallocated arrays.
* ``raw-single``: all tensors into one file, one ``fsync``; load with ``readinto``.

No checksums, no metadata, no atomic publication: what the hardware and the
kernel give for the same bytes. Used by ``bench/bench_host.py`` and
``gpuckpt bench``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gpuckpt.device.arrays import is_array
from gpuckpt.state import flatten_state_dict

__all__ = [
    "fsync_path",
    "raw_files_load",
    "raw_files_save",
    "raw_single_load",
    "raw_single_save",
    "tensors_of",
    "timed",
    "write_all",
]


def tensors_of(sd: dict[str, Any]) -> list[np.ndarray]:
    """The arrays of a state dict, in FQN order."""
    leaves, _ = flatten_state_dict(sd, is_array)
    return [v.value for v in leaves.values() if is_array(v.value)]


def fsync_path(p: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, mv: memoryview) -> None:
    """Write every byte of ``mv`` (``os.write`` may write less than asked)."""
    while mv.nbytes:
        n = os.write(fd, mv)
        mv = mv[n:]


def raw_files_save(arrays: list[np.ndarray], d: Path) -> None:
    """One file per array in the new directory ``d``, all fsynced."""
    d.mkdir()
    fds = []
    for i, a in enumerate(arrays):
        fd = os.open(d / f"{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_all(fd, memoryview(np.ascontiguousarray(a)).cast("B"))
        fds.append(fd)
    for fd in fds:
        os.fsync(fd)
        os.close(fd)
    fsync_path(d)
    fsync_path(d.parent)


def raw_files_load(arrays: list[np.ndarray], d: Path) -> None:
    """Read what :func:`raw_files_save` wrote into the preallocated C-contiguous ``arrays``."""
    for i, a in enumerate(arrays):
        with open(d / f"{i}.bin", "rb", buffering=0) as f:
            f.readinto(memoryview(a.reshape(-1).view(np.uint8)))


def raw_single_save(arrays: list[np.ndarray], d: Path) -> None:
    """All arrays, one after the other, in one fsynced file in the new directory ``d``."""
    d.mkdir()
    fd = os.open(d / "all.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for a in arrays:
        write_all(fd, memoryview(np.ascontiguousarray(a)).cast("B"))
    os.fsync(fd)
    os.close(fd)
    fsync_path(d)
    fsync_path(d.parent)


def raw_single_load(arrays: list[np.ndarray], d: Path) -> None:
    """Read what :func:`raw_single_save` wrote into the preallocated C-contiguous ``arrays``."""
    with open(d / "all.bin", "rb", buffering=0) as f:
        for a in arrays:
            f.readinto(memoryview(a.reshape(-1).view(np.uint8)))


def raw_single_load_parallel(
    arrays: list[np.ndarray], d: Path, *, threads: int = 8, piece: int = 64 << 20
) -> None:
    """As :func:`raw_single_load`, with ``threads`` threads reading ``piece``-byte ranges."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    offset = 0
    for a in arrays:
        mv = memoryview(a.reshape(-1).view(np.uint8))
        for start in range(0, len(mv), piece):
            jobs.append((mv[start : start + piece], offset + start))
        offset += len(mv)
    fd = os.open(d / "all.bin", os.O_RDONLY)
    try:

        def read(job: tuple[memoryview, int]) -> None:
            view, at = job
            while len(view):
                n = os.preadv(fd, [view], at)
                if n == 0:
                    raise EOFError(f"{d / 'all.bin'} ended early")
                view, at = view[n:], at + n

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, jobs))
    finally:
        os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
