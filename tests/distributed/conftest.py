"""Harness of the distributed tests: real multi-process jobs under mpiexec and torch.distributed.

``run_mpi(n, script, *args, timeout=60)`` runs ``mpiexec -n N python script
args...``; each rank of the script writes its result as JSON to
``$GPUCKPT_TEST_OUT/rank<R>.json`` (see ``scripts/_rank_io.py``), and the
harness returns them with the job's exit status and output. A job that runs
past ``timeout`` is killed (its whole process group) and the test fails, so a
hang never blocks the run.

mpiexec is looked up in ``$GPUCKPT_MPIEXEC``, then next to the running
Python (where the ``mpich`` wheel installs it), then on ``PATH``; without it
or without mpi4py the MPI tests are skipped with the reason.
``run_torch(n, script, *args)`` starts N processes joined by a gloo process
group (``init_method=file://``); it skips when torch is not importable.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench.compare.common import find_mpiexec

SCRIPTS = Path(__file__).parent / "scripts"


MPIEXEC = find_mpiexec()
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None


@functools.cache
def torch_distributed_available() -> bool:
    """Whether torch.distributed imports (checked once, when a torch test first needs it)."""
    try:
        import torch.distributed as dist
    except Exception:  # not installed, or a broken install: the torch tests skip
        return False
    return bool(dist.is_available())


@dataclass
class RankJob:
    """What a multi-process job left: exit status, output, and each rank's JSON result."""

    cmd: list[str]
    returncode: int
    output: str
    results: dict[int, dict[str, Any]] = field(default_factory=dict)

    def describe(self) -> str:
        errors = "\n".join(
            f"--- rank {r} error ---\n{res['error']}"
            for r, res in sorted(self.results.items())
            if "error" in res
        )
        return (
            f"command: {' '.join(self.cmd)}\nexit status: {self.returncode}\n"
            f"ranks with a result: {sorted(self.results)}\n{errors}\n--- output (tail) ---\n{self.output[-4000:]}"
        )

    def check(self, n: int) -> dict[int, dict[str, Any]]:
        """Assert that the job exited 0 and every rank wrote an error-free result; return the results."""
        ok = self.returncode == 0 and sorted(self.results) == list(range(n))
        ok = ok and not any("error" in r for r in self.results.values())
        assert ok, self.describe()
        return self.results


def _read_results(out: Path) -> dict[int, dict[str, Any]]:
    results: dict[int, dict[str, Any]] = {}
    for f in sorted(out.glob("rank*.json")):
        results[int(f.stem.removeprefix("rank"))] = json.loads(f.read_text())
    return results


def _run_processes(
    cmds: list[list[str]], envs: list[dict[str, str]], timeout: float, fail_fast: bool = False
) -> tuple[int, str]:
    """Run the commands concurrently, each in its own process group; kill them all past ``timeout``.

    ``fail_fast``: once a process has died of a signal, the others are killed too (what a
    launcher such as torchrun's agent does when a worker dies; mpiexec does it by itself)."""
    with contextlib.ExitStack() as files:
        outs = [files.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in cmds]
        return _watch(cmds, envs, outs, timeout, fail_fast)


def _watch(
    cmds: list[list[str]], envs: list[dict[str, str]], outs: list[Any], timeout: float, fail_fast: bool
) -> tuple[int, str]:
    """:func:`_run_processes` with the processes' output going to the files ``outs``."""
    procs = [
        subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for cmd, env, out in zip(cmds, envs, outs, strict=True)
    ]

    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()

    def output(i: int) -> str:
        outs[i].seek(0)
        return outs[i].read()

    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            kill_all()
            tails = [output(i)[-2000:] for i in range(len(procs))]
            pytest.fail(
                f"{cmds[0][:4]}... ran past {timeout} s and was killed; output tails:\n"
                + "\n---\n".join(tails)
            )
        if fail_fast and any((p.returncode or 0) < 0 for p in procs):
            kill_all()
            break
        time.sleep(0.05)
    codes = [p.returncode for p in procs]
    return max(codes, key=abs), "\n".join(output(i) for i in range(len(procs)))


def _base_env(out: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["GPUCKPT_TEST_OUT"] = str(out)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a rank that crashes prints where
    env.setdefault("HYDRA_LAUNCHER", "fork")  # single-host job: never try ssh
    return env


@pytest.fixture
def run_mpi(tmp_path: Path) -> Callable[..., RankJob]:
    """``run_mpi(n, script, *args, timeout=60, env=None) -> RankJob``: ``mpiexec -n N python
    script args`` (``env``: variables added to the job's environment)."""
    if MPIEXEC is None or not HAVE_MPI4PY:
        pytest.skip(
            "MPI tests need mpiexec and mpi4py (`pip install mpich mpi4py`); "
            f"found mpiexec={MPIEXEC!r}, mpi4py={'yes' if HAVE_MPI4PY else 'no'}"
        )
    counter = iter(range(1_000_000))

    def run(
        n: int, script: str | Path, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None
    ) -> RankJob:
        out = tmp_path / f"mpi-job-{next(counter)}"
        out.mkdir()
        cmd = [str(MPIEXEC), "-n", str(n), sys.executable, str(SCRIPTS / script), *map(str, args)]
        code, output = _run_processes([cmd], [{**_base_env(out), **(env or {})}], timeout)
        return RankJob(cmd, code, output, _read_results(out))

    return run


@pytest.fixture
def run_torch(tmp_path: Path) -> Callable[..., RankJob]:
    """``run_torch(n, script, *args, timeout=60, fail_fast=False) -> RankJob``: N processes
    joined by a gloo group (``fail_fast``: see ``_run_processes``).

    Each process gets ``RANK``, ``WORLD_SIZE`` and ``GPUCKPT_TORCH_INIT`` (a ``file://`` rendezvous).
    """
    if not torch_distributed_available():
        pytest.skip("torch.distributed is not importable (torch is not installed)")
    counter = iter(range(1_000_000))

    def run(
        n: int, script: str | Path, *args: str, timeout: float = 60.0, fail_fast: bool = False
    ) -> RankJob:
        job = next(counter)
        out = tmp_path / f"torch-job-{job}"
        out.mkdir()
        cmd = [sys.executable, str(SCRIPTS / script), *map(str, args)]
        envs = []
        for rank in range(n):
            env = _base_env(out)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(n),
                GPUCKPT_TORCH_INIT=f"file://{tmp_path / f'torch-rendezvous-{job}'}",
            )
            envs.append(env)
        code, output = _run_processes([cmd] * n, envs, timeout, fail_fast)
        return RankJob(cmd, code, output, _read_results(out))

    return run


@pytest.fixture
def load_script(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Import a module of ``scripts/`` (to run its rank functions in-process with threads)."""
    monkeypatch.syspath_prepend(str(SCRIPTS))

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"gpuckpt_test_scripts_{name}", SCRIPTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
