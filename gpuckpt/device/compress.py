"""Chunks compressed on their device: nvCOMP's zstd, whose frames the core Zarr ``zstd`` codec reads.

nvCOMP's ``Zstd`` in ``RAW`` bitstream mode compresses each buffer of a batch into one plain
zstd frame that announces its content size: what the host's zstd writes for the core ``zstd``
codec, and what every reader of it (gpuckpt's, zarr-python's numcodecs, TensorStore) decodes.
Measured on an H200 (bench/RESULTS.md, "GPU run of 2026-12-04"): the ratio of host zstd level 1,
5.3-6.1 GB/s on chunks of 1-4 MiB, 3.2-3.3 GB/s on 64 MiB chunks.

:func:`encode_device_chunks` compresses the stored blocks of chunks of a CuPy array (the same
blocks the device hashes: :func:`~gpuckpt.device.hashing.device_stored_groups`) and copies only
the frames to the host. The nvCOMP wheel (``nvidia-nvcomp-cu12`` or ``-cu13``) is optional:
without it :func:`nvcomp_module` is None and the chunks are compressed on the host after
staging, as every other codec's are.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpuckpt.device.backend import ChunkBox
from gpuckpt.device.hashing import device_stored_groups

__all__ = ["DEVICE_CODECS", "encode_device_chunks", "import_nvcomp", "nvcomp_module"]

#: the codecs a device compresses into (:class:`gpuckpt.format.codecs.Codec` names)
DEVICE_CODECS = ("zstd",)
#: raw bytes compressed per nvCOMP batch (its scratch and output are about as large again)
BATCH_BYTES = 256 << 20
#: where each chunk's bytes start in the buffers given to nvCOMP, a multiple of this (a chunk
#: that is a byte run of its array elsewhere, in a narrow dtype, is gathered into scratch)
INPUT_ALIGN = 16


def import_nvcomp() -> Any:
    """``nvidia.nvcomp``, also where another ``nvidia`` package earlier on the path is a regular
    package (CUDA wheels) and hides the folder the nvCOMP wheel was installed into. Raises
    ImportError where it is not installed."""
    try:
        from nvidia import nvcomp
    except ModuleNotFoundError:
        import nvidia

        for entry in sys.path:
            folder = Path(entry or ".") / "nvidia"
            if (folder / "nvcomp").is_dir() and str(folder) not in list(nvidia.__path__):
                nvidia.__path__.append(str(folder))
        from nvidia import nvcomp
    return nvcomp


@functools.cache
def nvcomp_module() -> Any:
    """nvCOMP's Python module, or None where it cannot be imported (looked for once)."""
    try:
        return import_nvcomp()
    except Exception:  # not installed, or built for another CUDA: the host compresses
        return None


def encode_device_chunks(
    array: Any, chunks: Sequence[ChunkBox], codec_name: str, *, nvcomp: Any = None, xp: Any = None
) -> list[np.ndarray] | None:
    """The compressed stored bytes of each of ``chunks`` of the CuPy ``array`` (host ``uint8``
    arrays, in order), compressed on the array's device after the work queued on the current
    stream; None where this device cannot write ``codec_name`` (no nvCOMP, another codec, an
    empty chunk). ``nvcomp`` and ``xp`` (the array module): nvCOMP's module and CuPy unless
    given (tests give stand-ins that run on the host)."""
    nvcomp = nvcomp if nvcomp is not None else nvcomp_module()
    if nvcomp is None or codec_name not in DEVICE_CODECS or any(math.prod(c[2]) == 0 for c in chunks):
        return None
    if xp is None:
        import cupy  # the array is CuPy's already

        xp = cupy

    out: list[np.ndarray | None] = [None] * len(chunks)
    groups = device_stored_groups(array, chunks, BATCH_BYTES, align=INPUT_ALIGN, xp=xp)
    for indices, buffer, spans in groups:
        # batches of at most BATCH_BYTES of raw bytes (an in-place group may be the whole array)
        k = 0
        while k < len(indices):
            take: list[int] = []
            total = 0
            while k < len(indices) and (not take or total + spans[k][1] <= BATCH_BYTES):
                take.append(k)
                total += spans[k][1]
                k += 1
            largest = max(spans[j][1] for j in take)
            if hasattr(xp, "cuda"):  # the gather ran on the current stream; nvCOMP queues on its own
                xp.cuda.get_current_stream().synchronize()
            codec = nvcomp.Codec(
                algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, uncomp_chunk_size=largest
            )
            batch = nvcomp.as_arrays(buffer, [spans[j][0] for j in take], [spans[j][1] for j in take])
            frames = codec.encode(batch).cpu()
            for j, frame in zip(take, frames, strict=True):
                out[indices[j]] = np.array(np.asarray(frame).reshape(-1).view(np.uint8), copy=True)
    return [f for f in out if f is not None]
