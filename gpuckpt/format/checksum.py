"""CRC32C, the checksum of every stored chunk and of the root metadata, and which library computes it.

Zarr's ``crc32c`` codec appends it to each chunk as :data:`CRC_BYTES` little-endian
bytes (see :mod:`gpuckpt.format.chunks`). Two libraries compute the same value:
awscrt where it is installed and passes a self-test (the faster), else the
``crc32c`` package; ``GPUCKPT_CRC32C`` forces either (:func:`crc32c_backend`).

Buffers under :data:`SMALL_BYTES` go to the ``crc32c`` package (imported with
this module) unless awscrt is forced: loading awscrt's library takes 40-60 ms
here (its random generator measures CPU jitter at start-up; seconds where the
library's pages were paged out), which the first save or load of a small state
would wait for, and on a 64 KiB buffer it saves 1.5 us. It is loaded when the
first large buffer comes, with one exception: on the I/O threads of a save or a
load (threads marked ``defers_library_loads``, see :mod:`gpuckpt.runtime.workers`) the
load would hold the GIL while every other thread of the run waits, so there large
buffers go to the ``crc32c`` package until the process has checksummed
:data:`LOAD_AFTER_BYTES` that way (about 2x awscrt's time per byte: the load pays
back after that much), and awscrt is loaded only then.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import crc32c as _crc32c

from gpuckpt.errors import InvalidOptionError

__all__ = [
    "CRC_BYTES",
    "LOAD_AFTER_BYTES",
    "SMALL_BYTES",
    "crc32c",
    "crc32c_backend",
    "crc32c_loaded",
    "large_backend_ready",
]

CRC_BYTES = 4


#: buffers smaller than this are checksummed by the crc32c package (see the module docstring)
SMALL_BYTES = 256 << 10

#: large buffers checksummed by the crc32c package on I/O threads before awscrt is loaded
#: there: at about 16 GB/s against awscrt's 30-45 GB/s (1 MiB pieces, AVX-512) the package
#: costs ~35 ms more per GiB, so awscrt's 40-60 ms load pays back after about 2 GiB
LOAD_AFTER_BYTES = 2 << 30

_deferred = [0]  # large-buffer bytes the package took on I/O threads (approximate: no lock)

_CHECK_VECTOR = (b"123456789", 0xE3069283)  # the standard check value of CRC-32C (Castagnoli)
_AWS_PIECE = 1 << 30  # the AWS C library takes an int length


def _crc_package(data: Any, value: int = 0) -> int:
    # the crc32c package: SSE4.2 / ARMv8 CRC instructions; releases the GIL from 64 KiB on
    return int(_crc32c.crc32c(data, value, gil_release_mode=1 if memoryview(data).nbytes >= 65536 else 0))


def _aws_function() -> Callable[[Any, int], int] | None:
    """awscrt's CRC32C (carry-less multiply folding with AVX-512 where the CPU has it,
    about twice the crc32c package's speed there), if it is installed and agrees with
    the reference on a self-test; ``None`` otherwise."""
    try:
        from awscrt import checksums
    except ImportError:
        return None
    aws = checksums.crc32c

    def crc(data: Any, value: int = 0) -> int:
        view = memoryview(data)
        if not view.c_contiguous:
            raise ValueError("CRC32C needs a C-contiguous buffer")
        if view.nbytes <= _AWS_PIECE:
            return int(aws(view, value))
        flat = view.cast("B")
        for i in range(0, flat.nbytes, _AWS_PIECE):
            value = int(aws(flat[i : i + _AWS_PIECE], value))
        return value

    # lengths around the vector code's thresholds, continued from a non-zero value
    sample = bytes(range(256)) * 80 + b"tail"
    for n in (0, 1, 9, 255, 256, 257, 1000, 4096, len(sample)):
        for start in (0, 0x12345678):
            if crc(sample[:n], start) != _crc_package(sample[:n], start):
                return None
    return crc if crc(_CHECK_VECTOR[0]) == _CHECK_VECTOR[1] else None


@functools.cache
def _choice() -> str:
    choice = os.environ.get("GPUCKPT_CRC32C", "auto")
    if choice not in ("auto", "awscrt", "crc32c"):
        raise InvalidOptionError(
            f"GPUCKPT_CRC32C={choice!r}; expected 'auto', 'awscrt' or 'crc32c', or unset it"
        )
    return choice


@functools.cache
def _backend() -> tuple[str, Callable[[Any, int], int]]:
    choice = _choice()
    if choice != "crc32c":
        aws = _aws_function()
        if aws is not None:
            return "awscrt", aws
        if choice == "awscrt":
            raise ImportError(
                "GPUCKPT_CRC32C=awscrt but awscrt is not installed or failed its self-test: "
                "pip install 'awscrt>=0.23', or unset GPUCKPT_CRC32C"
            )
    return "crc32c", _crc_package


def crc32c_backend() -> str:
    """The CRC32C implementation in use for large buffers: ``"awscrt"`` (fastest) or ``"crc32c"``.

    ``auto`` (the default) takes awscrt when it is installed and passes a
    self-test against the crc32c package (buffers under :data:`SMALL_BYTES`
    go to the crc32c package all the same); the environment variable
    ``GPUCKPT_CRC32C`` (``auto``, ``awscrt``, ``crc32c``) forces a choice.
    Both compute the same checksum: the choice changes speed only.
    """
    return _backend()[0]


def large_backend_ready() -> bool:
    """Whether :func:`crc32c` can take a large buffer without loading a library first: its
    choice for them is made (awscrt loaded, or found missing), or fixed by ``GPUCKPT_CRC32C``.

    Readers ask this before handing :func:`crc32c` a large buffer: where it would load
    awscrt, they checksum with a native library they hold already instead, so that a load
    never waits for awscrt (see the module docstring).
    """
    return _choice() != "auto" or _backend.cache_info().currsize > 0


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of ``data`` (any C-contiguous buffer), continuing from ``value``.

    The GIL is released for large buffers, so that I/O threads checksum in parallel.
    """
    choice = _choice()
    if choice == "awscrt":
        return _backend()[1](data, value)
    nbytes = memoryview(data).nbytes
    if nbytes < SMALL_BYTES:
        return _crc_package(data, value)
    if (
        choice == "auto"
        and _deferred[0] < LOAD_AFTER_BYTES
        and _backend.cache_info().currsize == 0
        and getattr(threading.current_thread(), "defers_library_loads", False)
    ):
        _deferred[0] += nbytes
        return _crc_package(data, value)
    return _backend()[1](data, value)


def crc32c_loaded(data: Any, value: int = 0) -> int:
    """:func:`crc32c`, by a library loaded already: the one chosen for large buffers once it
    is (:func:`large_backend_ready`), else the ``crc32c`` package. For what a load reads
    before any chunk (its root document), which must not wait for awscrt's load."""
    if large_backend_ready():
        return crc32c(data, value)
    return _crc_package(data, value)
