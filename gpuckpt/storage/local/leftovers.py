"""What saves leave beside a checkpoint: temporaries, set-aside copies, and whose they are.

A save to ``DIR/NAME`` writes into ``DIR/.NAME.gpuckpt-tmp-HOST-PID-RAND``
(:data:`TMP_TAG`); an overwrite on a file system without ``RENAME_EXCHANGE``
moves the old checkpoint to ``DIR/.NAME.gpuckpt-old-HOST-PID-RAND``
(:data:`OLD_TAG`) before the new one takes its place. A ``NAME`` too long
for that to fit in a file name (255 bytes on most file systems: any name
over 145 bytes or so) stands in these names as its first bytes, ``~`` and a
hash of all of it (:func:`side_prefix`), so that every legal name can be
saved to; such a set-aside copy is put back by the next save to ``NAME``
(which knows the name), not by :func:`cleanup_directory`.

Whose are dead: a writer holds an exclusive ``flock`` on its temporary
directory from the moment it creates it until the save is published or
aborted (and on a checkpoint it sets aside until it is done with it), and
RAND is ``k``, the kernel's boot tag (:func:`~gpuckpt.storage.local.fsutil.boot_tag`)
and eight random hex digits. One made on this kernel (the same boot tag,
whatever the host name or pid namespace: containers share the kernel) is dead
exactly when its lock is free, so a writer that was PID 1 of a container is
recognised too, and a live one never is. Those of other kernels (another
machine on a shared file system), of older gpuckpt versions (RAND of eight hex
digits, no lock) and on file systems without locks fall back to the pid in
the name: dead when HOST is this host and no process has PID.

What may be deleted: a dead writer's temporary. A set-aside copy is the last
complete copy of the checkpoint while ``NAME`` has none: it is put back
there, and deleted only once ``NAME`` holds a checkpoint again. What counts as
a checkpoint, for this and for ``overwrite=True``, is the identity test of
:func:`gpuckpt.read_metadata` (:func:`~gpuckpt.format.documents.root_document_problem`):
another program's Zarr store is never one.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from pathlib import Path

from gpuckpt.errors import InvalidPathError
from gpuckpt.format.documents import ROOT_DOCUMENT_PREFIX, ROOT_KEY, root_document_problem
from gpuckpt.storage.local import fsutil
from gpuckpt.storage.local.fileio import read_exact_at
from gpuckpt.storage.local.fsutil import side_prefix
from gpuckpt.storage.local.shared_dir import JOURNAL, restore

__all__ = [
    "OLD_TAG",
    "TMP_TAG",
    "cleanup_directory",
    "cleanup_stale_temporaries",
    "is_committed",
    "refuse_inside_a_checkpoint",
    "new_owner",
    "replace_problem",
    "set_aside_copies",
    "side_prefix",
]

TMP_TAG = ".gpuckpt-tmp-"
OLD_TAG = ".gpuckpt-old-"
#: the RAND of a locked temporary's name: k, the boot tag, eight random hex digits
_LOCKED_RAND = re.compile(r"k([0-9a-f]{8})[0-9a-f]{8}")
_MAX_ROOT_BYTES = 1 << 31


def _root_problem(path: Path) -> str | None:
    """Why the directory ``path`` is not a gpuckpt checkpoint; None when it is one (damaged or not).

    Reads the first bytes of its root ``zarr.json`` (the whole document only when
    they are not the ones gpuckpt writes), without following a symlink or
    blocking on a FIFO.
    """
    try:
        fd = os.open(path / ROOT_KEY, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return f"it has no {ROOT_KEY}"
    except OSError as exc:
        return f"its {ROOT_KEY} cannot be opened ({exc.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"its {ROOT_KEY} is not a regular file"
        head = os.pread(fd, len(ROOT_DOCUMENT_PREFIX), 0)
        if head == ROOT_DOCUMENT_PREFIX:
            return None
        if st.st_size > _MAX_ROOT_BYTES:
            return f"its {ROOT_KEY} is {st.st_size} bytes, more than any gpuckpt root document"
        buf = bytearray(st.st_size)
        n = read_exact_at(fd, buf, 0)
        return root_document_problem(bytes(buf[:n]))
    except OSError as exc:
        return f"its {ROOT_KEY} cannot be read ({exc.strerror})"
    finally:
        os.close(fd)


def is_committed(path: Path) -> bool:
    """True when ``path`` holds a published gpuckpt checkpoint: its root document exists and
    says so (the identity test of :func:`gpuckpt.read_metadata`; a Zarr store of another
    program is not one)."""
    return path.is_dir() and not path.is_symlink() and _root_problem(path) is None


def refuse_inside_a_checkpoint(path: Path) -> None:
    """Refuse ``path`` when it lies inside a published checkpoint (at any depth): a checkpoint or a
    manager's root there would be deleted, unasked, with the outer checkpoint when that one is
    replaced (``overwrite=True``) or deleted (a manager's retention, a removal)."""
    for parent in Path(os.path.abspath(path)).parents:
        if os.path.lexists(parent / ROOT_KEY) and is_committed(parent):
            raise InvalidPathError(
                f"{path} is inside the gpuckpt checkpoint {parent}: replacing or deleting that "
                "checkpoint (overwrite=True, a manager's retention) would delete what is saved here "
                "too; nothing was written. Save beside it instead (a sibling directory)"
            )


def replace_problem(path: Path) -> str | None:
    """Why an existing ``path`` may not be replaced by a save; None for a checkpoint or an empty directory."""
    if path.is_symlink():
        return "it is a symbolic link"
    if not path.is_dir():
        return "it is not a directory"
    problem = _root_problem(path)
    if problem is None:
        return None
    try:
        with os.scandir(path) as it:
            empty = next(it, None) is None
    except OSError:
        empty = False
    return None if empty else problem


def new_owner() -> str:
    """``HOST-PID-RAND`` of a new temporary: RAND is ``k``, the boot tag and random digits where
    the boot tag is known (the writer then holds the temporary's lock while it lives)."""
    boot = fsutil.boot_tag()
    rand = secrets.token_hex(4)
    return f"{fsutil.tmp_owner()}-{'k' + boot + rand if boot else rand}"


def _abandoned(path: Path, owner: str) -> tuple[bool, int | None]:
    """Whether the writer of the temporary ``path`` (named for ``owner``, ``HOST-PID-RAND``) is gone,
    and the fd holding its lock (to keep while it is removed or put back), if it has one."""
    host_pid, _, rand = owner.rpartition("-")
    host, _, pid = host_pid.rpartition("-")
    locked = _LOCKED_RAND.fullmatch(rand)
    if locked is not None and locked.group(1) == fsutil.boot_tag():
        try:
            fd = fsutil.lock_dir(path)
        except OSError as exc:
            if not fsutil.lock_unsupported(exc):
                return False, None  # gone, a symlink, not a directory: nothing of ours
        else:
            if fd is None:
                return False, None  # its writer holds the lock: alive
            if fsutil.same_file(fd, path):
                return True, fd
            fsutil.unlock(fd)
            return False, None
    # another kernel's temporary, an older version's (no lock), or no locks here: the pid tells
    return pid.isdigit() and not fsutil.pid_alive(host, int(pid)), None


def set_aside_copies(path: Path) -> list[Path]:
    """Complete checkpoints that an interrupted overwrite of ``path`` left aside
    (``.NAME.gpuckpt-old-...``), in name order."""
    prefix = side_prefix(path.name, OLD_TAG)
    try:
        with os.scandir(path.parent) as it:
            names = sorted(e.name for e in it if e.name.startswith(prefix))
    except OSError:
        return []
    return [path.parent / n for n in names if is_committed(path.parent / n)]


def _settle_set_aside(path: Path, old: Path) -> bool:
    """For a dead writer's set-aside copy ``old`` of ``path``: put it back if ``path`` has no
    checkpoint; returns whether it may be deleted (``path`` holds a checkpoint again, or
    ``old`` is an empty directory). Never deletes the last complete copy. A set-aside
    directory with a journal is a publication into a shared directory that died: it is
    settled by :func:`gpuckpt.storage.local.shared_dir.restore`, holding ``path``'s lock."""
    if os.path.lexists(old / JOURNAL):
        return _restore_locked(path, old)
    if is_committed(path):
        return True
    if not is_committed(old):
        return replace_problem(old) is None  # an empty directory was set aside
    if os.path.lexists(path):
        return False  # something else is there now: keep the copy, and do not touch that
    try:
        fsutil.rename_noreplace(old, path)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False  # another save published meanwhile; a later cleanup deletes the copy
        raise
    fsutil.fsync_dir(path.parent)
    return False


def _restore_locked(path: Path, old: Path) -> bool:
    try:
        held = fsutil.lock_dir(path, wait=True)
    except OSError as exc:
        if not fsutil.lock_unsupported(exc):
            return False  # the directory is gone or not one: the copy is kept
        held = None
    try:
        return restore(path, old)
    finally:
        if held is not None:
            fsutil.unlock(held)


def cleanup_stale_temporaries(path: Path) -> list[Path]:
    """Remove what dead saves (and conversions) to ``path`` left; returns what was removed.

    Temporaries of dead writers are deleted (directories of saves and Hugging Face exports,
    files of safetensors and torch.save conversions). A checkpoint that a dead writer's
    interrupted overwrite set aside is put back at ``path`` when ``path`` has
    no checkpoint, and deleted only once it does. A live writer's temporaries
    are never touched (see the module docstring).
    """
    removed: list[Path] = []
    parent, name = path.parent, path.name
    try:
        with os.scandir(parent) as it:
            found = sorted(
                (e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False)) for e in it
            )
    except (FileNotFoundError, NotADirectoryError):
        return removed
    entries = [entry for entry, is_dir, _ in found if is_dir]
    # a conversion's temporary file (a safetensors or torch.save file being written)
    for entry in (entry for entry, _, is_file in found if is_file):
        prefix = side_prefix(name, TMP_TAG)
        if entry.startswith(prefix):
            dead, fd = _abandoned(parent / entry, entry[len(prefix) :])
            if fd is not None:
                fsutil.unlock(fd)
            if dead:
                (parent / entry).unlink(missing_ok=True)
                removed.append(parent / entry)
    for entry in entries:
        for tag in (TMP_TAG, OLD_TAG):
            prefix = side_prefix(name, tag)
            if not entry.startswith(prefix):
                continue
            where = parent / entry
            dead, fd = _abandoned(where, entry[len(prefix) :])
            try:
                if dead and (tag == TMP_TAG or _settle_set_aside(path, where)):
                    fsutil.rmtree_quiet(where)
                    removed.append(where)
            finally:
                if fd is not None:
                    fsutil.unlock(fd)
    return removed


def cleanup_directory(directory: Path) -> list[Path]:
    """:func:`cleanup_stale_temporaries` for every checkpoint of ``directory`` that has leftovers there."""
    try:
        with os.scandir(directory) as it:
            hidden = sorted(e.name for e in it if e.name.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return []
    # a shortened stem (see side_prefix) is not a name: its leftovers are the next save's to settle
    names = {
        stem
        for entry in hidden
        for tag in (TMP_TAG, OLD_TAG)
        if tag in entry and side_prefix(stem := entry[1:].split(tag, 1)[0], tag) == f".{stem}{tag}"
    }
    removed: list[Path] = []
    for name in sorted(names):
        removed.extend(cleanup_stale_temporaries(directory / name))
    return removed
