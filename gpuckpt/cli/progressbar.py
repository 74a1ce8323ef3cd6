"""A progress bar on stderr, shown only when stderr is a terminal."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["ProgressBar", "format_bytes", "progress_for"]


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class ProgressBar:
    """A ``callback(done_bytes, total_bytes)`` that draws ``label [#####-----] 50% ...``.

    Redraws at most ten times a second; :meth:`close` ends the line.
    Thread-safe: gpuckpt calls progress callbacks from its I/O threads.
    """

    def __init__(
        self, label: str, stream: TextIO | None = None, *, width: int = 30, interval: float = 0.1
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.interval = interval
        self._start = time.perf_counter()
        self._last = -1.0
        self._drawn = False
        self._done = 0
        self._total = 0
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            self._done, self._total = done, total
            now = time.perf_counter()
            if done < total and now - self._last < self.interval:
                return
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        done, total = self._done, self._total
        frac = done / total if total else 1.0
        filled = int(frac * self.width)
        rate = done / max(now - self._start, 1e-9)
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'-' * (self.width - filled)}] {frac:4.0%} "
            f"{format_bytes(done)}/{format_bytes(total)} {format_bytes(rate)}/s "
        )
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """Draw the final state and end the line (nothing if never drawn)."""
        with self._lock:
            if self._drawn:
                self._draw(time.perf_counter())
                self.stream.write("\n")
                self.stream.flush()
                self._drawn = False


def progress_for(label: str, *, quiet: bool, stream: TextIO | None = None) -> ProgressBar | None:
    """A bar when ``stream`` (stderr) is a terminal and not ``quiet``, else None."""
    stream = stream if stream is not None else sys.stderr
    if quiet or not stream.isatty():
        return None
    return ProgressBar(label, stream)
