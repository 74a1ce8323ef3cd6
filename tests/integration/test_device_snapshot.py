"""Device-side snapshots (``async_save(staging="device")``) at one device-to-device copy (issue 23).

The arrays of a state are packed into one device allocation and copied with one copy
per run of arrays back to back in one allocation (and per run of 16 MiB or more), and one
batched copy of many small runs; the host back
end counts the copies it is asked for (``device_copies``), exactly as the CuPy back end
issues them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import gpuckpt
from gpuckpt.device import _kernel_ref
from gpuckpt.device.host_backend import HostBackend
from gpuckpt.device.packing import ARENA_ALIGN, BATCH_MIN_RUNS, DIRECT_MIN_BYTES, Run, plan_packing
from gpuckpt.testing.fakedevice import EmulatedDeviceArray

# ---- the plan (pure data) ---------------------------------------------------------


def test_adjacent_and_overlapping_arrays_form_one_run() -> None:
    # three arrays back to back, one view inside the second, one empty
    plan = plan_packing([(1000, 100), (1100, 50), (1120, 10), (1150, 8), (5, 0)])
    assert plan.runs == (Run(1000, 158, 0),)
    assert plan.places == (0, 100, 120, 150, 0)
    assert plan.total == 158 and plan.copies == 1 and not plan.batched


def test_separate_arrays_are_aligned_runs_and_many_are_batched() -> None:
    plan = plan_packing([(3000, 10), (1000, 300)])
    assert plan.runs == (Run(1000, 300, 0), Run(3000, 10, 512))
    assert plan.places == (512, 0) and plan.total == 522
    assert plan.copies == 2
    many = plan_packing([(i * 4096, 1000) for i in range(BATCH_MIN_RUNS)])
    assert many.batched and many.copies == 1
    assert [r.offset for r in many.runs] == [i * 1024 for i in range(BATCH_MIN_RUNS)]
    assert all(r.offset % ARENA_ALIGN == 0 for r in many.runs)


def test_arrays_of_separate_allocations_never_share_a_run() -> None:
    # back to back in the address space, but two allocations (one copy may not cross them),
    # and a view inside the second allocation that touches the first
    extents = [(1000, 100), (1100, 50), (1120, 10)]
    plan = plan_packing(extents, allocations=[1000, 1100, 1100])
    assert plan.runs == (Run(1000, 100, 0), Run(1100, 50, 256))
    assert plan.places == (0, 256, 276)
    # views of one allocation still form one run
    assert plan_packing(extents, allocations=[7, 7, 7]).runs == (Run(1000, 150, 0),)
    with pytest.raises(ValueError, match="2 allocations for 3 extents"):
        plan_packing(extents, allocations=[1, 2])


def test_large_runs_are_one_copy_each_and_the_small_ones_batched() -> None:
    big = DIRECT_MIN_BYTES
    # eight large allocations (a model's big weights): eight plain copies, no batched copy
    plan = plan_packing([(i << 30, big) for i in range(8)], allocations=range(8))
    assert plan.direct_runs == plan.runs and not plan.batched and plan.copies == 8
    assert plan.pieces(arena=1 << 40) == []
    # two large and many small: the large ones alone, the small ones in one batched copy
    extents = [(1 << 30, big), (2 << 30, 4 * big)] + [
        ((3 + i) << 30, 1000 + i) for i in range(BATCH_MIN_RUNS)
    ]
    plan = plan_packing(extents, allocations=range(len(extents)))
    assert [r.nbytes for r in plan.direct_runs] == [big, 4 * big]
    assert [r.nbytes for r in plan.batched_runs] == [1000 + i for i in range(BATCH_MIN_RUNS)]
    assert plan.batched and plan.copies == 3
    assert sum(n for _, _, n in plan.pieces(arena=1 << 40)) == sum(1000 + i for i in range(BATCH_MIN_RUNS))
    # fewer small runs than make a batched copy worth its launch: one copy each
    plan = plan_packing(extents[: BATCH_MIN_RUNS + 1], allocations=range(BATCH_MIN_RUNS + 1))
    assert not plan.batched and plan.copies == BATCH_MIN_RUNS + 1


def test_pieces_cover_every_run_exactly() -> None:
    plan = plan_packing([(1 << 30, 5000), (2 << 30, 1), (3 << 30, 4096), (4 << 30, 3)])
    assert plan.batched
    pieces = plan.pieces(arena=1 << 40, piece_bytes=2048)
    assert sum(n for _, _, n in pieces) == 5000 + 1 + 4096 + 3
    assert all(0 < n <= 2048 for _, _, n in pieces)
    for r in plan.runs:
        mine = [(s, d, n) for s, d, n in pieces if r.start <= s < r.start + r.nbytes]
        assert [s - r.start for s, _, _ in mine] == [d - (1 << 40) - r.offset for _, d, _ in mine]
        assert sum(n for _, _, n in mine) == r.nbytes


# ---- async_save(staging="device") on the host back end ----------------------------


def _state_in_one_buffer(rng: np.random.Generator) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Tensors that are views of one flat buffer (as in a flattened parameter store)."""
    flat = rng.standard_normal(40 * 300).astype(np.float32)
    return flat, {f"p{i:02d}": flat[i * 300 : (i + 1) * 300].reshape(15, 20) for i in range(40)}


def _save_device_snapshot(tmp_path: Path, arrays: dict[str, np.ndarray], backend: HostBackend) -> None:
    expected = {k: v.copy(order="K") for k, v in arrays.items()}
    state = {k: EmulatedDeviceArray(v, backend) for k, v in arrays.items()}
    fut = gpuckpt.async_save(state, tmp_path / "c", staging="device", chunk_bytes=4096, sync="none")
    for v in arrays.values():  # training goes on at once and changes the arrays
        v[...] = 0
    fut.result(timeout=60)
    back = gpuckpt.load_state_dict(tmp_path / "c")
    for k, v in expected.items():
        assert back[k].tobytes() == np.ascontiguousarray(v).tobytes(), k


def test_state_in_one_buffer_is_one_copy(tmp_path: Path) -> None:
    _flat, arrays = _state_in_one_buffer(np.random.default_rng(1))
    backend = HostBackend()
    _save_device_snapshot(tmp_path, arrays, backend)
    assert backend.device_copies == 1


def test_many_separate_tensors_are_one_batched_copy(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    arrays = {
        "a": rng.standard_normal((31, 17)).astype(np.float32),
        "b": rng.integers(0, 255, (7, 3, 5), dtype=np.uint8),
        "c": rng.standard_normal((50, 33)).astype(ml_dtypes.bfloat16),
        "cl": _kernel_ref.as_channels_last(rng.standard_normal((3, 5, 7, 9)).astype(np.float16)),
        "cl3d": _kernel_ref.as_channels_last(rng.standard_normal((2, 3, 4, 5, 6)).astype(np.float32)),
        "scalar": np.array(5, np.int64),
        "empty": np.zeros((0, 3), np.float32),
    }
    arrays.update({f"w{i}": rng.standard_normal(100 + i) for i in range(30)})
    backend = HostBackend()
    _save_device_snapshot(tmp_path, arrays, backend)
    assert backend.device_copies == 1


def test_a_large_tensor_is_a_copy_of_its_own_beside_the_batched_small_ones() -> None:
    rng = np.random.default_rng(3)
    arrays = [rng.integers(0, 255, DIRECT_MIN_BYTES, dtype=np.uint8)]
    arrays += [rng.standard_normal(100 + i) for i in range(BATCH_MIN_RUNS)]
    backend = HostBackend()
    copies = backend.copy_many_on_device(arrays)
    backend.synchronize()
    assert backend.device_copies == 2  # the large one, and one batched copy of the others
    for a, c in zip(arrays, copies, strict=True):
        assert c.tobytes() == a.tobytes()


def test_few_separate_tensors_are_one_copy_each(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    arrays = {"a": rng.standard_normal((64, 64)), "b": rng.standard_normal(1000).astype(np.float16)}
    backend = HostBackend()
    _save_device_snapshot(tmp_path, arrays, backend)
    assert backend.device_copies == 2


def test_strided_views_are_copied_on_their_own(tmp_path: Path) -> None:
    _flat, arrays = _state_in_one_buffer(np.random.default_rng(4))
    base = np.random.default_rng(5).standard_normal((40, 40))
    arrays["strided"] = base[:, ::2]  # not dense: no memory image to copy as a block
    backend = HostBackend()
    _save_device_snapshot(tmp_path, arrays, backend)
    assert backend.device_copies == 2  # the buffer's run, and the view alone


def test_back_to_back_buffers_are_copied_apart_views_of_one_together() -> None:
    # two buffers that lie back to back in memory (two allocations, as the driver would see
    # them) are two copies; views of one buffer are one, as on the device
    raw = bytearray(np.random.default_rng(9).integers(0, 255, 8192, dtype=np.uint8).tobytes())
    first = np.frombuffer(memoryview(raw)[:4096], np.uint8)
    second = np.frombuffer(memoryview(raw)[4096:], np.uint8)
    assert first.ctypes.data + first.nbytes == second.ctypes.data
    backend = HostBackend()
    copies = backend.copy_many_on_device([first, second])
    backend.synchronize()
    assert backend.device_copies == 2
    assert copies[0].tobytes() == first.tobytes() and copies[1].tobytes() == second.tobytes()
    whole = np.frombuffer(raw, np.uint8)
    backend = HostBackend()
    copies = backend.copy_many_on_device([whole[:4096], whole[4096:]])
    backend.synchronize()
    assert backend.device_copies == 1
    assert copies[0].tobytes() + copies[1].tobytes() == bytes(raw)


# ---- on a GPU ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["one-buffer", "separate"])
def test_cupy_device_snapshot(tmp_path: Path, layout: str) -> None:
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(6)
    if layout == "one-buffer":
        flat = cupy.asarray(rng.standard_normal(40 * 300).astype(np.float32))
        live = {f"p{i:02d}": flat[i * 300 : (i + 1) * 300].reshape(15, 20) for i in range(40)}
    else:
        live = {
            f"w{i}": cupy.asarray(rng.standard_normal(1000 + 7 * i).astype(np.float32)) for i in range(40)
        }
        live["odd"] = cupy.asarray(rng.integers(0, 255, 4097, dtype=np.uint8))[1:]  # not 16-byte aligned
    expected = {k: cupy.asnumpy(v) for k, v in live.items()}
    fut = gpuckpt.async_save(live, tmp_path / "c", staging="device", sync="none")
    for v in live.values():
        v[...] = 0
    fut.result(timeout=120)
    back = gpuckpt.load_state_dict(tmp_path / "c")
    for k, v in expected.items():
        assert back[k].tobytes() == v.tobytes(), k


@pytest.mark.gpu
def test_cupy_copy_many_on_device_is_bit_exact() -> None:
    cupy = pytest.importorskip("cupy")
    from gpuckpt.device.cuda import backend_for_device

    backend = backend_for_device(0)
    rng = np.random.default_rng(7)
    arrays = [cupy.asarray(rng.integers(0, 2**32, n, dtype=np.uint32)) for n in (1, 17, 4096, 300001)]
    arrays += [cupy.asarray(rng.integers(0, 255, 3 << 20, dtype=np.uint8))[3:]]  # pieces of 1 MiB, odd start
    arrays += [cupy.zeros((0, 4), cupy.float32)]
    backend.wait_for_producers()
    copies = backend.copy_many_on_device(arrays)
    backend.synchronize()
    for a, c in zip(arrays, copies, strict=True):
        assert c.shape == a.shape and c.strides == a.strides
        assert int(c.data.ptr) != int(a.data.ptr) or a.size == 0
        assert cupy.asnumpy(c).tobytes() == cupy.asnumpy(a).tobytes()


def _assert_copied_exactly(cupy: Any, backend: Any, arrays: list[Any]) -> None:
    """``backend.copy_many_on_device(arrays)`` gives copies of exactly their bytes."""
    expected = [cupy.asnumpy(a) for a in arrays]
    backend.wait_for_producers()
    copies = backend.copy_many_on_device(arrays)
    backend.synchronize()
    for want, c in zip(expected, copies, strict=True):
        assert np.array_equal(cupy.asnumpy(c), want)


@pytest.mark.gpu
def test_cupy_snapshot_of_large_separate_allocations() -> None:
    # Large arrays are separate cudaMallocs that the driver often places back to back: a
    # copy that ran from one into the next failed with cudaErrorInvalidValue (a 2 GiB state
    # on an H200). Each allocation is its own run; views of one stay one run.
    cupy = pytest.importorskip("cupy")
    from gpuckpt.device.cuda import allocation_bases, backend_for_device

    backend = backend_for_device(0)
    rng = cupy.random.default_rng(8)
    with cupy.cuda.using_allocator(cupy.cuda.MemoryPool().malloc):  # nothing freed to split
        arrays = [rng.integers(0, 2**31, (64 << 20) // 4, dtype=cupy.int32) for _ in range(3)]
    starts = [int(a.data.ptr) for a in arrays]
    bases = allocation_bases([*starts, int(arrays[0][1000:].data.ptr)])
    assert bases[3] == bases[0]  # a view lies in its array's allocation
    assert len(set(bases[:3])) == 3  # each 64 MiB array of a fresh pool is an allocation of its own
    _assert_copied_exactly(cupy, backend, arrays)


@pytest.mark.gpu
def test_cupy_snapshot_of_large_and_small_arrays() -> None:
    # large allocations by plain copies and the small arrays by one batched copy, in one call
    cupy = pytest.importorskip("cupy")
    from gpuckpt.device.cuda import backend_for_device

    backend = backend_for_device(0)
    rng = cupy.random.default_rng(9)
    arrays = [rng.integers(0, 2**31, (DIRECT_MIN_BYTES * 2) // 4, dtype=cupy.int32) for _ in range(2)]
    arrays += [rng.integers(0, 2**31, 1000 + 13 * i, dtype=cupy.int32) for i in range(2 * BATCH_MIN_RUNS)]
    _assert_copied_exactly(cupy, backend, arrays)
