"""A directory of checkpoints on a POSIX file system (the :class:`CheckpointRoot` of local paths).

A checkpoint is deleted by one rename out of sight (to a hidden name with
:data:`DEL_TAG`), made durable, before its files are removed; cleanup removes
such half-deleted directories and the temporaries of dead saves
(:mod:`gpuckpt.storage.local.leftovers`).
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from gpuckpt.errors import CheckpointWriteError, StoreError
from gpuckpt.storage.base import CheckpointRoot
from gpuckpt.storage.local import fsutil, leftovers, shared_dir

__all__ = ["DEL_TAG", "LocalRoot"]

DEL_TAG = ".gpuckpt-del-"


class LocalRoot(CheckpointRoot):
    """The directory ``path`` (created if needed) as a root of checkpoints."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).absolute()
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"checkpoint root {self.path} exists and is not a directory")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # read-only, full, a file among its parents, permissions: say so
            code, text = fsutil.failure_errno(exc)
            raise CheckpointWriteError(
                code, f"cannot create the checkpoint root {self.path}: {text} ({fsutil.failure_hint(exc)})"
            ) from exc

    def child(self, name: str) -> Path:
        return self.path / name

    def children(self) -> list[str]:
        try:
            entries = sorted(os.scandir(self.path), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        except OSError as exc:  # a file in its place, a lost mount, permissions: say what was listed
            raise StoreError(
                exc.errno or errno.EIO,
                f"cannot list the checkpoint root {self.path} ({exc.strerror or exc}): a manager lists "
                "it to find its steps; make it a readable directory again (a share that went away, a "
                "path replaced by a file), or open the manager on another root",
            ) from exc
        return [e.name for e in entries if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]

    def is_committed(self, name: str) -> bool:
        return leftovers.is_committed(self.path / name)

    def delete(self, names: Sequence[str]) -> None:
        for name in names:
            self._delete_one(name)
        if names:
            fsutil.fsync_dir(self.path)

    def foreign_entries(self, name: str) -> list[str]:
        try:
            return shared_dir.directory_entries(self.path / name)[2]
        except OSError:  # not there, or not a directory: nothing inside it
            return []

    def _delete_one(self, name: str) -> None:
        # rename first: the checkpoint disappears in one step, then the files go
        doomed = self.path / f".{name}{DEL_TAG}{secrets.token_hex(4)}"
        try:
            os.rename(self.path / name, doomed)
        except FileNotFoundError:
            return
        fsutil.rmtree_quiet(doomed)

    def cleanup(self, candidates: Sequence[str] | None = None) -> list[str]:
        # the leftovers here are hidden entries beside the children, found by one scan of the
        # directory: ``candidates`` need no look of their own
        removed = []
        for entry in os.scandir(self.path):
            if entry.name.startswith(".") and DEL_TAG in entry.name:
                fsutil.rmtree_quiet(Path(entry.path))
                removed.append(entry.name)
        removed.extend(p.name for p in leftovers.cleanup_directory(self.path))
        return removed
