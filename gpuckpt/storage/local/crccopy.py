"""The native copy-with-CRC32C loop (``crccopy.c``), where it was built for this machine.

Loading a chunk that is in the page cache through ``pread`` moves every byte twice:
the kernel copies it out, then the checksum reads it again. ``crccopy.c`` reads it
once from a memory map, checksums and copies it in the same pass, and so loads at
the speed of a plain memory copy (x86-64 with PCLMULQDQ; fastest with AVX-512).

The package's build hook compiles it into ``_crccopy.so`` next to this file when a
C compiler is available; without it (or on other CPUs) :func:`available` is False and
the reader uses ``pread`` plus the CRC32C library, with identical results.
``GPUCKPT_CRCCOPY`` chooses: ``auto`` (default: use it when built and it passes a
self-test), ``off``, or ``on`` (an error if it cannot be used).

A file truncated while it is mapped (``cp``, ``rsync --inplace`` or ``: > file`` over a
checkpoint during a load), or a page of it that cannot be read, makes the next read of
the map raise SIGBUS, which would kill the process. The library guards each copy out
of a map: its SIGBUS handler jumps back out of a copy that faults on its own pages, and
:func:`cached_copy_crc` then returns None, so the reader reads the range again with
``pread``, meets the file as it now is, and raises the same typed error as for any
truncated file. A SIGBUS anywhere else goes to the handler that was installed before
(the default action, or Python's ``faulthandler``), as without the library.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpuckpt.format.checksum import crc32c
from gpuckpt.options import switch_from_env
from gpuckpt.storage.local.fileio import buffer_address

__all__ = [
    "LIBRARY",
    "available",
    "cached_copy_crc",
    "crc_copy",
    "faults",
    "guarded_copy_crc",
    "guarded_copy_segments",
    "instruction_set",
    "load_library",
]

LIBRARY = Path(__file__).with_name("_crccopy.so")
_ABI = 5  # 2: copies guarded against SIGBUS (gck_faults); 3: the cache probed with mincore;
# 4: guarded copies into a file's map (gck_guarded_copy_crc); 5: a chunk's segments in one
# call (gck_guarded_copy_segments)
_ISA_NAMES = {0: "none", 1: "pclmul", 2: "avx512"}


class CrcCopy:
    """One loaded copy of the library (tests load several, one per instruction set)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        #: where it was loaded from
        self.path = os.fspath(path)
        lib = ctypes.CDLL(self.path)
        lib.gck_abi.restype = ctypes.c_int
        if lib.gck_abi() != _ABI:
            raise ImportError(f"{path} was built from another version of crccopy.c; reinstall gpuckpt")
        lib.gck_isa.restype = ctypes.c_int
        lib.gck_limit_isa.restype = ctypes.c_int
        lib.gck_limit_isa.argtypes = [ctypes.c_int]
        lib.gck_crc_copy.restype = ctypes.c_uint32
        lib.gck_crc_copy.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
        lib.gck_cached_copy_crc.restype = ctypes.c_int
        lib.gck_cached_copy_crc.argtypes = [
            ctypes.c_int,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_uint32,
            ctypes.POINTER(ctypes.c_uint32),
        ]
        lib.gck_guarded_copy_crc.restype = ctypes.c_int
        lib.gck_guarded_copy_crc.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_uint32,
            ctypes.POINTER(ctypes.c_uint32),
        ]
        lib.gck_guarded_copy_segments.restype = ctypes.c_int
        lib.gck_guarded_copy_segments.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_void_p,
        ]
        lib.gck_faults.restype = ctypes.c_ulong
        lib.gck_faults.argtypes = []
        self._lib = lib

    @property
    def isa(self) -> str:
        return _ISA_NAMES.get(self._lib.gck_isa(), "none")

    def limit(self, isa: str) -> str:
        """Use at most ``isa`` (``"pclmul"`` or ``"none"``); returns the set now in use."""
        code = {name: c for c, name in _ISA_NAMES.items()}[isa]
        return _ISA_NAMES[self._lib.gck_limit_isa(code)]

    def crc_copy(self, src: Any, dst: Any | None = None, value: int = 0) -> int:
        """CRC32C of ``src`` continued from ``value``; copies ``src`` into ``dst`` (same size) too."""
        s = memoryview(src).cast("B")
        src_addr = buffer_address(s)
        dst_addr = None
        if dst is not None:
            d = memoryview(dst).cast("B")
            if d.nbytes != s.nbytes:
                raise ValueError(f"crc_copy: destination is {d.nbytes} bytes, source {s.nbytes}")
            if d.readonly:
                raise ValueError("crc_copy: the destination is read-only")
            dst_addr = buffer_address(d)
        return int(self._lib.gck_crc_copy(value, src_addr, dst_addr, s.nbytes))

    def cached_copy_crc(self, fd: int, offset: int, dst: memoryview, value: int = 0) -> int | None:
        """Copy ``dst.nbytes`` bytes at ``offset`` of ``fd`` into ``dst``; returns their CRC32C.

        The CRC continues from ``value``. Returns None when the range cannot be mapped for want
        of address space (a process memory limit), when part of the range
        is not in the page cache or lies past the end of the file (nothing is
        copied), and when the file changed under the copy: truncated after the
        size was checked, or a page that could not be read, which would have
        been a SIGBUS (part of ``dst`` may be written). Read it with ``pread``
        then: that read sees what the file now holds and fails as any read of a
        short file does.
        """
        if dst.readonly:
            raise ValueError("cached_copy_crc: the destination is read-only")
        out = ctypes.c_uint32()
        address = buffer_address(dst)
        rc = self._lib.gck_cached_copy_crc(fd, offset, address, dst.nbytes, value, ctypes.byref(out))
        if rc == -errno.ENOMEM:
            return None  # no address space for the map (a process memory limit): pread needs none
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))
        return None if rc else int(out.value)  # 1: declined; 2: the file changed under the copy

    def guarded_copy_crc(self, src: Any, dst: Any, value: int = 0) -> int | None:
        """Copy ``src`` into ``dst`` (same size: a writable map of a file being written) and
        return its CRC32C, continued from ``value``; None when the copy could not be guarded
        (nothing written) or a fault interrupted it: the file was cut shorter under its map, or
        its file system could not give a page (part of ``dst`` may be written). Write the file
        with ``write()`` then, which reports what the file system refuses."""
        s = memoryview(src).cast("B")
        d = memoryview(dst).cast("B")
        if d.nbytes != s.nbytes:
            raise ValueError(f"guarded_copy_crc: destination is {d.nbytes} bytes, source {s.nbytes}")
        if d.readonly:
            raise ValueError("guarded_copy_crc: the destination is read-only")
        out = ctypes.c_uint32()
        src_addr, dst_addr = buffer_address(s), buffer_address(d)
        rc = self._lib.gck_guarded_copy_crc(src_addr, dst_addr, s.nbytes, value, ctypes.byref(out))
        return None if rc else int(out.value)

    def guarded_copy_segments(self, srcs: Sequence[Any], dst: Any, segment_bytes: int) -> list[int] | None:
        """Copy ``srcs`` one after the other into the start of ``dst`` (a writable map of a file
        being written, exactly their total size) under the guard of :meth:`guarded_copy_crc`, in
        one call; the CRC32C of each ``segment_bytes`` of ``dst`` from its start (the last one
        shorter), or None as :meth:`guarded_copy_crc` returns it."""
        views = [memoryview(s).cast("B") for s in srcs]
        d = memoryview(dst).cast("B")
        total = sum(v.nbytes for v in views)
        if d.nbytes != total:
            raise ValueError(f"guarded_copy_segments: destination is {d.nbytes} bytes, sources {total}")
        if d.readonly:
            raise ValueError("guarded_copy_segments: the destination is read-only")
        if segment_bytes <= 0:
            raise ValueError(f"guarded_copy_segments: segment_bytes must be positive, not {segment_bytes}")
        addresses = np.array([buffer_address(v) for v in views], np.uint64)
        lengths = np.array([v.nbytes for v in views], np.uint64)
        crcs = np.zeros(max(1, -(-total // segment_bytes)), np.uint32)
        rc = self._lib.gck_guarded_copy_segments(
            addresses.ctypes.data,
            lengths.ctypes.data,
            len(views),
            buffer_address(d),
            segment_bytes,
            crcs.ctypes.data,
        )
        return None if rc else crcs[: -(-total // segment_bytes)].tolist()

    @property
    def faults(self) -> int:
        """How many copies of this library a fault on their pages interrupted (SIGBUS caught)."""
        return int(self._lib.gck_faults())

    def self_test(self) -> bool:
        """Agreement with the CRC32C library around every threshold of the vector loops."""
        sample = bytes((i * 131 + 7) & 0xFF for i in range(3000))
        for n in (0, 1, 7, 63, 64, 65, 127, 128, 255, 256, 511, 512, 513, 1000, 3000):
            for start in (0, 0x9ABCDEF0):
                out = bytearray(n)
                if self.crc_copy(sample[:n], out, start) != crc32c(sample[:n], start) or out != sample[:n]:
                    return False
        return True


def load_library(path: str | os.PathLike[str] | None = None) -> CrcCopy | None:
    """The library at ``path`` (default :data:`LIBRARY`) if it loads, uses a vector
    instruction set and passes its self-test."""
    try:
        lib = CrcCopy(LIBRARY if path is None else path)
    except (OSError, ImportError, AttributeError):
        return None
    return lib if lib.isa != "none" and lib.self_test() else None


@functools.cache
def _instance() -> CrcCopy | None:
    choice = switch_from_env("GPUCKPT_CRCCOPY")
    if choice == "off":
        return None
    lib = load_library()
    if lib is None and choice == "on":
        raise ImportError(
            f"GPUCKPT_CRCCOPY=on but {LIBRARY} is missing, was built for another CPU, or failed its "
            "self-test: reinstall gpuckpt with a C compiler on PATH (x86-64), or unset GPUCKPT_CRCCOPY"
        )
    return lib


def available() -> bool:
    """Whether loads use the native copy-with-CRC loop."""
    return _instance() is not None


def instruction_set() -> str:
    """``"avx512"``, ``"pclmul"``, or ``"none"`` when the native loop is not in use."""
    lib = _instance()
    return lib.isa if lib is not None else "none"


def crc_copy(src: Any, dst: Any | None = None, value: int = 0) -> int:
    lib = _instance()
    if lib is None:
        raise RuntimeError("the native copy-with-CRC loop is not available; check available() first")
    return lib.crc_copy(src, dst, value)


def cached_copy_crc(fd: int, offset: int, dst: memoryview, value: int = 0) -> int | None:
    """See :meth:`CrcCopy.cached_copy_crc`; None also when the native loop is not available."""
    lib = _instance()
    return None if lib is None else lib.cached_copy_crc(fd, offset, dst, value)


def guarded_copy_crc(src: Any, dst: Any, value: int = 0) -> int | None:
    """See :meth:`CrcCopy.guarded_copy_crc`; None also when the native loop is not available."""
    lib = _instance()
    return None if lib is None else lib.guarded_copy_crc(src, dst, value)


def guarded_copy_segments(srcs: Sequence[Any], dst: Any, segment_bytes: int) -> list[int] | None:
    """See :meth:`CrcCopy.guarded_copy_segments`; None also when the native loop is not available."""
    lib = _instance()
    return None if lib is None else lib.guarded_copy_segments(srcs, dst, segment_bytes)


def faults() -> int:
    """How many loads' copies a file changed under them interrupted in this process (0
    when the native loop is not in use); each was read again with ``pread``."""
    lib = _instance()
    return 0 if lib is None else lib.faults
