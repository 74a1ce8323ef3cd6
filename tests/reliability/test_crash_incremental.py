"""SIGKILL during incremental saves: no committed checkpoint is lost or damaged, the base included.

An incremental save links most of its chunk files to the base's: a kill at any
moment (while linking, mid-file, at publication, during the manager's
retention) must leave the base and every committed step complete and
verifiable, and the next save must work.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import gpuckpt
from gpuckpt.manager import CheckpointManager
from gpuckpt.testing.crash import chain_state, phase_of
from gpuckpt.testing.faults import temporaries
from gpuckpt.verify import verify_checkpoint

from .conftest import STRESS_TRIALS, ChildRun, run_child

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

SEED = 5200


def assert_step(path: Path, step: int) -> None:
    want = chain_state(SEED, step)
    got = gpuckpt.load_state_dict(path)
    assert got["seed"] == SEED + step, f"{path} holds seed {got['seed']}, expected {SEED + step}"
    for k, v in want["model"].items():
        assert got["model"][k].tobytes() == v.tobytes(), f"{path}: tensor {k} differs"
    report = verify_checkpoint(path)
    assert report.ok, report.damage


def check_incremental(root: Path, run: ChildRun) -> None:
    assert_step(root / "good", 0)  # the base is intact
    nxt = root / "next"
    if nxt.exists():
        assert_step(nxt, 1)
        # published: its unchanged chunk files are the base's
        links = [f for f in (nxt / "model.w5").iterdir() if f.name != "zarr.json"]
        assert links and all(f.stat().st_nlink == 2 for f in links)
    else:
        assert not run.finished
        with pytest.raises(gpuckpt.CheckpointNotFoundError):
            gpuckpt.read_metadata(nxt)
    assert all(name.startswith(".") for name in temporaries(root))
    gpuckpt.save(chain_state(SEED, 1), nxt, base=root / "good", overwrite=True, chunk_bytes=16 * 1024)
    assert_step(nxt, 1)
    assert_step(root / "good", 0)
    assert temporaries(root) == []


def check_manager(root: Path, run: ChildRun) -> None:
    committed = run.committed()
    mgr = CheckpointManager(root / "mgr", max_to_keep=2, async_save=False, incremental=True, sync="none")
    assert temporaries(root / "mgr") == []
    steps = mgr.all_steps()
    if committed:
        assert steps and steps[-1] >= committed, (steps, committed)
    for step in steps:
        assert_step(mgr.step_path(step), step)
    nxt = (steps[-1] if steps else 0) + 1
    mgr.save(nxt, chain_state(SEED, nxt))
    assert_step(mgr.step_path(nxt), nxt)


KILL_POINTS = [
    ("reuse:1", "writing-chunks"),
    ("reuse:40", "writing-chunks"),
    ("mid-file:2", "writing-chunks"),
    ("root-write:1", "root-and-durability"),
    ("publish:1", "renaming"),
    ("published:1", "after-rename"),
]


@pytest.mark.parametrize(("kill_at", "phase"), KILL_POINTS, ids=[k for k, _ in KILL_POINTS])
def test_sigkill_incremental_save_at_each_phase(tmp_path: Path, kill_at: str, phase: str) -> None:
    root = tmp_path / "root"
    run = run_child(root, SEED, "incremental", kill_at=kill_at)
    recent = {phase_of(run.trace[: len(run.trace) - k]) for k in range(min(4, len(run.trace)))}
    assert run.killed and phase in recent, (run.trace[-5:], run.lines)
    check_incremental(root, run)


@pytest.mark.parametrize("trial", range(STRESS_TRIALS))
def test_sigkill_incremental_save_at_random_moment(tmp_path: Path, trial: int) -> None:
    delay = random.Random(f"incremental-{trial}").uniform(0.0, 0.3)
    root = tmp_path / "root"
    run = run_child(root, SEED, "incremental", delay=delay, scenario="incremental")
    check_incremental(root, run)


MANAGER_KILL_POINTS = ["reuse:30", "publish:2", "published:3", "retention:1", "retention:2"]


@pytest.mark.parametrize("kill_at", MANAGER_KILL_POINTS)
def test_sigkill_incremental_manager_keeps_every_committed_step(tmp_path: Path, kill_at: str) -> None:
    root = tmp_path / "root"
    run = run_child(root, SEED, "incremental-manager", kill_at=kill_at)
    assert run.killed, run.lines
    check_manager(root, run)


@pytest.mark.parametrize("trial", range(STRESS_TRIALS))
def test_sigkill_incremental_manager_at_random_moment(tmp_path: Path, trial: int) -> None:
    delay = random.Random(f"incremental-manager-{trial}").uniform(0.05, 1.0)
    root = tmp_path / "root"
    run = run_child(root, SEED, "incremental-manager", delay=delay, scenario="incremental-manager")
    check_manager(root, run)
    assert os.path.isdir(root / "mgr")
