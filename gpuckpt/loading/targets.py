"""The arrays a load in place writes into: refused before anything is read when they cannot take
the stored values element by element (read-only, or elements that share memory).

Every load path that fills the caller's arrays asks here first: ``gpuckpt.load`` (whole arrays and
ShardedArray boxes), loads from a Hugging Face directory, and the DCP Reader under ``dcp.load``.
"""

from __future__ import annotations

import mmap

import numpy as np

from gpuckpt.device.arrays import ArrayAdapter, overlaps_itself
from gpuckpt.errors import ReadOnlyTargetError

__all__ = ["check_writable_target"]


def check_writable_target(fqn: str, arr: ArrayAdapter, what: str = "the target") -> None:
    """Refuse ``arr``, the target of tensor ``fqn`` (``what`` says which part of it), when it is
    read-only or its elements share memory (a broadcast view: torch's ``expand()``, NumPy's
    ``as_strided`` with a stride of 0), which would keep one value per address; device arrays
    are always writable.

    Raises
    ------
    ReadOnlyTargetError
        Naming the tensor, what is wrong and what to pass instead.
    """
    if arr.backend is not None:
        return  # device memory
    host = arr.host_array()
    if host.flags.writeable and overlaps_itself(host.shape, host.strides, host.itemsize):
        raise ReadOnlyTargetError(
            f"tensor {fqn!r}: {what} has elements that share memory (shape {host.shape}, byte strides "
            f"{host.strides}: a broadcast view such as torch's expand() or NumPy's as_strided), so "
            "loading into it would keep one value per address; pass an array of its own memory "
            "(x.contiguous(), np.array(x)), or use load_state_dict to get new arrays (nothing was loaded)"
        )
    if not host.flags.writeable:
        kind = "memory map" if isinstance(host, np.memmap) or isinstance(host.base, mmap.mmap) else "array"
        raise ReadOnlyTargetError(
            f"tensor {fqn!r}: {what} is a read-only {kind} ({type(host).__name__}, writeable=False; a "
            "torch view whose conjugate or negation is lazy, from conj() or .imag of one, is read "
            "that way too), so it cannot be loaded in place; pass a writable array (np.array(x) or "
            "x.resolve_conj().resolve_neg() copies one; open a memmap with mode='r+'), or use "
            "load_state_dict to get new arrays (nothing was loaded)"
        )
