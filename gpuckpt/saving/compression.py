"""``compression="auto"``: compress only the tensors, and only for the stores, where it pays.

The rule (docs/compression.md says the same):

1. Tensors under :data:`AUTO_MIN_BYTES` are stored as they are: their chunks are small
   files, whose cost is the file, not the bytes (and a load reads them in native batches).
2. Every other tensor held in host memory is sampled: :data:`SAMPLES` pieces of
   :data:`SAMPLE_BYTES` spread over it are compressed with the save's codec (a few
   milliseconds per tensor, at most :data:`SAMPLE_BUDGET` bytes per save). A tensor whose
   samples shrink by less than :data:`MIN_SAVING` (random bytes, already-quantized data)
   is stored as it is. A tensor in device memory is not sampled (that would cost a copy):
   it follows the host tensors of its dtype sampled in the same save, and is compressed
   where there are none.
3. Compression must beat the store: with ``C`` the compressor's throughput measured on
   the samples (bytes per second of one thread), ``T`` the I/O threads that compress in
   parallel (at most the CPU count) and ``s`` the fraction of bytes saved, compressing
   ``N`` bytes costs ``N / (C T)`` of CPU and saves ``N s / B`` of writing to a store that
   writes ``B`` bytes per second (:func:`gpuckpt.storage.stores.write_rate`: 2 GB/s for a
   local file system, 250 MB/s for an object store). Compression is used when
   ``C T s > B``; otherwise nothing is compressed.
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from gpuckpt.device.arrays import HostArray
from gpuckpt.format.codecs import Codec, Compression, encode
from gpuckpt.format.dtypes import dtype_from_name
from gpuckpt.options import SaveOptions
from gpuckpt.planning.boxes import LocalTensor
from gpuckpt.planning.plan import StateDescription
from gpuckpt.runtime.runner import default_threads
from gpuckpt.saving.sources import Sources
from gpuckpt.storage.stores import write_rate

__all__ = [
    "AUTO_MIN_BYTES",
    "MIN_SAVING",
    "SAMPLES",
    "SAMPLE_BYTES",
    "AutoDecision",
    "decide",
    "resolve",
    "resolve_unsampled",
]

#: tensors smaller than this are never compressed by "auto"
AUTO_MIN_BYTES = 1 << 20
#: pieces sampled per tensor, and their size (smaller pieces understate what a chunk of 1 MiB
#: blocks saves: a 64 KiB piece of bf16 weights 1.29x, 256 KiB 1.44x, 1 MiB 1.46x)
SAMPLES = 2
SAMPLE_BYTES = 256 << 10
#: most bytes sampled by one save (the largest tensors first)
SAMPLE_BUDGET = 16 << 20
#: a tensor whose samples shrink by less than this fraction is stored as it is
MIN_SAVING = 0.05


class AutoDecision:
    """What "auto" found: per sampled tensor its saving, the compressor's throughput on every
    sample, and the fraction of bytes saved on the samples of the tensors worth compressing."""

    def __init__(self) -> None:
        self.saving: dict[str, float] = {}
        self.sampled = 0
        self.seconds = 0.0
        self.raw = 0  # of the tensors that save at least MIN_SAVING
        self.stored = 0

    @property
    def bytes_per_s(self) -> float:
        return self.sampled / self.seconds if self.seconds > 0 else float("inf")

    @property
    def fraction_saved(self) -> float:
        return 1 - self.stored / self.raw if self.raw else 0.0


def _samples(a: np.ndarray) -> list[np.ndarray]:
    """Up to :data:`SAMPLES` pieces of :data:`SAMPLE_BYTES` of ``a``'s bytes, spread over it
    (copies only of what is sampled)."""
    if a.ndim == 0 or a.size == 0:
        return []
    if a.flags.c_contiguous or a.flags.f_contiguous:
        flat = a.ravel(order="K").view(np.uint8)
        n = flat.nbytes
        step = max(n // SAMPLES, SAMPLE_BYTES)
        return [flat[at : at + SAMPLE_BYTES] for at in range(0, n - SAMPLE_BYTES + 1, step)][:SAMPLES]
    # another layout (channels-last, a slice): rows of the first axis, each copied
    rows = a.shape[0]
    row_bytes = a.nbytes // rows
    take = max(1, SAMPLE_BYTES // max(row_bytes, 1))
    step = max(rows // SAMPLES, take)
    return [
        np.ascontiguousarray(a[at : at + take]).reshape(-1).view(np.uint8)[:SAMPLE_BYTES]
        for at in range(0, rows - take + 1, step)
    ][:SAMPLES]


def decide(local: StateDescription, sources: Sources, compression: Compression) -> AutoDecision:
    """Sample the tensors of ``local`` that ``sources`` holds in host memory (see the module docstring)."""
    found = AutoDecision()
    budget = SAMPLE_BUDGET
    encode(compression.codec_for("", np.dtype(np.uint8), 1) or Codec("zstd", 1), np.zeros(64, np.uint8), 0)
    # (the first call loads the codec library: not timed)
    big = sorted(
        (t for t in local.tensors if _nbytes(t) >= AUTO_MIN_BYTES),
        key=_nbytes,
        reverse=True,
    )
    for t in big:
        if budget <= 0:
            break
        for src in sources.get(t.fqn, ()):
            adapter = src.array
            if not isinstance(adapter, HostArray) or adapter.array.dtype.hasobject:
                continue
            a = adapter.array
            codec = compression.codec_for(t.fqn, a.dtype, SAMPLE_BYTES * SAMPLES)
            if codec is None:
                continue
            pieces = _samples(a)
            raw = stored = 0
            start = time.perf_counter()
            for p in pieces:
                stored += encode(codec, np.ascontiguousarray(p), 0).nbytes
                raw += p.nbytes
            found.seconds += time.perf_counter() - start
            if raw:
                found.sampled += raw
                found.saving[t.fqn] = 1 - stored / raw
                if found.saving[t.fqn] >= MIN_SAVING:
                    found.raw += raw
                    found.stored += stored
                budget -= raw
            break
    return found


def _nbytes(t: LocalTensor) -> int:
    return math.prod(t.global_shape) * t.itemsize


#: the compressor throughput per thread "auto" assumes where it samples nothing (the DCP
#: Writer plans on rank 0 from the shapes alone): byte-shuffled zstd-1 on bf16 weights, measured
#: on a loaded 2-core VM (bench/RESULTS.md)
NOMINAL_BYTES_PER_S = 0.5e9
#: and the fraction of bytes it assumes saved (fp32 moments save about that, bf16 weights more)
NOMINAL_SAVING = 0.15


def resolve_unsampled(
    path: str | os.PathLike[str], options: SaveOptions, tensors: Iterable[LocalTensor]
) -> Compression | None:
    """:func:`resolve` where no tensor can be sampled: "auto" compresses the floating-point
    tensors of :data:`AUTO_MIN_BYTES` or more when :data:`NOMINAL_BYTES_PER_S` and
    :data:`NOMINAL_SAVING` beat the store's write rate, else nothing."""
    c = options.codecs
    if c is None or not c.auto:
        return c
    threads = min(options.threads or default_threads(), os.cpu_count() or 1)
    if NOMINAL_BYTES_PER_S * threads * NOMINAL_SAVING <= write_rate(path):
        return None
    skip = {
        t.fqn
        for t in tensors
        if _nbytes(t) < AUTO_MIN_BYTES or np.dtype(dtype_from_name(t.dtype)).kind != "f"
    }
    return Compression(c.codec, c.level, c.cname, c.shuffle, c.blocksize, auto=True, skip=frozenset(skip))


def resolve(
    path: str | os.PathLike[str], options: SaveOptions, local: StateDescription, sources: Sources
) -> Compression | None:
    """The compression a save of ``local`` to ``path`` plans with: ``options``' own, or for
    "auto" the one :func:`decide` and the store's write rate give (None: nothing compressed)."""
    c = options.codecs
    if c is None or not c.auto:
        return c
    found = decide(local, sources, c)
    threads = min(options.threads or default_threads(), os.cpu_count() or 1)
    if found.sampled and found.bytes_per_s * threads * found.fraction_saved <= write_rate(path):
        return None  # the store writes faster than compression saves
    by_dtype: dict[str, list[float]] = defaultdict(list)
    dtypes = {t.fqn: t.dtype for t in local.tensors}
    for fqn, saving in found.saving.items():
        by_dtype[dtypes[fqn]].append(saving)
    skip = set()
    for t in local.tensors:
        if _nbytes(t) < AUTO_MIN_BYTES:
            skip.add(t.fqn)
        elif t.fqn in found.saving:
            if found.saving[t.fqn] < MIN_SAVING:
                skip.add(t.fqn)
        elif by_dtype.get(t.dtype) and max(by_dtype[t.dtype]) < MIN_SAVING:
            skip.add(t.fqn)  # not sampled (device memory): as the host tensors of its dtype
    return Compression(c.codec, c.level, c.cname, c.shuffle, c.blocksize, auto=True, skip=frozenset(skip))
