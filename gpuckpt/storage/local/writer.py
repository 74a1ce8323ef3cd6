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
decided in :mod:`gpuckpt.storage.local.leftovers`.

A writer made with ``direct_io=True`` (what :func:`gpuckpt.async_save` uses)
writes large chunk files (1 MiB and more) around the page cache, into space
allocated up front for the whole file, through :mod:`gpuckpt.storage.local.direct`
(which falls back to buffered writes where the file system refuses).
Synchronous saves write through the page cache, so that a checkpoint read
soon after is served from memory. Reading is :mod:`gpuckpt.storage.local.reader`.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpuckpt.errors import (
    CheckpointExistsError,
    CheckpointWriteError,
)
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.documents import ROOT_KEY
from gpuckpt.format.segments import SEGMENT_BYTES
from gpuckpt.options import SYNC_MODES  # the one list of durability modes
from gpuckpt.storage.base import (
    BaseRef,
    CheckpointWriter,
    ChunkDigest,
    ChunkWrites,
    NotRegularFileError,
)
from gpuckpt.storage.copies import own_pieces
from gpuckpt.storage.local import batchio, crccopy, fsutil
from gpuckpt.storage.local.direct import DIRECT_MIN_BYTES, DirectWriter
from gpuckpt.storage.local.direct import available as direct_io_available
from gpuckpt.storage.local.fileio import (
    write_all,
    writev_all,
)
from gpuckpt.storage.local.filemaps import FileMaps
from gpuckpt.storage.local.leftovers import (
    OLD_TAG,
    TMP_TAG,
    cleanup_stale_temporaries,
    is_committed,
    new_owner,
    refuse_inside_a_checkpoint,
    replace_problem,
    set_aside_copies,
    side_prefix,
)
from gpuckpt.storage.local.reader import NATIVE_MAX_BYTES, PIECE_BYTES
from gpuckpt.storage.local.reuse import open_base_chunk
from gpuckpt.storage.local.shared_dir import JOURNAL, directory_entries, publish_into

__all__ = [
    "LocalWriter",
    "NotRegularFileError",
    "SYNC_MODES",
    "cleanup_stale_temporaries",
    "is_committed",
    "set_aside_copies",
]

_MANY_FILES = 64
_WRITEBACK_MIN = 1 << 20
#: where a directory given to :meth:`LocalWriter.reuse_files_of` lies until the commit
REUSED_NAME = ".gpuckpt-reused"
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
        and the file system allow it (:mod:`gpuckpt.storage.local.direct`); never with ``sync="none"``."""
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
        self._reuse_from: Path | None = None  # a directory given up to this save (reuse_files_of)
        self._reused: Path | None = None  # where it lies in the temporary directory, once moved
        self._reused_fds: set[int] = set()  # files open over a reused file's bytes
        self._reused_dirs: set[str] = set()  # folders of the reused directory found to be real ones
        self._maps: FileMaps | None = None  # kept maps of reused files, written through (reuse_files_of)
        #: chunk files written through a map of the reused file (:meth:`_write_mapped`)
        self.mapped_writes = 0
        self._begun = "new"  # how the target looked when the save began (see _target_mode)

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
        if tmp.parent != w.path.parent or not tmp.name.startswith(side_prefix(w.path.name, TMP_TAG)):
            raise ValueError(f"{token!r} is not a temporary of a save to {w.path}")
        w.tmp = tmp
        return w

    def _new_name(self, tag: str) -> Path:
        return self.path.parent / f"{side_prefix(self.path.name, tag)}{new_owner()}"

    def _target_mode(self) -> str:
        """How this save will publish, given what is at the path now; raises
        :class:`CheckpointExistsError` where it may not:

        * ``"new"``: nothing there;
        * ``"empty"``: an empty directory, which holds no checkpoint (no ``overwrite`` needed);
        * ``"replace"``: a checkpoint and nothing else (``overwrite=True``): one atomic exchange;
        * ``"into"``: a directory holding other files (``overwrite=True``): the checkpoint's own
          names are published into it beside them (:mod:`gpuckpt.storage.local.shared_dir`).
        """
        path = self.path
        if not (path.exists() or path.is_symlink()):
            return "new"
        if path.is_symlink() or not path.is_dir():
            what = "a symbolic link" if path.is_symlink() else "not a directory"
            raise CheckpointExistsError(
                f"{path} exists and is not a gpuckpt checkpoint: it is {what}; refusing to replace it"
                f"{' even with overwrite=True' if self.overwrite else ''}, nothing was deleted. Save to "
                "another path, or remove it yourself if it is yours to delete"
            )
        root, arrays, others = directory_entries(path)
        if ROOT_KEY in others:
            problem = replace_problem(path) or f"its {ROOT_KEY} is not a gpuckpt root document"
            raise CheckpointExistsError(
                f"{path} exists and is not a gpuckpt checkpoint: {problem}; refusing to replace it"
                f"{' even with overwrite=True' if self.overwrite else ''}, nothing was deleted. Save to "
                "another path, or remove it yourself if it is yours to delete"
            )
        if root and not self.overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists at {path}; pass overwrite=True to replace it, "
                "or save to a new path"
            )
        if not (root or arrays or others):
            return "empty"
        if others or not root:
            if not self.overwrite:
                raise CheckpointExistsError(
                    f"{path} holds {len(others) + len(arrays)} entries (e.g. {(others + arrays)[:3]}) and no "
                    "checkpoint; pass overwrite=True to publish the checkpoint's own names into it beside "
                    "them (nothing there that is not a gpuckpt checkpoint's is touched; a clash of names is "
                    "refused), or save to a new path"
                )
            return "into"
        return "replace"

    def reuse_files_of(self, path: str | os.PathLike[str], maps: FileMaps | None = None) -> None:
        """See :meth:`CheckpointWriter.reuse_files_of`: at :meth:`begin` the directory moves
        into this save's temporary directory in one rename (on the same file system; else it
        stays where it is), and each file created under a name it holds takes that file,
        overwritten and cut to its new size, rather than a new one.

        ``maps``: where the caller keeps maps of its files from one save to the next (a local
        tier on tmpfs, whose ``write()`` costs about three times a copy into mapped pages).
        A reused chunk file of the chunk's very size, its pages allocated, is then written
        by copying the chunk into its map with the checksum in the same pass
        (:meth:`_write_mapped`), the map kept there for the next save."""
        self._reuse_from = Path(path)
        self._maps = maps

    def begin(self) -> None:
        refuse_inside_a_checkpoint(self.path)
        # first: a checkpoint a crashed overwrite set aside is put back before anything is judged
        cleanup_stale_temporaries(self.path)
        self._begun = self._target_mode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp, self._lock_fd = self._make_locked(self.tmp, TMP_TAG)
        self._dirs.append(self.tmp)
        if self._reuse_from is not None:
            self._take_over(self._reuse_from)

    def _take_over(self, given: Path) -> None:
        """Move the directory given to :meth:`reuse_files_of` into the temporary directory."""
        reused = self.tmp / REUSED_NAME
        # (gone meanwhile, a link to a directory elsewhere, on another file system: new files)
        if fsutil.move_directory(given, reused):
            self._reused = reused

    def _make_locked(self, first: Path, tag: str) -> tuple[Path, int | None]:
        """A new directory (``first``, else another new name with ``tag``) and its lock, which tells
        cleaners that its writer lives (None where the file system has no locks: cleaners then
        go by the pid in its name)."""
        where = first
        for _ in range(8):
            os.mkdir(where)
            try:
                fd = fsutil.lock_dir(where)
            except FileNotFoundError:
                fd = None  # removed by a cleaner that took it for a dead writer's: try another name
            except OSError as exc:
                if not fsutil.lock_unsupported(exc):
                    raise
                return where, None
            if fd is not None and fsutil.same_file(fd, where):
                return where, fd
            if fd is not None:
                fsutil.unlock(fd)
            # a cleaner locked the new directory between its mkdir and our lock and removes it
            where = self._new_name(tag)
        raise CheckpointWriteError(
            errno.EBUSY,
            f"saving {self.path}: every new directory beside it was removed right after it was made "
            "(another process keeps cleaning this directory); nothing was published",
        )

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            fsutil.unlock(fd)

    def _create(self, rel: str) -> int:
        path = f"{self.tmp}/{rel}"
        if self._reused is not None:
            fd = self._take_reused(rel, path)
            if fd is not None:
                return fd
        return os.open(path, _CREATE_FLAGS, 0o644)

    def _take_reused(self, rel: str, path: str) -> int | None:
        """The reused directory's file ``rel`` moved to ``path`` and opened over its bytes, or
        None where there is none (what stood there that is no regular file is removed). A file
        with another name (a hard link: a copy someone kept with ``cp -al``, another checkpoint
        sharing it) is never written into: its name here is removed and a new file made."""
        if not self._reused_folders_real(rel):
            return None
        try:
            os.rename(f"{self._reused}/{rel}", path)
        except OSError:  # none of that name (or its folder is not made yet)
            return None
        mode = os.O_WRONLY if self._maps is None else os.O_RDWR  # (a shared writable map reads too)
        try:
            fd = os.open(path, mode | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # a link, a directory, ...
            if os.path.isdir(path) and not os.path.islink(path):
                fsutil.rmtree_quiet(Path(path))
            else:
                os.unlink(path)
            return None
        if not fsutil.overwritable(fd):  # (another name shares it: left intact)
            os.close(fd)
            os.unlink(path)
            return None
        self._reused_fds.add(fd)
        return fd

    def _reused_folders_real(self, rel: str) -> bool:
        """Whether every folder of ``rel`` in the reused directory is a directory itself: a
        link there would have the rename take a file from wherever it points."""
        folder = os.path.dirname(rel)
        while folder and folder not in self._reused_dirs:
            try:
                if not stat.S_ISDIR(os.lstat(f"{self._reused}/{folder}").st_mode):
                    return False
            except OSError:
                return False
            self._reused_dirs.add(folder)
            folder = os.path.dirname(folder)
        return True

    def _end_file(self, fd: int) -> None:
        """A written file opened over a reused one's bytes is cut where its writes ended."""
        if fd in self._reused_fds:
            self._reused_fds.discard(fd)
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR))

    def _write_file(self, rel: str, parts: Sequence[Any]) -> None:
        fd = self._create(rel)
        try:
            for p in parts:
                write_all(fd, p)
            self._end_file(fd)
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
        (:mod:`gpuckpt.storage.local.batchio`) where the library is available, else one by one."""
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
        self, name: str, key: str, parts: Sequence[Any], digest: ChunkDigest, *, stable: bool = False
    ) -> None:
        direct = self._direct
        if direct is not None and direct.enabled:
            size = sum(memoryview(p).nbytes for p in parts)
            fd = direct.create(f"{self.tmp}/{name}/{key}") if size >= DIRECT_MIN_BYTES else None
            if fd is not None:
                try:
                    # direct writes allocate blocks as they land: concurrent files would interleave
                    fsutil.preallocate(fd, size)
                    direct.write(fd, parts, digest, stable=stable)
                    self._settle(fd, size)
                finally:
                    os.close(fd)
                return
        # copied (unless stable), checksummed and written in pieces that are still in the CPU
        # cache: the checksum is of the bytes written (see CheckpointWriter)
        fd = self._create(f"{name}/{key}")
        try:
            if self._write_mapped(fd, parts, digest):
                return
            total = 0
            if len(parts) == 1 and memoryview(parts[0]).nbytes <= PIECE_BYTES:
                # a small chunk: one system call for its bytes and its checksum
                (piece,) = list(own_pieces(parts, stable=stable)) or [memoryview(b"")]
                digest.update(piece)
                writev_all(fd, [piece, digest.trailer()])
                total = piece.nbytes
            else:
                for piece in own_pieces(parts, stable=stable, piece=PIECE_BYTES):
                    total += piece.nbytes
                    digest.update(piece)
                    write_all(fd, piece)
                write_all(fd, digest.trailer())
            self._end_file(fd)
            self._settle(fd, total)
        finally:
            os.close(fd)

    def _write_mapped(self, fd: int, parts: Sequence[Any], digest: ChunkDigest) -> bool:
        """Write a chunk into the reused file open at ``fd`` through a map of it (see
        :meth:`reuse_files_of`): each segment copied with its CRC32C in one pass, read once
        from ``parts`` (so the checksum is of the bytes written, whether or not they are
        stable), then the trailer. False where it does not apply, nothing written (no maps
        given, a new file, another size, pages not all allocated: a write into a hole of a
        full tmpfs would be a SIGBUS; no native copy loop), or where a fault interrupted the
        copy (the file cut shorter under its map): the caller then writes the file with
        ``write()``, which reports what the file system refuses, and ``digest`` has been fed
        nothing."""
        maps = self._maps
        if maps is None or fd not in self._reused_fds or not crccopy.available():
            return False
        views = [memoryview(p).cast("B") for p in parts]
        data = sum(v.nbytes for v in views)
        size = data + CRC_BYTES
        st = os.fstat(fd)
        if size < maps.MIN_BYTES or st.st_size != size or st.st_blocks * 512 < size:
            return False
        try:
            m, held = maps.map(fd, st, size, writable=True)
        except OSError:  # a file system or a limit that refuses the map: write() goes on
            return False
        if not held:
            m.close()  # (as many kept as allowed: written with write())
            return False
        try:
            whole = memoryview(m)
        except ValueError:  # closed by the tier's retention meanwhile
            return False
        with whole:
            crcs = _copy_segments(views, whole[:data])
            if crcs is None:
                return False
            for crc, n in crcs:
                digest.update_crc(crc, n)
            if crccopy.guarded_copy_crc(digest.trailer(), whole[data:]) is None:
                raise OSError(
                    errno.EIO, "the file was cut shorter while it was written", f"/proc/self/fd/{fd}"
                )
        self._reused_fds.discard(fd)  # (its size is the chunk's already)
        self._settle(fd, data)
        self.mapped_writes += 1
        return True

    def reuse_chunk(self, name: str, key: str, base: BaseRef) -> bool:
        """A hard link to the base's chunk file, else a reflink (``FICLONE``) of it, else False.

        The base file is opened and checked as :func:`~gpuckpt.storage.local.reuse.open_base_chunk`
        says, and the new name is checked to be that very file (the base may have been
        replaced meanwhile). Two checkpoints then share one inode: nothing in gpuckpt ever
        writes into a published chunk file, and deleting either name leaves the other intact.
        """
        opened = open_base_chunk(base, self._published)
        if not isinstance(opened, tuple):
            if opened is not None:
                self.note_base_mismatch(base, opened)
            return False
        fd, st, src = opened
        try:
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
        fd = os.open(f"{self.tmp}/{rel}", _CREATE_FLAGS, 0o644)  # (never a reused file)
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
        (:mod:`gpuckpt.storage.local.batchio`) where the library is available; larger ones,
        and all without the library, one file at a time (:meth:`write_chunk_checked`:
        checksummed piece by piece while in the CPU cache, ``O_DIRECT`` where chosen)."""
        lib = batchio.instance()
        small = [
            i
            for i, (b, p) in enumerate(zip(batch.buffers, batch.pads, strict=True))
            if memoryview(b).nbytes + p < NATIVE_MAX_BYTES
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
        # an array stored as one chunk: its directory, document and chunk come together, so
        # that its directory in the retired part (if any) is taken whole and written over
        take = self._reused is not None
        for name, key, buf, pad, document in zip(
            batch.names, batch.keys, batch.buffers, batch.pads, documents, strict=True
        ):
            if document is not None:
                whole = take and "/" not in name and "/" not in key
                kinds += (batchio.TAKEDIR if whole else batchio.MKDIR, batchio.FILE)
                paths += (name, f"{name}/zarr.json")
                buffers += (b"", document)
                pads += (2 if whole else 0, 0)
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
            reuse=None if self._reused is None else os.fspath(self._reused),
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
        if self._reused is not None:  # what this save did not take of the reused files
            fsutil.rmtree_quiet(self._reused)
            self._reused = None
        self._write_file(ROOT_KEY, [root_document])
        self._make_durable()
        try:
            mode = self._target_mode()  # judged again: another process may have changed it meanwhile
        except CheckpointExistsError:
            if self._begun in ("new", "empty") and is_committed(self.path):
                raise CheckpointExistsError(
                    f"Checkpoint already exists at {self.path}: another save published it while this one "
                    "ran; this save was discarded and the other one kept"
                ) from None
            raise
        if mode == "replace":
            if not fsutil.exchange(self.tmp, self.path):
                self._replace_by_two_renames()
            else:
                fsutil.rmtree_quiet(self.tmp)  # it holds the previous checkpoint now
        elif mode == "into":
            self._publish_into()
        else:
            try:
                if mode == "new":
                    fsutil.rename_noreplace(self.tmp, self.path)
                else:
                    os.rename(self.tmp, self.path)  # replaces an empty directory, and only an empty one
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    raise CheckpointExistsError(
                        f"Checkpoint already exists at {self.path}: another save published it (or put files "
                        "there) while this one ran; this save was discarded and the other one kept"
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

    def _publish_into(self) -> None:
        """Publish into the directory at the path, which holds other files
        (:func:`~gpuckpt.storage.local.shared_dir.publish_into`), holding its lock; the set-aside
        directory is removed once the publication is done or undone (kept, with its journal,
        if undoing failed too: the next save settles it)."""
        held = self._lock_target()
        try:
            aside, fd = self._make_locked(self._new_name(OLD_TAG), OLD_TAG)
            done = False
            try:
                publish_into(self.tmp, self.path, aside)
                done = True
            finally:
                if done or set(os.listdir(aside)) <= {JOURNAL}:
                    fsutil.rmtree_quiet(aside)
                if fd is not None:
                    fsutil.unlock(fd)
            fsutil.rmtree_quiet(self.tmp)  # empty now, but for names it never had
        finally:
            if held is not None:
                fsutil.unlock(held)

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


def _copy_segments(views: list[memoryview], dst: memoryview) -> list[tuple[int, int]] | None:
    """Copy ``views`` one after the other into the start of ``dst`` with the CRC32C of each
    segment (:data:`~gpuckpt.format.segments.SEGMENT_BYTES`, the last one shorter), in one
    native call; None where a copy could not be made or was interrupted."""
    crcs = crccopy.guarded_copy_segments(views, dst, SEGMENT_BYTES)
    if crcs is None:
        return None
    total = dst.nbytes
    return [(crc, min(SEGMENT_BYTES, total - k * SEGMENT_BYTES)) for k, crc in enumerate(crcs)]
