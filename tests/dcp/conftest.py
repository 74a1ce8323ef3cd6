"""Harness of the gpuckpt.dcp tests: real multi-process torch.distributed jobs on loopback.

``run_ranks(n, job, out, timeout=120)`` starts ``n`` processes of
``scripts/dcp_ranks.py JOB OUT`` joined by a gloo process group
(``MASTER_ADDR=127.0.0.1``, a free port), each in its own process group so
that a job past ``timeout`` is killed whole and the test fails instead of
hanging. It returns each rank's JSON result.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "dcp_ranks.py"
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(n: int, job: str, out: Path, timeout: float = 120.0) -> dict[int, dict[str, Any]]:
    """Run ``job`` on ``n`` ranks; fail the test (with every rank's output) unless all succeed."""
    port = _free_port()
    procs = []
    for rank in range(n):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",  # ranks share the machine's cores
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), job, str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(0.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        tails = "\n---\n".join(p.communicate()[0][-3000:] for p in procs)
        pytest.fail(f"{job} on {n} ranks ran past {timeout} s and was killed; output tails:\n{tails}")
    results = {}
    for rank in range(n):
        f = out / f"rank{rank}.json"
        results[rank] = json.loads(f.read_text()) if f.exists() else {"error": "no result written"}
    failed = {r: res["error"] for r, res in results.items() if "error" in res}
    codes = [p.returncode for p in procs]
    assert not failed and not any(codes), (
        f"{job} on {n} ranks: exit codes {codes}\n"
        + "\n".join(f"--- rank {r} ---\n{e}" for r, e in failed.items())
        + "\n--- output ---\n"
        + "\n".join(o[-3000:] for o in outputs)
    )
    return results


@pytest.fixture(scope="session")
def run_ranks() -> Callable[..., dict[int, dict[str, Any]]]:
    """``run_ranks(n, job, out, timeout=120)``: see :func:`launch`."""
    return launch
