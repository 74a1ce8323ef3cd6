"""bench/bench_incremental.py runs end to end at toy size (figures are not checked: a smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_incremental_toy_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_incremental.py"), "--quick", "--rounds", "1"]
    cmd += ["--steps", "3", "--settle", "0", "--dir", str(tmp_path), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    lora = res["lora"]
    # the incremental save wrote the changed files only; the full save all of them
    assert lora["incremental bytes"] == lora["changed bytes"] < lora["full bytes"]
    assert lora["incremental / full time"] > 0 and res["all-changed"]["with / without base time"] > 0
    steps = res["chain"]["steps"]
    assert len(steps) == 3 and steps[0]["incremental bytes"] == steps[0]["full bytes"]
    # the same files changed every step (the root document's length varies with its numbers)
    assert all(abs(s["incremental bytes"] - lora["changed bytes"]) < 1000 for s in steps[1:])
    assert not any(q.name.startswith("gpuckpt-bench-incr-") for q in tmp_path.iterdir())
