"""Concurrent writers and readers, in real processes: one winner, no mixed checkpoint, clear errors."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.testing.faults import temporaries

from .concurrency_worker import consistent, state
from .conftest import STRESS_TRIALS

WORKER = str(Path(__file__).with_name("concurrency_worker.py"))


def spawn(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, WORKER, *map(str, args)], stdout=subprocess.PIPE, text=True)


def outputs(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[list[str]]:
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out
        outs.append(out.splitlines())
    return outs


@pytest.mark.parametrize("trial", range(STRESS_TRIALS))
def test_two_processes_saving_same_new_path_one_wins(tmp_path: Path, trial: int) -> None:
    path, go = tmp_path / "ckpt", tmp_path / "go"
    procs = [spawn("save", path, 100 + i, 0, go) for i in range(2)]
    time.sleep(0.5)  # both are waiting on the go file with their state ready
    go.touch()
    results = sorted(line for out in outputs(procs) for line in out)
    assert results == ["exists", "ok"], results
    got = gpuckpt.load_state_dict(path)
    assert got["seed"] in (100, 101) and consistent(got)
    assert temporaries(tmp_path) == []


def test_two_processes_overwriting_same_path_never_mix(tmp_path: Path) -> None:
    path, go = tmp_path / "ckpt", tmp_path / "go"
    gpuckpt.save(state(1), path)
    repeat = max(3, STRESS_TRIALS)
    procs = [spawn("save", path, 1000 * (i + 1), 1, go, repeat) for i in range(2)]
    time.sleep(0.5)
    go.touch()
    results = Counter(line for out in outputs(procs) for line in out)
    assert set(results) <= {"ok"}, results
    got = gpuckpt.load_state_dict(path)
    assert got["seed"] in (1000 + repeat - 1, 2000 + repeat - 1) and consistent(got)
    assert temporaries(tmp_path) == []


def test_loading_while_another_process_overwrites_never_returns_mixed_data(tmp_path: Path) -> None:
    path, go = tmp_path / "ckpt", tmp_path / "go"
    gpuckpt.save(state(1), path)
    go.touch()
    seconds = 1.5 + 0.1 * STRESS_TRIALS
    reader = spawn("load", path, seconds)
    writer = spawn("save", path, 10, 1, go, 40 * max(1, STRESS_TRIALS // 3))
    time.sleep(seconds)
    writer.terminate()
    (loads,) = outputs([reader])
    writer.communicate(timeout=60)
    kinds = Counter(line.split()[0] for line in loads)
    assert kinds["bad"] == 0, [x for x in loads if x.startswith("bad")][:5]
    assert kinds["ok"] > 0, loads[:5]
    # a load racing an overwrite may fail, but only with a typed error it can retry on
    assert {line.split()[1] for line in loads if line.startswith("typed")} <= {
        "ChecksumError",
        "MissingChunkError",
        "CheckpointCorruptedError",
        "CheckpointNotFoundError",
        "MetadataError",
    }


def test_back_to_back_async_saves_capture_each_snapshot(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 129)).astype(np.float32)
    b = np.zeros(1000, np.int64)
    wanted, futs = [], []
    for i in range(6 + STRESS_TRIALS):
        w += 1
        b[:] = i
        wanted.append((w.copy(), b.copy()))
        futs.append(gpuckpt.async_save({"w": w, "b": b, "i": i}, tmp_path / f"s{i}", chunk_bytes=8192))
        w *= -1  # modified right away, while earlier saves are still being written
        b[:] = -1
        w *= -1
    futs.append(
        gpuckpt.async_save({"w": w, "b": b, "i": -1}, tmp_path / "s0", overwrite=True, chunk_bytes=8192)
    )
    for f in futs:
        f.result(timeout=120)
    for i, (ww, bb) in enumerate(wanted[1:], start=1):
        got = gpuckpt.load_state_dict(tmp_path / f"s{i}")
        assert got["i"] == i and got["w"].tobytes() == ww.tobytes() and got["b"].tobytes() == bb.tobytes()
    last = gpuckpt.load_state_dict(tmp_path / "s0")
    assert last["i"] == -1 and last["w"].tobytes() == w.tobytes()


def _many_chunks(version: str) -> dict[str, Any]:
    """A state that saves as format ``version`` (2: a chunk table; 3: tensors as columns)."""
    rng = np.random.default_rng(7)
    if version == "2":
        return {"w": rng.standard_normal(5000 * 16).astype(np.float32), "step": 3}
    return {f"t{i:04d}": rng.standard_normal(64).astype(np.float32) for i in range(1100)} | {
        "w": rng.standard_normal(4000 * 16).astype(np.float32),
        "step": 3,
    }


@pytest.mark.parametrize("version", ["2", "3"])
def test_concurrent_loads_of_one_checkpoint_share_its_metadata_safely(tmp_path: Path, version: str) -> None:
    state = _many_chunks(version)
    path = tmp_path / "ckpt"
    md = gpuckpt.save(state, path, chunk_bytes=64)
    assert md.version == version
    failures: list[BaseException] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # threads take turns often: a race shows in a few rounds
    try:
        _load_in_threads(path, state, failures)
    finally:
        sys.setswitchinterval(interval)
    assert failures == [], failures[:3]


def _load_in_threads(path: Path, state: dict[str, Any], failures: list[BaseException]) -> None:
    import threading

    from gpuckpt.loading.open import clear_shared_indexes

    for _ in range(4):
        clear_shared_indexes()  # the next load parses the document again: a new shared index
        gpuckpt.load({"w": np.empty_like(state["w"])}, path)
        go = threading.Barrier(8)

        def load(i: int, go: threading.Barrier = go) -> None:
            go.wait()
            try:
                got = gpuckpt.load_state_dict(path, keys=["w", "step"] if i % 2 else ["w"])
                assert np.array_equal(got["w"], state["w"])
            except BaseException as exc:  # every failure is reported by the caller
                failures.append(exc)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
