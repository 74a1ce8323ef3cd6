"""File-system primitives for durable, atomic publication (Linux first, POSIX fallback)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import hashlib
import mmap
import os
import shutil
import socket
import stat
from pathlib import Path
from typing import Any

from gpuckpt.storage.base import NotRegularFileError
from gpuckpt.storage.local import batchio

__all__ = [
    "boot_tag",
    "exchange",
    "first_page_cached",
    "fsync_dir",
    "lock_dir",
    "preallocate",
    "start_writeback",
    "pid_alive",
    "rename_noreplace",
    "lock_unsupported",
    "move_directory",
    "open_regular",
    "overwritable",
    "rmtree_quiet",
    "same_file",
    "syncfs",
    "failure_hint",
    "side_prefix",
    "tmp_owner",
    "unlock",
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


#: ``statfs`` magic numbers of file systems that keep every file in memory (linux/magic.h)
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def memory_backed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` lies on a file system that keeps its files in memory (tmpfs, ramfs):
    every read is a copy out of memory, never a disk's. False where that cannot be told."""
    fn = getattr(_libc, "statfs", None)
    if fn is None:
        return False
    buf = ctypes.create_string_buffer(512)  # struct statfs, its first field f_type (a long)
    if fn(os.fsencode(path), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF in _MEMORY_FS


def first_page_cached(fd: int) -> bool | None:
    """Whether the first page of the file ``fd`` is in the page cache; None where that cannot be
    told (an empty file, no ``mincore``). A shared mapping and ``mincore(2)``: it reads nothing
    and starts no readahead, unlike a non-blocking read (``preadv2(RWF_NOWAIT)`` starts the
    readahead of the pages it finds missing, and returns them when that I/O is quick)."""
    calls = _mincore_calls()
    if calls is None or os.fstat(fd).st_size == 0:
        return None
    map_, unmap, mincore = calls
    addr = map_(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        vec = ctypes.c_ubyte(0)
        if mincore(addr, mmap.PAGESIZE, ctypes.byref(vec)) != 0:
            return None
        return bool(vec.value & 1)
    finally:
        unmap(addr, mmap.PAGESIZE)


@functools.cache
def _mincore_calls() -> tuple[Any, Any, Any] | None:
    """libc's ``mmap``, ``munmap`` and ``mincore`` with their signatures, or None where missing."""
    if _libc is None or not all(hasattr(_libc, n) for n in ("mmap", "munmap", "mincore")):
        return None
    map_, unmap, mincore = _libc.mmap, _libc.munmap, _libc.mincore
    map_.restype = ctypes.c_void_p
    int_ = ctypes.c_int
    map_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, int_, int_, int_, ctypes.c_long]
    unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return map_, unmap, mincore


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


#: the longest file name made here (NAME_MAX of Linux file systems), and the most an owner
#: (HOST-PID-RAND: a 64-byte host name, a 7-digit pid, 17 bytes of RAND) adds to a prefix
_NAME_MAX = 255
_OWNER_MAX = 64 + 1 + 7 + 1 + 17


def side_prefix(name: str, tag: str) -> str:
    """The start of the names of ``NAME``'s temporaries or set-aside copies (``tag``: see
    :mod:`gpuckpt.storage.local.leftovers`): ``.NAME`` and the tag, or where that and an owner could exceed
    a file name's 255 bytes, ``.`` and as many of NAME's first bytes as fit, ``~``, 12 hex
    digits of a hash of the whole name, and the tag (the same for the same name, on every
    machine)."""
    full = f".{name}{tag}"
    budget = _NAME_MAX - _OWNER_MAX
    if len(os.fsencode(full)) <= budget:
        return full
    digest = hashlib.blake2b(os.fsencode(name), digest_size=6).hexdigest()
    keep = budget - len(f".~{digest}{tag}")
    head = os.fsencode(name)[:keep].decode("utf-8", "ignore") if keep > 0 else ""
    while len(os.fsencode(head)) > keep:  # a name that is not UTF-8 (surrogate escapes)
        head = head[:-1]
    return f".{head}~{digest}{tag}"


def _name_max(directory: str) -> int:
    try:
        return int(os.pathconf(directory or ".", "PC_NAME_MAX"))
    except (OSError, ValueError):
        return _NAME_MAX


def _not_a_directory(path: str) -> str | None:
    """The first component of ``path`` that exists and is not a directory, if any."""
    parts = Path(path).parts
    for i in range(1, len(parts) + 1):
        at = Path(*parts[:i])
        try:
            if not at.is_dir():
                return str(at) if at.exists() or at.is_symlink() else None
        except OSError:
            return None
    return None


def failure_errno(exc: OSError) -> tuple[int, str]:
    """The errno and its text that a save reports for ``exc``: ``os.makedirs`` reports a file
    among a path's parents as EEXIST, which is told as ENOTDIR, as ``open`` and ``mkdir`` tell it."""
    name = os.fspath(exc.filename) if isinstance(exc.filename, (str, os.PathLike)) else ""
    if exc.errno == errno.EEXIST and name and _not_a_directory(name) is not None:
        return errno.ENOTDIR, os.strerror(errno.ENOTDIR)
    code = exc.errno or errno.EIO
    return code, exc.strerror or str(exc)


def _out_of_inodes(name: str) -> bool:
    """Whether the file system of ``name`` (its nearest existing parent) has no free inodes
    (never for a URL: no local file system answers for it)."""
    if "://" in name:
        return False
    where = os.path.abspath(name)
    while where and not os.path.exists(where):
        parent = os.path.dirname(where)
        if parent == where:
            return False
        where = parent
    try:
        st = os.statvfs(where)
    except OSError:
        return False
    return st.f_files > 0 and st.f_favail == 0


def failure_hint(exc: OSError, near: str | os.PathLike[str] | None = None) -> str:
    """What to do about the failed system call ``exc`` of a save: a remedy that fits its errno
    (and, where it says which, the name at fault; else ``near``, a path on the same file system,
    for what only the file system tells: whether its inodes ran out, asked before the save's
    temporaries are removed), for the end of an error message."""
    e, name = exc.errno, os.fspath(exc.filename) if isinstance(exc.filename, (str, os.PathLike)) else ""
    if e == errno.ENAMETOOLONG and name:
        limit = _name_max(name.rstrip("/").rpartition("/")[0])
        longest = max((c for c in name.split("/")), key=lambda c: len(os.fsencode(c)))
        n = len(os.fsencode(longest))
        if n > limit:
            return (
                f"the name {longest!r} is {n} bytes, {n - limit} more than the {limit} this file system "
                "allows: save under a shorter name"
            )
        size = len(os.fsencode(name))
        return f"the path is {size} bytes, more than the system allows: save under a shorter path"
    if e in (errno.ENOSPC, errno.EDQUOT):
        on = name or (os.fspath(near) if near is not None else "")
        if e == errno.ENOSPC and on and _out_of_inodes(on):
            return (
                "the file system has no free inodes left (`df -i`), whatever space it has: remove "
                "files there (or save fewer, larger chunks: a larger chunk_bytes), then save again"
            )
        return "free space on the device (or raise the quota), then save again"
    if e in (errno.EEXIST, errno.ENOTDIR):
        where = _not_a_directory(name) if name else None
        if where is not None:
            return f"{where} is a file, not a directory: save under a path whose parents are directories"
        return "a file stands where a directory is needed: save under another path"
    if e in (errno.EMFILE, errno.ENFILE):
        return (
            "this process has too many files open: raise the limit (`ulimit -n`), or save with fewer "
            'threads (with sync="file" each file stays open until it is synced: sync="auto" keeps '
            "fewer open), then save again"
        )
    if e in (errno.EACCES, errno.EPERM):
        return f"permission denied{f' on {name}' if name else ''}: save where this process may write"
    if e == errno.EROFS:
        return "the file system is mounted read-only: save elsewhere"
    if e == errno.EIO:
        return "the device reported an I/O error: check it (the kernel log), then save again"
    return "fix the cause, then save again"


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


@functools.cache
def boot_tag() -> str:
    """Eight hex digits of this kernel's boot id, shared by every container on the machine
    ("" where unknown). Two processes with the same tag see each other's ``flock`` s on any
    file system, whatever their host names and pid namespaces."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            tag = f.read().strip().replace("-", "")[:8].lower()
    except OSError:
        return ""
    return tag if len(tag) == 8 and all(c in "0123456789abcdef" for c in tag) else ""


_LOCK_UNSUPPORTED = frozenset((errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS))
_HELD: set[int] = set()  # fds of the locks this process holds (see _forget_locks)


def lock_dir(path: Path, *, wait: bool = False) -> int | None:
    """An fd of the directory ``path`` holding an exclusive ``flock`` on it, or None when
    another open file description holds one (``wait=False``). Release it with :func:`unlock`.

    The lock belongs to the directory itself, so it follows the directory through
    renames, and it is released when the process dies, however it dies (a child
    forked meanwhile does not inherit it). Raises ``OSError``: ``ENOTDIR``/``ELOOP``
    for a non-directory or a symlink, ``ENOENT`` when it is gone, and where the file
    system has no locks an error for which :func:`lock_unsupported` is true.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    _HELD.add(fd)
    return fd


def unlock(fd: int) -> None:
    """Release a lock taken by :func:`lock_dir`."""
    _HELD.discard(fd)
    with contextlib.suppress(OSError):  # the lock goes with the descriptor all the same
        os.close(fd)


def _forget_locks() -> None:
    # A forked child shares the parent's open file descriptions, and with them its
    # locks: without this, a long-lived child (a data-loader worker forked during a
    # save) would keep a dead parent's temporary "alive" and its checkpoint locked.
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks)


def lock_unsupported(exc: OSError) -> bool:
    """Whether ``exc`` from :func:`lock_dir` means "this file system has no locks"."""
    return exc.errno in _LOCK_UNSUPPORTED


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` (not followed if a symlink) is still the file open as ``fd``."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def overwritable(fd: int) -> bool:
    """Whether the file open as ``fd`` may be written over in place: a regular file of one name
    (a hard link's other name, a copy kept with ``cp -al``, keeps its bytes only if it is not)."""
    st = os.fstat(fd)
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def move_directory(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst`` (a free name) only if ``src`` is itself a directory: never a
    symbolic link to one (whose target's files a caller would then take and overwrite) nor
    anything else. False where it is not, is gone, or the rename fails; a link put in its
    place between the check and the rename is moved back."""
    try:
        before = os.lstat(src)
    except OSError:
        return False
    if not stat.S_ISDIR(before.st_mode):
        return False
    try:
        os.rename(src, dst)
    except OSError:
        return False
    after = os.lstat(dst)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISDIR(after.st_mode):
        with contextlib.suppress(OSError):
            os.rename(dst, src)
        return False
    return True


def native_tree_bytes(path: str | os.PathLike[str]) -> int | None:
    """The bytes of the regular files below the directory ``path``, links not followed, counted
    natively (:meth:`~gpuckpt.storage.local.batchio.BatchIO.tree_bytes`, the GIL released);
    None where the library is not built, or ``path`` is no directory it can open."""
    lib = batchio.instance_or_none()
    if lib is None:
        return None
    try:
        return lib.tree_bytes(path)[1]
    except OSError:
        return None


def rmtree_quiet(path: Path) -> None:
    """Remove the directory ``path`` and what it holds, links not followed, errors ignored (what
    cannot be removed stays): natively where the library is built
    (:meth:`~gpuckpt.storage.local.batchio.BatchIO.remove_tree`: a part of 10,000 small
    tensors went in 0.27 s rather than 0.36 s), else, and after a native failure, with
    ``shutil.rmtree``."""
    lib = batchio.instance()
    if lib is not None:
        try:
            lib.remove_tree(path)
            return
        except OSError:
            pass
    shutil.rmtree(path, ignore_errors=True)


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str) -> int:
    """Open a file of a checkpoint for reading, or raise :class:`NotRegularFileError`.

    ``O_NONBLOCK``: a FIFO or device planted in a checkpoint cannot block the
    open (it is not even opened when ``lstat`` already shows what it is);
    ``O_NOFOLLOW``: a symlink is not followed; ``fstat`` then checks that what
    was opened is a regular file (it may have been replaced since the ``lstat``).
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(path, st.st_mode)
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # replaced by a symlink since the lstat
            raise NotRegularFileError(path, stat.S_IFLNK) from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFileError(path, st.st_mode)
    return fd
