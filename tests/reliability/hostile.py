"""Helpers shared by the hostile-checkpoint tests and the atheris harness."""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

import gpuckpt
from gpuckpt.device.arrays import HostMemory

# Untyped exceptions that known core bugs still let escape: each entry needs a
# test reproducing the bug; empty while no such bug is known.
KNOWN_BUGS: list[tuple[type[BaseException], re.Pattern[str]]] = []


def is_known_bug(exc: BaseException) -> bool:
    return any(isinstance(exc, t) and p.search(str(exc)) for t, p in KNOWN_BUGS)


def make_state() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "w": rng.standard_normal((12, 7)).astype(np.float32),
        "empty": np.zeros((0, 3), np.int16),
        "s": np.full((), 2.0, np.float64),
        "nested": {"b": np.arange(5, dtype=np.uint8), "lst": [np.ones(2), np.zeros(1)]},
        "step": 7,
        "cfg": {"lr": 1e-3, "name": "x", "t": (1, 2), "raw": b"\x00\x01"},
    }


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise :class:`Timeout` in the main thread after ``seconds`` (a hang detector)."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise Timeout(f"no result after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


class CountingMemory(HostMemory):
    """HostMemory that records how many bytes a load asked for."""

    requested = 0

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any], memory_format: Any) -> np.ndarray:
        n = 1
        for s in shape:
            n *= int(s)
        CountingMemory.requested += n * np.dtype(dtype).itemsize
        return super().allocate(shape, dtype, memory_format)


def disk_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def every_reader(path: Path) -> None:
    """Run every public read path over ``path`` (errors propagate)."""
    gpuckpt.read_metadata(path)
    gpuckpt.load_state_dict(path)
    target = make_state()
    gpuckpt.load(target, path, strict=False)
