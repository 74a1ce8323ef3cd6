"""bench/bench_s3.py runs end to end at toy size (figures are not checked: a smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto.server")

REPO = Path(__file__).resolve().parents[2]


def test_bench_s3_toy_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "bench_s3.py"),
        "--size",
        "6",
        "--rounds",
        "1",
        "--ranks",
        "0",
    ]
    cmd += ["--sweep", "1,4", "--manager-steps", "2,20", "--manager-saves", "2", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    single = res["single process"]
    assert single["save / raw put"] > 0 and single["load / raw get"] > 0
    small, large = res["requests"]
    # smaller chunks: more objects, so more puts and gets
    assert small["save"]["put"] > large["save"]["put"] and small["load"]["get"] > large["load"]["get"]
    few, many = res["manager"]["runs"]
    assert (few["steps kept"], many["steps kept"]) == (2, 20)
    assert few["save requests"] == many["save requests"]  # a save's requests do not grow with the steps kept
