"""Array adapters: their facts, and how each kind stages a box out and in.

Device memory is stood in for by :class:`~gpuckpt.device.host_backend.HostBackend`
(copies queued on one worker thread, optionally slowed down), so the device
adapter's buffer handling is checked without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpuckpt
from gpuckpt.device import _kernel_ref
from gpuckpt.device.arrays import ArrayAdapter, DeviceArray, HostArray, adapt, device_backends
from gpuckpt.device.backend import FINISHED, Staging, buffer_pool, staging_buffer_bytes
from gpuckpt.device.host_backend import HostBackend
from gpuckpt.metadata import TensorProperties
from gpuckpt.testing.fakedevice import EmulatedDeviceArray


def _device(data: np.ndarray, backend: HostBackend) -> DeviceArray:
    return DeviceArray(data, backend, data.dtype)


def test_host_boxes_are_views_of_the_array_itself() -> None:
    a = np.arange(60, dtype=np.float32).reshape(6, 10)
    host = HostArray(a)
    assert host.backend is None
    staging = Staging([(host.backend, 40)])  # host memory needs no staging
    assert staging.backends == []
    out = host.stage_out((2, 0), (2, 10), staging)
    assert out.ready
    box = out.wait()
    assert np.shares_memory(box, a) and np.array_equal(box, a[2:4])
    out.release()
    inbound = host.stage_in((4, 5), (2, 5), staging)
    inbound.box[...] = -1
    inbound.finish()
    inbound.release()
    assert (a[4:6, 5:] == -1).all() and (a[4:6, :5] >= 0).all()
    # a 0-d array has one box, the whole array
    scalar = HostArray(np.array(7.0))
    assert scalar.stage_out((), (), staging).wait().shape == ()


def test_a_device_box_is_copied_into_a_staging_buffer_held_until_release() -> None:
    backend = HostBackend()
    data = np.arange(64 * 32, dtype=np.int32).reshape(64, 32)
    dev = _device(data, backend)
    nbytes = 8 * 32 * 4
    staging = Staging([(dev.backend, nbytes)], budget_bytes=4 * nbytes)
    pool = staging.pool(backend)
    assert pool is buffer_pool(backend, staging_buffer_bytes(nbytes), 4 * nbytes)
    out = dev.stage_out((8, 0), (8, 32), staging)
    assert not out.ready and pool.peak_in_use == 1
    box = out.wait()
    assert np.array_equal(box, data[8:16]) and not np.shares_memory(box, data)
    out.release()
    out.release()  # a second release gives back nothing twice
    assert pool.peak_in_use == 1 and pool.allocated == 1
    # in: the filled buffer reaches the device array when finished
    inbound = dev.stage_in((0, 16), (4, 16), staging)
    inbound.box[...] = -5
    assert (data[0:4, 16:] != -5).all()  # nothing moved before finish()
    inbound.finish()
    inbound.release()
    assert (data[0:4, 16:] == -5).all() and (data[0:4, :16] != -5).all()
    assert pool.allocated == 1  # the same buffer served both


def test_releasing_a_box_never_read_waits_for_its_copy_before_reusing_the_buffer() -> None:
    backend = HostBackend(bytes_per_second=64 << 10)  # a 4 KiB copy takes about 60 ms
    data = np.ones(1024, np.float32)
    dev = _device(data, backend)
    staging = Staging([(dev.backend, data.nbytes)], budget_bytes=data.nbytes)
    pool = staging.pool(backend)
    pool.allocator = lambda n: np.zeros(n, np.uint8)
    dev.stage_out((0,), (1024,), staging).release()  # e.g. a job skipped after an error
    buf = pool.acquire(data.nbytes)  # the one buffer, handed out again
    assert np.array_equal(buf[: data.nbytes].view(np.float32), data)  # the copy had ended
    pool.release(buf)


def test_staging_has_one_pool_per_back_end_sized_for_its_largest_box() -> None:
    a, b = HostBackend(), HostBackend()
    staging = Staging([(a, 5000), (None, 1 << 30), (b, 100), (a, 9000), (b, 70)], budget_bytes=1 << 20)
    assert staging.backends == [a, b]
    assert staging.pool(a).buffer_bytes == staging_buffer_bytes(9000) == 16384
    assert staging.pool(b).buffer_bytes == staging_buffer_bytes(100)
    with pytest.raises(ValueError, match="no staging was planned for back end 'host'"):
        staging.pool(HostBackend())
    arrays: list[ArrayAdapter] = [
        _device(np.zeros(1), a),
        HostArray(np.zeros(1)),
        _device(np.zeros(2), b),
        _device(np.zeros(3), a),
    ]
    assert device_backends(arrays) == [a, b]


@pytest.mark.parametrize("kind", ["host", "device"])
def test_copy_to_host_fills_destinations_in_c_order_and_in_the_arrays_format(kind: str) -> None:
    backend = HostBackend()
    src = _kernel_ref.as_channels_last(np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5))
    arr = HostArray(src) if kind == "host" else _device(src, backend)
    assert arr.memory_format is gpuckpt.channels_last
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    for dst in (np.zeros(src.shape, src.dtype), _kernel_ref.empty_channels_last(src.shape, src.dtype)):
        ticket = arr.copy_to_host(dst, lambda d, s: copies.append((d, s)))
        ticket.wait()
        if kind == "host":
            assert ticket is FINISHED and copies[-1][0] is dst and copies[-1][1] is src
            np.copyto(*copies[-1])  # the caller runs host copies itself
        assert np.array_equal(dst, src)
    if kind == "device":
        assert copies == [] and backend.copies == 2
        with pytest.raises(ValueError, match="dense destination"):
            arr.copy_to_host(np.asfortranarray(np.zeros(src.shape, src.dtype)), lambda d, s: None)


@pytest.mark.parametrize("kind", ["host", "device"])
def test_a_copy_keeps_the_facts_and_not_the_memory(kind: str) -> None:
    backend = HostBackend()
    src = _kernel_ref.as_channels_last(np.arange(120.0).reshape(2, 3, 4, 5))
    arr = (
        HostArray(src, requires_grad=True, pinned=True)
        if kind == "host"
        else DeviceArray(src, backend, src.dtype, True)
    )
    copy = arr.copy()
    for b in device_backends([copy]):
        b.synchronize()
    src[...] = 0
    assert type(copy) is type(arr) and copy.backend is arr.backend
    assert copy.requires_grad and copy.pinned == arr.pinned and copy.memory_format is gpuckpt.channels_last
    assert np.array_equal(
        copy.data if isinstance(copy, DeviceArray) else copy.host_array(),
        np.arange(120.0).reshape(2, 3, 4, 5),
    )


def test_metadata_builds_properties_from_the_facts() -> None:
    backend = HostBackend()
    cl = _kernel_ref.as_channels_last(np.zeros((2, 3, 4, 5), np.float16))
    props = TensorProperties.from_array(HostArray(cl, requires_grad=True, pinned=True))
    assert (props.dtype, props.memory_format, props.requires_grad, props.pin_memory) == (
        np.dtype(np.float16),
        gpuckpt.channels_last,
        True,
        True,
    )
    dev = adapt(EmulatedDeviceArray(cl, backend, requires_grad=True))
    assert isinstance(dev, DeviceArray) and dev.writable and not dev.pinned
    assert TensorProperties.from_array(dev) == TensorProperties(
        dtype=np.dtype(np.float16), requires_grad=True, memory_format=gpuckpt.channels_last
    )
    assert TensorProperties.create_from_tensor(cl).memory_format is gpuckpt.channels_last
    ro = np.zeros(3)
    ro.flags.writeable = False
    assert not adapt(ro).writable and adapt(np.zeros(3)).writable
    with pytest.raises(TypeError, match="no host view"):
        dev.host_array()
