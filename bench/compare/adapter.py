"""The interface every compared system implements (NumPy only; Python 3.11 syntax)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.compare.common import peak_rss, prefault, reset_peak, rss

__all__ = ["Adapter", "timed_copy"]


class Adapter:
    """One checkpoint system, bound to one state.

    The runner calls, in this order: ``save(path)``; then for each load,
    ``prepare_load()`` (untimed: allocate and touch the targets), ``load(path)``
    (timed), ``loaded()`` (the arrays to check, untimed), ``clear()``; and
    ``async_variants()`` for the ``async`` operation.

    ``durable``: whether ``save`` makes its files durable by itself (if not,
    the runner fsyncs every file and counts it). ``fresh``: whether ``load``
    allocates its result instead of filling preallocated arrays (the result's
    size is then not counted as extra memory).
    """

    durable = True
    fresh = False
    #: modules the system's calls use, imported when the adapter is made (untimed): the first
    #: import of a library (``torch.distributed.checkpoint`` takes about 0.6 s here) is not
    #: part of a save or load
    modules: tuple[str, ...] = ()

    def __init__(self, state: dict[str, np.ndarray]) -> None:
        self.state = state
        self.targets: dict[str, np.ndarray] = {}
        for name in self.modules:
            importlib.import_module(name)

    def version(self) -> str:
        return ""

    def save(self, path: str) -> None:
        raise NotImplementedError

    def prepare_load(self) -> None:
        """Preallocated, touched targets of the state's shapes and dtypes."""
        self.targets = {k: np.empty_like(v) for k, v in self.state.items()}
        prefault(self.targets.values())

    def load(self, path: str) -> None:
        raise NotImplementedError

    def loaded(self) -> dict[str, Any]:
        """What the last load produced, as NumPy arrays."""
        return self.targets

    def clear(self) -> None:
        self.targets = {}

    def async_variants(self) -> dict[str, Callable[[str], dict[str, Any]]]:
        return {}


def timed_copy(state: dict[str, np.ndarray]) -> float:
    """Seconds of one copy of ``state`` into already-allocated, touched memory (``np.copyto``)."""
    dst = {k: np.empty_like(v) for k, v in state.items()}
    prefault(dst.values())
    t0 = time.perf_counter()
    for k, v in state.items():
        np.copyto(dst[k], v)
    return time.perf_counter() - t0


def measure_async(
    start: Callable[[str], Any],
    wait: Callable[[Any], float | None],
    prefix: str,
    copy_s: float,
    sync_save: Callable[[str], None] | None = None,
    copy_after: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Two asynchronous saves back to back; the second one (cached staging, if any) is reported.

    ``start(path)`` begins a save and returns a handle; ``wait(handle)`` blocks
    until it is durable and returns when (perf_counter) staging finished, or
    None where staging is part of the call. Extra memory is the peak RSS
    above the resident size before the first call, over the two asynchronous
    saves (not the synchronous reference between them). ``sync_save``, if given,
    is the same system's synchronous save, timed right after the second
    asynchronous one and also right before it (after the first): references
    taken in the same position (a durable save right after another one is
    slower on this disk than the first of a process), on both sides of the
    measured call so that a drift over the sequence cancels.
    ``copy_after``, if given, times one copy of the state into touched memory
    right after the second save is durable (after its memory was read): the
    copy reference in the same position as the second call, reported as
    ``copy_ref_s`` (``copy_s``, taken before the first call, as
    ``copy_ref_before_s``).
    """
    r0 = rss()
    reset_peak()
    t0 = time.perf_counter()
    h = start(f"{prefix}-1")
    first_block = time.perf_counter() - t0
    wait(h)
    first_durable = time.perf_counter() - t0
    peak_first = peak_rss()
    sync_before = None
    if sync_save is not None:
        t0 = time.perf_counter()
        sync_save(f"{prefix}-0")
        sync_before = time.perf_counter() - t0
        reset_peak()  # the reference's own memory is not the asynchronous saves'
    t0 = time.perf_counter()
    h = start(f"{prefix}-2")
    block = time.perf_counter() - t0
    staged_at = wait(h)
    durable = time.perf_counter() - t0
    rec: dict[str, Any] = {
        "op": "async",
        "blocking_first_s": first_block,
        "durable_first_s": first_durable,
        "blocking_s": block,
        "seconds": durable,
        "copy_ref_s": copy_s,
        "extra_peak": max(peak_first, peak_rss()) - r0,
    }
    if copy_after is not None:
        rec["copy_ref_before_s"] = copy_s
        rec["copy_ref_s"] = copy_after()
    if staged_at is not None:
        rec["staged_s"] = staged_at - t0
    if sync_save is not None and sync_before is not None:
        t0 = time.perf_counter()
        sync_save(f"{prefix}-3")
        rec["sync_after_s"] = time.perf_counter() - t0
        rec["sync_before_s"] = sync_before
        rec["durable_over_sync_after"] = durable / rec["sync_after_s"]
        # against the mean of the two references on either side
        rec["durable_over_sync"] = durable / ((sync_before + rec["sync_after_s"]) / 2)
    return rec
