"""A save killed with SIGKILL at a random moment never damages or fakes a checkpoint."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.testing.crash import make_state

TRIALS = int(os.environ.get("GPUCKPT_CRASH_TRIALS", "4"))


def assert_state(path: Path, seed: int) -> None:
    want = make_state(seed)
    got = gpuckpt.load_state_dict(path)
    assert got["seed"] == seed
    for k, v in want["model"].items():
        assert got["model"][k].tobytes() == v.tobytes()


def run_and_kill(root: Path, seed: int, mode: str, delay: float) -> bool:
    """Start the child, kill it ``delay`` s into the second save; True if it finished first."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuckpt.testing.crash", str(root), str(seed), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "good"
    assert proc.stdout.readline().strip() == "start"
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    rest = proc.stdout.read()
    proc.wait()
    return "done" in rest


@pytest.mark.parametrize("mode", ["new", "overwrite"])
@pytest.mark.parametrize("trial", range(TRIALS))
def test_sigkill_during_save(tmp_path: Path, mode: str, trial: int) -> None:
    seed = 1000 + trial
    delay = random.Random(trial * 7 + len(mode)).uniform(0.0, 0.25)
    finished = run_and_kill(tmp_path, seed, mode, delay)
    if mode == "new":
        assert_state(tmp_path / "good", seed)  # the earlier checkpoint is intact
        if (tmp_path / "next").exists():
            assert_state(tmp_path / "next", seed + 1)  # published means complete
        else:
            assert not finished
    else:
        # either the old or the new checkpoint, complete, never a mix
        got = gpuckpt.load_state_dict(tmp_path / "good")["seed"]
        assert got in (seed, seed + 1)
        assert_state(tmp_path / "good", got)
    # the next save to the same path cleans up what the killed one left behind
    gpuckpt.save({"x": np.ones(1)}, tmp_path / ("next" if mode == "new" else "good"), overwrite=True)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []
