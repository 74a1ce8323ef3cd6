from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt import background
from gpuckpt.background import BACKGROUND_PLAN_MIN, wait_all
from gpuckpt.device.staging import ArenaPool, StagingArena
from gpuckpt.planning.plan import SavePlan, plan_save
from gpuckpt.saving.writing import open_save_writer
from gpuckpt.verify import verify_checkpoint


def test_async_save_snapshots_before_returning(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 256)).astype(np.float32)
    cl = rng.standard_normal((2, 6, 7, 3)).astype(np.float32).transpose(0, 3, 1, 2)
    want_w, want_cl = w.copy(), cl.copy()
    cfg = {"lr": 0.1}
    fut = gpuckpt.async_save({"w": w, "cl": cl, "cfg": cfg}, tmp_path / "c", chunk_bytes=4096)
    # the caller changes everything right away
    w[:] = -1
    cl[...] = 7
    cfg["lr"] = 99.0
    del w
    for bad in ("x", -1, float("nan"), True):
        with pytest.raises(gpuckpt.InvalidOptionError, match="timeout must be a number of seconds"):
            fut.result(timeout=bad)  # type: ignore[arg-type]
    md = fut.result(timeout=60)
    assert fut.done() and fut.exception() is None and fut.exception(timeout=0) is None
    assert md.state_dict_metadata["cl"].properties.memory_format is gpuckpt.channels_last
    back = gpuckpt.load_state_dict(tmp_path / "c")
    assert np.array_equal(back["w"], want_w) and np.array_equal(back["cl"], want_cl)
    assert back["cfg"] == {"lr": 0.1}


def test_snapshot_of_many_tensors_in_batches(tmp_path: Path) -> None:
    # more than one copy slab in total: the copies run in batches on the copy
    # threads; every tensor must be copied before async_save returns
    rng = np.random.default_rng(3)
    state = {f"t{i}": rng.standard_normal(int(rng.integers(1000, 16_000))) for i in range(700)}
    state["big"] = rng.standard_normal(5_000_000)  # 40 MB: split into slabs itself
    want = {k: v.copy() for k, v in state.items()}
    assert sum(v.nbytes for v in state.values()) > 64 << 20
    fut = gpuckpt.async_save(state, tmp_path / "c")
    for v in state.values():
        v[...] = np.nan
    fut.result(timeout=120)
    back = gpuckpt.load_state_dict(tmp_path / "c")
    for k, v in want.items():
        np.testing.assert_array_equal(back[k], v)


def test_back_to_back_saves_queue_in_order(tmp_path: Path) -> None:
    x = np.zeros(100_000)
    futs = []
    for i in range(5):
        x[:] = i
        futs.append(gpuckpt.async_save({"x": x, "i": i}, tmp_path / f"s{i}", chunk_bytes=8192))
    for i, f in enumerate(futs):
        f.result(timeout=60)
        got = gpuckpt.load_state_dict(tmp_path / f"s{i}")
        assert got["i"] == i and (got["x"] == i).all()


def test_errors_surface_from_result_and_nothing_is_published(tmp_path: Path) -> None:
    gpuckpt.save({"a": np.ones(3)}, tmp_path / "c")
    fut = gpuckpt.async_save({"a": np.zeros(3)}, tmp_path / "c")  # exists, no overwrite
    with pytest.raises(gpuckpt.CheckpointExistsError):
        fut.result(timeout=60)
    assert isinstance(fut.exception(), gpuckpt.CheckpointExistsError)
    assert gpuckpt.load_state_dict(tmp_path / "c")["a"].all()
    # unsupported values fail in the caller, before anything is queued
    with pytest.raises(gpuckpt.UnsupportedValueError):
        gpuckpt.async_save({"f": print}, tmp_path / "d")
    wait_all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_result_timeout(tmp_path: Path) -> None:
    gate = threading.Event()
    # occupy the background writer so that the next save stays queued
    from gpuckpt import background

    blocker = background._writer_executor().submit(gate.wait)
    fut = gpuckpt.async_save({"a": np.ones(2)}, tmp_path / "c")
    with pytest.raises(TimeoutError, match="not finished"):
        fut.result(timeout=0.05)
    assert not fut.done()
    # a timeout longer than any wait (inf, 2**64 s) waits without a limit, as None does
    threading.Timer(0.2, gate.set).start()
    assert fut.exception(timeout=math.inf) is None
    blocker.result()
    fut.result(timeout=60)
    fut.result(timeout=2**64)


def test_progress_callback(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    gpuckpt.save(
        {"a": np.ones(4096)}, tmp_path / "c", chunk_bytes=4096, progress=lambda d, t: seen.append((d, t))
    )
    assert seen[0] == (0, 32768) and seen[-1] == (32768, 32768) and len(seen) == 9
    seen.clear()
    gpuckpt.load_state_dict(tmp_path / "c", progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (32768, 32768)


def test_arena_reuses_memory_and_aligns() -> None:
    calls: list[int] = []

    def alloc(n: int) -> np.ndarray:
        calls.append(n)
        return np.empty(n, np.uint8)

    arena = StagingArena(alloc, piece_bytes=1 << 16)
    a = arena.take(100)
    b = arena.take(5000)
    assert b.ctypes.data % 4096 == 0 and a.nbytes == 100
    big = arena.take(1 << 17)  # larger than a piece: its own piece
    assert big.nbytes == 1 << 17 and len(calls) == 2
    arena.reset()
    arena.take(100)
    arena.take(5000)
    assert len(calls) == 2  # reused, nothing allocated
    arr = arena.take_array((2, 3, 4, 5), np.float32, (0, 2, 3, 1))
    assert arr.shape == (2, 3, 4, 5) and arr.strides == (240, 4, 60, 12)


def test_arena_pool_bounds_and_waits() -> None:
    pool = ArenaPool(max_arenas=1)
    a = pool.acquire()
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.05)
    t = threading.Timer(0.05, pool.release, args=(a,))
    t.start()
    start = time.perf_counter()
    b = pool.acquire(timeout=5)
    assert b is a and time.perf_counter() - start >= 0.04


def _saves_of_a_state_that_contains_itself(how: str, path: Path) -> list[BaseException | None]:
    """Save, along path ``how``, a state dict holding itself; the error each rank gets (None: saved)."""

    def state(cyclic: bool = True) -> dict[str, object]:
        s: dict[str, object] = {"w": np.ones(3), "b": gpuckpt.ShardedArray(np.ones(2), (0,), (2,))}
        if cyclic:
            s["self"] = s
        return s

    def attempt(fn: object) -> BaseException | None:
        try:
            fn()  # type: ignore[operator]
        except Exception as exc:
            return exc
        return None

    if how in ("save", "async_save"):
        plain = state()
        del plain["b"]  # no ShardedArray: the single-process path
        if how == "save":
            return [attempt(lambda: gpuckpt.save(plain, path))]
        return [attempt(lambda: gpuckpt.async_save(plain, path).result(timeout=60))]
    if how == "distributed save":
        return [attempt(lambda: gpuckpt.save(state(), path))]
    if how == "distributed async_save":
        return [attempt(lambda: gpuckpt.async_save(state(), path).result(timeout=60))]
    # two ranks, the second holding the cycle: both fail, neither waits for the other forever
    from gpuckpt.distributed import run_ranks

    def rank(c: object) -> BaseException | None:
        s = state(cyclic=c.rank == 1)  # type: ignore[attr-defined]
        s["b"] = gpuckpt.ShardedArray(np.ones(1), (c.rank,), (2,))  # type: ignore[attr-defined]
        return attempt(lambda: gpuckpt.async_save(s, path, coordinator=c).result(timeout=60))

    return run_ranks(2, rank, timeout=60)


@pytest.mark.parametrize(
    "how",
    ["save", "async_save", "distributed save", "distributed async_save", "distributed async_save, 2 ranks"],
)
def test_a_state_that_contains_itself_is_a_typed_error(tmp_path: Path, how: str) -> None:
    errors = _saves_of_a_state_that_contains_itself(how, tmp_path / "c")
    for err in errors:
        assert isinstance(err, gpuckpt.GpuckptError), repr(err)
        assert "reference cycle at 'self'" in str(err)
    assert not (tmp_path / "c").exists()


def test_wait_all_waits_for_the_saves_of_every_writer(tmp_path: Path) -> None:
    # a distributed save runs on its coordinator's writer, not the process's: wait_all
    # returns only once that one is done too (it is queued behind a busy writer here)
    from gpuckpt.distributed import SingleProcessCoordinator
    from gpuckpt.pending import writer_executor

    coord = SingleProcessCoordinator()
    writer_executor(coord).submit(time.sleep, 0.3)
    s = gpuckpt.ShardedArray(np.arange(6.0), (0,), (6,))
    fut = gpuckpt.async_save({"w": s}, tmp_path / "c", coordinator=coord)
    wait_all()
    assert fut.done()
    assert np.array_equal(gpuckpt.load_state_dict(tmp_path / "c")["w"], np.arange(6.0))


@pytest.mark.parametrize("ntensors", [BACKGROUND_PLAN_MIN - 2, BACKGROUND_PLAN_MIN - 1])
def test_a_state_of_many_tensors_is_planned_by_the_background_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ntensors: int
) -> None:
    """The caller waits for the description and the copy only: from BACKGROUND_PLAN_MIN
    tensors the plan is made on the writer thread (a tenth of a second for 10,000 tensors).
    The checkpoint is the one a synchronous save writes, and is written as durably."""
    planned_on: list[str] = []
    writers: list[Any] = []

    def recording_writer(*args: Any, **kwargs: Any) -> Any:
        writers.append(open_save_writer(*args, **kwargs))
        return writers[-1]

    monkeypatch.setattr(background, "open_save_writer", recording_writer)

    def recording_plan_save(*args: Any, **kwargs: Any) -> SavePlan:
        planned_on.append(threading.current_thread().name)
        return plan_save(*args, **kwargs)

    monkeypatch.setattr(background, "plan_save", recording_plan_save)
    rng = np.random.default_rng(5)
    state: dict[str, Any] = {f"t{i}": rng.standard_normal(int(rng.integers(1, 600))) for i in range(ntensors)}
    state["big"] = rng.standard_normal(3000)  # three chunks of 8 KiB
    state["step"] = 7
    want = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in state.items()}
    fut = gpuckpt.async_save(state, tmp_path / "a", chunk_bytes=8192)
    for v in state.values():
        if isinstance(v, np.ndarray):
            v[...] = -1  # after the call: not what is saved
    md = fut.result(timeout=120)
    caller = threading.current_thread().name
    assert len(planned_on) == 1
    assert (planned_on[0] != caller) == (ntensors + 1 >= BACKGROUND_PLAN_MIN)
    gpuckpt.save(want, tmp_path / "s", chunk_bytes=8192)
    assert md == gpuckpt.read_metadata(tmp_path / "a")
    sync_md = gpuckpt.read_metadata(tmp_path / "s")
    assert md.state_dict_metadata == sync_md.state_dict_metadata
    assert md.storage_data["tensors"] == sync_md.storage_data["tensors"]
    assert len(md.state_dict_metadata["big"].chunks) == 3
    back = gpuckpt.load_state_dict(tmp_path / "a")
    assert back.keys() == want.keys() and back["step"] == 7
    assert all(np.array_equal(back[k], v) for k, v in want.items() if isinstance(v, np.ndarray))
    assert verify_checkpoint(tmp_path / "a").ok
    # hundreds of files: made durable by one file-system sync, as a synchronous save does
    assert [w.sync for w in writers] == ["fs"]


def test_an_incremental_async_save_plans_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Which arrays it shares with its base is known before the copy: its plan is made first."""
    planned_on: list[str] = []

    def recording_plan_save(*args: Any, **kwargs: Any) -> SavePlan:
        planned_on.append(threading.current_thread().name)
        return plan_save(*args, **kwargs)

    state = {f"t{i}": np.full(8, float(i)) for i in range(BACKGROUND_PLAN_MIN + 10)}
    gpuckpt.save(state, tmp_path / "base")
    monkeypatch.setattr(background, "plan_save", recording_plan_save)
    state["t0"][:] = -5.0
    gpuckpt.async_save(state, tmp_path / "next", base=tmp_path / "base").result(timeout=120)
    assert planned_on == [threading.current_thread().name]
    back = gpuckpt.load_state_dict(tmp_path / "next")
    assert np.array_equal(back["t0"], np.full(8, -5.0)) and np.array_equal(back["t9"], np.full(8, 9.0))
