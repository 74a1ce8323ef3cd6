"""Batches of small chunk files written and read by native code (``batchio.c``), where it was built.

A checkpoint of thousands of small tensors is mostly system calls (a directory,
a document and a chunk file per tensor). From Python each call holds the
interpreter, so the I/O threads take turns; :class:`BatchIO` hands a whole
batch to C in one call with the GIL released and gets back, per item, how far
it got, the CRC32C it wrote or read, and the ``errno`` and step of a failure.
The local back end (:class:`~gpuckpt.storage.local.writer.LocalWriter`,
:class:`~gpuckpt.storage.local.reader.LocalReader`) turns those into the same errors
as its one-file-at-a-time path, which is also the fallback.

The package's build hook compiles ``_batchio.so`` next to this file when a C
compiler is available (Linux). ``GPUCKPT_BATCHIO`` chooses: ``auto`` (default:
use it when built and it passes a self-test), ``off``, or ``on`` (an error if
it cannot be used).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from gpuckpt.format.checksum import _crc_package
from gpuckpt.options import switch_from_env
from gpuckpt.runtime.workers import Workers

__all__ = [
    "LIBRARY",
    "BatchIO",
    "PreparedReads",
    "Stop",
    "available",
    "instance",
    "instance_or_none",
    "load_library",
]

LIBRARY = Path(__file__).with_name("_batchio.so")
#: files that :meth:`BatchIO.sizes` checks on two threads (fewer: on one)
PARALLEL_STAT_MIN = 2048
_ABI = 9
#: the second thread of :meth:`BatchIO.sizes`
_stat_threads = Workers(4, "gpuckpt-stat")
_LEVELS = {0: "table", 1: "pclmul", 2: "avx512"}

MKDIR, FILE, CHUNK, TAKEDIR = 1, 2, 3, 4
STEPS = {
    1: "mkdir",
    2: "open",
    3: "write",
    4: "fsync",
    5: "close",
    6: "stat",
    7: "not-regular",
    8: "read",
    9: "short",
    10: "mismatch",
    11: "long",
}
_FSYNC, _WRITEBACK, _FSYNC_GROUP, _OVER = 1, 2, 4, 8
#: flag of gbio_read: the files were checked (BatchIO.sizes) just before
_CHECKED = 1

#: ``struct gbio_item`` of batchio.c
ITEM = np.dtype(
    [
        ("path", np.uint64),
        ("data", np.uint64),
        ("nbytes", np.uint64),
        ("pad", np.uint64),
        ("kind", np.uint32),
        ("expect", np.uint32),
        ("err", np.int32),
        ("step", np.int32),
        ("crc", np.uint32),
        ("stored", np.uint32),
        ("done", np.uint64),
        ("mode", np.uint32),
        ("taken", np.uint32),
    ]
)


@dataclass(frozen=True, slots=True)
class Stop:
    """Where a batch stopped: item ``index`` did not complete.

    ``step`` is one of :data:`STEPS`' values; ``err`` the ``errno`` of a system
    error (0 for ``short`` and ``mismatch``); ``mode`` the ``st_mode`` of a file
    that is not regular; ``done`` the bytes written or read, trailer included;
    ``crc`` the CRC32C of the data and padding, ``stored`` the trailer read.
    """

    index: int
    step: str
    err: int
    mode: int
    done: int
    crc: int
    stored: int

    def os_error(self, path: str) -> OSError:
        """The system error as Python raises it (``FileNotFoundError`` for ``ENOENT``, ...)."""
        return OSError(self.err, os.strerror(self.err), path)


def _address(buf: Any, writable: bool) -> tuple[int, int]:
    """``(address, nbytes)`` of a C-contiguous buffer."""
    if isinstance(buf, np.ndarray):
        flags = buf.flags
        if not flags.c_contiguous:
            raise ValueError("batchio: a buffer is not C-contiguous")
        nbytes = buf.nbytes
        if not nbytes:
            return 0, 0
        if flags.writeable:  # the cheapest way to the address (a third of __array_interface__'s cost)
            return ctypes.addressof(ctypes.c_char.from_buffer(buf)), nbytes
        if writable:
            raise ValueError("batchio: a destination is read-only")
        return buf.__array_interface__["data"][0], nbytes
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("batchio: a buffer is not C-contiguous")
    if writable and view.readonly:
        raise ValueError("batchio: a destination is read-only")
    if not view.nbytes:
        return 0, 0
    arr = np.frombuffer(view.cast("B"), np.uint8)
    return int(arr.__array_interface__["data"][0]), view.nbytes


class BatchIO:
    """One loaded copy of the library (tests load several, one per CRC code path)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        lib = ctypes.CDLL(os.fspath(path))
        lib.gbio_abi.restype = ctypes.c_int
        if lib.gbio_abi() != _ABI:
            raise ImportError(f"{path} was built from another version of batchio.c; reinstall gpuckpt")
        lib.gbio_item_size.restype = ctypes.c_int
        if lib.gbio_item_size() != ITEM.itemsize:
            raise ImportError(
                f"{path}: struct gbio_item is {lib.gbio_item_size()} bytes, expected {ITEM.itemsize}"
            )
        lib.gbio_isa.restype = ctypes.c_int
        lib.gbio_limit_isa.restype = ctypes.c_int
        lib.gbio_limit_isa.argtypes = [ctypes.c_int]
        lib.gbio_crc32c.restype = ctypes.c_uint32
        lib.gbio_crc32c.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]
        lib.gbio_write.restype = ctypes.c_int64
        lib.gbio_write.argtypes = [
            ctypes.c_char_p,
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_uint32,
            ctypes.c_uint64,
            ctypes.c_char_p,
        ]
        lib.gbio_read.restype = ctypes.c_int64
        lib.gbio_read.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32]
        lib.gbio_stat.restype = ctypes.c_int64
        lib.gbio_stat.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_uint64]
        lib.gbio_remove_tree.restype = ctypes.c_int64
        lib.gbio_remove_tree.argtypes = [ctypes.c_char_p]
        lib.gbio_tree_bytes.restype = ctypes.c_int64
        lib.gbio_tree_bytes.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint64)]
        lib.gbio_isa()  # chooses the CRC code once, on this thread
        self._lib = lib

    @property
    def isa(self) -> str:
        """The CRC32C code in use: ``"avx512"``, ``"pclmul"`` or ``"table"``."""
        return _LEVELS[self._lib.gbio_isa()]

    def limit(self, isa: str) -> str:
        """Use at most ``isa``; returns the code now in use."""
        code = {name: c for c, name in _LEVELS.items()}[isa]
        return _LEVELS[self._lib.gbio_limit_isa(code)]

    def crc32c(self, data: Any, value: int = 0) -> int:
        """CRC32C of the C-contiguous buffer ``data``, continued from ``value``."""
        address, nbytes = _address(data, writable=False)
        return int(self._lib.gbio_crc32c(value, address, nbytes))

    @staticmethod
    def _items(paths: Sequence[str], kinds: Sequence[int]) -> tuple[np.ndarray, bytes]:
        joined = "\0".join(paths) + "\0"
        blob = os.fsencode(joined)
        # the byte length of each path: its length in characters when all are ASCII
        lengths = [len(p) for p in paths] if joined.isascii() else [len(os.fsencode(p)) for p in paths]
        items = np.zeros(len(paths), ITEM)
        if paths:
            starts = np.zeros(len(paths), np.uint64)
            np.cumsum([n + 1 for n in lengths[:-1]], out=starts[1:])
            items["path"] = starts + np.uint64(np.frombuffer(blob, np.uint8).__array_interface__["data"][0])
        items["kind"] = kinds
        return items, blob

    def write(
        self,
        root: str,
        kinds: Sequence[int],
        paths: Sequence[str],
        buffers: Sequence[Any],
        pads: Sequence[int],
        *,
        fsync: str | None,
        writeback_min: int | None,
        reuse: str | None = None,
        over: bool = False,
    ) -> tuple[np.ndarray, Stop | None]:
        """Create the items under ``root`` in order (see ``gbio_write`` in batchio.c).

        ``kinds[i]`` is :data:`MKDIR` (``buffers[i]`` unused), :data:`FILE` or
        :data:`CHUNK` (``buffers[i]``, ``pads[i]`` zero bytes, and for a chunk
        its CRC32C), or :data:`TAKEDIR`: a directory taken from ``reuse`` (a directory
        of the files of a checkpoint this save replaces) where it is there, else made, and
        ``pads[i]`` items after it that are all its files (``"dir/file"``), written over the
        files there (their ``taken`` field says which were) and what else it held removed.
        ``fsync="each"`` syncs each file as it is written, ``"group"``
        syncs them a group at a time once written (fewer journal commits); else
        ``writeback_min`` (if not None) starts the writeback of files at least that
        large. ``over``: every file and chunk is written over the regular file of its name
        of one link where there is one (cut to its new size), else made anew, whatever stood
        there removed; their folders must exist and be directories (the caller's to make).
        Returns the items (their ``crc`` field holds each chunk's CRC32C) and where it
        stopped, if it did.
        """
        items, blob = self._items(paths, kinds)
        dirs = (MKDIR, TAKEDIR)
        data = [b if k not in dirs else b"" for b, k in zip(buffers, kinds, strict=True)]
        self._buffers(items, data, False)
        items["pad"] = pads
        if fsync not in (None, "each", "group"):
            raise ValueError(f"fsync={fsync!r}; expected None, 'each' or 'group'")
        flags = (
            _FSYNC
            if fsync == "each"
            else _FSYNC_GROUP
            if fsync == "group"
            else _WRITEBACK
            if writeback_min is not None
            else 0
        )
        if over:
            flags |= _OVER
        wb = writeback_min if writeback_min is not None else 2**64 - 1
        taken = None if reuse is None else os.fsencode(reuse)
        done = self._lib.gbio_write(os.fsencode(root), items.ctypes.data, len(items), flags, wb, taken)
        del blob  # referenced until the call returned
        return items, self._stop(items, done, root)

    def remove_tree(self, path: str | os.PathLike[str]) -> int:
        """Remove the directory ``path`` and everything under it, links not followed (a link
        is removed, never what it points to; ``path`` itself must be a directory); returns
        how many entries went. Raises the first ``OSError`` met, after removing what it could.

        With the GIL released: a part of 10,000 small tensors is 40,000 entries, which
        ``shutil.rmtree`` removed at about 9 us each, most of it in the interpreter."""
        done = self._lib.gbio_remove_tree(os.fsencode(path))
        if done < 0:
            raise OSError(-done, os.strerror(-done), os.fspath(path))
        return int(done)

    def tree_bytes(self, path: str | os.PathLike[str]) -> tuple[int, int]:
        """``(files, bytes)`` of the regular files below the directory ``path``, links not
        followed, entries removed meanwhile passed over. Raises ``OSError`` where ``path`` is
        no directory (a link to one included).

        With the GIL released: a restore reports its part's bytes, and a part of 10,000 small
        tensors is 30,000 entries, which ``os.scandir`` and a ``stat`` each took 0.13 s over."""
        total = ctypes.c_uint64(0)
        files = self._lib.gbio_tree_bytes(os.fsencode(path), ctypes.byref(total))
        if files < 0:
            raise OSError(-files, os.strerror(-files), os.fspath(path))
        return int(files), int(total.value)

    def prepare_read(
        self,
        paths: Sequence[str],
        buffers: Sequence[Any],
        pads: Sequence[int],
        expected: Sequence[int],
        *,
        checked: bool = False,
    ) -> PreparedReads:
        """The items of :meth:`read`, made once: :meth:`PreparedReads.read` then reads any
        range of them (from any thread, each range once)."""
        return self._prepare(paths, buffers, pads, expected, checked)

    def _prepare(
        self,
        paths: Sequence[str],
        buffers: Sequence[Any],
        pads: Sequence[int],
        expected: Sequence[int],
        checked: bool,
    ) -> PreparedReads:
        items, blob = self._items(paths, [CHUNK] * len(paths))
        self._buffers(items, buffers, True)
        items["pad"] = pads
        items["expect"] = expected
        return PreparedReads(self, items, blob, _CHECKED if checked else 0)

    def read(
        self,
        root: str,
        paths: Sequence[str],
        buffers: Sequence[Any],
        pads: Sequence[int],
        expected: Sequence[int],
        *,
        checked: bool = False,
    ) -> tuple[np.ndarray, Stop | None]:
        """Read chunk ``paths[i]`` under ``root`` into ``buffers[i]``, then ``pads[i]`` bytes
        that are checksummed and dropped, then its trailer, and check the CRC32C against
        the trailer and ``expected[i]`` (see ``gbio_read`` in batchio.c). ``checked``: every
        path was found a regular file by :meth:`sizes` just before; each is then opened
        without looking at it first (what was opened is still refused if not a regular file)."""
        prepared = self._prepare(paths, buffers, pads, expected, checked)
        return prepared.items, prepared.read(root, 0, len(paths))

    def read_files(self, root: str, paths: Sequence[str], buffers: Sequence[Any]) -> Stop | None:
        """Read each whole file ``paths[i]`` under ``root`` into ``buffers[i]``, which is its
        size: a file that holds fewer bytes stops the batch at step ``short``, one that holds
        more at ``long`` (``done`` then says how many were read, at most one more). Files are
        opened as chunks are (regular files only, no link followed, never blocking). Returns
        where it stopped, if it did."""
        items, blob = self._items(paths, [FILE] * len(paths))
        self._buffers(items, buffers, True)
        done = self._lib.gbio_read(os.fsencode(root), items.ctypes.data, len(items), 0)
        del blob  # referenced until the call returned
        return self._stop(items, done, root)

    def sizes(self, root: str, paths: Sequence[str]) -> tuple[np.ndarray, list[Stop]]:
        """The size of each regular file ``paths[i]`` under ``root`` (-1 where it is not
        one), and a :class:`Stop` for every path that is missing or not a regular file
        (see ``gbio_stat`` in batchio.c); nothing is opened."""
        items, blob = self._items(paths, [CHUNK] * len(paths))
        where, base, n = os.fsencode(root), items.ctypes.data, len(items)
        # the second half on a second thread (the library releases the GIL): a load of many
        # small chunks checks every file before it reads any
        half = n // 2 if n >= PARALLEL_STAT_MIN else n
        # (a pool's thread, not one started here: at interpreter exit none can be started,
        # and the pool then runs the call in this thread)
        tail = (
            _stat_threads.submit(self._lib.gbio_stat, where, base + half * items.itemsize, n - half)
            if half < n
            else None
        )
        results = [0, 0]
        try:
            results[0] = self._lib.gbio_stat(where, base, half)
        finally:
            if tail is not None:
                results[1] = tail.result()
        del blob
        for done in results:
            if done < 0:
                raise OSError(-done, os.strerror(-done), root)
        failed = np.flatnonzero(items["step"])
        sizes = items["done"].astype(np.int64)
        sizes[failed] = -1
        stops = [
            Stop(
                int(i),
                STEPS.get(int(items["step"][i]), "unknown"),
                int(items["err"][i]),
                int(items["mode"][i]),
                0,
                0,
                0,
            )
            for i in failed
        ]
        return sizes, stops

    @staticmethod
    def _buffers(items: np.ndarray, buffers: Sequence[Any], writable: bool) -> None:
        if len(buffers) != len(items):
            raise ValueError(f"batchio: {len(buffers)} buffers for {len(items)} items")
        if len(items):
            addresses, sizes = zip(*[_address(b, writable) for b in buffers], strict=True)
            items["data"] = addresses
            items["nbytes"] = sizes

    @staticmethod
    def _stop(items: np.ndarray, done: int, root: str) -> Stop | None:
        if done < 0:
            raise OSError(-done, os.strerror(-done), root)
        if done == len(items):
            return None
        it = items[done]
        return Stop(
            done,
            STEPS.get(int(it["step"]), "unknown"),
            int(it["err"]),
            int(it["mode"]),
            int(it["done"]),
            int(it["crc"]),
            int(it["stored"]),
        )

    def self_test(self) -> bool:
        """Agreement with the crc32c package around every threshold of the vector loops
        (a CPU that lacks what the build assumed fails here), from a non-zero start too."""
        sample = bytes((i * 131 + 7) & 0xFF for i in range(1100))
        for n in (0, 1, 7, 63, 64, 127, 128, 255, 256, 511, 512, 1100):
            for start in (0, 0x9ABCDEF0):
                if self.crc32c(sample[:n], start) != _crc_package(sample[:n], start):
                    return False
        return self.crc32c(b"123456789") == 0xE3069283


class PreparedReads:
    """Chunk reads made into the library's items once (see :meth:`BatchIO.prepare_read`)."""

    def __init__(self, lib: BatchIO, items: np.ndarray, blob: bytes, flags: int = 0) -> None:
        self._lib, self.items, self._blob = lib, items, blob  # the blob holds the paths
        self._flags = flags

    def read(self, root: str, start: int, stop: int) -> Stop | None:
        """Read items ``[start, stop)`` (as :meth:`BatchIO.read`); where they stopped, the
        index counted from the first item of all."""
        part = self.items[start:stop]
        done = self._lib._lib.gbio_read(os.fsencode(root), part.ctypes.data, len(part), self._flags)
        where = BatchIO._stop(part, done, root)
        return None if where is None else replace(where, index=start + where.index)


def load_library(path: str | os.PathLike[str] | None = None) -> BatchIO | None:
    """The library at ``path`` (default :data:`LIBRARY`) if it loads and passes its self-test."""
    try:
        lib = BatchIO(LIBRARY if path is None else path)
    except (OSError, ImportError, AttributeError):
        return None
    return lib if lib.self_test() else None


@functools.cache
def instance() -> BatchIO | None:
    """The library that batches use, or None (then the local back end goes file by file)."""
    choice = switch_from_env("GPUCKPT_BATCHIO")
    if choice == "off":
        return None
    lib = load_library()
    if lib is None and choice == "on":
        raise ImportError(
            f"GPUCKPT_BATCHIO=on but {LIBRARY} is missing, was built from another version of batchio.c, "
            "or failed its self-test: reinstall gpuckpt with a C compiler on PATH, or unset GPUCKPT_BATCHIO"
        )
    return lib


def instance_or_none() -> BatchIO | None:
    """:func:`instance`, or None where it raises (``GPUCKPT_BATCHIO=on`` without the library,
    or an unknown value): for callers with a path of their own that need not report it."""
    try:
        return instance()
    except (ImportError, ValueError):
        return None


def available() -> bool:
    """Whether batches of small chunk files are written and read by the native library."""
    return instance() is not None
