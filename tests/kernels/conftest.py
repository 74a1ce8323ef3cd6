"""Fixtures for the channels-last kernel tests.

The CPU-emulation libraries are built once per test session, in a temporary
folder that the session's test workers share, and in the background: every
variant is queued when the first test asks for one, on two compiler
processes, so later builds overlap with the tests that already run; a test
that needs a variant still queued builds it at once.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
if str(REPO_ROOT) not in sys.path:  # source checkout without an install
    sys.path.insert(0, str(REPO_ROOT))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import kernel_emu  # noqa: E402


class EmuBuilds:
    """Session-wide, lazily started builds of every emulation variant, into a folder that the
    test workers of one session share (each library is built once, by whichever worker
    gets to it first: :func:`kernel_emu.build`)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[str, Future[Path]] = {}
        self._libs: dict[str, kernel_emu.EmuLibrary] = {}

    def _start(self) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2)
            for variant in kernel_emu.ALL_VARIANTS:
                self._futures[variant.name] = self._pool.submit(kernel_emu.build, variant, self.out_dir)

    def path(self, variant: kernel_emu.Variant) -> Path:
        """Library file of ``variant``, building it if needed: now, in this thread, where its
        build is still queued behind others."""
        if kernel_emu.gxx() is None:
            pytest.skip("g++ not found on PATH: the CPU emulation of the kernels cannot be built")
        self._start()
        future = self._futures.get(variant.name)
        if future is None or future.cancel():
            return kernel_emu.build(variant, self.out_dir)
        return future.result()

    def library(self, variant: kernel_emu.Variant) -> kernel_emu.EmuLibrary:
        """Loaded library of a non-sanitizer ``variant``."""
        assert variant.sanitize is None, "sanitizer builds run in a subprocess"
        if variant.name not in self._libs:
            self._libs[variant.name] = kernel_emu.EmuLibrary(self.path(variant))
        return self._libs[variant.name]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def emu_builds(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.getbasetemp()
    # under pytest-xdist each worker's base is a folder of the session's: builds go beside them
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = shared / "kernel_emu"
    out.mkdir(exist_ok=True)
    builds = EmuBuilds(out)
    yield builds
    builds.close()


@pytest.fixture(scope="session")
def emu_lib(emu_builds: EmuBuilds) -> kernel_emu.EmuLibrary:
    """The plain (fiber-mode, optimised) emulation library."""
    return emu_builds.library(kernel_emu.PLAIN)
