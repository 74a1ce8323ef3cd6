"""``compression={"codec": "zstd", "device": True}``: chunks of device arrays compressed where they
live, only their frames crossing to the host, through the host back end that stands in for a
device (its ``encode_chunks`` writes the zstd frames nvCOMP writes on a GPU; the GPU itself is
tested in tests/device/test_device_compression_gpu.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import zarr

import gpuckpt
from gpuckpt.device.arrays import adapt
from gpuckpt.device.host_backend import HostBackend
from gpuckpt.distributed import run_ranks
from gpuckpt.errors import InvalidOptionError
from gpuckpt.format.codecs import Codec
from gpuckpt.saving.device_encoding import ByteBudget, DeviceEncoder
from gpuckpt.saving.writing import ChunkJob
from gpuckpt.testing.fakedevice import EmulatedDeviceArray
from gpuckpt.verify import verify_checkpoint

ON_DEVICE = {"codec": "zstd", "device": True}


def _weights(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)


def _state(backend: HostBackend) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    arrays = {
        "w": _weights((300, 1024)),  # chunks of 64 rows: four whole ones and an edge chunk (padded)
        "m": (rng.standard_normal((257, 33)).astype(np.float32) ** 2) * 1e-6,  # 2-D edge chunks
        # channels-last (NHWC memory of an NCHW tensor): stored in logical C order
        "conv": np.ascontiguousarray(rng.standard_normal((8, 6, 6, 16)).astype(np.float16)).transpose(
            0, 3, 1, 2
        ),
        "i": rng.integers(0, 50, (4096,), dtype=np.int32),
    }
    state: dict[str, Any] = {k: EmulatedDeviceArray(v, backend) for k, v in arrays.items()}
    state["host"] = arrays["w"].copy()  # host memory: compressed on the host by the I/O threads
    state["step"] = 7
    return state, arrays


def _codecs(path: Path) -> dict[str, str | None]:
    md = gpuckpt.read_metadata(path)
    return {f: e.get("codec", {}).get("name") for f, e in md.storage_data["tensors"].items()}


def _chunk_files(path: Path, name: str) -> list[Path]:
    return sorted(p for p in (path / name).rglob("*") if p.is_file() and p.name != "zarr.json")


def test_device_chunks_are_compressed_on_the_device_and_read_by_every_reader(tmp_path: Path) -> None:
    backend = HostBackend()
    state, arrays = _state(backend)
    ckpt = tmp_path / "c"
    gpuckpt.save(state, ckpt, compression=ON_DEVICE, chunk_bytes=128 << 10)
    device_chunks = sum(len(_chunk_files(ckpt, k)) for k in arrays)
    # every chunk of every device array was compressed where it lives; nothing raw was staged
    assert backend.encoded_chunks == device_chunks > len(arrays)
    stored = sum(p.stat().st_size for k in arrays for p in _chunk_files(ckpt, k))
    assert backend.bytes_to_host == stored - 4 * device_chunks  # the frames, without their CRC32C
    assert set(_codecs(ckpt).values()) == {"zstd"}
    assert json.loads((ckpt / "w" / "zarr.json").read_text())["codecs"][1]["name"] == "zstd"
    # gpuckpt's reader, into device and host arrays
    back: dict[str, Any] = {k: EmulatedDeviceArray(np.zeros_like(v), backend) for k, v in arrays.items()}
    back.update(host=np.zeros_like(arrays["w"]), step=0)
    gpuckpt.load(back, ckpt)
    for k, v in arrays.items():
        assert back[k].data.tobytes() == v.tobytes(), k  # (logical C order, both)
    assert back["host"].tobytes() == arrays["w"].tobytes() and back["step"] == 7
    # zarr-python reads the device's frames as the core zstd codec's
    for k, v in arrays.items():
        got = zarr.open_array(ckpt / k, mode="r")[...]
        assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(v).view(np.uint8)), k
    assert verify_checkpoint(ckpt).ok


def test_a_damaged_device_compressed_chunk_is_found(tmp_path: Path) -> None:
    backend = HostBackend()
    state, arrays = _state(backend)
    ckpt = tmp_path / "c"
    gpuckpt.save(state, ckpt, compression=ON_DEVICE, chunk_bytes=128 << 10)
    victim = _chunk_files(ckpt, "w")[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    report = verify_checkpoint(ckpt)
    assert not report.ok
    with pytest.raises(gpuckpt.ChecksumError, match="'w'"):
        gpuckpt.load({"w": np.zeros_like(arrays["w"])}, ckpt)


def test_a_back_end_without_a_device_codec_compresses_on_the_host(tmp_path: Path) -> None:
    backend = HostBackend(encodes=False)
    state, arrays = _state(backend)
    ckpt = tmp_path / "c"
    gpuckpt.save(state, ckpt, compression=ON_DEVICE, chunk_bytes=128 << 10)
    assert backend.encoded_chunks == 0
    assert backend.bytes_to_host == sum(v.nbytes for v in arrays.values())  # staged raw
    assert set(_codecs(ckpt).values()) == {"zstd"}
    out = {"w": np.zeros_like(arrays["w"]), "i": np.zeros_like(arrays["i"])}
    gpuckpt.load(out, ckpt)
    assert out["w"].tobytes() == arrays["w"].tobytes() and np.array_equal(out["i"], arrays["i"])


def test_a_failure_on_the_device_falls_back_to_the_host_with_a_warning(tmp_path: Path) -> None:
    backend = HostBackend()
    state, arrays = _state(backend)

    def fails(*_: Any) -> Any:
        raise RuntimeError("out of device memory for the codec's scratch")

    backend.encode_chunks = fails  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match="on the device failed .*out of device memory"):
        gpuckpt.save(state, tmp_path / "c", compression=ON_DEVICE, chunk_bytes=128 << 10)
    assert backend.bytes_to_host == sum(v.nbytes for v in arrays.values())  # staged raw
    assert set(_codecs(tmp_path / "c").values()) == {"zstd"}
    out = {"w": np.zeros_like(arrays["w"]), "m": np.zeros_like(arrays["m"])}
    gpuckpt.load(out, tmp_path / "c")
    assert out["w"].tobytes() == arrays["w"].tobytes() and out["m"].tobytes() == arrays["m"].tobytes()


def test_async_save_staged_on_the_device_compresses_its_snapshot_there(tmp_path: Path) -> None:
    backend = HostBackend()
    w = _weights((512, 512), 4)
    state = {"w": EmulatedDeviceArray(w.copy(), backend)}
    fut = gpuckpt.async_save(
        state, tmp_path / "c", compression=ON_DEVICE, staging="device", chunk_bytes=64 << 10
    )
    state["w"].data[:] = 0  # after the snapshot: not saved
    fut.result()
    assert backend.device_copies >= 1 and backend.encoded_chunks == 8
    out = {"w": np.zeros_like(w)}
    gpuckpt.load(out, tmp_path / "c")
    assert out["w"].tobytes() == w.tobytes()


def test_a_distributed_save_compresses_every_ranks_device_boxes_there(tmp_path: Path) -> None:
    backend = HostBackend()
    full = _weights((4 * 256, 128), 6)

    def rank(c: Any) -> None:
        r = c.rank
        local = EmulatedDeviceArray(full[r * 256 : (r + 1) * 256].copy(), backend)
        box = gpuckpt.ShardedArray(local, (r * 256, 0), full.shape)
        gpuckpt.save(
            {"w": box, "step": 2}, tmp_path / "c", coordinator=c, compression=ON_DEVICE, chunk_bytes=16 << 10
        )

    run_ranks(4, rank)
    assert backend.encoded_chunks == len(_chunk_files(tmp_path / "c", "w")) == 16
    assert _codecs(tmp_path / "c")["w"] == "zstd"
    assert gpuckpt.load_state_dict(tmp_path / "c")["w"].tobytes() == full.tobytes()
    assert verify_checkpoint(tmp_path / "c").ok


def test_device_compression_is_zstd_only_and_a_bool() -> None:
    with pytest.raises(InvalidOptionError, match="device=True needs"):
        gpuckpt.save({"x": np.zeros(4)}, "/nonexistent/x", compression={"device": True})
    with pytest.raises(InvalidOptionError, match="device must be True or False"):
        gpuckpt.save({"x": np.zeros(4)}, "/nonexistent/x", compression={"codec": "zstd", "device": "yes"})


def _jobs(backend: HostBackend, rows: int, chunk_rows: int) -> tuple[list[ChunkJob], np.ndarray]:
    data = _weights((rows, 256), 9)
    source = adapt(EmulatedDeviceArray(data, backend))
    codec = Codec("zstd", 3)
    jobs = [
        ChunkJob("w", (k, 0), source, (r, 0), (min(chunk_rows, rows - r), 256), (chunk_rows, 256), k, codec)
        for k, r in enumerate(range(0, rows, chunk_rows))
    ]
    return jobs, data


def test_the_encoder_holds_at_most_the_staging_budget_of_frames() -> None:
    backend = HostBackend()
    jobs, _ = _jobs(backend, 64 * 16, 64)  # 16 chunks of 32 KiB
    budget = 4 * 32 << 10  # groups of two chunks
    enc = DeviceEncoder(jobs, budget)
    held = [enc.take(0), enc.take(1), enc.take(2), enc.take(3)]
    assert all(h is not None for h in held) and backend.encoded_chunks == 4
    assert enc.budget.in_use == sum(h.wait().nbytes for h in held if h is not None) <= budget
    # the next group waits for the I/O threads to give frames back
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(enc.take(4)))
    t.start()
    t.join(0.3)
    # four frames of bf16 weights (about 1.28x smaller than their 32 KiB) and two more raw
    # chunks would pass the budget: blocked
    assert enc.budget.in_use + 2 * (32 << 10) > budget
    assert t.is_alive() and not got
    for h in held:
        assert h is not None
        h.release()
    t.join(5)
    assert not t.is_alive() and got and got[0] is not None
    assert enc.budget.peak <= budget + (1 << 10)  # (a frame may be a little larger than raw)


def test_the_encoder_asks_a_refusing_back_end_once_per_array() -> None:
    backend = HostBackend(encodes=False)
    jobs, _ = _jobs(backend, 64 * 4, 64)
    calls = []
    real = backend.encode_chunks

    def counted(*a: Any) -> Any:
        calls.append(a)
        return real(*a)

    backend.encode_chunks = counted  # type: ignore[method-assign]
    enc = DeviceEncoder(jobs, 1 << 20)
    assert [enc.take(i) for i in range(4)] == [None] * 4
    assert len(calls) == 1 and enc.budget.in_use == 0


def test_byte_budget_lets_one_holder_pass_the_limit_alone() -> None:
    b = ByteBudget(100)
    b.take(250)  # nothing else held: allowed
    assert b.in_use == 250
    b.give(250)
    b.take(60)
    b.add(10)
    assert b.in_use == 70 and b.peak == 250
