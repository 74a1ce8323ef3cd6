from __future__ import annotations

import importlib.util

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci")


def _register_dtypes_where_zarr_ignores_entry_points() -> None:
    """Give zarr 3.1 the ml_dtypes data types, as an installed gpuckpt gives them to zarr >= 3.4.

    Many tests read checkpoints back with plain zarr-python. zarr 3.1.x (the line that
    Python 3.11 gets) collects the ``zarr.data_type`` entry points but never loads them,
    so there the types are registered explicitly, as its users must do (README); the
    entry-point route itself is tested in tests/unit/test_zarr_dtypes.py.
    """
    import zarr

    if tuple(int(part) for part in zarr.__version__.split(".")[:2]) < (3, 4):
        from gpuckpt.storage.zarr_dtypes import register_zarr_dtypes

        register_zarr_dtypes()


_register_dtypes_where_zarr_ignores_entry_points()


def _gpu_available() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # CuPy installed without a driver or device
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
