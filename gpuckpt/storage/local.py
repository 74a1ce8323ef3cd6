"""Checkpoints in a directory of a local (or POSIX shared) file system.

Publication: everything is written under a temporary sibling directory
``.<name>.gpuckpt-tmp-<host>-<pid>-<random>``, made durable (each file and
directory fsynced, or one ``syncfs`` of the file system when there are many
files), then renamed to ``<name>`` in one step, and the parent directory is
fsynced. A reader therefore sees either no checkpoint or a complete one.
Temporaries left by crashed processes are removed by the next save to the
same path.

A writer holds a lock on its temporary while it lives, and replaces only a
gpuckpt checkpoint or an empty directory: ``RENAME_EXCHANGE``, else two
renames (old aside, new in place). What is dead, foreign or set aside is
decided in :mod:`gpuckpt.storage.leftovers`.

A writer made with ``direct_io=True`` (what :func:`gpuckpt.async_save` uses)
writes large chunk files (1 MiB and more) around the page cache, into space
allocated up front for the whole file, through :mod:`gpuckpt.storage.direct`
(which falls back to buffered writes where the file system refuses).
Synchronous saves write through the page cache, so that a checkpoint read
soon after is served from memory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    MetadataError,
)
from gpuckpt.options import SYNC_MODES, direct_io_from_env  # the one list of durability modes
from gpuckpt.storage import batchio, crccopy, fsutil
from gpuckpt.storage.base import (
    BaseRef,
    CheckpointReader,
    CheckpointWriter,
    ChunkReads,
    ChunkWrites,
    NotRegularFileError,
    ReadStop,
)
from gpuckpt.storage.checksum import CRC_BYTES, crc32c
from gpuckpt.storage.direct import DIRECT_MIN_BYTES, DirectWriter, read_direct
from gpuckpt.storage.direct import available as direct_io_available
from gpuckpt.storage.fileio import (
    buffer_address,
    read_crcs_at,
    read_exact,
    read_exact_at,
    readv_exact,
    write_all,
    writev_all,
)
from gpuckpt.storage.layout import MAX_ARRAY_DOCUMENT_BYTES, MAX_ROOT_DOCUMENT_BYTES, ROOT_KEY, too_large
from gpuckpt.storage.leftovers import (
    OLD_TAG,
    TMP_TAG,
    cleanup_stale_temporaries,
    is_committed,
    new_owner,
    replace_problem,
    set_aside_copies,
)

__all__ = [
    "LocalReader",
    "LocalWriter",
    "NotRegularFileError",
    "SYNC_MODES",
    "cleanup_stale_temporaries",
    "is_committed",
    "set_aside_copies",
]

_MANY_FILES = 64
_PIECE = 1 << 20
#: O_DIRECT reads fill whole blocks of this size
_DIRECT_ALIGN = 4096
_WRITEBACK_MIN = 1 << 20
#: chunk files smaller than this go through the native batches (larger ones are read
#: and written piece by piece, around the page cache where chosen, one by one)
_NATIVE_MAX = min(_PIECE, DIRECT_MIN_BYTES)
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
#: ``ioctl(dst, FICLONE, src)``: share the source's blocks (btrfs, XFS with reflink, bcachefs)
_FICLONE = 0x40049409
#: link() refusals that mean "no hard link here" (another device, too many links, a file
#: system without links or that forbids them): a clone, else a write, takes its place
_NO_LINK = frozenset(
    getattr(errno, n)
    for n in ("EXDEV", "EMLINK", "EPERM", "EOPNOTSUPP", "ENOSYS", "EACCES")
    if hasattr(errno, n)
)
#: ioctl(FICLONE) refusals that mean "no clone here"
_NO_CLONE = frozenset(
    getattr(errno, n)
    for n in ("EXDEV", "EOPNOTSUPP", "EINVAL", "ENOTTY", "ENOSYS", "EPERM", "EBADF")
    if hasattr(errno, n)
)


class LocalWriter(CheckpointWriter):
    """Writes a checkpoint directory; see the module docstring for the protocol."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        sync: str = "auto",
        expected_files: int = 0,
        direct_io: bool = False,
    ) -> None:
        """``sync``: ``"file"`` fsyncs each file as it is written, ``"fs"`` runs one
        syncfs before publishing (cheaper for many small files), ``"none"`` skips
        durability (tests, scratch data); ``"auto"`` picks ``"fs"`` above 64 files.
        ``direct_io``: write large chunk files with ``O_DIRECT`` where the platform
        and the file system allow it (:mod:`gpuckpt.storage.direct`); never with ``sync="none"``."""
        if sync not in SYNC_MODES:
            raise ValueError(f"sync={sync!r}; expected one of {SYNC_MODES}")
        self.path = Path(path).absolute()
        self.overwrite = overwrite
        if sync == "auto":
            sync = "fs" if expected_files > _MANY_FILES else "file"
        self.sync = sync
        self.tmp = self._new_name(TMP_TAG)
        self._lock_fd: int | None = None  # held on self.tmp from begin to commit or abort
        self._dirs: list[Path] = []
        use_direct = direct_io and sync != "none" and direct_io_available()
        self._direct = DirectWriter() if use_direct else None
        self._published: dict[str, int | None] = {}  # base root -> its root document's mtime

    @property
    def direct_io(self) -> bool:
        """Whether large chunk files are (still) written with ``O_DIRECT``."""
        return self._direct is not None and self._direct.enabled

    @property
    def token(self) -> str:
        """What other processes need to write into this save (see :meth:`attach`)."""
        return os.fspath(self.tmp)

    @classmethod
    def attach(cls, path: str | os.PathLike[str], token: str) -> LocalWriter:
        """A participant writing chunks into the save ``token`` that another process began.

        A participant only calls :meth:`write_chunk`; each of its files is
        fsynced as it is written, and the process that began the save commits it.
        """
        w = cls(path, sync="file")
        tmp = Path(token)
        if tmp.parent != w.path.parent or not tmp.name.startswith(f".{w.path.name}{TMP_TAG}"):
            raise ValueError(f"{token!r} is not a temporary of a save to {w.path}")
        w.tmp = tmp
        return w

    def _new_name(self, tag: str) -> Path:
        return self.path.parent / f".{self.path.name}{tag}{new_owner()}"

    def _check_target(self) -> None:
        if not (self.path.exists() or self.path.is_symlink()):
            return
        problem = replace_problem(self.path)
        if problem is not None:
            raise CheckpointExistsError(
                f"{self.path} exists and is not a gpuckpt checkpoint: {problem}; refusing to replace it"
                f"{' even with overwrite=True' if self.overwrite else ''}, nothing was deleted. Save to "
                "another path, or remove it yourself if it is yours to delete"
            )
        if not self.overwrite:
            what = "a checkpoint" if is_committed(self.path) else "an empty directory"
            raise CheckpointExistsError(
                f"{self.path} already exists ({what}); pass overwrite=True to replace it, "
                "or save to a new path"
            )

    def begin(self) -> None:
        # first: a checkpoint a crashed overwrite set aside is put back before anything is judged
        cleanup_stale_temporaries(self.path)
        self._check_target()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._make_tmp()

    def _make_tmp(self) -> None:
        """Create the temporary and take its lock (which tells cleaners that its writer lives)."""
        for _ in range(8):
            os.mkdir(self.tmp)
            try:
                fd = fsutil.lock_dir(self.tmp)
            except FileNotFoundError:
                fd = None  # removed by a cleaner that took it for a dead writer's: try another name
            except OSError as exc:
                if not fsutil.lock_unsupported(exc):
                    raise
                self._dirs.append(self.tmp)  # no locks on this file system: cleaners go by the pid
                return
            if fd is not None and fsutil.same_file(fd, self.tmp):
                self._lock_fd = fd
                self._dirs.append(self.tmp)
                return
            if fd is not None:
                fsutil.unlock(fd)
            # a cleaner locked the new directory between its mkdir and our lock and removes it
            self.tmp = self._new_name(TMP_TAG)
        raise CheckpointWriteError(
            errno.EBUSY,
            f"saving {self.path}: every new temporary directory was removed right after it was made "
            "(another process keeps cleaning this directory); nothing was published",
        )

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            fsutil.unlock(fd)

    def _create(self, rel: str) -> int:
        return os.open(f"{self.tmp}/{rel}", _CREATE_FLAGS, 0o644)

    def _write_file(self, rel: str, parts: Sequence[Any]) -> None:
        fd = self._create(rel)
        try:
            for p in parts:
                write_all(fd, p)
            if self.sync == "file":
                os.fsync(fd)
        finally:
            os.close(fd)

    def write_array_document(self, name: str, document: bytes) -> None:
        d = f"{self.tmp}/{name}"
        os.mkdir(d)
        if self.sync == "file":
            self._dirs.append(Path(d))
        self._write_file(f"{name}/zarr.json", [document])

    def write_array_documents(self, names: Sequence[str], documents: Sequence[bytes]) -> None:
        """The directories and documents of ``names`` in one native call with the GIL released
        (:mod:`gpuckpt.storage.batchio`) where the library is available, else one by one."""
        lib = batchio.instance()
        if lib is None or len(names) < 2:
            super().write_array_documents(names, documents)
            return
        kinds: list[int] = []
        paths: list[str] = []
        buffers: list[Any] = []
        for name, document in zip(names, documents, strict=True):
            kinds += (batchio.MKDIR, batchio.FILE)
            paths += (name, f"{name}/{ROOT_KEY}")
            buffers += (b"", document)
        tmp = os.fspath(self.tmp)
        _items, stop = lib.write(
            tmp,
            kinds,
            paths,
            buffers,
            [0] * len(kinds),
            fsync="group" if self.sync == "file" else None,
            writeback_min=None,
        )
        if self.sync == "file":
            self._dirs.extend(Path(f"{self.tmp}/{n}") for n in names)
        if stop is not None:
            raise stop.os_error(f"{tmp}/{paths[stop.index]}")

    def rewrite_array_document(self, name: str, document: bytes) -> None:
        # within the unpublished temporary: the new file replaces the old one in one rename
        self._write_file(f"{name}/{ROOT_KEY}.new", [document])
        os.replace(f"{self.tmp}/{name}/{ROOT_KEY}.new", f"{self.tmp}/{name}/{ROOT_KEY}")

    def write_chunk(self, name: str, key: str, parts: Sequence[Any]) -> None:
        self._write_file(f"{name}/{key}", parts)

    def write_chunk_checked(
        self,
        name: str,
        key: str,
        parts: Sequence[Any],
        digest: Callable[[Any], None],
        trailer: Callable[[], bytes],
    ) -> None:
        direct = self._direct
        if direct is not None and direct.enabled:
            size = sum(memoryview(p).nbytes for p in parts)
            fd = direct.create(f"{self.tmp}/{name}/{key}") if size >= DIRECT_MIN_BYTES else None
            if fd is not None:
                try:
                    # direct writes allocate blocks as they land: concurrent files would interleave
                    fsutil.preallocate(fd, size)
                    direct.write(fd, parts, digest, trailer)
                    self._settle(fd, size)
                finally:
                    os.close(fd)
                return
        # checksum and write in pieces that are still in the CPU cache
        fd = self._create(f"{name}/{key}")
        try:
            total = 0
            if len(parts) == 1 and memoryview(parts[0]).nbytes <= _PIECE:
                # a small chunk: one system call for its bytes and its checksum
                digest(parts[0])
                writev_all(fd, [parts[0], trailer()])
                total = memoryview(parts[0]).nbytes
            else:
                for p in parts:
                    view = memoryview(p).cast("B")
                    total += view.nbytes
                    for i in range(0, view.nbytes, _PIECE):
                        piece = view[i : i + _PIECE]
                        digest(piece)
                        write_all(fd, piece)
                write_all(fd, trailer())
            self._settle(fd, total)
        finally:
            os.close(fd)

    def _published_ns(self, root: str) -> int | None:
        """When the checkpoint at ``root`` was published: the mtime of its root document,
        written after every other file of it (None when it cannot be read)."""
        if root not in self._published:
            try:
                self._published[root] = os.stat(f"{root}/{ROOT_KEY}", follow_symlinks=False).st_mtime_ns
            except OSError:
                self._published[root] = None
        return self._published[root]

    def reuse_chunk(self, name: str, key: str, base: BaseRef) -> bool:
        """A hard link to the base's chunk file, else a reflink (``FICLONE``) of it, else False.

        The base file is opened as a load opens it (no symlink, no FIFO), checked to
        have the size and the CRC32C trailer its metadata gives and to be no younger
        than the base's root document (a file written into after the base was
        published, its trailer kept, may hold other bytes than the base's records
        describe: it is not linked, the chunk is written), and the new name is
        checked to be that very file (the base may have been replaced meanwhile). Two
        checkpoints then share one inode: nothing in gpuckpt ever writes into a
        published chunk file, and deleting either name leaves the other intact.
        """
        if "://" in base.location and not base.location.startswith("file://"):
            return False
        root = base.location.removeprefix("file://")
        src = f"{root}/{base.name}/{base.key}"
        try:
            fd = open_regular(src)
        except OSError:
            return False  # missing, not a regular file: written instead
        try:
            st = os.fstat(fd)
            if st.st_size != base.nbytes or base.nbytes < CRC_BYTES:
                return False
            published = self._published_ns(root)
            if published is None or st.st_mtime_ns > published:
                return False  # changed after its checkpoint was published: its bytes are not the base's
            trailer = bytearray(CRC_BYTES)
            if read_exact_at(fd, trailer, base.nbytes - CRC_BYTES) != CRC_BYTES:
                return False
            if int.from_bytes(trailer, "little") != base.crc32c:
                return False
            dst = f"{self.tmp}/{name}/{key}"
            try:
                os.link(src, dst, follow_symlinks=False)
            except FileNotFoundError:
                return False  # the base file went away since it was opened
            except OSError as exc:
                if exc.errno not in _NO_LINK:
                    raise
                return self._clone(fd, f"{name}/{key}", base.nbytes)
            linked = os.lstat(dst)
            if (linked.st_dev, linked.st_ino) != (st.st_dev, st.st_ino):
                os.unlink(dst)  # another file took the base's name between the check and the link
                return False
            return True
        finally:
            os.close(fd)

    def _clone(self, src_fd: int, rel: str, nbytes: int) -> bool:
        """A new file sharing ``src_fd``'s blocks (``FICLONE``), or False where refused."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            return False
        fd = self._create(rel)
        try:
            fcntl.ioctl(fd, _FICLONE, src_fd)
            self._settle(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(f"{self.tmp}/{rel}")
            if exc.errno in _NO_CLONE:
                return False
            raise
        os.close(fd)
        return True

    def write_chunks(self, batch: ChunkWrites) -> list[int]:
        """Chunks under 1 MiB in one native call with the GIL released
        (:mod:`gpuckpt.storage.batchio`) where the library is available; larger ones,
        and all without the library, one file at a time (:meth:`write_chunk_checked`:
        checksummed piece by piece while in the CPU cache, ``O_DIRECT`` where chosen)."""
        lib = batchio.instance()
        small = [
            i
            for i, (b, p) in enumerate(zip(batch.buffers, batch.pads, strict=True))
            if memoryview(b).nbytes + p < _NATIVE_MAX
        ]
        if lib is None or not small:
            return super().write_chunks(batch)
        crcs = [0] * len(batch.names)
        if len(small) < len(crcs):
            large = sorted(set(range(len(crcs))) - set(small))
            for i, c in zip(large, super().write_chunks(batch.select(large)), strict=True):
                crcs[i] = c
            batch = batch.select(small)
        for i, c in zip(small, self._write_native(lib, batch), strict=True):
            crcs[i] = c
        return crcs

    def _write_native(self, lib: batchio.BatchIO, batch: ChunkWrites) -> list[int]:
        kinds: list[int] = []
        paths: list[str] = []
        buffers: list[Any] = []
        pads: list[int] = []
        made: list[Path] = []
        documents = batch.documents or [None] * len(batch.names)
        for name, key, buf, pad, document in zip(
            batch.names, batch.keys, batch.buffers, batch.pads, documents, strict=True
        ):
            if document is not None:
                kinds += (batchio.MKDIR, batchio.FILE)
                paths += (name, f"{name}/zarr.json")
                buffers += (b"", document)
                pads += (0, 0)
                made.append(Path(f"{self.tmp}/{name}"))
            kinds.append(batchio.CHUNK)
            paths.append(f"{name}/{key}")
            buffers.append(buf)
            pads.append(pad)
        tmp = os.fspath(self.tmp)
        items, stop = lib.write(
            tmp,
            kinds,
            paths,
            buffers,
            pads,
            fsync="group" if self.sync == "file" else None,
            writeback_min=_WRITEBACK_MIN if self.sync == "fs" else None,
        )
        if self.sync == "file":
            self._dirs.extend(made)
        if stop is not None:
            raise stop.os_error(f"{tmp}/{paths[stop.index]}")
        return [int(c) for c in items["crc"][items["kind"] == batchio.CHUNK]]

    def _settle(self, fd: int, nbytes: int) -> None:
        """A written chunk file's share of durability: its fsync (``"file"``), or the start
        of its writeback (``"fs"``) for large files, so that the final syncfs waits for
        less; for small ones the extra call costs more than it saves."""
        if self.sync == "file":
            os.fsync(fd)
        elif self.sync == "fs" and nbytes >= _WRITEBACK_MIN:
            fsutil.start_writeback(fd)

    def _make_durable(self) -> None:
        if self.sync == "none":
            return
        if self.sync == "fs" and fsutil.syncfs(self.tmp):
            return
        dirs = list(self._dirs)
        if self.sync == "fs":
            # no syncfs here: files were not fsynced as they were written
            for root, _dirs, files in os.walk(self.tmp):
                if root != os.fspath(self.tmp):
                    dirs.append(Path(root))
                for f in files:
                    fd = os.open(os.path.join(root, f), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        for d in reversed(dirs):
            fsutil.fsync_dir(d)

    def commit(self, root_document: bytes) -> None:
        self._write_file(ROOT_KEY, [root_document])
        self._make_durable()
        if self.overwrite and (self.path.exists() or self.path.is_symlink()):
            self._check_target()
            if not fsutil.exchange(self.tmp, self.path):
                self._replace_by_two_renames()
            else:
                fsutil.rmtree_quiet(self.tmp)  # it holds the previous checkpoint now
        else:
            try:
                fsutil.rename_noreplace(self.tmp, self.path)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    raise CheckpointExistsError(
                        f"{self.path} was created by another save while this one ran; "
                        "this save was discarded and the other one kept"
                    ) from None
                raise
        if self.sync != "none":
            try:
                fsutil.fsync_dir(self.path.parent)
            except OSError as exc:
                raise CheckpointWriteError(
                    exc.errno or errno.EIO,
                    f"checkpoint {self.path} was published complete, but syncing its parent directory "
                    f"failed ({exc.strerror or exc}): it may not survive a power loss; save again to be sure",
                ) from exc
        self._unlock()

    def _replace_by_two_renames(self) -> None:
        """No atomic exchange here: move the old checkpoint aside, then the new one into place.

        The old one is locked first and stays locked (a live writer's) until this
        save is done with it: a crash between the two renames leaves it, complete
        and unlocked, for the next save to put back (:func:`cleanup_stale_temporaries`).
        """
        held = self._lock_target()
        try:
            old = self._new_name(OLD_TAG)
            os.rename(self.path, old)
            try:
                os.rename(self.tmp, self.path)
            except BaseException:
                os.rename(old, self.path)  # put the previous checkpoint back
                raise
            self.tmp = old
            fsutil.rmtree_quiet(old)  # still locked: no cleaner takes it for a dead writer's
        finally:
            if held is not None:
                fsutil.unlock(held)

    def _lock_target(self) -> int | None:
        """The lock of the checkpoint at ``path`` (waiting for a save that is setting it aside or
        has just published it); None where the file system has no locks."""
        for _ in range(100):
            try:
                fd = fsutil.lock_dir(self.path, wait=True)
            except OSError as exc:
                if fsutil.lock_unsupported(exc):
                    return None
                raise
            assert fd is not None
            if fsutil.same_file(fd, self.path):
                return fd
            fsutil.unlock(fd)  # replaced while we waited: lock the new one
        raise CheckpointWriteError(
            errno.EBUSY, f"saving {self.path}: it kept being replaced by other saves; nothing was published"
        )

    def abort(self) -> None:
        fsutil.rmtree_quiet(self.tmp)
        self._unlock()


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


def _read_document(path: str, limit: int, name: str) -> bytearray:
    """The whole regular file ``path``, refused unread when larger than ``limit`` (the cap ``name``)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise too_large(path, size, limit, name)
        buf = bytearray(size)
        del buf[read_exact(fd, buf) :]  # shorter if it shrank meanwhile: the parser says so
        return buf
    finally:
        os.close(fd)


class LocalReader(CheckpointReader):
    """Reads a published checkpoint directory without following symlinks out of it.

    The array directories are listed once (one ``scandir`` of the root); a name
    that is a symlink or not a directory there is treated as missing. Every
    file is opened with :func:`open_regular` (``O_NOFOLLOW | O_NONBLOCK``, then
    checked to be a regular file), documents are size-capped before they are
    read, and chunks are read only up to the size the metadata gives. So a
    symlink, FIFO or device planted in a checkpoint cannot make a read leave
    it, block, or read without end.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._root = os.fspath(self.path)
        self._dirs: set[str] | None = None
        #: large chunk parts read by each path: ``"cached"`` (copied and checksummed in one
        #: pass from the page cache), ``"direct"`` (O_DIRECT into aligned memory: cold),
        #: ``"buffered"`` (pread and checksum in pieces); a record for tests and benchmarks
        self.read_paths = {"cached": 0, "direct": 0, "buffered": 0}
        self._paths_lock = threading.Lock()
        # cold chunks are read around the page cache unless GPUCKPT_DIRECT_IO=off; turned off
        # for good the first time the file system refuses
        self._direct = direct_io_from_env() != "off"

    def _note(self, path: str) -> None:
        with self._paths_lock:
            self.read_paths[path] += 1

    def read_root(self) -> bytearray:
        """The root document's bytes (a buffer the caller parses in place, never copied)."""
        root = os.path.join(self._root, ROOT_KEY)
        try:
            return _read_document(root, MAX_ROOT_DOCUMENT_BYTES, "MAX_ROOT_DOCUMENT_BYTES")
        except NotRegularFileError as exc:
            if stat.S_ISLNK(exc.mode):
                raise CheckpointNotFoundError(
                    f"cannot open {root}: it is a symlink, which gpuckpt does not follow"
                ) from None
            raise MetadataError(f"{root} {exc.strerror}; the checkpoint is damaged") from None
        except FileNotFoundError:
            hint = ""
            with contextlib.suppress(OSError):
                if any(p.name.startswith(f".{self.path.name}{TMP_TAG}") for p in self.path.parent.iterdir()):
                    hint = " (an unfinished or crashed save left a temporary next to it)"
            aside = set_aside_copies(self.path) if not os.path.lexists(self.path) else []
            if aside:
                raise CheckpointNotFoundError(
                    f"no checkpoint at {self.path}, but an overwrite that was interrupted between its two "
                    "renames (a file system without RENAME_EXCHANGE) left the previous checkpoint, complete, "
                    f"at {aside[-1]}: the next save to {self.path} puts it back first, or recover it now "
                    f"with: mv '{aside[-1]}' '{self.path}' (unless a save to it is running right now)"
                ) from None
            if self.path.is_dir():
                raise CheckpointNotFoundError(
                    f"{self.path} is not a committed checkpoint: it has no {ROOT_KEY}{hint}"
                ) from None
            raise CheckpointNotFoundError(f"no checkpoint at {self.path}{hint}") from None
        except OSError as exc:
            raise CheckpointNotFoundError(f"cannot open {root}: {exc.strerror}") from None

    def _array_dirs(self) -> set[str]:
        """The names of the real (not symlinked) directories of the checkpoint, listed once."""
        if self._dirs is None:
            with os.scandir(self._root) as it:
                self._dirs = {e.name for e in it if e.is_dir(follow_symlinks=False)}
        return self._dirs

    def _array_dir(self, name: str) -> str:
        if name not in self._array_dirs():
            raise FileNotFoundError(errno.ENOENT, "array directory missing or not a directory", name)
        return f"{self._root}/{name}"

    def read_array_document(self, name: str) -> bytearray:
        return _read_document(
            f"{self._array_dir(name)}/zarr.json", MAX_ARRAY_DOCUMENT_BYTES, "MAX_ARRAY_DOCUMENT_BYTES"
        )

    def _lstat_chunk(self, name: str, key: str) -> os.stat_result | None:
        try:
            st = os.lstat(f"{self._array_dir(name)}/{key}")
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st if stat.S_ISREG(st.st_mode) else None

    def chunk_nbytes(self, name: str, key: str) -> int | None:
        st = self._lstat_chunk(name, key)
        return None if st is None else st.st_size

    def chunk_sizes(self, names: Sequence[str], keys: Sequence[str]) -> list[int | None]:
        """One native call for all of them (:mod:`gpuckpt.storage.batchio`) where the library
        is available: the checks before a load of many small tensors were one ``lstat``
        from Python per chunk."""
        lib = batchio.instance()
        if lib is None or len(names) < 2:
            return super().chunk_sizes(names, keys)
        dirs = self._array_dirs()
        sizes, _stops = lib.sizes(self._root, [f"{n}/{k}" for n, k in zip(names, keys, strict=True)])
        return [int(s) if s >= 0 and n in dirs else None for n, s in zip(names, sizes.tolist(), strict=True)]

    def chunk_usage(self, name: str, key: str) -> tuple[int, int] | None:
        st = self._lstat_chunk(name, key)
        return None if st is None else (st.st_size, st.st_blocks * 512)

    def chunk_shared(self, name: str, key: str) -> bool:
        st = self._lstat_chunk(name, key)
        return st is not None and st.st_nlink > 1

    def read_chunk_crc(self, name: str, key: str, dests: Sequence[Any]) -> tuple[int, int]:
        fd = self._open_chunk(name, key)
        try:
            if len(dests) == 2 and memoryview(dests[0]).nbytes <= _PIECE:
                # a small chunk: one system call for its bytes and its checksum
                total = readv_exact(fd, dests)
                return total, crc32c(dests[0]) if total >= memoryview(dests[0]).nbytes else 0
            total = value = 0
            for d in dests[:-1]:
                view = memoryview(d).cast("B")
                start = 0
                if view.nbytes >= _PIECE:
                    # in the page cache: copied and checksummed in one pass (crccopy.c)
                    fused = crccopy.cached_copy_crc(fd, total, view, value)
                    if fused is not None:
                        value = fused
                        total += view.nbytes
                        self._note("cached")
                        continue
                    if total == 0 and self._direct:
                        # not cached (a cold load): straight from the disk into aligned memory
                        start = self._read_direct(fd, view)
                        if start:
                            value = crc32c(view[:start], value)
                            total = start
                            if start % _DIRECT_ALIGN:
                                return total, value  # the file ended early
                    if not start:
                        self._note("buffered")
                # read and checksum in pieces that are still in the CPU cache
                for i in range(start, view.nbytes, _PIECE):
                    piece = view[i : i + _PIECE]
                    n = read_exact_at(fd, piece, total)
                    total += n
                    if n < piece.nbytes:
                        return total, value
                    value = crc32c(piece, value)
            return total + read_exact_at(fd, dests[-1], total), value
        finally:
            os.close(fd)

    def _read_direct(self, fd: int, view: memoryview) -> int:
        """The bytes of ``view`` read with O_DIRECT from offset 0 (0 where not possible)."""
        if buffer_address(view) % _DIRECT_ALIGN:
            return 0  # memory not aligned (host targets): buffered
        got = read_direct(fd, view)
        if got is None:
            self._direct = False  # the file system refuses: buffered from now on
            return 0
        self._note("direct")
        return got

    def read_chunks(self, batch: ChunkReads) -> ReadStop | None:
        """Runs of chunks under 1 MiB in one native call each, with the GIL released
        (:mod:`gpuckpt.storage.batchio`), where the library is available; larger ones,
        and all without the library, one file at a time (:meth:`read_chunk_crc`: copied and
        checksummed in one pass when cached). Files are opened as :func:`open_regular`
        does, in array directories checked as :meth:`read_chunk_crc` checks them."""
        lib = batchio.instance()
        if lib is None:
            return super().read_chunks(batch)
        small = [
            memoryview(b).nbytes + p < _NATIVE_MAX for b, p in zip(batch.buffers, batch.pads, strict=True)
        ]
        start = 0
        while start < len(small):
            end = start
            while end < len(small) and small[end] == small[start]:
                end += 1
            run = batch if start == 0 and end == len(small) else batch.select(range(start, end))
            stop = self._read_native(lib, run) if small[start] else super().read_chunks(run)
            if stop is not None:
                return replace(stop, index=start + stop.index)
            start = end
        return None

    def _read_native(self, lib: batchio.BatchIO, batch: ChunkReads) -> ReadStop | None:
        missing: ReadStop | None = None
        count = len(batch.names)
        dirs = self._array_dirs()
        for i, name in enumerate(batch.names):
            if name in dirs:
                continue
            try:
                self._array_dir(name)  # raises for a name that is not an array directory
            except FileNotFoundError as exc:
                missing, count = ReadStop(i, error=exc), i
                break
        paths = [f"{n}/{k}" for n, k in zip(batch.names[:count], batch.keys[:count], strict=True)]
        _items, stop = lib.read(
            self._root, paths, batch.buffers[:count], batch.pads[:count], batch.expected[:count]
        )
        if stop is None:
            return missing
        path = f"{self._root}/{paths[stop.index]}"
        if stop.step == "not-regular":
            return ReadStop(stop.index, error=NotRegularFileError(path, stop.mode))
        if stop.step == "short":
            return ReadStop(stop.index, stop.done)
        if stop.step == "mismatch":
            return ReadStop(stop.index, stop.done, stop.crc, stop.stored)
        if stop.err == errno.ENOTDIR:
            name = batch.names[stop.index]
            error: OSError = FileNotFoundError(errno.ENOENT, "array directory is not a directory", name)
            return ReadStop(stop.index, error=error)
        return ReadStop(stop.index, error=stop.os_error(path))

    def read_chunk_checksum(self, name: str, key: str, nbytes: int, piece: int) -> tuple[int, int, int]:
        """Streams the chunk through one buffer of at most ``piece`` bytes."""
        data = max(0, nbytes - CRC_BYTES)
        buf = memoryview(bytearray(max(1, min(piece, data))))
        fd = self._open_chunk(name, key)
        try:
            total = value = 0
            while total < data:
                view = buf[: min(buf.nbytes, data - total)]
                n = read_exact_at(fd, view, total)
                value = crc32c(view[:n], value)
                total += n
                if n < view.nbytes:
                    return total, value, 0
            trailer = bytearray(CRC_BYTES)
            total += read_exact_at(fd, trailer, total)
            return total, value, int.from_bytes(trailer, "little")
        finally:
            os.close(fd)

    def chunk_cached(self, name: str, key: str) -> bool | None:
        """A one-byte ``preadv2(RWF_NOWAIT)`` of the chunk file: it fails with ``EAGAIN`` instead
        of reading from the device when the page is not cached (None where the kernel or file
        system does not offer the flag, or the file cannot be opened)."""
        flag = getattr(os, "RWF_NOWAIT", None)
        if flag is None:
            return None
        try:
            fd = self._open_chunk(name, key)
        except OSError:
            return None
        try:
            os.preadv(fd, [bytearray(1)], 0, flag)
            return True
        except BlockingIOError:
            return False
        except OSError:
            return None
        finally:
            os.close(fd)

    def _open_chunk(self, name: str, key: str) -> int:
        try:
            return open_regular(f"{self._array_dir(name)}/{key}")
        except NotADirectoryError:
            raise FileNotFoundError(errno.ENOENT, "array directory is not a directory", name) from None

    reads_ranges = True

    def read_range_crcs(
        self, name: str, key: str, offset: int, dests: Sequence[Any]
    ) -> tuple[int, list[int]]:
        fd = self._open_chunk(name, key)
        try:
            return read_crcs_at(fd, offset, dests)
        finally:
            os.close(fd)

    def read_chunk_into(self, name: str, key: str, dests: Sequence[Any]) -> int:
        fd = self._open_chunk(name, key)
        try:
            total = 0
            for d in dests:
                n = read_exact(fd, d)
                total += n
                if n < memoryview(d).nbytes:
                    break
            return total
        finally:
            os.close(fd)
