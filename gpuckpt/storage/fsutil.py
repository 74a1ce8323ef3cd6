"""File-system primitives for durable, atomic publication (Linux first, POSIX fallback)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import socket
from pathlib import Path

__all__ = [
    "exchange",
    "fsync_dir",
    "preallocate",
    "start_writeback",
    "pid_alive",
    "rename_noreplace",
    "rmtree_quiet",
    "syncfs",
    "tmp_owner",
]

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
except OSError:
    _libc = None


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(2); False when the call or the flag is unsupported here."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), ctypes.c_uint(flags))
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``, failing with ``FileExistsError`` if ``dst`` exists."""
    if _renameat2(src, dst, _RENAME_NOREPLACE):
        return
    # Fallback: a directory rename fails on a non-empty target, and we refuse
    # an existing one first; the window between the two is the fallback's limit.
    if dst.exists() or dst.is_symlink():
        raise FileExistsError(errno.EEXIST, "target exists", os.fspath(dst))
    os.rename(src, dst)


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the system cannot."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing ``fd``'s dirty pages now, without waiting (Linux).

    Writeback of earlier chunks then overlaps the writing of later ones, and
    the durability barrier at the end has less left to do. A no-op elsewhere.
    """
    fn = getattr(_libc, "sync_file_range", None)
    if fn is not None:
        fn(fd, ctypes.c_int64(0), ctypes.c_int64(0), ctypes.c_uint(_SYNC_FILE_RANGE_WRITE))


_FALLOC_FL_KEEP_SIZE = 1


def preallocate(fd: int, nbytes: int) -> None:
    """Reserve ``nbytes`` of space for ``fd`` from offset 0 in as few extents as the file
    system can (Linux ``fallocate`` with ``FALLOC_FL_KEEP_SIZE``: the size stays as written).

    A hint: where the call or the mode is unsupported, or space is short (the
    write that follows reports that), nothing happens.
    """
    fn = getattr(_libc, "fallocate", None)
    if fn is not None:
        fn(fd, ctypes.c_int(_FALLOC_FL_KEEP_SIZE), ctypes.c_int64(0), ctypes.c_int64(nbytes))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def syncfs(path: Path) -> bool:
    """Flush the whole file system holding ``path``; False where syncfs(2) is missing."""
    fn = getattr(_libc, "syncfs", None)
    if fn is None:
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if fn(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs failed: {os.strerror(err)}", os.fspath(path))
    finally:
        os.close(fd)
    return True


def tmp_owner() -> str:
    """Tag naming this process in temporary names: host and pid."""
    return f"{socket.gethostname().replace('-', '_').replace('.', '_')}-{os.getpid()}"


def pid_alive(host: str, pid: int) -> bool:
    """Whether a process that left a temporary may still be running (unknown hosts: assume yes)."""
    if host != socket.gethostname().replace("-", "_").replace(".", "_"):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def rmtree_quiet(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
