"""Helpers shared by every runner: states, fingerprints, memory, durability, cache dropping.

This module needs only NumPy and the standard library (it runs in the peer
environment too, where gpuckpt is not installed), and keeps to syntax that
Python 3.11 accepts.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import math
import mmap
import os
import platform
import resource
import secrets
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "OP_SETTLE_S",
    "STATE_KINDS",
    "build_state",
    "cut_from",
    "drop_cache",
    "emit",
    "fingerprint",
    "fsync_tree",
    "peak_rss",
    "prefault",
    "reset_peak",
    "resident_fraction",
    "warm_cache",
    "rss",
    "state_bytes",
    "tree_files",
]

STATE_KINDS = ("gpt", "gpt-adam", "small", "tiny")
_BLOCK = 4 << 20  # elements of the random block every tensor is cut from (16 MiB of float32)

# Toy sizes for --quick, full sizes otherwise; the GPT shapes are those of
# gpuckpt.testing.states.gpt_state_dict (about 1.25 GiB of float32 weights).
GPT_FULL = {"vocab": 32000, "width": 1024, "layers": 24, "mlp": 4096}
GPT_QUICK = {"vocab": 512, "width": 64, "layers": 2, "mlp": 256}
SMALL_FULL = 10_000
SMALL_QUICK = 200
TINY = 20  # the "tiny" state: a unit test's or a small model's whole checkpoint


def _gpt_shapes(vocab: int, width: int, layers: int, mlp: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed.weight", (vocab, width))]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.attn.{n}", (width, width)) for n in ("q", "k", "v", "o")]
        shapes += [
            (f"{p}.mlp.up", (width, mlp)),
            (f"{p}.mlp.down", (mlp, width)),
            (f"{p}.mlp.up_bias", (mlp,)),
        ]
        shapes += [(f"{p}.{n}.{w}", (width,)) for n in ("norm1", "norm2") for w in ("weight", "bias")]
    return shapes


def build_state(
    kind: str, *, quick: bool = False, seed: int = 0, max_bytes: float | None = None
) -> dict[str, np.ndarray]:
    """The benchmark state as a flat ``{fqn: float32 array}``; the same bytes for the same arguments.

    ``gpt``: the GPT-like weights; ``gpt-adam``: the same plus two Adam moments
    per weight (3x); ``small``: 10,000 tensors of 4-64 KiB (200 with ``quick``);
    ``tiny``: 20 tensors of 4-64 KiB (the same with ``quick``).
    Every tensor is cut from one seeded block of normal values at a
    per-tensor offset: no random draw per tensor. ``max_bytes``: only the first tensors (in
    order) up to that many bytes, each the same bytes as in the whole state, or, where the
    first alone is larger, its first rows up to that size (at least one); the others are
    never made (a toy run of a benchmark then touches no more memory than it
    uses: on a VM that hands freed memory back to its host, first touches cost 0.3 GB/s).
    """
    rng = np.random.default_rng(seed)
    block = (rng.standard_normal(_BLOCK, dtype=np.float32) * np.float32(0.02)).astype(np.float32)
    if kind in ("gpt", "gpt-adam"):
        shapes = _gpt_shapes(**(GPT_QUICK if quick else GPT_FULL))
        if kind == "gpt-adam":
            shapes += [(f"optim.{n}.{m}", s) for n, s in list(shapes) for m in ("exp_avg", "exp_avg_sq")]
    elif kind in ("small", "tiny"):
        count = TINY if kind == "tiny" else SMALL_QUICK if quick else SMALL_FULL
        sizes = rng.integers(1024, 16 * 1024 + 1, size=count)
        shapes = [(f"t{i:05d}", (int(n),)) for i, n in enumerate(sizes)]
    else:
        raise ValueError(f"unknown state kind {kind!r}; expected one of {STATE_KINDS}")
    offsets = rng.integers(0, _BLOCK, size=len(shapes))
    out: dict[str, np.ndarray] = {}
    total = 0
    for (name, shape), off in zip(shapes, offsets, strict=True):
        nbytes = 4 * math.prod(shape)
        if max_bytes is not None and total + nbytes > max_bytes:
            if not out:  # the first tensor alone is larger: its first rows (the same bytes)
                rows = max(1, int(max_bytes // (nbytes // shape[0])))
                out[name] = cut_from(block, (rows, *shape[1:]), int(off))
            break
        out[name] = cut_from(block, shape, int(off))
        total += nbytes
    return out


def cut_from(block: np.ndarray, shape: tuple[int, ...], offset: int) -> np.ndarray:
    """A new float32 array of ``shape`` filled with ``block`` read from ``offset`` on, wrapping
    around: random bytes without a random draw per tensor."""
    a = np.empty(shape, np.float32)
    flat = a.reshape(-1)
    pos, start = 0, offset
    while pos < flat.size:
        k = min(flat.size - pos, block.size - start)
        flat[pos : pos + k] = block[start : start + k]
        pos, start = pos + k, 0
    return a


def state_bytes(state: Mapping[str, Any]) -> int:
    """Total bytes of the arrays of ``state``."""
    return sum(int(a.nbytes) for a in state.values())


def fingerprint(arrays: Mapping[str, Any]) -> str:
    """A digest of every byte of every array (wrapping 64-bit sum and xor per tensor, in key order).

    Reading every byte is the point: it proves a load really delivered the
    data, and is computed outside the timed region.
    """
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        raw = a.reshape(-1).view(np.uint8)
        if raw.size % 8 == 0 and raw.size:
            w = raw.view(np.uint64)
            s, x = int(w.sum(dtype=np.uint64)), int(np.bitwise_xor.reduce(w))
        else:
            s, x = int(raw.sum(dtype=np.uint64)), int(np.bitwise_xor.reduce(raw)) if raw.size else 0
        h.update(f"{name}:{a.dtype.str}:{a.shape}:{s}:{x};".encode())
    return h.hexdigest()[:32]


def prefault(arrays: Iterable[np.ndarray]) -> None:
    """Touch every page of ``arrays`` (a model already in memory is not a fresh allocation)."""
    for a in arrays:
        a.reshape(-1).view(np.uint8)[:] = 0


def rss() -> int:
    """Resident set size of this process, bytes."""
    return _status_kb("VmRSS:") * 1024


def peak_rss() -> int:
    """Peak resident set size since the last :func:`reset_peak` (or the start), bytes."""
    kb = _status_kb("VmHWM:")
    if kb:
        return kb * 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak() -> None:
    """Reset the peak RSS to the current RSS (Linux: ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_files(path: str) -> list[str]:
    """Every regular file under ``path``."""
    out = []
    for root, _dirs, files in os.walk(path):
        out.extend(os.path.join(root, f) for f in files)
    return out


def fsync_tree(path: str) -> None:
    """fsync every file and directory under ``path`` and ``path``'s parent (for systems that do not)."""
    targets = [path] if os.path.isfile(path) else [*tree_files(path), *(r for r, _d, _f in os.walk(path))]
    for p in [*targets, os.path.dirname(os.path.abspath(path))]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache(path: str) -> float:
    """Evict ``path``'s files from the page cache; returns the fraction still resident after.

    ``os.sync()`` first (dirty pages cannot be dropped), then
    ``posix_fadvise(DONTNEED)`` on every file.
    """
    os.sync()
    files = [path] if os.path.isfile(path) else tree_files(path)
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_fraction(files)


def warm_cache(path: str) -> float:
    """Read every byte of ``path``'s files (untimed) so that they are in the page cache; returns
    the fraction that was resident before.

    A warm load means the data is in the page cache, whatever the save left
    there: a system that writes with ``O_DIRECT`` leaves none of it cached,
    one that writes through the cache leaves all of it (while memory lasts).
    """
    files = [path] if os.path.isfile(path) else tree_files(path)
    before = resident_fraction(files)
    buf = bytearray(8 << 20)
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)
    return before


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_pages(path: str) -> np.ndarray | None:
    """Which pages of ``path`` are in the page cache, one bool per page (``mincore`` on a shared
    mapping: it reads nothing and starts no readahead); None where that cannot be told."""
    size = os.path.getsize(path)
    if size == 0:
        return np.zeros(0, bool)
    npages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * npages)()
            if _libc.mincore(addr, size, vec) != 0:
                return None
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return (np.frombuffer(vec, np.uint8) & 1).astype(bool)


def resident_fraction(files: Iterable[str]) -> float:
    """Fraction of the pages of ``files`` that are in the page cache (``mincore``; NaN if unknown)."""
    total = resident = 0
    for p in files:
        pages = resident_pages(p)
        if pages is None:
            return float("nan")
        resident += int(pages.sum())
        total += pages.size
    return resident / total if total else 0.0


def find_mpiexec() -> str | None:
    """The mpiexec of the MPI that mpi4py was built for: ``GPUCKPT_MPIEXEC``, this venv, then PATH
    (where the ``mpich`` wheel puts it, next to the running Python)."""
    explicit = os.environ.get("GPUCKPT_MPIEXEC")
    if explicit:
        return explicit
    for folder in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidate = folder / "mpiexec"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("mpiexec")


def emit(record: Mapping[str, Any]) -> None:
    """Print one result record as a JSON line tagged for the driver."""
    sys.stdout.write("@@RESULT " + json.dumps(record, sort_keys=True) + "\n")
    sys.stdout.flush()


#: benchmark outputs with more files than this are set aside, not deleted, during a run
MANY_FILES = 1000


#: ... unless they hold more bytes than this (the disk must not fill up): the
#: small-tensor state's asynchronous runs leave four checkpoints of 0.4 GB with
#: 30,000 entries each in one tree, which must not be deleted during the state
MAX_ASIDE_BYTES = 2 << 30

#: ... or the file system has less free space than this
ASIDE_FREE_BYTES = 16 << 30


def _tree_stats(path: Path) -> tuple[int, int]:
    """Entries (files and directories) and bytes of the files below ``path``."""
    n = size = 0
    for root, dirs, files in os.walk(path):
        n += len(files) + len(dirs)
        size += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    return n, size


#: seconds after which freed inodes no longer slow down creations: ext4 without
#: a journal skips inodes freed in the last 60 s, or 360 s while their inode
#: table block is dirty (which new creations in the same block make it)
SETTLE_S = 361.0

#: seconds each measurement process waits, idle, right before every timed
#: operation. On this VM (virtio-balloon with free page reporting) memory that
#: has been free for about 2 s is handed back to the host, and touching it again
#: costs a host page fault per page: a 1 GiB ``np.ones`` took 0.13-0.20 s right
#: after 1 GiB was freed and 0.89-0.94 s 5 s later (2026-12-01 10:30 UTC), and
#: one ``gpuckpt.save`` of the GPT state 0.52-0.62 s (0.34-0.52 s of system CPU)
#: right after the previous save's files were deleted against 1.16-1.55 s
#: (1.80-1.93 s) 5 s later. A save writes into newly allocated page cache, so
#: its speed depends on when, and how, memory was freed before it: by the
#: previous process (which one: see ``driver.round_order``) and by its own
#: start-up (NumPy only ~0.9 s, torch ~3 s). After this wait every system meets
#: memory returned to the host, as a save in a long-running job does.
OP_SETTLE_S = 3.0


def set_aside(path: Path, trash: Path | None) -> None:
    """Remove a benchmark output without charging later measurements for it.

    Deleting tens of thousands of files makes later file creations slow for
    minutes on some file systems (ext4 without a journal checks, one by one,
    recently freed inodes before reusing one: here creating 30,000 files and
    directories took 1 s on a settled file system and 3-7 s in the minutes
    after deleting as many). A tree with more than :data:`MANY_FILES` entries
    and at most :data:`MAX_ASIDE_BYTES` is therefore moved into ``trash`` (one
    rename; unless less than :data:`ASIDE_FREE_BYTES` are free), to be deleted
    at the end of the state; other trees are deleted now
    (large states have few files per byte, and must not fill the disk). Either way the change is
    synced out before the next measurement starts.
    """
    entries, nbytes = _tree_stats(path) if trash is not None else (0, 0)
    room = shutil.disk_usage(path.parent).free >= ASIDE_FREE_BYTES if trash is not None else False
    if trash is not None and entries > MANY_FILES and nbytes <= MAX_ASIDE_BYTES and room:
        trash.mkdir(parents=True, exist_ok=True)
        os.rename(path, trash / f"{path.name}-{secrets.token_hex(4)}")
    else:
        shutil.rmtree(path, ignore_errors=True)
    os.sync()


def settle(trash: Path, settle_s: float = SETTLE_S) -> None:
    """Delete what :func:`set_aside` moved into ``trash``, sync, and wait ``settle_s``
    for the freed inodes to age out (see :data:`SETTLE_S`): a run starts with
    this, so that files deleted before it do not slow down its first state."""
    shutil.rmtree(trash, ignore_errors=True)
    os.sync()
    time.sleep(settle_s)


def machine_info(repo: Path) -> dict[str, Any]:
    """What a run of record says of its machine and code: CPUs and their model, memory, kernel,
    Python, NumPy and gpuckpt versions, and the commit of ``repo`` (marked when the tracked
    files differ from it)."""
    import gpuckpt

    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "gpuckpt": gpuckpt.__version__,
    }
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        info["cpu_model"] = next(
            (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?"
        )
    with contextlib.suppress(OSError, StopIteration), open("/proc/meminfo") as f:
        kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
        info["memory_gib"] = round(kb / 2**20, 1)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "-C", str(repo)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        info["git_commit"] = head.stdout.strip() + (
            " (with uncommitted changes)" if dirty.stdout.strip() else ""
        )
    return info
