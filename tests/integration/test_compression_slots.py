"""Compression never takes every core: a save compresses at most ``CpuSlots.limit`` chunks at
once, whatever its I/O threads, and what it stores is what an unbounded save stores."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.runtime import runner
from gpuckpt.runtime.runner import CpuSlots
from gpuckpt.saving import writing


def test_the_default_limit_leaves_one_core() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert CpuSlots().limit == max(1, cpus - 1)
    assert CpuSlots(3).limit == 3


def test_a_save_compresses_at_most_the_limit_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "compressing", CpuSlots(2))
    lock = threading.Lock()
    now, most = 0, 0
    real = writing.encode

    def counted(*a: Any, **kw: Any) -> Any:
        nonlocal now, most
        with lock:
            now += 1
            most = max(most, now)
        try:
            time.sleep(0.05)  # long enough for 4 threads to overlap if they could
            return real(*a, **kw)
        finally:
            with lock:
                now -= 1

    monkeypatch.setattr(writing, "encode", counted)
    rng = np.random.default_rng(0)
    state = {"w": rng.normal(0, 0.02, (16, 1 << 16)).astype(np.float32)}  # 16 chunks of 256 KiB
    gpuckpt.save(state, tmp_path / "a", compression="zstd", threads=4, chunk_bytes=1 << 18)
    assert most == 2
    out = {"w": np.zeros_like(state["w"])}
    gpuckpt.load(out, tmp_path / "a")
    assert np.array_equal(out["w"], state["w"])


_FORKED = """
import os
from gpuckpt.runtime.runner import CpuSlots
slots = CpuSlots(1)
with slots:  # held by this process while it forks
    pid = os.fork()
    if pid == 0:
        os._exit(0 if slots._slots.acquire(timeout=5) else 1)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


def test_slots_are_free_again_in_a_forked_child() -> None:
    # in a process of its own: this one runs threads, and forking it is unsafe
    done = subprocess.run([sys.executable, "-c", _FORKED], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
