"""Systems measured in the project's own interpreter: gpuckpt, the raw baselines, TensorStore."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.compare.adapter import Adapter, measure_async, timed_copy

__all__ = [
    "Gpuckpt",
    "GpuckptBuffered",
    "GpuckptDirect",
    "GpuckptPread",
    "RawFiles",
    "RawSingle",
    "TensorStoreZarr3",
]

_CHUNK_BYTES = 64 << 20


class RawFiles(Adapter):
    """One file per tensor, plain writes, fsync of every file and directory; readinto preallocated arrays."""

    def version(self) -> str:
        return "os.write/readinto"

    def save(self, path: str) -> None:
        from gpuckpt.cli.rawio import raw_files_save

        raw_files_save(list(self.state.values()), Path(path))

    def load(self, path: str) -> None:
        from gpuckpt.cli.rawio import raw_files_load

        raw_files_load(list(self.targets.values()), Path(path))


class RawSingle(Adapter):
    """All tensors in one file, one fsync; readinto preallocated arrays."""

    def version(self) -> str:
        return "os.write/readinto"

    def save(self, path: str) -> None:
        from gpuckpt.cli.rawio import raw_single_save

        raw_single_save(list(self.state.values()), Path(path))

    def load(self, path: str) -> None:
        from gpuckpt.cli.rawio import raw_single_load

        raw_single_load(list(self.targets.values()), Path(path))


class Gpuckpt(Adapter):
    """gpuckpt's public API: ``save``, ``load`` in place, ``async_save`` (defaults throughout)."""

    modules = ("gpuckpt",)

    def version(self) -> str:
        import gpuckpt
        from gpuckpt.format.checksum import crc32c_backend
        from gpuckpt.storage.local.crccopy import instruction_set

        return f"{gpuckpt.__version__} (CRC32C: {crc32c_backend()}; copy-with-CRC: {instruction_set()})"

    def save(self, path: str) -> None:
        import gpuckpt

        gpuckpt.save(self.state, path)

    def load(self, path: str) -> None:
        import gpuckpt

        gpuckpt.load(self.targets, path)

    def async_variants(self) -> dict[str, Callable[[str], dict[str, Any]]]:
        import gpuckpt

        def run(prefix: str) -> dict[str, Any]:
            copy_s = timed_copy(self.state)
            return measure_async(
                lambda p: gpuckpt.async_save(self.state, p),
                lambda f: f.result() and None,
                prefix,
                copy_s,
                sync_save=self.save,
                copy_after=lambda: timed_copy(self.state),
            )

        return {self.async_name: run}

    async_name = "gpuckpt-async"


class GpuckptBuffered(Gpuckpt):
    """gpuckpt with ``GPUCKPT_DIRECT_IO=0``: the async save writes through the page cache too."""

    async_name = "gpuckpt-async-buffered"

    def __init__(self, state: dict[str, np.ndarray]) -> None:
        os.environ["GPUCKPT_DIRECT_IO"] = "0"  # this measurement process only
        super().__init__(state)


class GpuckptDirect(Gpuckpt):
    """gpuckpt with ``GPUCKPT_DIRECT_IO=1``: the synchronous save writes with O_DIRECT too."""

    def __init__(self, state: dict[str, np.ndarray]) -> None:
        os.environ["GPUCKPT_DIRECT_IO"] = "1"  # this measurement process only
        super().__init__(state)


class GpuckptPread(Gpuckpt):
    """gpuckpt with ``GPUCKPT_CRCCOPY=off``: loads read with pread and checksum after (no fused loop)."""

    def __init__(self, state: dict[str, np.ndarray]) -> None:
        os.environ["GPUCKPT_CRCCOPY"] = "off"  # this measurement process only
        super().__init__(state)


def _chunk_shape(shape: tuple[int, ...], itemsize: int) -> list[int]:
    """About 64 MiB chunks split along the first axis (the layout gpuckpt uses)."""
    if not shape:
        return []
    row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    rows = max(1, min(shape[0], _CHUNK_BYTES // max(1, row)))
    return [rows, *shape[1:]]


class TensorStoreZarr3(Adapter):
    """TensorStore's zarr3 driver, one array per tensor, bytes + crc32c codecs (as gpuckpt).

    All opens and writes are issued at once and awaited together (TensorStore
    parallelizes them); its file kvstore fsyncs what it writes by default.
    Loads read into the preallocated arrays (``ts.array(target).write(store)``).
    """

    modules = ("tensorstore",)

    def version(self) -> str:
        return importlib.metadata.version("tensorstore")

    @staticmethod
    def _spec(path: str, name: str) -> dict[str, Any]:
        return {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(path, name)}}

    def save(self, path: str) -> None:
        import tensorstore as ts

        os.makedirs(path)
        opens = []
        for name, a in self.state.items():
            spec = self._spec(path, name)
            spec["metadata"] = {
                "shape": list(a.shape),
                "data_type": str(a.dtype),
                "chunk_grid": {
                    "name": "regular",
                    "configuration": {"chunk_shape": _chunk_shape(a.shape, a.dtype.itemsize)},
                },
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            }
            opens.append(ts.open(spec, create=True))
        writes = [o.result().write(a) for o, a in zip(opens, self.state.values(), strict=True)]
        for w in writes:
            w.result()

    def load(self, path: str) -> None:
        import tensorstore as ts

        opens = [ts.open(self._spec(path, name), open=True) for name in self.targets]
        reads = [ts.array(t).write(o.result()) for o, t in zip(opens, self.targets.values(), strict=True)]
        for r in reads:
            r.result()
