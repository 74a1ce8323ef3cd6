"""bench/bench_tier_many.py runs end to end at toy size (figures are not checked: a smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_tier_many_toy_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_tier_many.py"), "--rounds", "1", "--warmup", "1"]
    cmd += ["--many", "40", "--gpt-mib", "2", "--settle", "0", "--dir", str(tmp_path), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [(r["state"], r["tensors"]) for r in res["results"]] == [("gpt", 289), ("many", 40)]
    for r in res["results"]:
        assert r["restore_bit_exact"]
        assert r["root_steps"] == []  # a write timed is the tier's part alone, no drain to the root
        assert all(
            r["median_s"][k] > 0
            for k in (
                "save",
                "copy",
                "copy_own",
                "write",
                "plain_write",
                "restore",
                "plain_read",
                "mapped_read",
            )
        )
        # the restore's ceiling: the faster of the two plain reads, round by round
        assert r["median_s"]["faster_read"] <= max(r["median_s"]["plain_read"], r["median_s"]["mapped_read"])
        assert r["restore_ratio"] == r["median_s"]["faster_read"] / r["median_s"]["restore"]
    assert not any(q.name.startswith("gpuckpt-tier-many-") for q in tmp_path.iterdir())
