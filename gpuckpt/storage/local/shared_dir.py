"""Publishing a checkpoint into a directory that holds files of others.

A save to a directory that exists and holds other files (a ``model.pt`` beside
it, a program that saves into a directory it made and filled) cannot be
published by one rename of the whole directory: that would replace the other
files too. Such a save publishes its own names into the directory instead,
one rename each, the root document last: until that last rename there is no
checkpoint there, after it a complete one. Nothing gpuckpt did not write is
touched: every name the new checkpoint needs is checked against what is there
first, and a clash is refused before anything moves.

What is gpuckpt's in such a directory (:func:`directory_entries`): the root
``zarr.json`` when it is a gpuckpt root document, and each subdirectory whose
``zarr.json`` is a gpuckpt array document (an array or a column of the chunk
table). Everything else is the directory's own.

An earlier checkpoint there (``overwrite=True``) is moved aside first, into a
locked set-aside directory beside the target (``.NAME.gpuckpt-old-...``,
:data:`~gpuckpt.storage.local.leftovers.OLD_TAG`), root document first, so that it
stops being a checkpoint before any of its arrays leaves; the new names come
in; then the new root document. Before anything moves, a journal (:data:`JOURNAL`,
fsynced in the set-aside directory) records the old and the new names, so a
save that dies at any point is undone by the next save to the same path
(:func:`restore`): if the new root document never arrived, the new names are
removed and the old ones put back, and the earlier checkpoint is whole again;
if it arrived, the set-aside copy is deleted. Concurrent saves into one
directory take turns on its lock.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path

from gpuckpt.errors import CheckpointExistsError
from gpuckpt.format import jsontext
from gpuckpt.format.documents import ROOT_DOCUMENT_PREFIX, ROOT_KEY, root_document_problem
from gpuckpt.storage.local import fsutil

__all__ = ["JOURNAL", "directory_entries", "publish_into", "restore"]

#: the journal of a publication into a shared directory, in its set-aside directory
JOURNAL = ".gpuckpt-publish.json"
#: the attribute that marks an array document as gpuckpt's (see gpuckpt.format.documents)
_ARRAY_MARK = b'"attributes":{"gpuckpt":'
_MAX_ARRAY_DOCUMENT = 1 << 20  # a gpuckpt array document is a few hundred bytes
_MAX_JOURNAL = 64 << 20  # a journal names a checkpoint's arrays: far less, even for 100,000 of them


def _head(path: Path, limit: int) -> bytes | None:
    """The first ``limit`` bytes of the regular file ``path`` (no symlink followed, never
    blocking), or None when it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.pread(fd, limit, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def _is_array(entry: os.DirEntry[str]) -> bool:
    """Whether ``entry`` is a directory holding a gpuckpt array document."""
    if not entry.is_dir(follow_symlinks=False):
        return False
    doc = _head(Path(entry.path, ROOT_KEY), _MAX_ARRAY_DOCUMENT)
    return doc is not None and _ARRAY_MARK in doc


def _is_root(path: Path) -> bool:
    head = _head(path, 1 << 20)
    if head is None:
        return False
    if head.startswith(ROOT_DOCUMENT_PREFIX):
        return True
    try:
        return root_document_problem(path.read_bytes()) is None
    except OSError:
        return False


def directory_entries(directory: Path) -> tuple[bool, list[str], list[str]]:
    """``(holds a gpuckpt root document, names of gpuckpt arrays, every other name)`` of the
    entries of ``directory``."""
    root, arrays, others = False, [], []
    with os.scandir(directory) as it:
        for e in it:
            if e.name == ROOT_KEY and _is_root(Path(e.path)):
                root = True
            elif e.name != ROOT_KEY and _is_array(e):
                arrays.append(e.name)
            else:
                others.append(e.name)
    return root, sorted(arrays), sorted(others)


def _durable(*dirs: Path) -> None:
    for d in dirs:
        fsutil.fsync_dir(d)


def publish_into(tmp: Path, target: Path, aside: Path) -> None:
    """Publish the complete, durable checkpoint ``tmp`` into the existing directory ``target``
    (see the module docstring), using ``aside``, a new empty set-aside directory this process
    holds the lock of; the caller holds ``target``'s lock and removes ``aside`` afterwards.

    Raises :class:`CheckpointExistsError` naming the clash when a name the checkpoint needs is
    taken by something that is not gpuckpt's; then nothing was moved."""
    new = sorted(n for n in os.listdir(tmp) if n != ROOT_KEY)
    root, arrays, others = directory_entries(target)
    clash = sorted({*new, ROOT_KEY} & set(others))
    if clash:
        raise CheckpointExistsError(
            f"{target} holds {len(clash)} name(s) that this checkpoint needs and that are not a "
            f"gpuckpt checkpoint's: {clash[:5]}; refusing to touch them, nothing was moved. Save to "
            "another directory, or move them away"
        )
    old = ([ROOT_KEY] if root else []) + arrays  # the root document first: it unpublishes
    journal = aside / JOURNAL
    with open(journal, "x") as f:
        json.dump({"target": target.name, "new": new, "old": old}, f)
        f.flush()
        os.fsync(f.fileno())
    _durable(aside)
    moved: list[str] = []
    try:
        for name in old:
            os.rename(target / name, aside / name)
        _durable(target, aside)
        for name in new:
            fsutil.rename_noreplace(tmp / name, target / name)
            moved.append(name)
        _durable(target)
        fsutil.rename_noreplace(tmp / ROOT_KEY, target / ROOT_KEY)
    except BaseException:
        _undo(target, aside, new, old, moved)
        raise
    _durable(target)


def _undo(target: Path, aside: Path, new: list[str], old: list[str], moved: list[str] | None) -> bool:
    """Take the new names out of ``target`` and put the old ones back from ``aside``: ``target`` is
    as it was before the publication began. ``moved``: the new names this process moved in (an
    error of its own); None after a crash, when each new name there is taken out only if it is
    a gpuckpt array (never what another program put there meanwhile).

    Each is taken out by one rename into ``aside`` before it is deleted there, so that a crash
    while undoing never leaves a half-deleted array in ``target`` (which no later undo could
    tell from another program's entry); the earlier root document goes back last, once every
    array of it is back and durable, so that ``target`` is never a checkpoint with arrays
    missing. Returns whether the earlier checkpoint is whole in ``target`` again (nothing of it
    left in ``aside``): where a name of it is taken by another entry, it stays aside, and so
    does its root document."""
    for name in new if moved is None else moved:
        if name in old and not os.path.lexists(aside / name):
            continue  # the earlier checkpoint's entry of that name never left: it is that one
        at = target / name
        if moved is not None or _is_array_path(at):
            _take_out(at, aside)
    arrays = [n for n in old if n != ROOT_KEY]
    for name in arrays:
        if os.path.lexists(aside / name) and not os.path.lexists(target / name):
            os.rename(aside / name, target / name)
    _durable(target, aside)
    if any(os.path.lexists(aside / n) for n in arrays):
        return False  # a name of it is taken: the copy aside is kept whole with its root document
    if ROOT_KEY in old and os.path.lexists(aside / ROOT_KEY) and not os.path.lexists(target / ROOT_KEY):
        os.rename(aside / ROOT_KEY, target / ROOT_KEY)
        _durable(target, aside)
    return not os.path.lexists(aside / ROOT_KEY)


def _take_out(path: Path, aside: Path) -> None:
    """Remove ``path`` (an entry of the target) by renaming it into ``aside`` first, under a new
    name no array has (an array's name never starts with ``.``), then deleting it there."""
    trash = aside / f".gpuckpt-undone-{secrets.token_hex(8)}"
    os.rename(path, trash)
    fsutil.rmtree_quiet(trash)


def _entry_names(value: object) -> list[str]:
    """The names of a journal's list: each one entry of a directory, as :func:`publish_into`
    records them (never a path: ``a/b``, ``..`` or an absolute name would reach beyond the
    target and its set-aside directory, wherever a journal planted there pointed)."""
    if not isinstance(value, list):
        raise TypeError("a journal's names are a list")
    for name in value:
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
            raise ValueError(f"{name!r} is not the name of one directory entry")
    return value


def _is_array_path(path: Path) -> bool:
    if path.is_symlink() or not path.is_dir():
        return False
    doc = _head(path / ROOT_KEY, _MAX_ARRAY_DOCUMENT)
    return doc is not None and _ARRAY_MARK in doc


def restore(target: Path, aside: Path) -> bool:
    """Settle what a dead publication into ``target`` left in ``aside`` (holding its journal);
    returns whether ``aside`` may now be deleted. If the new root document arrived (``target``
    holds a root document, and the earlier one, if there was one, is aside) the publication
    is complete; otherwise it is undone and the earlier checkpoint, if any, is whole in
    ``target`` again. The caller holds the locks of both."""
    journal = _head(aside / JOURNAL, _MAX_JOURNAL + 1)
    if journal is None or len(journal) > _MAX_JOURNAL:
        return False  # not a regular file of a journal's size: left alone
    try:
        info = jsontext.loads(journal)
        new, old = _entry_names(info["new"]), _entry_names(info["old"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return False  # not a journal this release wrote: left alone
    if info.get("target") != target.name:
        return False  # a journal of another directory: left alone
    if not target.is_dir() or target.is_symlink():
        return False  # the directory itself went away: the copy is kept
    here = (target / ROOT_KEY).exists()
    if here and (ROOT_KEY not in old or os.path.lexists(aside / ROOT_KEY)):
        return True  # published: what is aside is the earlier checkpoint, replaced
    # undone: the set-aside directory may go only once nothing of the earlier checkpoint is in it
    return _undo(target, aside, new, old, None)
