"""bench/bench_planning.py runs end to end at toy size (figures are not checked: a smoke test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_planning_toy_run() -> None:
    cmd = [sys.executable, str(REPO / "bench" / "bench_planning.py"), "--ranks", "8", "--tensors", "6"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([*cmd, "--irregular"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line for line in p.stdout.splitlines() if re.match(r"(regular|irregular) ", line)]
    assert [r.split()[0] for r in rows] == ["regular"] * 4 + ["irregular"]
    for row in rows:
        assert "cached" in row and "load" in row and "root" in row and "of target" in row
    assert "doubling the ranks multiplied the save time by" in p.stdout
