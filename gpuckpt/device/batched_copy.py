"""The batched device-to-device copy (``kernels/batched_copy.cu``): one launch for many pieces.

Compiled through CuPy (NVRTC) lazily, once per device; importing this module
never imports CuPy. :class:`~gpuckpt.device.cuda.CupyBackend` uses it for
device snapshots whose arrays lie in many separate allocations
(:mod:`gpuckpt.device.packing`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from gpuckpt.device.kernel_source import kernel_source_dir

__all__ = ["BATCHED_COPY_FILE", "THREADS", "batched_copy_source", "launch_batched_copy"]

BATCHED_COPY_FILE = "batched_copy.cu"
#: threads per block of the batched copy
THREADS = 256
#: most blocks launched; the kernel loops over the rest of the pieces
_MAX_BLOCKS = 1 << 16

_kernels: dict[int, Any] = {}
_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_after_fork)


def batched_copy_source() -> str:
    """The CUDA source of the batched copy."""
    return (kernel_source_dir() / BATCHED_COPY_FILE).read_text(encoding="utf-8")


def _kernel(device_id: int) -> Any:
    kernel = _kernels.get(device_id)
    if kernel is not None:
        return kernel
    import cupy

    with _lock:
        kernel = _kernels.get(device_id)
        if kernel is None:
            with cupy.cuda.Device(device_id):
                module = cupy.RawModule(code=batched_copy_source(), options=("-std=c++17",))
                module.compile()
                kernel = _kernels[device_id] = module.get_function("gpuckpt_batched_copy")
    return kernel


def launch_batched_copy(device_id: int, table: Any, npieces: int) -> None:
    """Copy ``npieces`` pieces described by ``table`` (a device array of ``3 * npieces`` uint64:
    source, destination, bytes) with one launch on the current stream of ``device_id``."""
    import numpy as np

    if npieces <= 0:
        return
    blocks = min(npieces, _MAX_BLOCKS)
    _kernel(device_id)((blocks,), (THREADS,), (table, np.int64(npieces)))
