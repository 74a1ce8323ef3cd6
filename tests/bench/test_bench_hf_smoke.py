"""bench/bench_hf.py runs end to end at toy size (figures are not checked: a smoke test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_hf_toy_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "bench_hf.py"),
        *("--mib", "4", "--rounds", "1", "--op-settle", "0", "--shard-size", "1MB"),
        *("--dir", str(tmp_path / "work"), "--json", str(out)),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [
        line for line in p.stdout.splitlines() if line.startswith("| export") or line.startswith("| import")
    ]
    assert len(rows) == 6 and all(">= 0.8" in r for r in rows), p.stdout
    records = json.loads(out.read_text())["records"]
    assert {(r["mode"], r["op"]) for r in records} == {
        (m, o) for m in ("warm", "cold") for o in ("export single", "export dist", "import")
    }
    assert all(r["op_s"] > 0 and r["copy_s"] > 0 for r in records)
    assert not [p for p in (tmp_path / "work").iterdir()]  # its working files are removed
