"""bench/bench_host.py runs end to end at toy size (figures are not checked: a smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_host_toy_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_host.py"), "--rounds", "1", "--layers", "1"]
    cmd += ["--small", "1200", "--settle", "0", "--dir", str(tmp_path), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    labels = [r["label"] for r in res["runs"]]
    assert labels == ["small-1200", "gpt-1L-float32"]  # the many-files state first
    for run in res["runs"]:
        assert set(run["systems"]) == {"raw-files", "raw-single", "gpuckpt"}
        for s in run["systems"].values():
            assert s["save"]["median_s"] > 0 and s["load"]["median_s"] > 0
    # every output was removed, including the ones set aside
    assert not any(p.name.startswith("gpuckpt-bench-") for p in tmp_path.iterdir())
