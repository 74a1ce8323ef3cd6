"""Shared knobs and helpers of the reliability suite.

``GPUCKPT_STRESS_TRIALS`` (default 3) sets the number of random trials per
scenario: crash kills at random moments, damage trials per file kind, fuzz
examples (x20). CI keeps the default; a stress run uses 50 or more. The
phases at which crash trials were killed are tallied and printed at the end
of the run (and written as JSON to ``GPUCKPT_PHASE_LOG`` if set).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuckpt.testing.crash import phase_of

STRESS_TRIALS = int(os.environ.get("GPUCKPT_STRESS_TRIALS", "3"))

PHASE_TALLY: dict[str, Counter[str]] = {}


@dataclass
class ChildRun:
    """What a killed (or finished) crash child left: its output lines, trace and phase."""

    lines: list[str]
    trace: list[str] = field(default_factory=list)
    killed: bool = False
    elapsed: float = 0.0  # seconds from "start" to the end of the child

    @property
    def finished(self) -> bool:
        return "done" in self.lines

    @property
    def phase(self) -> str:
        return "returned" if self.finished else phase_of(self.trace)

    def committed(self) -> int:
        """Highest step the manager child reported as committed (0: none)."""
        steps = [int(x.split()[1]) for x in self.lines if x.startswith("committed ")]
        return max(steps, default=0)


def run_child(
    root: Path,
    seed: int,
    mode: str,
    *,
    delay: float | None = None,
    kill_at: str | None = None,
    scenario: str | None = None,
) -> ChildRun:
    """Run ``gpuckpt.testing.crash`` and SIGKILL it ``delay`` s after ``start`` or at ``kill_at``."""
    trace = root.parent / f"{root.name}.trace"
    env = {**os.environ, "GPUCKPT_TEST_TRACE": str(trace)}
    if kill_at:
        env["GPUCKPT_TEST_KILL_AT"] = kill_at
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuckpt.testing.crash", str(root), str(seed), mode],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    lines = []
    elapsed = 0.0
    try:
        for expected in ("good", "start"):
            line = proc.stdout.readline().strip()
            lines.append(line)
            if line != expected:
                break
        t_start = time.perf_counter()
        if delay is not None:
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        lines += [x.strip() for x in proc.stdout.read().splitlines() if x.strip()]
        proc.wait(timeout=120)
        elapsed = time.perf_counter() - t_start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    joined = lines
    events = trace.read_text().split() if trace.exists() else []
    run = ChildRun(joined, events, killed=proc.returncode == -signal.SIGKILL, elapsed=elapsed)
    if kill_at is None and delay is not None:
        PHASE_TALLY.setdefault(scenario or mode, Counter())[run.phase] += 1
    if kill_at is not None and not run.killed and mode != "manager":
        raise AssertionError(f"the child was to be killed at {kill_at} but exited: {joined}")
    return run


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not PHASE_TALLY:
        return
    terminalreporter.section("crash phases (random-moment kills)")
    for scenario, tally in sorted(PHASE_TALLY.items()):
        terminalreporter.write_line(f"{scenario}: {dict(sorted(tally.items()))}")
    out = os.environ.get("GPUCKPT_PHASE_LOG")
    if out:
        Path(out).write_text(json.dumps({k: dict(v) for k, v in PHASE_TALLY.items()}, indent=1))
