"""Content hashes of chunks in device memory, computed on the device (``kernels/xxh3_tree.cu``).

An incremental save compares each chunk's hash with the base's before the
chunk is staged: a chunk found unchanged never crosses PCIe. The hash is the
one :mod:`gpuckpt.storage.contenthash` defines (XXH3-128 over 1 MiB leaves);
:func:`leaf_plan` (pure data) cuts chunks into leaves, the kernel
``gpuckpt_xxh3_leaves`` hashes every leaf of many chunks in one launch (one
thread per leaf) and ``gpuckpt_xxh3_roots`` the leaf digests of each chunk;
:func:`hash_device_chunks` runs both through CuPy and returns 32 bytes per
chunk. The CPU emulation of the kernels is tested against ``xxhash``
(``tests/kernels/test_xxh3_emu.py``); the CuPy launch needs a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.device.kernels import kernel_source_dir

__all__ = ["HASH_KERNEL_FILE", "LEAF", "LeafPlan", "hash_device_chunks", "leaf_plan"]

#: the kernel source, next to the channels-last kernels
HASH_KERNEL_FILE = "xxh3_tree.cu"
#: bytes per leaf: :data:`gpuckpt.storage.contenthash.LEAF` (the device layer imports no storage;
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
    from gpuckpt.device.cuda import import_cupy

    cupy = import_cupy()
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
