"""The device save/load pipeline, with host memory standing in for device memory.

Every byte of an EmulatedDeviceArray goes through the backend's staging
pipeline exactly as GPU memory would (stage_out / stage_in on one ordered
stream, a bounded pool of staging buffers, I/O threads); only the copy
primitives differ on a real GPU.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import gpuckpt
from gpuckpt.device import _kernel_ref
from gpuckpt.device.backend import BufferPool, buffer_pool, staging_buffer_bytes
from gpuckpt.device.host_backend import HostBackend
from gpuckpt.options import SaveOptions
from gpuckpt.planning.plan import plan_save
from gpuckpt.saving.session import execute_save
from gpuckpt.saving.sources import describe_state
from gpuckpt.storage.local.writer import LocalWriter
from gpuckpt.testing.fakedevice import EmulatedDeviceArray


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "w": rng.standard_normal((300, 64)).astype(np.float32),
        "bf16": rng.standard_normal((50, 33)).astype(ml_dtypes.bfloat16),
        "cl": _kernel_ref.as_channels_last(rng.standard_normal((3, 5, 7, 9)).astype(np.float16)),
        "cl3d": _kernel_ref.as_channels_last(rng.standard_normal((2, 3, 4, 5, 6)).astype(np.float32)),
        "fortran": np.asfortranarray(rng.standard_normal((20, 30))),
        "scalar": np.array(5, np.int64),
        "empty": np.zeros((0, 3), np.float32),
    }


def test_round_trip_through_staging(tmp_path: Path, rng: np.random.Generator) -> None:
    backend = HostBackend()
    src = arrays(rng)
    state = {"model": {k: EmulatedDeviceArray(v, backend) for k, v in src.items()}, "step": 3}
    md = gpuckpt.save(state, tmp_path / "c", chunk_bytes=2048)
    assert md.state_dict_metadata["model.cl"].properties.memory_format is gpuckpt.channels_last
    assert md.state_dict_metadata["model.cl3d"].properties.memory_format is gpuckpt.channels_last_3d
    assert backend.copies >= sum(len(md.state_dict_metadata[f"model.{k}"].chunks) for k in src)
    # on the host, the values are the logical ones
    host = gpuckpt.load_state_dict(tmp_path / "c")
    for k, v in src.items():
        assert host["model"][k].tobytes() == np.ascontiguousarray(v).tobytes(), k
    # into "device" arrays in place, keeping their layout
    targets = {k: EmulatedDeviceArray(np.zeros_like(v), backend) for k, v in src.items()}
    for k in ("cl", "cl3d"):
        targets[k] = EmulatedDeviceArray(_kernel_ref.empty_channels_last(src[k].shape, src[k].dtype), backend)
    gpuckpt.load({"model": targets}, tmp_path / "c", strict=False)
    for k, v in src.items():
        assert targets[k].data.tobytes() == v.tobytes(), k
        assert targets[k].data.strides == v.strides or k in ("fortran",), k
    # a fresh state allocated by the backend, with the saved memory format
    dev = gpuckpt.load_state_dict(tmp_path / "c", device=backend)
    assert dev["model"]["cl"].strides == src["cl"].strides
    assert np.array_equal(dev["model"]["cl3d"], src["cl3d"])


def test_host_memory_stays_within_the_staging_budget(tmp_path: Path) -> None:
    backend = HostBackend()
    chunk = 64 << 10
    state = {f"t{i}": EmulatedDeviceArray(np.full((64, 256), i, np.float32), backend) for i in range(12)}
    budget = 3 * chunk
    gpuckpt.save(state, tmp_path / "c", chunk_bytes=chunk, staging_bytes=budget)
    pool = buffer_pool(backend, staging_buffer_bytes(chunk), budget)
    # 12 chunks of 64 KiB went through at most 3 buffers, allocated once
    assert pool.allocated <= 3 and pool.peak_in_use <= 3
    gpuckpt.save(state, tmp_path / "d", chunk_bytes=chunk, staging_bytes=budget)
    assert pool.allocated <= 3  # reused, not reallocated
    out = gpuckpt.load_state_dict(tmp_path / "d", device=backend, staging_bytes=budget)
    assert all((out[f"t{i}"] == i).all() for i in range(12))


def test_pool_blocks_producer_until_a_buffer_returns() -> None:
    pool = BufferPool(lambda n: np.empty(n, np.uint8), buffer_bytes=16, budget_bytes=32)
    a, b = pool.acquire(16), pool.acquire(8)
    got: list[np.ndarray] = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(4)))
    t.start()
    time.sleep(0.05)
    assert not got  # waiting: the budget is in use
    pool.release(a)
    t.join(5)
    assert got and got[0] is a and pool.allocated == 2
    with pytest.raises(ValueError, match="does not fit staging buffers"):
        pool.acquire(17)
    pool.release(b)


class RecordingWriter(LocalWriter):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.spans: list[tuple[float, float]] = []
        self._spans_lock = threading.Lock()

    def write_chunks(self, batch: Any) -> list[int]:
        # every write goes through here (a device chunk is a batch of its own)
        start = time.perf_counter()
        time.sleep(0.02 * len(batch.names))  # a slow disk
        crcs = super().write_chunks(batch)
        with self._spans_lock:
            self.spans.extend([(start, time.perf_counter())] * len(batch.names))
        return crcs


class RecordingBackend(HostBackend):
    """A slow link (~1 ms per 64 KiB chunk) whose stream starts only once two copies are queued
    (or after 5 s): a pipeline that queues the next copies ahead gets two in flight whatever the
    scheduler does on a loaded machine, one that waits for each copy before the next cannot."""

    def __init__(self) -> None:
        super().__init__(bytes_per_second=64 << 20, gate=threading.Event())
        self.spans: list[tuple[float, float]] = []
        self._timeout = threading.Timer(5.0, self.release)
        self._timeout.daemon = True
        self._timeout.start()

    def release(self) -> None:
        assert self.gate is not None
        self.gate.set()
        self._timeout.cancel()

    def stage_out(self, array: Any, offsets: Any, sizes: Any, dest: np.ndarray) -> Any:
        ticket = super().stage_out(array, offsets, sizes, dest)
        queued = time.perf_counter()
        if self.in_flight >= 2:
            self.release()

        class T:
            def wait(inner) -> None:
                ticket.wait()
                self.spans.append((queued, time.perf_counter()))

        return T()


def test_copies_of_next_chunks_overlap_writes(tmp_path: Path) -> None:
    backend = RecordingBackend()
    state = {"w": EmulatedDeviceArray(np.arange(16 * 16384, dtype=np.float32).reshape(16, 16384), backend)}
    options = SaveOptions(chunk_bytes=64 << 10, threads=4, staging_bytes=4 * (64 << 10))
    local, sources = describe_state(state, allow_pickle=False)
    plan = plan_save([local], chunk_bytes=options.chunk_bytes)
    writer = RecordingWriter(tmp_path / "c", sync="none")
    execute_save(plan, sources, writer, options)
    assert len(writer.spans) == 16
    # more than one copy was queued while writes were running ...
    assert backend.max_in_flight >= 2
    # ... and some write ran while a later chunk's copy was in flight
    overlaps = sum(1 for ws, we in writer.spans for cs, ce in backend.spans if cs < we and ce > ws)
    assert overlaps > len(writer.spans)
    assert np.array_equal(gpuckpt.load_state_dict(tmp_path / "c")["w"], state["w"].data)


def test_copy_failure_publishes_nothing_and_returns_buffers(tmp_path: Path) -> None:
    gpuckpt.save({"w": np.ones(4)}, tmp_path / "c")
    backend = HostBackend(fail_after=3)
    state = {"w": EmulatedDeviceArray(np.zeros((64, 1024), np.float32), backend)}
    with pytest.raises(RuntimeError, match="injected copy failure"):
        gpuckpt.save(state, tmp_path / "c", overwrite=True, chunk_bytes=16 << 10, staging_bytes=64 << 10)
    assert gpuckpt.load_state_dict(tmp_path / "c")["w"].tolist() == [1, 1, 1, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    pool = buffer_pool(backend, staging_buffer_bytes(16 << 10), 64 << 10)
    assert pool._in_use == 0


def test_load_copy_failure_is_raised(tmp_path: Path) -> None:
    gpuckpt.save({"w": np.ones((64, 1024), np.float32)}, tmp_path / "c", chunk_bytes=16 << 10)
    backend = HostBackend(fail_after=2)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        gpuckpt.load_state_dict(tmp_path / "c", device=backend)


@pytest.mark.parametrize("staging", ["host", "device"])
def test_async_save_of_device_arrays_snapshots(
    tmp_path: Path, rng: np.random.Generator, staging: str
) -> None:
    backend = HostBackend()
    src = arrays(rng)
    live = {k: v.copy(order="K") for k, v in src.items()}
    state = {k: EmulatedDeviceArray(v, backend) for k, v in live.items()}
    fut = gpuckpt.async_save(state, tmp_path / "c", chunk_bytes=4096, staging=staging)
    for v in live.values():  # training goes on and overwrites the arrays
        v[...] = 0
    fut.result(timeout=60)
    back = gpuckpt.load_state_dict(tmp_path / "c")
    for k, v in src.items():
        assert back[k].tobytes() == np.ascontiguousarray(v).tobytes(), k
    assert back["cl"].strides == src["cl"].strides


def test_device_strings(tmp_path: Path) -> None:
    gpuckpt.save({"w": np.ones(2)}, tmp_path / "c")
    with pytest.raises(ValueError, match="expected 'cpu', 'cuda' or 'cuda:N'"):
        gpuckpt.load_state_dict(tmp_path / "c", device="tpu")
    with pytest.raises(TypeError):
        gpuckpt.load_state_dict(tmp_path / "c", device=3)
