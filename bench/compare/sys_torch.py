"""PyTorch peers (run in the peer environment): torch.save/load, safetensors, torch.distributed.checkpoint.

The state's NumPy arrays are wrapped with ``torch.from_numpy`` (no copy), so
every system saves exactly the same bytes.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench.compare.adapter import Adapter, measure_async, timed_copy

__all__ = ["DCP1", "DCP2", "DCPGpuckpt", "Safetensors", "TorchSave"]


class _TorchAdapter(Adapter):
    def __init__(self, state: dict[str, np.ndarray]) -> None:
        super().__init__(state)
        self.tstate = {k: torch.from_numpy(v) for k, v in state.items()}
        self.result: dict[str, torch.Tensor] = {}

    def version(self) -> str:
        return f"torch {torch.__version__}"

    def loaded(self) -> dict[str, Any]:
        if self.fresh:
            return {k: v.numpy() for k, v in self.result.items()}
        return self.targets

    def clear(self) -> None:
        self.result = {}
        self.targets = {}


class TorchSave(_TorchAdapter):
    """``torch.save`` of the dict (no fsync of its own: fsynced after, timed); ``torch.load(weights_only=True)``."""

    durable = False
    fresh = True

    def save(self, path: str) -> None:
        torch.save(self.tstate, path)

    def prepare_load(self) -> None:
        pass

    def load(self, path: str) -> None:
        self.result = torch.load(path, weights_only=True, mmap=False)


class Safetensors(_TorchAdapter):
    """``safetensors.torch.save_file`` (fsynced after, timed); load materialized into preallocated tensors.

    ``load_file`` returns tensors that view the file's memory map (it returns
    in milliseconds and reads nothing), so the load copies each tensor from
    ``safe_open(...).get_tensor`` into the preallocated targets: every byte is
    read inside the timed region.
    """

    durable = False
    modules = ("safetensors", "safetensors.torch")

    def version(self) -> str:
        return f"safetensors {importlib.metadata.version('safetensors')}"

    def save(self, path: str) -> None:
        from safetensors.torch import save_file

        save_file(self.tstate, path)

    def load(self, path: str) -> None:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                torch.from_numpy(self.targets[k]).copy_(f.get_tensor(k))


class _DCP(_TorchAdapter):
    """``dcp.save`` with ``FileSystemWriter(thread_count=N)`` (fsyncs: ``sync_files=True``); ``dcp.load`` in place."""

    threads = 1
    modules = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.staging")

    def save(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.tstate, storage_writer=dcp.FileSystemWriter(path, thread_count=self.threads))

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        tt = {k: torch.from_numpy(v) for k, v in self.targets.items()}
        dcp.load(tt, storage_reader=dcp.FileSystemReader(path))

    def writer(self, path: str) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.FileSystemWriter(path, thread_count=self.threads)

    def async_variants(self) -> dict[str, Callable[[str], dict[str, Any]]]:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cpu = {"use_pinned_memory": False, "use_shared_memory": False, "use_non_blocking_copy": False}
        return {
            # a new staging copy per call (what dcp.async_save does without a stager)
            "dcp-async-default": _async_variant(self, lambda: None),
            # one stager reused across calls: its staging memory is cached
            "dcp-async-cached": _async_variant(
                self, lambda: DefaultStager(StagingOptions(use_async_staging=False, **cpu))
            ),
            # staging on a background thread: the call returns before the copy
            "dcp-async-bgstage": _async_variant(
                self, lambda: DefaultStager(StagingOptions(use_async_staging=True, **cpu))
            ),
        }


def _async_variant(ad: Any, make_stager: Callable[[], Any]) -> Callable[[str], dict[str, Any]]:
    """Two ``dcp.async_save`` calls back to back through ``ad.writer``, with one stager for both."""
    import torch.distributed.checkpoint as dcp

    def run(prefix: str) -> dict[str, Any]:
        copy_s = timed_copy(ad.state)
        stager = make_stager()

        def start(p: str) -> Any:
            return dcp.async_save(ad.tstate, storage_writer=ad.writer(p), async_stager=stager)

        def wait(h: Any) -> float | None:
            if hasattr(h, "staging_completion"):
                h.staging_completion.result()
                staged = time.perf_counter()
                h.upload_completion.result()
                return staged
            h.result()
            return None

        rec = measure_async(
            start, wait, prefix, copy_s, sync_save=ad.save, copy_after=lambda: timed_copy(ad.state)
        )
        if stager is not None:
            stager.close()
        return rec

    return run


class DCP1(_DCP):
    threads = 1


class DCP2(_DCP):
    threads = 2


class DCPGpuckpt(_TorchAdapter):
    """``dcp.save`` through ``gpuckpt.dcp.Writer`` (defaults: durable, atomic); ``dcp.load`` in place
    through ``gpuckpt.dcp.Reader``; ``dcp.async_save`` with one ``gpuckpt.dcp.Stager`` for every call."""

    modules = ("torch.distributed.checkpoint", "gpuckpt", "gpuckpt.dcp")

    def version(self) -> str:
        # as the native adapter's version(): naming the backends loads them (the CRC32C library's
        # code, ~4 MB resident), before any timed operation as for every other library
        import gpuckpt
        from gpuckpt.format.checksum import crc32c_backend
        from gpuckpt.storage.local.crccopy import instruction_set

        return (
            f"torch {torch.__version__}, gpuckpt {gpuckpt.__version__} "
            f"(CRC32C: {crc32c_backend()}; copy-with-CRC: {instruction_set()})"
        )

    def writer(self, path: str) -> Any:
        import gpuckpt.dcp

        return gpuckpt.dcp.Writer(path)

    def save(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.tstate, storage_writer=self.writer(path))

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        import gpuckpt.dcp

        tt = {k: torch.from_numpy(v) for k, v in self.targets.items()}
        dcp.load(tt, storage_reader=gpuckpt.dcp.Reader(path))

    def async_variants(self) -> dict[str, Callable[[str], dict[str, Any]]]:
        import gpuckpt.dcp

        return {"dcp-gpuckpt-async": _async_variant(self, gpuckpt.dcp.Stager)}
