"""A tiered CheckpointManager that is never closed keeps the promise of its saves at exit, in
real processes: the last step's part, its replication round and a drain in flight are written
before the process ends (every rank's exit waits for its own work, so the ranks' rounds meet),
or what was not written is named on stderr and the exit status is 1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpuckpt.format.parts import part_name

SCRIPT = "tier_lifecycle.py"
SCRIPTS = Path(__file__).parent / "scripts"


def _one_process(
    tmp_path: Path, *args: Any
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """``tier_lifecycle.py none ARGS`` in a process of its own: its exit, and its result (if any)."""
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
    out.mkdir()
    env = {**os.environ, "GPUCKPT_TEST_OUT": str(out), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(SCRIPTS / SCRIPT), "none", *map(str, args)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    result = out / "rank0.json"
    return done, json.loads(result.read_text()) if result.exists() else None


def _committed(path: Path) -> bool:
    return (path / "zarr.json").is_file()


def test_an_unclosed_tiered_managers_last_step_and_drain_are_written_at_exit(tmp_path: Path) -> None:
    root = tmp_path / "root"
    left, _ = _one_process(tmp_path, "leave", tmp_path, root, 2)
    assert left.returncode == 0 and "gpuckpt:" not in left.stderr, left.stderr
    assert _committed(tmp_path / "n0" / part_name(2, 0))  # the last step, in the tier
    assert _committed(root / "step_00000000")  # the drain that was in flight
    reopened, got = _one_process(tmp_path, "open", tmp_path, root)
    assert reopened.returncode == 0, reopened.stderr
    assert got is not None and got["step"] == 2 and got["exact"] and got["source"] == "tiers", got
    assert got["root"] == [0], got


def test_a_drain_that_fails_at_exit_is_named_on_stderr_and_the_exit_status_is_1(tmp_path: Path) -> None:
    root = tmp_path / "root"
    left, _ = _one_process(tmp_path, "leave-failing", tmp_path, root, 2)
    assert left.returncode == 1, (left.returncode, left.stderr)
    assert f"not written: step 0 to the root {root / 'step_00000000'}" in left.stderr, left.stderr
    assert "injected: the root refuses every save" in left.stderr, left.stderr
    assert _committed(tmp_path / "n0" / part_name(2, 0))  # the tier's work itself was done


def test_mpi_ranks_leaving_without_close_write_their_parts_replicas_and_drain(
    run_mpi: Any, tmp_path: Path
) -> None:
    """2 ranks on 2 nodes, replicas=1: each node's tier holds both ranks' parts of the last
    step (its own and the other's replica), the root the drained step; with node n1 replaced
    (its tier wiped) and the root moved away, the last step restores from the tiers, rank 1's
    part from its replica on n0. A job whose ranks exit cleanly does not hang at exit."""
    root = tmp_path / "root"
    run_mpi(2, SCRIPT, "mpi", "leave", tmp_path, root, 2, timeout=120).check(2)
    for node in ("n0", "n1"):
        for rank in (0, 1):
            assert _committed(tmp_path / node / part_name(2, rank)), (node, rank)
    assert _committed(root / "step_00000000")
    shutil.rmtree(tmp_path / "n1")
    shutil.move(root, tmp_path / "root-moved-away")
    restored = run_mpi(2, SCRIPT, "mpi", "open", tmp_path, root, timeout=120).check(2)
    for rank, r in restored.items():
        assert r["step"] == 2 and r["exact"] and r["source"] == "tiers", (rank, r)
        assert r["parts"] == {"0": ["local", None], "1": ["peer", 0]}, (rank, r)


def test_mpi_ranks_whose_drain_fails_at_exit_say_so_and_exit_1_without_hanging(
    run_mpi: Any, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    job = run_mpi(2, SCRIPT, "mpi", "leave-failing", tmp_path, root, 2, timeout=120)
    assert job.returncode != 0 and sorted(job.results) == [0, 1], job.describe()
    # each rank names what it did not write; the first rank to exit with status 1 makes mpiexec
    # end the job, which may stop the other before its line is out
    assert job.output.count("not written: step 0 to the root") >= 1, job.describe()
