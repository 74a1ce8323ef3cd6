"""``compression="auto"``: compress only the tensors, and only for the stores, where it pays.

The rule (docs/compression.md says the same):

1. Tensors under :data:`AUTO_MIN_BYTES` are stored as they are: their chunks are small
   files, whose cost is the file, not the bytes (and a load reads them in native batches).
2. Every other tensor held in host memory is screened, the largest first: the order-0 entropy
   of each byte position of its elements (the bytes a byte shuffle groups) is measured on
   :data:`SAMPLES` pieces of :data:`SCREEN_BYTES` spread over it. A tensor whose entropy
   promises less than :data:`MIN_SAVING` (random bytes, already-quantized data) is stored as it
   is, unless deflate's fastest level saves that much on :data:`REPEAT_BYTES` of it (repeats,
   which entropy misses). The screens of one save read at most :data:`BUDGET_SHARE` of the
   bytes it may compress (at least :data:`MIN_BUDGET`, at most :data:`SAMPLE_BUDGET`; the
   largest tensor of each dtype whatever the budget, then the others of every dtype by turns,
   each dtype's largest first); tensors left unscreened, and tensors in device memory
   (screening them would cost a copy), follow the screened tensors of their dtype: compressed
   where any of them is worth compressing (a tensor compressed for nothing costs the
   compressor's time, one stored as it is for nothing the bytes it would have saved), and
   where there are none.
3. Each dtype with a tensor worth compressing gets one trial: a piece of :data:`SAMPLE_BYTES`
   of its largest such tensor compressed with the save's codec, timed. A dtype whose trial
   saves less than :data:`MIN_SAVING` is stored as it is (the codec does not deliver what the
   entropy promised: bit-shuffled one-byte types).
4. Compression must make the save faster. The I/O threads compress a chunk and then write it,
   so compressing overlaps writing: with ``C`` the compressor's throughput on the trials (bytes
   per second of one thread), ``T`` the chunks compressed at once (the save's I/O threads, at
   most :data:`gpuckpt.runtime.runner.compressing`'s slots: one fewer than the CPUs), ``s`` the
   fraction of bytes saved (each dtype's trial, weighted by the bytes of that dtype to
   compress) and ``B`` the store's write rate (:func:`gpuckpt.storage.stores.write_rate`: 2 GB/s
   for a local file system, 250 MB/s for an object store), a save runs at the slower of
   compressing (``C T``) and writing fewer bytes (``B / (1 - s)``) instead of at ``B``
   (:func:`predicted_gain`). Compression is used when that is at least :data:`MIN_GAIN` times
   faster; otherwise nothing is compressed.

Why entropy for the screen, not the codec: zstd's savings on small pieces vary with the piece's
size (fp32 moments save 8% on 16 KiB, 2% on 64 KiB and 16% on a 1 MiB chunk), while the byte
entropy is stable from 16 KiB up and costs as little; the codec is timed once per dtype, on a
piece large enough to save what a chunk saves.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuckpt.device.arrays import HostArray
from gpuckpt.format.codecs import Compression, encode
from gpuckpt.format.dtypes import FLOAT_NAMES
from gpuckpt.options import SaveOptions
from gpuckpt.planning.boxes import LocalTensor
from gpuckpt.planning.plan import StateDescription
from gpuckpt.runtime import runner
from gpuckpt.saving.sources import Sources
from gpuckpt.storage.stores import write_rate

__all__ = [
    "AUTO_MIN_BYTES",
    "MIN_SAVING",
    "SAMPLES",
    "SAMPLE_BYTES",
    "SCREEN_BYTES",
    "AutoDecision",
    "MIN_GAIN",
    "decide",
    "entropy_saving",
    "predicted_gain",
    "resolve",
    "resolve_unsampled",
]

#: tensors smaller than this are never compressed by "auto"
AUTO_MIN_BYTES = 1 << 20
#: pieces screened per tensor, and their size
SAMPLES = 2
SCREEN_BYTES = 16 << 10
#: bytes of a screened piece deflated where its entropy promises nothing (:func:`_repeats`)
REPEAT_BYTES = 4 << 10
#: the piece of a dtype's trial (smaller pieces understate what a chunk of 1 MiB blocks saves:
#: a 64 KiB piece of bf16 weights 1.29x, 256 KiB 1.44x, 512 KiB and 1 MiB 1.46x; fp32 moments
#: 1.02x, 1.14x, 1.19x and 1.19x)
SAMPLE_BYTES = 512 << 10
#: the bytes one save screens: this share of the bytes "auto" may compress, within the bounds
BUDGET_SHARE = 1 / 1024
MIN_BUDGET = 1 << 20
SAMPLE_BUDGET = 16 << 20
#: a tensor (or dtype) expected to shrink by less than this fraction is stored as it is
MIN_SAVING = 0.05
#: byte planes of elements wider than this are not told apart (structured types)
_MAX_PLANES = 16


@dataclass(slots=True)
class AutoDecision:
    """What "auto" found: per screened tensor its expected saving, per dtype the saving of its
    trial, the compressor's throughput on the trials, and the fraction of bytes the tensors
    worth compressing are expected to save."""

    saving: dict[str, float] = field(default_factory=dict)  # screened tensors, by FQN
    trials: dict[str, float] = field(default_factory=dict)  # dtypes, by name
    screened: int = 0  # bytes read by the screens
    sampled: int = 0  # bytes compressed by the trials
    seconds: float = 0.0  # spent compressing them
    fraction_saved: float = 0.0
    skip: set[str] = field(default_factory=set)
    why: dict[str, str] = field(default_factory=dict)  # skipped tensors of AUTO_MIN_BYTES or more

    @property
    def bytes_per_s(self) -> float:
        return self.sampled / self.seconds if self.seconds > 0 else float("inf")


def entropy_saving(pieces: Iterable[np.ndarray], itemsize: int) -> float:
    """``1 -`` the order-0 entropy of each byte position of ``itemsize``-byte elements, summed, over
    ``8 * itemsize`` bits: the fraction of bytes an entropy coder of byte-shuffled ``pieces``
    (``uint8``, whole elements) would save (0 for random bytes, 1 for a constant)."""
    k = itemsize if 1 <= itemsize <= _MAX_PLANES else 1
    counts = np.zeros(256 * k, np.int64)
    planes = np.arange(k, dtype=np.uint16) << 8
    for p in pieces:
        n = p.nbytes - p.nbytes % k
        if n:
            counts += np.bincount((p[:n].reshape(-1, k) + planes).reshape(-1), minlength=256 * k)
    per_plane = counts.reshape(k, 256)
    totals = per_plane.sum(axis=1, keepdims=True)
    if not totals.all():
        return 0.0
    prob = per_plane / totals
    with np.errstate(divide="ignore", invalid="ignore"):
        bits = -np.nansum(prob * np.log2(prob))
    return float(1 - bits / (8 * k))


def _pieces(a: np.ndarray, size: int, count: int) -> list[np.ndarray]:
    """Up to ``count`` pieces of ``size`` bytes of ``a`` (whole elements), spread over it, as
    contiguous ``uint8`` arrays (copies only of what is taken, at most twice ``size`` each)."""
    if a.ndim == 0 or a.size == 0:
        return []
    item = a.dtype.itemsize
    size = max(item, size - size % item)
    if a.flags.c_contiguous or a.flags.f_contiguous:
        flat = a.ravel(order="K").view(np.uint8)
        n = flat.nbytes
        if n <= size:
            return [flat]
        # at 1/(count+1), 2/(count+1), ... of the bytes, on element boundaries
        starts = sorted({(n * (i + 1) // (count + 1) - size // 2) // item * item for i in range(count)})
        return [flat[max(0, s) : max(0, s) + size] for s in starts]
    # another layout (channels-last, a slice): around each point, rows of the innermost axes that
    # hold about ``size`` bytes, copied
    elements = size // item
    return [_window(a, (i + 1) / (count + 1), elements).view(np.uint8)[:size] for i in range(count)]


def _window(a: np.ndarray, at: float, elements: int) -> np.ndarray:
    """About ``elements`` elements of ``a`` (more only where ``a`` has fewer), in logical order,
    around the fraction ``at`` of its first axis: a copy of a few rows of the axes where a row
    holds fewer elements than that (never a whole row of a larger one)."""
    while a.ndim > 1 and a[0].size >= elements:
        a = a[min(a.shape[0] - 1, int(a.shape[0] * at))]  # one row holds enough: look inside it
    take = max(1, elements // max(1, a.size // a.shape[0]))
    start = max(0, min(a.shape[0] - take, int(a.shape[0] * at) - take // 2))
    return np.ascontiguousarray(a[start : start + take]).reshape(-1)


def _repeats(piece: np.ndarray) -> float:
    """The fraction of :data:`REPEAT_BYTES` of ``piece`` that deflate's fastest level saves: repeats
    the byte entropy cannot see (a tiled pattern). zlib, not the save's codec: it is loaded already,
    and a save that compresses nothing need not load the codec library."""
    head = piece[:REPEAT_BYTES]
    return 1 - len(zlib.compress(head, 1)) / head.nbytes if head.nbytes else 0.0


def decide(local: StateDescription, sources: Sources, compression: Compression) -> AutoDecision:
    """Screen the tensors of ``local`` that ``sources`` holds in host memory, try the codec once per
    dtype worth compressing, and say which tensors to skip (see the module docstring)."""
    found = AutoDecision()
    big = sorted((t for t in local.tensors if _nbytes(t) >= AUTO_MIN_BYTES), key=_nbytes, reverse=True)
    budget = min(SAMPLE_BUDGET, max(MIN_BUDGET, int(sum(map(_nbytes, big)) * BUDGET_SHARE)))
    host = {t.fqn: a for t in big if (a := _host_array(t, sources)) is not None}
    # the largest tensor of each dtype first (whatever the budget), then the others of every
    # dtype by turns, each dtype's by size (an unscreened tensor follows its dtype's screens:
    # each dtype screens as many as the budget allows, not the first dtype all of its own)
    by_dtype: dict[str, list[LocalTensor]] = {}
    for t in big:
        if t.fqn in host:
            by_dtype.setdefault(t.dtype, []).append(t)
    order = sorted((ts[0] for ts in by_dtype.values()), key=_nbytes, reverse=True)
    order += [t for turn in itertools.zip_longest(*(ts[1:] for ts in by_dtype.values())) for t in turn if t]
    for i, t in enumerate(order):
        if budget <= 0 and i >= len(by_dtype):
            break
        a = host[t.fqn]
        pieces = _pieces(a, SCREEN_BYTES, SAMPLES)
        saving = entropy_saving(pieces, a.dtype.itemsize)
        if saving < MIN_SAVING:
            saving = max(saving, _repeats(pieces[0]))
        found.saving[t.fqn] = saving
        taken = sum(p.nbytes for p in pieces)
        found.screened += taken
        budget -= taken
    # one trial per dtype, on its largest tensor worth compressing
    for t in big:
        if t.dtype in found.trials or found.saving.get(t.fqn, 0.0) < MIN_SAVING:
            continue
        a = host[t.fqn]
        codec = compression.codec_for(t.fqn, a.dtype, SAMPLE_BYTES)
        if codec is None:
            continue
        piece = np.ascontiguousarray(_pieces(a, SAMPLE_BYTES, 1)[0])
        if not found.sampled:
            encode(codec, piece[:64], 0)  # the first call loads the codec library: not timed
        start = time.perf_counter()
        stored = encode(codec, piece, 0).nbytes
        found.seconds += time.perf_counter() - start
        found.sampled += piece.nbytes
        found.trials[t.dtype] = 1 - stored / piece.nbytes
    # which tensors to skip, and what the others save
    screened_dtypes = {t.dtype for t in big if t.fqn in found.saving}
    weighted = weight = 0.0
    for t in local.tensors:
        if _nbytes(t) < AUTO_MIN_BYTES:
            found.skip.add(t.fqn)
        elif found.saving.get(t.fqn, 1.0) < MIN_SAVING:
            found.skip.add(t.fqn)  # screened: incompressible
            found.why[t.fqn] = (
                f"incompressible: its screen promises {found.saving[t.fqn]:.1%} saved, under {MIN_SAVING:.0%}"
            )
        elif t.dtype in found.trials:
            if found.trials[t.dtype] < MIN_SAVING:
                found.skip.add(t.fqn)  # the codec does not deliver on this dtype
                trial = found.trials[t.dtype]
                found.why[t.fqn] = f"the codec's trial on {t.dtype} saved {trial:.1%}, under {MIN_SAVING:.0%}"
            else:
                weighted += found.trials[t.dtype] * _nbytes(t)
                weight += _nbytes(t)
        elif t.dtype in screened_dtypes:
            found.skip.add(t.fqn)  # not screened: as the screened tensors of its dtype, all incompressible
            found.why[t.fqn] = f"not screened, and every screened {t.dtype} tensor is incompressible"
    found.fraction_saved = weighted / weight if weight else 0.0
    return found


def _host_array(t: LocalTensor, sources: Sources) -> np.ndarray | None:
    """The first box of ``t`` held in host memory as a NumPy array (None: none is)."""
    for src in sources.get(t.fqn, ()):
        adapter = src.array
        if isinstance(adapter, HostArray) and not adapter.array.dtype.hasobject and adapter.array.size:
            return adapter.array
    return None


def _nbytes(t: LocalTensor) -> int:
    return math.prod(t.global_shape) * t.itemsize


#: "auto" compresses only where its model (:func:`predicted_gain`) promises a save at least this
#: much faster. The model's promise for the benchmark's state (half bf16 weights, half fp32
#: moments: s = 0.24) to S3 through 200 MB/s on the 2-core test machine is 1.32x; measured:
#: 1.36-1.41x (bench/RESULTS.md)
MIN_GAIN = 1.1


def predicted_gain(bytes_per_s: float, threads: int, saving: float, store_bytes_per_s: float) -> float:
    """How many times faster a save whose ``threads`` compress at ``bytes_per_s`` each, saving
    the fraction ``saving`` of the bytes, writes to a store of ``store_bytes_per_s`` than the same
    save uncompressed: compression overlaps the writes, so the save runs at the slower of the two."""
    if store_bytes_per_s <= 0:
        raise ValueError(f"a store's write rate must be positive, got {store_bytes_per_s}")
    saving = min(max(saving, 0.0), 1.0 - 1e-9)
    return min(bytes_per_s * threads, store_bytes_per_s / (1.0 - saving)) / store_bytes_per_s


def _compressing(options: SaveOptions) -> int:
    """The chunks a save with ``options`` compresses at once."""
    return max(1, min(options.threads or runner.default_threads(), runner.compressing.limit))


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
    :data:`NOMINAL_SAVING` promise a save :data:`MIN_GAIN` times faster, else nothing."""
    c = options.codecs
    if c is None or not c.auto:
        return c
    threads, store = _compressing(options), write_rate(path)
    gain = predicted_gain(NOMINAL_BYTES_PER_S, threads, NOMINAL_SAVING, store)
    tensors = list(tensors)
    report: dict[str, Any] = {
        "mode": "auto",
        "min_bytes": AUTO_MIN_BYTES,
        "sampled": False,
        "threads": threads,
        "store_bytes_per_s": round(store),
        "predicted_gain": round(gain, 3),
        "tensors": {},
    }
    if gain < MIN_GAIN:
        report["decision"] = (
            f"nothing compressed: planned from the shapes alone, {threads} thread(s) at a nominal "
            f"{NOMINAL_BYTES_PER_S / 1e9:.1f} GB/s saving {NOMINAL_SAVING:.0%} would make a save to a store "
            f"written at {store / 1e9:.2f} GB/s only {gain:.2f}x as fast (compression pays from {MIN_GAIN}x)"
        )
        return dataclasses.replace(c, auto=True, keep_all=True, report=report)
    skip = {t.fqn for t in tensors if _nbytes(t) < AUTO_MIN_BYTES or t.dtype not in FLOAT_NAMES}
    report["tensors"] = {
        t.fqn: f"not floating-point ({t.dtype}): left as it is"
        for t in tensors
        if _nbytes(t) >= AUTO_MIN_BYTES and t.dtype not in FLOAT_NAMES
    }
    report["decision"] = (
        f"planned from the shapes alone: the floating-point tensors of {AUTO_MIN_BYTES >> 20} MiB or more "
        f"compressed, predicted {gain:.2f}x as fast"
    )
    return dataclasses.replace(c, auto=True, skip=frozenset(skip), report=report)


def resolve(
    path: str | os.PathLike[str], options: SaveOptions, local: StateDescription, sources: Sources
) -> Compression | None:
    """The compression a save of ``local`` to ``path`` plans with: ``options``' own, or for
    "auto" the one :func:`decide` and the store's write rate give (None: nothing compressed)."""
    c = options.codecs
    if c is None or not c.auto:
        return c
    found = decide(local, sources, c)
    threads, store = _compressing(options), write_rate(path)
    gain = predicted_gain(found.bytes_per_s, threads, found.fraction_saved, store)
    report: dict[str, Any] = {"mode": "auto", "min_bytes": AUTO_MIN_BYTES, "screened_bytes": found.screened}
    if found.sampled:
        report.update(
            compressor_bytes_per_s=round(found.bytes_per_s),
            threads=threads,
            store_bytes_per_s=round(store),
            fraction_saved=round(found.fraction_saved, 4),
            predicted_gain=round(gain, 3),
            trials={d: round(v, 4) for d, v in found.trials.items()},
        )
    if found.sampled and gain < MIN_GAIN:
        # the store writes about as fast as compression would make the save: nothing compressed
        report["decision"] = (
            f"nothing compressed: {threads} thread(s) compressing at {found.bytes_per_s / 1e9:.2f} GB/s each "
            f"and saving {found.fraction_saved:.0%} would make a save to a store written at "
            f"{store / 1e9:.2f} GB/s only {gain:.2f}x as fast (compression pays from {MIN_GAIN}x)"
        )
        report["tensors"] = dict(sorted(found.why.items()))
        return dataclasses.replace(c, auto=True, keep_all=True, report=report)
    n = sum(t.fqn not in found.skip for t in local.tensors)
    report["decision"] = f"{n} of {len(local.tensors)} tensor(s) compressed" + (
        f": predicted {gain:.2f}x as fast as a save uncompressed"
        if found.sampled
        else ": no screened tensor promised a saving (tensors that could not be screened are compressed)"
    )
    report["tensors"] = dict(sorted(found.why.items()))
    return dataclasses.replace(c, auto=True, skip=frozenset(found.skip), report=report)
