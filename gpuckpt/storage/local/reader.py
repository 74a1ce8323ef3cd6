"""Reading checkpoints in a directory of a local (or POSIX shared) file system.

Every file is opened through :func:`open_regular` (no symbolic links, no FIFOs or
devices: regular files only); documents are size-capped before a byte is read;
chunk files are read with their CRC32C trailer in one pass (the native batches of
:mod:`gpuckpt.storage.local.batchio` for many small ones, piece by piece, around the page
cache where chosen, for large ones). Writing is :mod:`gpuckpt.storage.local.writer`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpuckpt.errors import (
    CheckpointNotFoundError,
    MetadataError,
)
from gpuckpt.format.checksum import CRC_BYTES, SMALL_BYTES, crc32c, large_backend_ready
from gpuckpt.format.documents import (
    MAX_ARRAY_DOCUMENT_BYTES,
    MAX_ROOT_DOCUMENT_BYTES,
    ROOT_KEY,
    is_chunk_file_key,
    too_large,
)
from gpuckpt.storage.base import (
    Capabilities,
    CheckpointReader,
    ChunkReads,
    NotRegularFileError,
    ReadStop,
)
from gpuckpt.storage.local import batchio, crccopy, fsutil
from gpuckpt.storage.local.direct import DIRECT_MIN_BYTES, read_direct
from gpuckpt.storage.local.fileio import (
    buffer_address,
    read_crcs_at,
    read_exact,
    read_exact_at,
    readv_exact,
)
from gpuckpt.storage.local.fsutil import open_regular
from gpuckpt.storage.local.leftovers import (
    TMP_TAG,
    set_aside_copies,
    side_prefix,
)

__all__ = ["DIRECT_ALIGN", "NATIVE_MAX_BYTES", "PIECE_BYTES", "LocalReader", "open_regular"]

#: large chunk files are read (and written) piece by piece, this many bytes at a time
PIECE_BYTES = 1 << 20
#: O_DIRECT reads fill whole blocks of this size
DIRECT_ALIGN = 4096
#: chunk files smaller than this go through the native batches (larger ones are read
#: and written piece by piece, around the page cache where chosen, one by one)
NATIVE_MAX_BYTES = min(PIECE_BYTES, DIRECT_MIN_BYTES)
#: on a file system that keeps its files in memory (tmpfs: a local tier) where the one-pass
#: copy out of a map is not built, chunk files under this many bytes are read in native
#: batches too: a file of 1-4 MiB read and checksummed in one call with the GIL released rather
#: than from Python piece by piece (a GPT-like part of 289 tensors, 97 such files: its load
#: 52 -> 49 ms in one process). Where it is built, files of 1 MiB and more are copied out of
#: populated maps instead, pread's page-by-page copy avoided (the same part: 46-48 -> 34-35 ms,
#: against 41 ms for a plain read with 4 threads, one process, 2026-12-05)
NATIVE_MEMORY_MAX_BYTES = 8 << 20


def _cold(fd: int) -> bool:
    """Whether a large chunk the native loop did not copy from the page cache is cold, asked of
    ``mincore`` (its first page). The loop declines cached chunks too where it is not built (an
    install without a C compiler; where it is, it copies every tmpfs chunk, out of a populated
    map). Read around the cache, a cached chunk would load at the disk's speed, or, on tmpfs, be
    read whole and then read again for its checksum; ``pread`` in pieces checksums each piece
    while it is in the CPU's cache."""
    return fsutil.first_page_cached(fd) is not True


def _crc(data: Any, value: int = 0) -> int:
    """CRC32C of bytes just read, continued from ``value``.

    A buffer of :data:`~gpuckpt.format.checksum.SMALL_BYTES` or more goes to
    :func:`~gpuckpt.format.checksum.crc32c` only where its library for large buffers is
    ready; otherwise to the native library of :mod:`~gpuckpt.storage.local.batchio`, which loads
    in about a millisecond (and which loads of small chunks load anyway). ``crc32c`` would
    load awscrt for it: 40-60 ms (its random generator's start-up), during which the GIL
    is held and every thread of the load waits; the first load of a process with one chunk
    of 256 KiB to 1 MiB paid that.
    """
    if memoryview(data).nbytes >= SMALL_BYTES and not large_backend_ready():
        lib = batchio.instance_or_none()  # (the batches that need it raise its error)
        if lib is not None:
            return lib.crc32c(data, value)
    return crc32c(data, value)


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


def _chunk_sizes(batch: ChunkReads) -> list[int]:
    """The stored size of each chunk of ``batch`` (its bytes and its pad)."""
    return [memoryview(b).nbytes + p for b, p in zip(batch.buffers, batch.pads, strict=True)]


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

    def __init__(self, path: str | os.PathLike[str], *, direct_io: bool = True) -> None:
        self.path = Path(path)
        self._root = os.fspath(self.path)
        self._dirs: set[str] | None = None
        self._dirs_lock = threading.Lock()  # a load's size check may list them on another thread
        #: large chunk parts read by each path: ``"cached"`` (copied and checksummed in one
        #: pass from the page cache), ``"direct"`` (O_DIRECT into aligned memory: cold),
        #: ``"buffered"`` (pread and checksum in pieces), ``"memory"`` (in a native batch, on a
        #: file system that keeps its files in memory); a record for tests and benchmarks
        self.read_paths = {"cached": 0, "direct": 0, "buffered": 0, "memory": 0}
        self._memory: bool | None = None  # on tmpfs (fsutil.memory_backed), asked once
        self._paths_lock = threading.Lock()
        # cold chunks are read around the page cache unless the load says not to
        # (LoadOptions.direct_io); turned off for good the first time the file system refuses
        self._direct = direct_io

    def _native_limit(self) -> int:
        """The size under which chunk files go to the native batches (see
        :data:`NATIVE_MEMORY_MAX_BYTES`); large ones read that way count as ``"memory"``."""
        if self._memory is None:
            self._memory = fsutil.memory_backed(self._root)
        return NATIVE_MEMORY_MAX_BYTES if self._memory and not crccopy.available() else NATIVE_MAX_BYTES

    def _note(self, path: str, count: int = 1) -> None:
        with self._paths_lock:
            self.read_paths[path] += count

    def _note_memory(self, sizes: Sequence[int]) -> None:
        """Counts the chunks of these stored ``sizes``, read natively, of :data:`NATIVE_MAX_BYTES`
        or more (read so because the store keeps its files in memory)."""
        if not self._memory:
            return
        large = sum(n >= NATIVE_MAX_BYTES for n in sizes)
        if large:
            self._note("memory", large)

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
                prefix = side_prefix(self.path.name, TMP_TAG)
                if any(p.name.startswith(prefix) for p in self.path.parent.iterdir()):
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
                if os.path.isfile(self.path / ".metadata"):  # (what DCP's FileSystemWriter writes)
                    raise CheckpointNotFoundError(
                        f"{self.path} is a torch.distributed.checkpoint directory (DCP's FileSystemWriter "
                        f"wrote it: it holds a .metadata file and no {ROOT_KEY}), not a gpuckpt checkpoint: "
                        "read it with torch.distributed.checkpoint.FileSystemReader, or convert it once with "
                        f"`gpuckpt convert {self.path} CKPT --trust-pickle-metadata` (its .metadata is a "
                        "pickle: only for a directory you trust)"
                    ) from None
                held = hint or _held(self.path)
                raise CheckpointNotFoundError(
                    f"{self.path} is not a committed checkpoint: it has no {ROOT_KEY}{held}"
                ) from None
            raise CheckpointNotFoundError(
                f"no checkpoint at {self.path}{hint or ': nothing is there (check the path)'}"
            ) from None
        except NotADirectoryError:
            if self.path.is_file():
                raise CheckpointNotFoundError(
                    f"{self.path} is a file, not a checkpoint (a directory holding {ROOT_KEY})"
                ) from None
            raise CheckpointNotFoundError(
                f"no checkpoint at {self.path}: a part of the path is a file"
            ) from None
        except OSError as exc:
            raise CheckpointNotFoundError(f"cannot open {root}: {exc.strerror}") from None

    def _array_dirs(self) -> set[str]:
        """The names of the real (not symlinked) directories of the checkpoint, listed once."""
        dirs = self._dirs
        if dirs is None:
            with self._dirs_lock:
                dirs = self._dirs
                if dirs is None:
                    with os.scandir(self._root) as it:
                        dirs = self._dirs = {e.name for e in it if e.is_dir(follow_symlinks=False)}
        return dirs

    def _array_dir(self, name: str) -> str:
        if name not in self._array_dirs():
            raise FileNotFoundError(errno.ENOENT, "array directory missing or not a directory", name)
        return f"{self._root}/{name}"

    def read_array_document(self, name: str) -> bytearray:
        return _read_document(
            f"{self._array_dir(name)}/zarr.json", MAX_ARRAY_DOCUMENT_BYTES, "MAX_ARRAY_DOCUMENT_BYTES"
        )

    def chunk_keys(self, name: str) -> set[str]:
        """The chunk keys in the array's directory (one ``scandir``; a missing or symlinked
        directory holds none)."""
        try:
            where = self._array_dir(name)
            with os.scandir(where) as it:
                return {e.name for e in it if is_chunk_file_key(e.name)}
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def _lstat_entry(self, name: str, key: str) -> os.stat_result | None:
        """What stands where chunk ``key`` of array ``name`` is, of any kind (None: nothing, or
        no array directory)."""
        try:
            return os.lstat(f"{self._array_dir(name)}/{key}")
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _lstat_chunk(self, name: str, key: str) -> os.stat_result | None:
        st = self._lstat_entry(name, key)
        return st if st is not None and stat.S_ISREG(st.st_mode) else None

    def chunk_nbytes(self, name: str, key: str) -> int | None:
        st = self._lstat_chunk(name, key)
        return None if st is None else st.st_size

    def chunk_absence(self, name: str, key: str) -> str:
        st = self._lstat_entry(name, key)
        if st is None or stat.S_ISREG(st.st_mode):  # (a file put there since it was found absent)
            return "missing"
        return str(NotRegularFileError(f"{self._root}/{name}/{key}", st.st_mode).strerror)

    def chunk_sizes(self, names: Sequence[str], keys: Sequence[str]) -> list[int | None]:
        """One native call for all of them (:mod:`gpuckpt.storage.local.batchio`) where the library
        is available: the checks before a load of many small tensors were one ``lstat``
        from Python per chunk."""
        lib = batchio.instance()
        if lib is None or len(names) < 2:
            return super().chunk_sizes(names, keys)
        dirs = self._array_dirs()
        try:
            sizes, _stops = lib.sizes(self._root, [f"{n}/{k}" for n, k in zip(names, keys, strict=True)])
        except (FileNotFoundError, NotADirectoryError):  # the checkpoint itself, opened by name
            raise CheckpointNotFoundError(
                f"{self.path} was removed while it was read (another process deleted or replaced it: "
                "a manager's retention, an overwrite); nothing of it was loaded: load again"
            ) from None
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
            if len(dests) == 2 and memoryview(dests[0]).nbytes <= PIECE_BYTES:
                # a small chunk: one system call for its bytes and its checksum
                total = readv_exact(fd, dests)
                return total, _crc(dests[0]) if total >= memoryview(dests[0]).nbytes else 0
            total = value = 0
            for d in dests[:-1]:
                view = memoryview(d).cast("B")
                start = 0
                if view.nbytes >= PIECE_BYTES:
                    # in the page cache: copied and checksummed in one pass (crccopy.c)
                    fused = crccopy.cached_copy_crc(fd, total, view, value)
                    if fused is not None:
                        value = fused
                        total += view.nbytes
                        self._note("cached")
                        continue
                    if total == 0 and self._direct and buffer_address(view) % DIRECT_ALIGN == 0 and _cold(fd):
                        # not cached (a cold load): straight from the disk into aligned memory
                        start = self._read_direct(fd, view)
                        if start:
                            value = _crc(view[:start], value)
                            total = start
                            if start % DIRECT_ALIGN:
                                return total, value  # the file ended early
                    if not start:
                        self._note("buffered")
                # read and checksum in pieces that are still in the CPU cache
                for i in range(start, view.nbytes, PIECE_BYTES):
                    piece = view[i : i + PIECE_BYTES]
                    n = read_exact_at(fd, piece, total)
                    total += n
                    if n < piece.nbytes:
                        return total, value
                    value = _crc(piece, value)
            return total + read_exact_at(fd, dests[-1], total), value
        finally:
            os.close(fd)

    def _read_direct(self, fd: int, view: memoryview) -> int:
        """The bytes of ``view`` read with O_DIRECT from offset 0 (0 where not possible)."""
        got = read_direct(fd, view)  # the caller checked that the memory is aligned
        if got is None:
            self._direct = False  # the file system refuses: buffered from now on
            return 0
        self._note("direct")
        return got

    def read_chunks(self, batch: ChunkReads) -> ReadStop | None:
        """Runs of chunks under 1 MiB in one native call each, with the GIL released
        (:mod:`gpuckpt.storage.local.batchio`), where the library is available; larger ones,
        and all without the library, one file at a time (:meth:`read_chunk_crc`: copied and
        checksummed in one pass when cached). Files are opened as :func:`open_regular`
        does, in array directories checked as :meth:`read_chunk_crc` checks them."""
        lib = batchio.instance()
        if lib is None:
            return super().read_chunks(batch)
        sizes = _chunk_sizes(batch)
        limit = self._native_limit()
        small = [n < limit for n in sizes]
        start = 0
        while start < len(small):
            end = start
            while end < len(small) and small[end] == small[start]:
                end += 1
            run = batch if start == 0 and end == len(small) else batch.select(range(start, end))
            if small[start]:
                self._note_memory(sizes[start:end])
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
            self._root,
            paths,
            batch.buffers[:count],
            batch.pads[:count],
            batch.expected[:count],
            checked=batch.checked,
        )
        return missing if stop is None else self._read_stop(stop, batch)

    def _read_stop(self, stop: batchio.Stop, batch: ChunkReads) -> ReadStop:
        """The :class:`ReadStop` of the library's ``stop`` in ``batch``."""
        path = f"{self._root}/{batch.names[stop.index]}/{batch.keys[stop.index]}"
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

    def chunk_read_jobs(
        self, batch: ChunkReads, spans: Sequence[tuple[int, int]]
    ) -> list[Callable[[], ReadStop | None]]:
        """The library's items for the whole batch made once, in this thread (a batch of
        10,000 small chunks spent more of its time making them, range by range, than
        reading), then read a range per job; ranges holding a chunk of 1 MiB or more, and
        all of them without the library or when a name is not a known array directory
        (the per-range path reports it), as :meth:`read_chunks` reads them."""
        lib = batchio.instance()
        if lib is None or not self._array_dirs().issuperset(batch.names):
            return super().chunk_read_jobs(batch, spans)
        sizes = _chunk_sizes(batch)
        limit = self._native_limit()
        small = [n < limit for n in sizes]
        prepared = lib.prepare_read(
            [f"{n}/{k}" for n, k in zip(batch.names, batch.keys, strict=True)],
            batch.buffers,
            batch.pads,
            batch.expected,
            checked=batch.checked,
        )
        fallback = dict(zip(spans, super().chunk_read_jobs(batch, spans), strict=True))

        def job(start: int, stop: int) -> ReadStop | None:
            self._note_memory(sizes[start:stop])
            where = prepared.read(self._root, start, stop)
            return None if where is None else self._read_stop(where, batch)

        return [functools.partial(job, a, b) if all(small[a:b]) else fallback[a, b] for a, b in spans]

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
                value = _crc(view[:n], value)
                total += n
                if n < view.nbytes:
                    return total, value, 0
            trailer = bytearray(CRC_BYTES)
            total += read_exact_at(fd, trailer, total)
            return total, value, int.from_bytes(trailer, "little")
        finally:
            os.close(fd)

    def chunk_cached(self, name: str, key: str) -> bool | None:
        """Whether the first page of the chunk file is in the page cache
        (:func:`~gpuckpt.storage.local.fsutil.first_page_cached`: it reads nothing, so asking
        warms nothing); None where that cannot be told or the file cannot be opened."""
        try:
            fd = self._open_chunk(name, key)
        except OSError:
            return None
        try:
            return fsutil.first_page_cached(fd)
        except OSError:
            return None
        finally:
            os.close(fd)

    def _open_chunk(self, name: str, key: str) -> int:
        try:
            return open_regular(f"{self._array_dir(name)}/{key}")
        except NotADirectoryError:
            raise FileNotFoundError(errno.ENOENT, "array directory is not a directory", name) from None

    capabilities = Capabilities(reads_ranges=True)

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


def _held(path: Path) -> str:
    """What a directory that is no checkpoint holds, said for the error of a load from it: a
    manager's steps (load one of them), nothing at all, or else nothing more."""
    try:
        with os.scandir(path) as it:
            names = sorted(e.name for e in itertools.islice(it, 10_000))
    except OSError:
        return ""
    if not names:
        return " (the directory is empty)"
    steps = [n for n in names if n.startswith("step_") and n[5:].isdigit()]
    if steps:
        more = "..., " if len(steps) > 3 else ""
        return (
            f"; it holds a CheckpointManager's steps ({more}{', '.join(steps[-3:])}): "
            f"load one of them ({path / steps[-1]}), or restore with CheckpointManager('{path}')"
        )
    return ""
