from __future__ import annotations

import importlib
import importlib.util
import os
import time
from collections.abc import Generator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci")

# The MPI jobs of the tests share two cores with each other and with the other test workers.
# MPICH's blocking calls poll without pause while they wait (three ranks waiting 3 s in a barrier
# for a fourth burn 6 s of CPU); with heavy yield they sleep between polls (1 s), leaving the cores
# to the ranks and tests that work. Every job the tests start inherits it.
os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")


def _register_dtypes_where_zarr_ignores_entry_points() -> None:
    """Give zarr 3.1 the ml_dtypes data types, as an installed gpuckpt gives them to zarr >= 3.4.

    Many tests read checkpoints back with plain zarr-python. zarr 3.1.x (the line that
    Python 3.11 gets) collects the ``zarr.data_type`` entry points but never loads them,
    so there the types are registered explicitly, as its users must do (README); the
    entry-point route itself is tested in tests/unit/test_zarr_dtypes.py.
    """
    from gpuckpt.format._zarr_compat import ZARR_BEFORE_3_4

    if ZARR_BEFORE_3_4:
        from gpuckpt.format.zarr_dtypes import register_zarr_dtypes

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


# ---------------------------------------------------------------------------------------------------
# The torch suite. `make test` runs the tests marked `torch` in a venv that has torch
# (.venv311) with GPUCKPT_REQUIRE_TORCH=1: there a torch test that skips, for whatever reason,
# is a failure, so CI cannot pass while they silently do not run.

REQUIRE_TORCH = os.environ.get("GPUCKPT_REQUIRE_TORCH") == "1"
# what the torch tests import; each must import for the suite to be meaningful
_TORCH_MODULES = ("torch", "torch.distributed", "torch.distributed.checkpoint")


def pytest_configure(config: pytest.Config) -> None:
    if not REQUIRE_TORCH:
        return
    for name in _TORCH_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            raise pytest.UsageError(
                f"GPUCKPT_REQUIRE_TORCH=1, but {name} does not import ({type(exc).__name__}: {exc}). "
                "Run the torch suite in a venv with torch (`make test` makes .venv311), "
                "or unset GPUCKPT_REQUIRE_TORCH."
            ) from exc
        if name == "torch.distributed" and not (module.is_available() and module.is_gloo_available()):
            raise pytest.UsageError(
                "GPUCKPT_REQUIRE_TORCH=1, but this torch has no torch.distributed with the gloo "
                "backend, which the torch tests use; install a torch build with distributed support."
            )


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if (
        REQUIRE_TORCH
        and report.skipped
        and not hasattr(report, "wasxfail")
        and item.get_closest_marker("torch") is not None
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} is marked torch and GPUCKPT_REQUIRE_TORCH=1, so it must run, "
            f"but it skipped: {_skip_reason(report)}"
        )
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    # A module that skips as a whole while it is imported (a module-level importorskip of a
    # torch module) never yields items to carry the marker: judge it by its reason instead.
    report = yield
    if REQUIRE_TORCH and report.skipped and "torch" in _skip_reason(report):
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid} skipped while the torch suite must run (GPUCKPT_REQUIRE_TORCH=1): "
            f"{_skip_reason(report)}"
        )
    return report


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # The torch suite (`-m torch`) selects tests marked `torch`: a test module whose text never
    # says "torch" holds none, and importing it in every worker only to deselect all of it cost
    # each worker about 13 of its 17 seconds of collection.
    if (config.option.markexpr or "").strip() != "torch" or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    try:
        text = collection_path.read_text(encoding="utf-8")
    except (OSError, UnicodeError):
        return None
    return None if "torch" in text else True


# ---------------------------------------------------------------------------------------------------
# MPI jobs whose ranks the tests kill with SIGKILL leave MPICH's shared-memory segment in
# /dev/shm: at the end of the run, those made during it that no process maps are removed.

_SESSION_START = time.time()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller sweeps, at the end
        return
    from gpuckpt.testing.shm import orphaned_segments

    for f in orphaned_segments(_SESSION_START):
        f.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The libc fault shim (gpuckpt/testing/faultshim.c), built once; skips where it cannot be."""
    from gpuckpt.testing.faults import build_fault_shim

    built = build_fault_shim(tmp_path_factory.mktemp("shim"))
    if built is None:
        pytest.skip("no C compiler (or not Linux): the libc fault shim cannot be built")
    return built


@pytest.fixture
def proxy(endpoint: str) -> Generator[object, None, None]:
    """A counting HTTP proxy (no faults) in front of the module's own ``endpoint`` fixture
    (its loopback S3 server): it counts requests and the bytes of their answers."""
    from gpuckpt.testing.faultproxy import FaultProxy

    with FaultProxy(endpoint) as p:
        yield p
