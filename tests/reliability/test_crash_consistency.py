"""SIGKILL during sync saves, async saves and manager saves: the last committed checkpoint survives.

Each trial runs :mod:`gpuckpt.testing.crash` in a child process and kills it
either at a deterministic trace event (so every phase is covered: before any
file, mid-file, during fsync, writing the root, making it durable, renaming,
after the rename, during retention) or at a random moment of the save (the
phase it landed in is tallied and printed at the end of the run).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.manager import CheckpointManager
from gpuckpt.testing.crash import make_state, phase_of
from gpuckpt.testing.faults import temporaries

from .conftest import STRESS_TRIALS, ChildRun, run_child

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

SEED = 4200


def assert_bit_exact(path: Path, seed: int) -> None:
    want = make_state(seed)
    got = gpuckpt.load_state_dict(path)
    assert got["seed"] == seed, f"{path} holds the state of seed {got['seed']}, expected {seed}"
    assert sorted(got["model"]) == sorted(want["model"])
    for k, v in want["model"].items():
        assert got["model"][k].tobytes() == v.tobytes(), f"{path}: tensor {k} differs"


def check_after_kill(root: Path, mode: str, run: ChildRun) -> None:
    """The invariants every kill must leave true, then a save to the same place must work."""
    if mode == "manager":
        check_manager_after_kill(root, run)
        return
    if mode == "overwrite":
        got = gpuckpt.read_metadata(root / "good")  # always a committed checkpoint
        seed = gpuckpt.load_state_dict(root / "good", keys=["seed"])["seed"]
        assert seed in (SEED, SEED + 1)
        if run.finished:
            assert seed == SEED + 1
        assert_bit_exact(root / "good", seed)
        assert got.storage_meta is not None
    else:
        assert_bit_exact(root / "good", SEED)  # the earlier checkpoint is intact
        nxt = root / "next"
        if nxt.exists():
            # published means complete; for async: the snapshot, not the scribbled arrays
            assert_bit_exact(nxt, SEED + 1)
        else:
            assert not run.finished
            # an unfinished save is never visible under its name
            with pytest.raises(gpuckpt.CheckpointNotFoundError):
                gpuckpt.read_metadata(nxt)
            with pytest.raises(gpuckpt.CheckpointNotFoundError):
                gpuckpt.load_state_dict(nxt)
    assert all(name.startswith(".") for name in temporaries(root))
    # the next save to the same path cleans up what the killed one left behind
    target = root / ("good" if mode == "overwrite" else "next")
    gpuckpt.save({"x": np.ones(1)}, target, overwrite=True)
    assert temporaries(root) == []


def check_manager_after_kill(root: Path, run: ChildRun) -> None:
    committed = run.committed()
    mgr = CheckpointManager(root / "mgr", max_to_keep=2, async_save=False, sync="none")
    # a new manager removes what the dead one left half done
    assert temporaries(root / "mgr") == []
    steps = mgr.all_steps()
    latest = mgr.latest_step()
    if committed:
        # retention never deleted the last committed step, and nothing older came back as latest
        assert latest is not None and latest >= committed, (steps, committed)
    for step in steps:  # every listed step is complete
        assert_bit_exact(mgr.step_path(step), SEED + step)
    if latest is not None:
        assert mgr.restore_state_dict()["seed"] == SEED + latest
    # and the manager carries on
    nxt = (latest or 0) + 1
    mgr.save(nxt, make_state(SEED + nxt))
    assert mgr.latest_step() == nxt


# deterministic kill points: (event:N, the phase it belongs to) --------------------------

KILL_POINTS = [
    ("begin:1", "before-files"),
    ("chunk:1", "writing-chunks"),
    ("mid-file:40", "writing-chunks"),
    ("fsync:10", "fsync"),
    ("root-write:1", "root-and-durability"),
    ("durable:1", "root-and-durability"),
    ("publish:1", "renaming"),
    ("published:1", "after-rename"),
]
MANAGER_KILL_POINTS = [
    ("mid-file:100", "writing-chunks"),
    ("publish:2", "renaming"),
    ("published:2", "after-rename"),
    ("retention:1", "after-rename"),
]


@pytest.mark.parametrize("mode", ["new", "overwrite", "async"])
@pytest.mark.parametrize(("kill_at", "phase"), KILL_POINTS, ids=[k for k, _ in KILL_POINTS])
def test_sigkill_at_each_phase_keeps_last_committed_checkpoint(
    tmp_path: Path, mode: str, kill_at: str, phase: str
) -> None:
    root = tmp_path / "root"
    run = run_child(root, SEED, mode, kill_at=kill_at)
    # other I/O threads may log an event or two between the kill point and the
    # signal's delivery: the kill phase is among the last few events' phases
    recent = {phase_of(run.trace[: len(run.trace) - k]) for k in range(min(4, len(run.trace)))}
    assert run.killed and phase in recent, (run.trace[-5:], run.lines)
    check_after_kill(root, mode, run)


@pytest.mark.parametrize(("kill_at", "phase"), MANAGER_KILL_POINTS, ids=[k for k, _ in MANAGER_KILL_POINTS])
def test_sigkill_manager_at_each_phase_keeps_latest_step(tmp_path: Path, kill_at: str, phase: str) -> None:
    root = tmp_path / "root"
    run = run_child(root, SEED, "manager", kill_at=kill_at)
    recent = {phase_of(run.trace[: len(run.trace) - k]) for k in range(min(4, len(run.trace)))}
    assert run.killed and phase in recent, (run.trace[-5:], run.lines)
    check_after_kill(root, "manager", run)


_DURATION: dict[str, float] = {}


def save_duration(tmp_path_factory: pytest.TempPathFactory, mode: str) -> float:
    """Seconds from ``start`` to ``done`` of an uninterrupted child (the manager: ~4 steps)."""
    if mode not in _DURATION:
        root = tmp_path_factory.mktemp(f"calibrate-{mode}") / "root"
        # the manager: the time to the 5th save; the others: one whole save
        run = run_child(root, SEED, mode, kill_at="begin:5" if mode == "manager" else None)
        assert mode == "manager" or run.finished, run.lines
        _DURATION[mode] = max(0.05, run.elapsed)
    return _DURATION[mode]


@pytest.mark.parametrize("mode", ["new", "overwrite", "async", "manager"])
@pytest.mark.parametrize("trial", range(STRESS_TRIALS))
def test_sigkill_at_random_moment_keeps_last_committed_checkpoint(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, mode: str, trial: int
) -> None:
    span = save_duration(tmp_path_factory, mode)
    delay = random.Random(f"{mode}-{trial}").uniform(0.0, span)
    root = tmp_path / "root"
    run = run_child(root, SEED, mode, delay=delay, scenario=mode)
    check_after_kill(root, mode, run)
