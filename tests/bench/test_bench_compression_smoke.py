"""bench/bench_compression.py runs end to end at toy size (figures are not checked: a smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("obstore")
pytest.importorskip("moto.server")

REPO = Path(__file__).resolve().parents[2]


def test_bench_compression_toy_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_compression.py"), "--quick", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ratios"]["zstd"]["weight"] > 1.2 and 0.99 < res["ratios"]["zstd"]["random"] <= 1.0
    assert res["codec"]["compress_gbps"] > 0 and res["s3"]["stored_ratio"] > 1.1
    assert {r["figure"] for r in res["targets"]} and all("met" in r for r in res["targets"])
