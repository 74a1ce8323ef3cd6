"""Progress reporting: a callback receives bytes done and bytes in total."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["ProgressCallback", "ProgressCounter"]

#: ``callback(done_bytes, total_bytes)``; called from I/O threads, serialised.
ProgressCallback = Callable[[int, int], None]


class ProgressCounter:
    """Accumulates bytes from several threads and reports each step to a callback."""

    def __init__(self, callback: ProgressCallback | None, total: int) -> None:
        self.callback = callback
        self.total = total
        self.done = 0
        self._lock = threading.Lock()
        if callback is not None:
            callback(0, total)

    def add(self, nbytes: int) -> None:
        if self.callback is None:
            return
        with self._lock:
            self.done += nbytes
            self.callback(self.done, self.total)
