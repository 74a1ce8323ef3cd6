"""The chunk file of an incremental save's base, opened to be shared (linked or cloned)
only when it is certainly the base's: what :meth:`LocalWriter.reuse_chunk
<gpuckpt.storage.local.writer.LocalWriter.reuse_chunk>` checks first."""

from __future__ import annotations

import os

from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.documents import ROOT_KEY
from gpuckpt.storage.base import BaseRef, CheckpointWriter
from gpuckpt.storage.local.fileio import read_exact_at
from gpuckpt.storage.local.fsutil import open_regular

__all__ = ["open_base_chunk", "published_ns"]


def published_ns(root: str, seen: dict[str, int | None]) -> int | None:
    """When the checkpoint at ``root`` was published: the mtime of its root document, written
    after every other file of it (None when it cannot be read); remembered in ``seen``."""
    if root not in seen:
        try:
            seen[root] = os.stat(f"{root}/{ROOT_KEY}", follow_symlinks=False).st_mtime_ns
        except OSError:
            seen[root] = None
    return seen[root]


def open_base_chunk(
    base: BaseRef, seen: dict[str, int | None]
) -> tuple[int, os.stat_result, str] | str | None:
    """The base's chunk file opened (its descriptor, status and path), or, where it must be
    written instead, why: a string where the file is not as the base's records describe
    (missing, not a regular file: it is opened as a load opens it, no symlink, no FIFO; not of
    the size and CRC32C trailer its metadata gives; younger than the base's root document, so
    written into after the base was published, its trailer kept or not), None where sharing
    does not apply (not on this file system, the base's root document unreadable, a file that
    another user owns or may write).
    ``seen``: the publication times already read (:func:`published_ns`)."""
    if "://" in base.location and not base.location.startswith("file://"):
        return None
    root = base.location.removeprefix("file://")
    src = f"{root}/{base.name}/{base.key}"
    try:
        fd = open_regular(src)
    except FileNotFoundError:
        return CheckpointWriter.BASE_MISSING
    except OSError as exc:
        return f"not readable as a chunk file ({exc.strerror or exc})"
    try:
        st = os.fstat(fd)
        why = None if not _ours_alone(st) else _unlike_the_base(fd, st, base, root, seen)
        if why == "":
            return fd, st, src
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return why


def _ours_alone(st: os.stat_result) -> bool:
    """Whether only this process's user can change the file: a hard link to a file of another
    user, or one that others may write, would change under the new checkpoint whenever they
    rewrite it (its checksum made to match is no defence), so such a file is not shared."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _unlike_the_base(
    fd: int, st: os.stat_result, base: BaseRef, root: str, seen: dict[str, int | None]
) -> str | None:
    """ "" where the open file is the base's chunk; else why not (None: cannot tell)."""
    if st.st_size != base.nbytes or base.nbytes < CRC_BYTES:
        return CheckpointWriter.base_other_size(st.st_size, base)
    published = published_ns(root, seen)
    if published is None:
        return None
    if st.st_mtime_ns > published:
        return CheckpointWriter.BASE_REWRITTEN
    trailer = bytearray(CRC_BYTES)
    if read_exact_at(fd, trailer, base.nbytes - CRC_BYTES) != CRC_BYTES:
        return "cut short while it was read"
    if int.from_bytes(trailer, "little") != base.crc32c:
        return CheckpointWriter.BASE_OTHER_TRAILER
    return ""
