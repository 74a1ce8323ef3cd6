"""A bool array whose bytes are not all 0 and 1 (a ``uint8`` array viewed as bool, as a torch
``view(torch.bool)`` makes one) is stored with 0 and 1 on every save path: TensorStore refuses
a stored bool byte of 2 ("Invalid bool value"), and NumPy's own operations disagree on such an
array. The caller's array is left as it was; its truth values are what comes back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.device.host_backend import HostBackend
from gpuckpt.testing.fakedevice import EmulatedDeviceArray
from gpuckpt.verify import verify_checkpoint


def _odd_bools(shape: tuple[int, ...], channels_last: bool = False) -> np.ndarray:
    raw = (np.arange(int(np.prod(shape)), dtype=np.uint8) * 37 % 5).reshape(shape)  # bytes 0-4
    if channels_last:
        raw = np.ascontiguousarray(raw.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    return raw.view(np.bool_)


def _truth(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8) != 0


def _bool_arrays(root: Path) -> list[Path]:
    """Every Zarr array of data type bool under ``root`` (tiers and parts included)."""
    found = []
    for doc in root.rglob("zarr.json"):
        meta = json.loads(doc.read_text())
        if meta.get("node_type") == "array" and meta.get("data_type") == "bool":
            found.append(doc.parent)
    return sorted(found)


def _read_by_tensorstore(array_dir: Path) -> np.ndarray:
    ts = pytest.importorskip("tensorstore")
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(array_dir)}}
    return np.asarray(ts.open(spec).result().read().result())


def _check_stored(root: Path, want: dict[str, np.ndarray]) -> None:
    arrays = _bool_arrays(root)
    assert {p.name for p in arrays} >= set(want), arrays
    for p in arrays:
        got = _read_by_tensorstore(p)  # raises on a stored byte other than 0 and 1
        assert got.view(np.uint8).max(initial=0) <= 1
        if p.name in want:
            np.testing.assert_array_equal(got, _truth(want[p.name]))


def _state() -> dict[str, np.ndarray]:
    return {"mask": _odd_bools((6, 70)), "cl": _odd_bools((2, 3, 4, 5), channels_last=True)}


def test_a_save_stores_0_and_1_and_leaves_the_callers_array_as_it_was(tmp_path: Path) -> None:
    state = _state()
    before = {k: v.view(np.uint8).copy() for k, v in state.items()}
    gpuckpt.save(state, tmp_path / "c", chunk_bytes=64)
    for k, v in state.items():
        np.testing.assert_array_equal(v.view(np.uint8), before[k])  # not canonicalized in place
    _check_stored(tmp_path / "c", state)
    back = gpuckpt.load_state_dict(tmp_path / "c")
    for k, v in state.items():
        assert back[k].view(np.uint8).max() == 1
        np.testing.assert_array_equal(back[k], _truth(v))
    assert back["cl"].strides == state["cl"].strides  # the layout is the array's own
    assert verify_checkpoint(tmp_path / "c").ok


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_async_incremental_and_compressed_saves_store_0_and_1(
    tmp_path: Path, compression: str | None
) -> None:
    state = _state()
    gpuckpt.async_save(state, tmp_path / "a", chunk_bytes=64, compression=compression).result(timeout=60)
    _check_stored(tmp_path / "a", state)
    # an incremental save over a base holding the same truth values in other bytes reuses them
    again = {k: (v.view(np.uint8) != 0).view(np.bool_) for k, v in state.items()}
    gpuckpt.save(again, tmp_path / "b", chunk_bytes=64, compression=compression, base=tmp_path / "a")
    _check_stored(tmp_path / "b", state)
    for k, v in gpuckpt.load_state_dict(tmp_path / "b").items():
        np.testing.assert_array_equal(v, _truth(state[k]))


@pytest.mark.parametrize("staging", ["host", "device"])
def test_device_arrays_are_canonicalized_on_their_device(tmp_path: Path, staging: str) -> None:
    backend = HostBackend()
    state = _state()
    live = {k: v.copy(order="K") for k, v in state.items()}
    gpuckpt.async_save(
        {k: EmulatedDeviceArray(v, backend) for k, v in live.items()},
        tmp_path / "c",
        chunk_bytes=64,
        staging=staging,
    ).result(timeout=60)
    for k, v in live.items():
        np.testing.assert_array_equal(v.view(np.uint8), state[k].view(np.uint8))
    _check_stored(tmp_path / "c", state)
    gpuckpt.save({"m": EmulatedDeviceArray(live["mask"], backend)}, tmp_path / "s", chunk_bytes=64)
    _check_stored(tmp_path / "s", {"m": state["mask"]})


def test_sharded_boxes_and_a_managers_tier_and_root_store_0_and_1(tmp_path: Path) -> None:
    whole = _odd_bools((8, 10))
    boxes = [
        gpuckpt.ShardedArray(whole[:4], (0, 0), (8, 10)),
        gpuckpt.ShardedArray(whole[4:], (4, 0), (8, 10)),
    ]
    gpuckpt.save({"s": boxes}, tmp_path / "sharded")
    _check_stored(tmp_path / "sharded", {"s": whole})
    mgr = gpuckpt.CheckpointManager(
        tmp_path / "root", local_dir=tmp_path / "tier", replicas=0, persist_interval_steps=1
    )
    state = _state()
    mgr.save(1, state)
    mgr.wait()
    mgr.close()
    _check_stored(tmp_path / "tier", state)
    _check_stored(tmp_path / "root", state)


def _with_odd_bool_bytes(path: Path) -> np.ndarray:
    """A checkpoint of one bool tensor whose chunk holds bytes 2 and 3, with its checksums made
    to match (as a checkpoint saved before saves stored 0 and 1 has them, or another writer's);
    returns the truth values."""
    from gpuckpt.format.checksum import crc32c
    from gpuckpt.testing.faults import rewrite_root_metadata

    gpuckpt.save({"b": np.array([True, False, True, True, False, True])}, path)
    f = path / "b" / "c.0"
    body = bytearray(f.read_bytes()[:-4])
    body[0], body[3] = 2, 3
    f.write_bytes(bytes(body) + crc32c(bytes(body)).to_bytes(4, "little"))

    def edit(md: dict[str, object]) -> None:
        md["storage_data"]["tensors"]["b"]["chunks"][0]["crc32c"] = crc32c(bytes(body))  # type: ignore[index]

    rewrite_root_metadata(path, edit)
    return np.array([True, False, True, True, False, True])


def test_a_load_reads_a_stored_bool_byte_other_than_0_and_1_as_true_and_verify_names_it(
    tmp_path: Path,
) -> None:
    truth = _with_odd_bool_bytes(tmp_path / "c")
    report = verify_checkpoint(tmp_path / "c")
    assert not report.ok and "2 bool element(s) hold a byte other than 0 and 1" in str(report.damage[0])
    loads = {
        "new arrays": gpuckpt.load_state_dict(tmp_path / "c")["b"],
        "device": gpuckpt.load_state_dict(tmp_path / "c", device=HostBackend())["b"],
    }
    target = {"b": np.zeros(6, bool)}
    gpuckpt.load(target, tmp_path / "c")
    loads["in place"] = target["b"]
    boxes = {
        "b": [
            gpuckpt.ShardedArray(np.zeros(3, bool), (0,), (6,)),
            gpuckpt.ShardedArray(np.zeros(3, bool), (3,), (6,)),
        ]
    }
    gpuckpt.load(boxes, tmp_path / "c")
    loads["boxes"] = np.concatenate([boxes["b"][0].local, boxes["b"][1].local])
    for how, got in loads.items():
        got = np.asarray(got.numpy() if hasattr(got, "numpy") else got)
        assert got.view(np.uint8).max() == 1 and np.array_equal(got, truth), how


def test_a_cooperative_load_reads_a_stored_bool_byte_other_than_0_and_1_as_true(tmp_path: Path) -> None:
    from gpuckpt.distributed import run_ranks

    truth = _with_odd_bool_bytes(tmp_path / "c")

    def rank(c: object) -> np.ndarray:
        r = c.rank  # type: ignore[attr-defined]
        target = {"b": gpuckpt.ShardedArray(np.zeros(3, bool), (3 * (r % 2),), (6,))}
        gpuckpt.load(target, tmp_path / "c", coordinator=c, cooperative=True)
        return target["b"].local

    for r, got in enumerate(run_ranks(4, rank)):
        assert got.view(np.uint8).max() == 1 and np.array_equal(got, truth[3 * (r % 2) :][:3]), r
