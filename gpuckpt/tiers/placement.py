"""Where a part fetched from a peer is received: straight into the arrays the restore fills.

A rank of a replaced node restores its part from a copy on another node. Each of its host
arrays whose whole value is one stored chunk (a part's usual layout: the rank's local
arrays, uncompressed) takes that chunk's bytes from the transport directly; the load then
reads them "into" the same memory, which only checks their checksum
(:mod:`gpuckpt.storage.memory`). No buffer of the part's size is allocated, no byte is
copied twice, and the arrays' pages, which the job has touched already, take no faults
(on a 2-vCPU VM, receiving 256 MiB into new memory took 0.15-0.45 s against 0.07 s into
memory in use).

A chunk file travels as two messages, its bytes and its checksum trailer
(:func:`message_sizes`, the same rule on both ends), so that the bytes can land in an array.

Only what is safe is placed: host memory (a NumPy array, or a CPU tensor viewed through
DLPack as the load views it), C-contiguous, writable, of the stored dtype (little-endian) and
shape, whose memory overlaps no other array of the state (else the
load could write one array before the bytes received into the other were read). Anything
else is received into a buffer and loaded from there as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuckpt.device.arrays import HostArray, adapt, is_array
from gpuckpt.format.checksum import CRC_BYTES
from gpuckpt.format.documents import is_chunk_file_key
from gpuckpt.format.entries import whole_chunk_key
from gpuckpt.loading.open import index_of_root
from gpuckpt.saving.sources import is_leaf
from gpuckpt.state import flatten_state_dict

__all__ = ["message_sizes", "placement"]

try:  # numpy >= 2.0
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # pragma: no cover - numpy 1.26
    _byte_bounds = np.byte_bounds  # type: ignore[attr-defined]


def message_sizes(rel: str, size: int) -> list[int]:
    """The sizes of the messages a part's file of ``size`` bytes named ``rel`` travels as: a
    chunk file as its bytes and its checksum trailer, any other file whole, an empty one not
    at all."""
    if size > CRC_BYTES and is_chunk_file_key(rel.rpartition("/")[2]):
        return [size - CRC_BYTES, CRC_BYTES]
    return [size] if size else []


def placement(root: bytes, where: str, view: dict[str, Any]) -> dict[str, memoryview]:
    """For the part whose root document is ``root`` (named ``where`` in errors) and the state
    ``view`` it is restored into (:func:`~gpuckpt.tiers.parts.part_view`): each chunk file
    (relative name) whose bytes can be received into an array of ``view``, with that array's
    bytes. Raises what reading the document raises (a damaged document: nothing placed)."""
    index = index_of_root(root, where)
    leaves, _ = flatten_state_dict(view, is_leaf)
    arrays = {fqn: a for fqn, leaf in leaves.items() if (a := _host_view(leaf.value)) is not None}
    shared = _overlapping(arrays)
    out: dict[str, memoryview] = {}
    for fqn, a in arrays.items():
        t = index.tensors.get(fqn)
        if t is None or fqn in shared or not t.whole or t.codec is not None or t.nchunks != 1:
            continue
        if (
            a.shape != t.shape
            or a.dtype != t.dtype
            or a.dtype.byteorder == ">"
            or not a.flags.c_contiguous
            or not a.flags.writeable
            or a.nbytes != t.nbytes
        ):
            continue
        out[f"{t.name}/{whole_chunk_key(len(t.shape))}"] = memoryview(a.reshape(-1).view(np.uint8))
    return out


def _host_view(value: Any) -> np.ndarray | None:
    """``value``'s memory as the NumPy array a load reads into (:func:`~gpuckpt.device.arrays.adapt`:
    NumPy arrays, CPU tensors through DLPack), or None for device arrays and anything else."""
    if isinstance(value, np.ndarray):
        return value
    if not is_array(value):
        return None
    try:
        adapted = adapt(value)
    except Exception:  # (what the load says about it is the load's to say)
        return None
    return adapted.array if isinstance(adapted, HostArray) else None


def _overlapping(arrays: dict[str, np.ndarray]) -> set[str]:
    """The FQNs of the arrays whose memory overlaps another's (the same array under two
    names, views of one buffer)."""
    spans = sorted((*_byte_bounds(a), fqn) for fqn, a in arrays.items() if a.nbytes)
    out: set[str] = set()
    end, last = -1, ""
    for lo, hi, fqn in spans:
        if lo < end:
            out.update((fqn, last))
        if hi > end:
            end, last = hi, fqn
    return out
