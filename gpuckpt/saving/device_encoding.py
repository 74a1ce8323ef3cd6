"""Chunks of device arrays compressed on their device before they cross to the host.

A save with ``compression={"codec": "zstd", "device": True}`` asks each device array's back end
to compress its chunks where they live
(:meth:`~gpuckpt.device.backend.DeviceBackend.encode_chunks`: nvCOMP on a GPU): only the
compressed frames are copied to the host, and the I/O threads checksum and write them as they
are (no staging buffer, no host compression). A back end that cannot (no nvCOMP) is asked once
per array; its chunks are then staged and compressed on the host, as every other codec's are. So
are the chunks of an array whose compression on the device failed (its device short of memory
for the codec's scratch, a library error), with a ``RuntimeWarning`` naming the error.

:class:`DeviceEncoder` runs in the save's calling thread, ahead of the staging loop: it
compresses the next chunks of the same array together, up to half the save's staging budget
of raw bytes at a time, and holds at most that budget of frames waiting for the I/O threads
(:class:`ByteBudget`: the calling thread blocks while they are behind, as staging buffers make
it block).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Container, Sequence
from typing import Protocol

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter
from gpuckpt.format.codecs import Codec

__all__ = ["ByteBudget", "DeviceEncoder", "EncodedChunk"]


class ByteBudget:
    """Bytes held at once, at most ``limit`` (one holder may take more when nothing else is held)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.in_use = 0
        self.peak = 0
        self._cond = threading.Condition()

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes, blocking while that would pass the limit and others are held."""
        with self._cond:
            self._cond.wait_for(lambda: self.in_use == 0 or self.in_use + n <= self.limit)
            self.in_use += n
            self.peak = max(self.peak, self.in_use)

    def add(self, n: int) -> None:
        """Hold ``n`` more bytes at once (what a holder found it needs beyond what it took)."""
        with self._cond:
            self.in_use += n
            self.peak = max(self.peak, self.in_use)

    def give(self, n: int) -> None:
        with self._cond:
            self.in_use -= n
            self._cond.notify_all()


class EncodedChunk:
    """A chunk's stored bytes, compressed where its array lives: ready for an I/O thread."""

    __slots__ = ("_budget", "_data")
    ready = True
    stable = True  # the save's own bytes

    def __init__(self, data: np.ndarray, budget: ByteBudget) -> None:
        self._data: np.ndarray | None = data
        self._budget = budget

    def wait(self) -> np.ndarray:
        assert self._data is not None, "wait() after release()"
        return self._data

    def release(self) -> None:
        data, self._data = self._data, None
        if data is not None:
            self._budget.give(data.nbytes)


class _Job(Protocol):
    """What the encoder reads of a chunk job (:class:`gpuckpt.saving.writing.ChunkJob`)."""

    @property
    def source(self) -> ArrayAdapter: ...
    @property
    def offsets(self) -> tuple[int, ...]: ...
    @property
    def sizes(self) -> tuple[int, ...]: ...
    @property
    def stored(self) -> tuple[int, ...]: ...
    @property
    def codec(self) -> Codec | None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def name(self) -> str: ...


class DeviceEncoder:
    """The device-compressed chunks of a save's ``jobs`` (see the module docstring)."""

    def __init__(self, jobs: Sequence[_Job], staging_bytes: int) -> None:
        self._jobs = jobs
        self.budget = ByteBudget(staging_bytes)
        self._group_bytes = max(1, staging_bytes // 2)
        self._ready: dict[int, np.ndarray] = {}
        self._refused: set[int] = set()  # id() of sources whose back end cannot

    def take(self, i: int, skip: Container[int] = ()) -> EncodedChunk | None:
        """Job ``i``'s chunk compressed on its device (with the following chunks of the same
        array not in ``skip``, if not done already), or None: staged and compressed on the
        host."""
        j = self._jobs[i]
        if j.codec is None or j.source.backend is None or id(j.source) in self._refused:
            return None
        if i not in self._ready:
            self._encode_from(i, skip)
        data = self._ready.pop(i, None)
        return None if data is None else EncodedChunk(data, self.budget)

    def _encode_from(self, i: int, skip: Container[int]) -> None:
        first = self._jobs[i]
        group: list[int] = []
        raw = 0
        for k in range(i, len(self._jobs)):
            j = self._jobs[k]
            if j.source is not first.source or j.codec != first.codec or k in skip:
                break
            n = j.nbytes
            if group and raw + n > self._group_bytes:
                break
            group.append(k)
            raw += n
        assert first.codec is not None
        self.budget.take(raw)
        try:
            frames = first.source.encode_chunks(
                [(self._jobs[k].offsets, self._jobs[k].sizes, self._jobs[k].stored) for k in group],
                first.codec.name,
            )
        except Exception as exc:  # (device memory for the codec's scratch, a library error)
            warnings.warn(
                f"compressing chunks of {first.name!r} on the device failed ({type(exc).__name__}: {exc}); "
                "they are compressed on the host after staging, with the same codec",
                RuntimeWarning,
                stacklevel=2,
            )
            frames = None
        except BaseException:
            self.budget.give(raw)
            raise
        if frames is None:
            self._refused.add(id(first.source))
            self.budget.give(raw)
            return
        held = sum(int(f.nbytes) for f in frames)
        # each frame gives back its own bytes once written: what the raw estimate left over now
        if held < raw:
            self.budget.give(raw - held)
        else:  # (incompressible bytes: a frame is a little larger than its chunk)
            self.budget.add(held - raw)
        for k, f in zip(group, frames, strict=True):
            self._ready[k] = f
