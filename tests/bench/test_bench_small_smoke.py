"""bench/bench_small.py runs end to end at toy size (figures are not checked: a smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_small_toy_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_small.py"), "--rounds", "1", "--small", "30"]
    cmd += ["--first-runs", "1", "--settle", "0", "--dir", str(tmp_path), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [r["label"] for r in res["runs"]] == ["tiny", "small"]
    for run in res["runs"]:
        assert run["files"] == 2 * run["tensors"] + 1 and run["directories"] == run["tensors"] + 1
        assert {"save / floor save", "warm load / floor warm load", "save / floor-fsync save"} <= set(
            run["ratios"]
        )
        assert all(v > 0 for v in run["ratios"].values())
    assert res["first_calls"]["first save s"] > 0 and res["first_calls"]["first load s"] > 0
    # every output was removed, including the ones set aside
    assert not any(q.name.startswith("gpuckpt-bench-small-") for q in tmp_path.iterdir())
