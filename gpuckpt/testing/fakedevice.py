"""Arrays that pretend to live on a device, backed by host memory.

``EmulatedDeviceArray(np_array, backend)`` is accepted by ``save``, ``load``
and ``async_save`` like a GPU array: it has no host view, so every byte goes
through the backend's staging pipeline exactly as device memory would. With
a :class:`~gpuckpt.device.host_backend.HostBackend` that slows copies down, the
pipeline's overlap and back-pressure become measurable without a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuckpt.device.arrays import DeviceArray
from gpuckpt.device.host_backend import HostBackend

__all__ = ["EmulatedDeviceArray"]


class EmulatedDeviceArray:
    """A NumPy array presented to gpuckpt as device memory of ``backend``."""

    def __init__(self, data: np.ndarray, backend: HostBackend, *, requires_grad: bool = False) -> None:
        self.data = data
        self.backend = backend
        self.requires_grad = requires_grad

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def __gpuckpt_adapter__(self) -> DeviceArray:
        return DeviceArray(self.data, self.backend, self.data.dtype, self.requires_grad)

    def __repr__(self) -> str:
        return f"EmulatedDeviceArray(shape={self.shape}, dtype={self.data.dtype})"

    def numpy(self) -> Any:
        return self.data
