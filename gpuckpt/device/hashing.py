"""Content hashes of chunks in device memory, computed on the device (``kernels/xxh3_tree.cu``).

An incremental save compares each chunk's hash with the base's before the
chunk is staged: a chunk found unchanged never crosses PCIe. The hash is the
one :mod:`gpuckpt.format.contenthash` defines (XXH3-128 over 1 MiB leaves);
:func:`leaf_plan` (pure data) cuts chunks into leaves, the kernel
``gpuckpt_xxh3_leaves`` hashes every leaf of many chunks in one launch (one
thread per leaf) and ``gpuckpt_xxh3_roots`` the leaf digests of each chunk;
:func:`hash_device_chunks` runs both through CuPy and returns 32 bytes per
chunk. The CPU emulation of the kernels is tested against ``xxhash``
(``tests/kernels/test_xxh3_emu.py``); the CuPy launch needs a GPU.

A device back end hashes the chunks of an array as they are stored
(:meth:`~gpuckpt.device.backend.DeviceBackend.hash_chunks`): the box of
each chunk in logical C order, at the origin of a zero block of the chunk's
stored shape, little-endian. :func:`stored_block` builds that block for host
memory, and :func:`hash_host_chunks` hashes such blocks with the ``xxhash``
library (the host stand-in of a device, :mod:`gpuckpt.device.host_backend`).
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.device.backend import ChunkBox
from gpuckpt.device.kernels import kernel_source_dir

__all__ = [
    "HASH_KERNEL_FILE",
    "LEAF",
    "ChunkBox",
    "LeafPlan",
    "hash_device_chunks",
    "hash_host_chunks",
    "host_hashing_available",
    "leaf_plan",
    "stored_block",
]


_xxhash: Any
try:  # optional (gpuckpt[incremental]), as for gpuckpt.format.contenthash
    _xxhash = importlib.import_module("xxhash")
except ImportError:  # exercised where xxhash is not installed
    _xxhash = None

#: the kernel source, next to the channels-last kernels
HASH_KERNEL_FILE = "xxh3_tree.cu"
#: bytes per leaf: :data:`gpuckpt.format.contenthash.LEAF` (the device layer imports no storage;
#: ``tests/kernels/test_xxh3_emu.py`` checks that the two agree)
LEAF = 1 << 20
_THREADS = 128
_modules: dict[int, Any] = {}
_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class LeafPlan:
    """The leaves of a list of chunks: leaf ``i`` is ``lengths[i]`` bytes at byte ``offsets[i]``
    of the buffer; chunk ``c`` owns leaves ``first[c]`` to ``first[c] + counts[c] - 1``."""

    offsets: np.ndarray
    lengths: np.ndarray
    first: np.ndarray
    counts: np.ndarray


def leaf_plan(chunks: Sequence[tuple[int, int]]) -> LeafPlan:
    """The leaves of ``chunks``, each ``(byte offset in the buffer, byte length)``.

    Examples
    --------
    >>> p = leaf_plan([(0, 5), (8, (1 << 20) + 1)])
    >>> p.lengths.tolist(), p.first.tolist(), p.counts.tolist()
    ([5, 1048576, 1], [0, 1], [1, 2])
    """
    offsets: list[int] = []
    lengths: list[int] = []
    first: list[int] = []
    counts: list[int] = []
    for start, n in chunks:
        if start < 0 or n < 0:
            raise ValueError(f"chunk ({start}, {n}): offsets and lengths must be >= 0")
        first.append(len(offsets))
        pieces = range(0, max(n, 1), LEAF)
        offsets += [start + o for o in pieces]
        lengths += [min(LEAF, n - o) for o in pieces]
        counts.append(len(pieces))
    return LeafPlan(
        np.array(offsets, np.uint64),
        np.array(lengths, np.uint64),
        np.array(first, np.uint64),
        np.array(counts, np.uint64),
    )


def _module(cupy: Any) -> Any:
    device = int(cupy.cuda.Device().id)
    with _lock:
        module = _modules.get(device)
        if module is None:
            source = (kernel_source_dir() / HASH_KERNEL_FILE).read_text(encoding="utf-8")
            module = cupy.RawModule(code=source, options=("-std=c++17",))
            module.compile()
            _modules[device] = module
    return module


def hash_device_chunks(buffer: Any, chunks: Sequence[tuple[int, int]]) -> list[tuple[bytes, bytes]]:
    """``(hash, head)`` of each chunk of the CuPy ``buffer`` (C-contiguous, any dtype; chunks
    given in bytes as for :func:`leaf_plan`), computed on the buffer's device; only 32 bytes
    per chunk come back to the host."""
    import cupy  # as the kernel launches of gpuckpt.device.kernels: the buffer is CuPy's already

    if not buffer.flags.c_contiguous:
        raise ValueError(f"hash_device_chunks needs a C-contiguous buffer, got shape {buffer.shape}")
    nbytes = buffer.size * buffer.itemsize
    for start, n in chunks:
        if start + n > nbytes:
            raise ValueError(f"chunk ({start}, {n}) ends past the buffer's {nbytes} bytes")
    if not chunks:
        return []
    plan = leaf_plan(chunks)
    data = buffer.reshape(-1).view(cupy.uint8)
    module = _module(cupy)
    nleaves, nchunks = len(plan.offsets), len(plan.first)
    leaves = cupy.empty(16 * nleaves, cupy.uint8)
    roots = cupy.empty(16 * nchunks, cupy.uint8)
    grid = ((nleaves + _THREADS - 1) // _THREADS,)
    module.get_function("gpuckpt_xxh3_leaves")(
        grid,
        (_THREADS,),
        (data, cupy.asarray(plan.offsets), cupy.asarray(plan.lengths), np.uint64(nleaves), leaves),
    )
    grid = ((nchunks + _THREADS - 1) // _THREADS,)
    module.get_function("gpuckpt_xxh3_roots")(
        grid,
        (_THREADS,),
        (leaves, cupy.asarray(plan.first), cupy.asarray(plan.counts), np.uint64(nchunks), roots),
    )
    heads = cupy.asnumpy(leaves.reshape(nleaves, 16)[plan.first.astype(np.int64)])
    root = cupy.asnumpy(roots.reshape(nchunks, 16))
    return [(bytes(root[c]), bytes(heads[c])) for c in range(nchunks)]


def host_hashing_available() -> bool:
    """Whether :func:`hash_host_chunks` can hash (the ``xxhash`` package is installed)."""
    return _xxhash is not None


def stored_block(array: np.ndarray, chunk: ChunkBox) -> np.ndarray:
    """The stored bytes (``uint8``, C order, little-endian) of ``chunk`` of the host ``array``:
    its box at the origin of a zero block of its stored shape (the box itself, without a
    copy, when it fills the block and is C-contiguous and little-endian)."""
    offsets, sizes, stored = chunk
    box = array[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] if sizes else array[...]
    dt = box.dtype.newbyteorder("<") if box.dtype.byteorder == ">" else box.dtype
    if tuple(sizes) == tuple(stored) and box.flags.c_contiguous and dt == box.dtype:
        return box.reshape(-1).view(np.uint8)
    block = np.zeros(tuple(stored), dt)
    block[tuple(slice(0, s) for s in sizes)] = box
    return block.reshape(-1).view(np.uint8)


def _tree(data: memoryview) -> tuple[bytes, bytes]:
    """``(hash, head)`` of one chunk's stored bytes: the tree of :mod:`gpuckpt.format.contenthash`."""
    n = data.nbytes
    if n <= LEAF:
        d = bytes(_xxhash.xxh3_128_digest(data))
        return d, d
    leaves = [bytes(_xxhash.xxh3_128_digest(data[i : i + LEAF])) for i in range(0, n, LEAF)]
    return bytes(_xxhash.xxh3_128_digest(b"".join(leaves))), leaves[0]


def hash_host_chunks(array: np.ndarray, chunks: Sequence[ChunkBox]) -> list[tuple[bytes, bytes]] | None:
    """``(hash, head)`` of the stored block of each of ``chunks`` of the host ``array``
    (:func:`stored_block`), with the ``xxhash`` library; None when it is not installed."""
    if _xxhash is None:
        return None
    out = []
    for c in chunks:
        if (
            len(c[1]) != array.ndim
            or len(c[2]) != array.ndim
            or any(a > b for a, b in zip(c[1], c[2], strict=True))
        ):
            raise ValueError(
                f"chunk {c} does not fit an array of {array.ndim} dimensions: expected (offsets, sizes, "
                "stored shape) with sizes no larger than the stored shape"
            )
        out.append(_tree(memoryview(stored_block(array, c))))
    return out


#: device scratch for the stored blocks of chunks hashed in one launch (boxes that are not
#: already a contiguous byte run of their array, or that are padded)
_SCRATCH_BYTES = 256 << 20


def device_stored_groups(
    array: Any,
    chunks: Sequence[ChunkBox],
    scratch_bytes: int = _SCRATCH_BYTES,
    *,
    align: int = 1,
    xp: Any = None,
) -> Iterator[tuple[list[int], Any, list[tuple[int, int]]]]:
    """The stored blocks of ``chunks`` of the CuPy ``array`` (as :func:`stored_block` makes them
    on the host), on the array's device, on the current stream: groups ``(indices, buffer,
    spans)``, where the chunk ``chunks[indices[k]]`` is the C-contiguous byte run
    ``spans[k] = (start, nbytes)`` of the ``uint8`` device ``buffer``, each start a multiple of
    ``align`` (a library's required input alignment). Chunks that are such a byte run of a
    C-contiguous array come first, in place (the buffer is the array's memory); the others are
    gathered, with their zero padding, into device scratch of at most about ``scratch_bytes``
    per group (a group is used before the next is made). ``xp``: the array module (CuPy; NumPy
    where tests run the grouping on the host)."""
    if xp is None:
        import cupy  # the array is CuPy's already (gpuckpt.device.cuda imports this module)

        xp = cupy

    in_place: list[int] = []
    spans: list[tuple[int, int]] = []
    gather: list[int] = []
    base = _address(array)
    for i, (offsets, sizes, stored) in enumerate(chunks):
        box = array[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] if sizes else array
        start = _address(box) - base if box.size else 0
        if (
            array.flags.c_contiguous
            and tuple(sizes) == tuple(stored)
            and box.flags.c_contiguous
            and start % align == 0
        ):
            in_place.append(i)
            spans.append((start, int(box.nbytes)))
        else:
            gather.append(i)
    if in_place:
        yield in_place, array.reshape(-1).view(xp.uint8), spans
    itemsize = int(array.itemsize)
    step = math.lcm(align, itemsize)
    nxt = 0
    while nxt < len(gather):
        take: list[int] = []
        total = 0
        while nxt < len(gather):
            n = -(-math.prod(chunks[gather[nxt]][2]) * itemsize // step) * step
            if take and total + n > scratch_bytes:
                break
            take.append(gather[nxt])
            total += n
            nxt += 1
        scratch = xp.zeros(max(1, total), xp.uint8)
        places = []
        at = 0
        for i in take:
            offsets, sizes, stored = chunks[i]
            n = math.prod(stored) * itemsize
            block = scratch[at : at + n].view(array.dtype).reshape(stored)
            region = tuple(slice(0, s) for s in sizes)
            src = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            block[region] = array[src]
            places.append((at, n))
            at += -(-n // step) * step
        yield take, scratch, places


def _address(a: Any) -> int:
    """Where ``a``'s first element is: a CuPy array's device pointer, a NumPy array's address."""
    data = getattr(a, "data", None)
    ptr = getattr(data, "ptr", None)
    return int(ptr) if ptr is not None else int(a.ctypes.data)


def hash_device_boxes(array: Any, chunks: Sequence[ChunkBox]) -> list[tuple[bytes, bytes]]:
    """``(hash, head)`` of the stored block of each of ``chunks`` of the CuPy ``array``
    (:func:`device_stored_groups`), computed on the array's device on the current stream.
    Only 32 bytes per chunk come back to the host."""
    out: list[tuple[bytes, bytes] | None] = [None] * len(chunks)
    for indices, buffer, spans in device_stored_groups(array, chunks):
        for i, d in zip(indices, hash_device_chunks(buffer, spans), strict=True):
            out[i] = d
    return [d for d in out if d is not None]
