"""Smoke test of the comparison harness (bench/compare) at toy size.

Runs ``python -m bench.compare --quick`` with the systems this environment
has: gpuckpt, the raw baselines, dd and TensorStore in the project's
interpreter; the PyTorch peers only where their environment exists (they
are skipped, with the harness's reason, where it does not).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MAIN_SYSTEMS = "dd,raw-files,raw-single,gpuckpt,gpuckpt-async,tensorstore"
PEER_SYSTEMS = "torch-save,dcp-t2,dcp-async,dcp-gpuckpt,dcp-gpuckpt-async"


def run_harness(tmp_path: Path, systems: str, states: str) -> dict[str, Any]:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench.compare", "--quick", "--systems", systems, "--states", states]
    cmd += ["--async-states", states, "--out", str(out), "--md", str(tmp_path / "r.md")]
    cmd += ["--plot", str(tmp_path / "p.png"), "--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / "compare-quick.json").read_text())
    result["stderr"] = p.stderr
    return result


def check_records(result: dict[str, Any], systems: str, states: str) -> None:
    records = result["records"]
    errors = [r for r in records if "error" in r]
    assert not errors, errors
    ran = {s for s in systems.split(",") if s not in result["meta"]["skipped"]}
    seen = {r["system"] for r in records}
    for s in ran - {"dd", "gpuckpt-async", "dcp-async", "dcp-gpuckpt-async"}:
        assert s in seen, f"no record for {s}"
        for st in states.split(","):
            ops = {r["op"] for r in records if r["system"] == s and r["state"] == st}
            assert ops == {"save", "load_warm", "load_cold"}, (s, st, ops)
    for r in records:
        assert r["bytes"] > 0 and r["seconds"] > 0, r
        if r["op"] == "save" and not r["system"].startswith("dd"):
            assert r["files"] >= 1 and r["disk_bytes"] > 0, r
        if r["op"].startswith("load") and not r["system"].startswith("dd"):
            assert r["verified"] is True, r  # loaded bytes match the source's checksum
        if r["op"] == "load_cold" and not r["system"].startswith("dd"):
            assert r["resident_before"] < 0.5, r  # the cache really was dropped
        if r["op"] == "async":
            assert 0 < r["blocking_s"] <= r["seconds"], r
            assert r["copy_ref_s"] > 0 and r["copy_ref_before_s"] > 0, r  # same position, and before
            assert r["sync_after_s"] > 0 and r["sync_before_s"] > 0, r  # references on both sides
            assert r["durable_over_sync"] == r["seconds"] / ((r["sync_before_s"] + r["sync_after_s"]) / 2), r
            assert r["durable_over_sync_after"] == r["seconds"] / r["sync_after_s"], r


def test_harness_main_systems(tmp_path: Path) -> None:
    if importlib.util.find_spec("tensorstore") is None:
        systems = MAIN_SYSTEMS.replace(",tensorstore", "")
    else:
        systems = MAIN_SYSTEMS
    states = "gpt,small"  # the report's targets and plot are of gpt; gpt-adam is gpt with more tensors
    result = run_harness(tmp_path, systems, states)
    check_records(result, systems, states)
    assert {r["system"] for r in result["records"]} >= {"dd-direct", "dd-fdatasync", "gpuckpt-async"}
    report = (tmp_path / "r.md").read_text()
    assert "## Targets" in report and "| gpuckpt |" in report
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "p.png").stat().st_size > 0


def test_harness_peers(tmp_path: Path) -> None:
    result = run_harness(tmp_path, PEER_SYSTEMS, "gpt")
    skipped = result["meta"]["skipped"]
    if set(PEER_SYSTEMS.split(",")) <= set(skipped):
        pytest.skip("; ".join(sorted(set(skipped.values()))))
    check_records(result, PEER_SYSTEMS, "gpt")
    assert {"dcp-async-default", "dcp-async-cached", "dcp-async-bgstage"} <= {
        r["system"] for r in result["records"]
    }
    if "dcp-gpuckpt-async" not in skipped:
        assert "dcp-gpuckpt-async" in {r["system"] for r in result["records"]}
    if "dcp-gpuckpt" not in skipped:
        # its libraries are loaded before timing as the native adapter's are: the CRC32C backend
        # (whose code pages would otherwise count as memory of its first save)
        versions = {r["version"] for r in result["records"] if r["system"] == "dcp-gpuckpt"}
        assert versions and all("CRC32C: " in v and "copy-with-CRC: " in v for v in versions), versions


def run_runner(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "bench.compare.runner", "raw-single", "--state", "tiny", "--quick"]
    cmd += ["--dir", str(tmp_path), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_runner_settles_before_every_timed_operation(tmp_path: Path) -> None:
    # every measurement process waits the same time, idle, before each timed operation (memory
    # freed before it then is in the same state whatever the system's start-up time), and says so
    p = run_runner(tmp_path, "--ops", "save,load_warm", "--settle-op", "0.05")
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(line[9:]) for line in p.stdout.splitlines() if line.startswith("@@RESULT ")]
    assert [r["op"] for r in recs] == ["save", "load_warm"]
    assert all(r["settle_s"] == 0.05 and "error" not in r for r in recs), recs
    # the process's CPU time over the timed region, beside the wall time (a shared machine)
    assert all(r["cpu_user_s"] >= 0 and r["cpu_sys_s"] >= 0 for r in recs), recs
    assert any(r["cpu_user_s"] + r["cpu_sys_s"] > 0 for r in recs), recs
    bad = run_runner(tmp_path, "--ops", "save", "--settle-op", "-1")
    assert bad.returncode != 0 and "--settle-op must be >= 0 seconds, got -1.0" in bad.stderr


def test_harness_passes_its_settle_to_every_process(tmp_path: Path) -> None:
    result = run_harness(tmp_path, "raw-single", "tiny")
    assert result["meta"]["settle_op_s"] == 0.0  # --quick: no wait
    assert result["records"] and all(r["settle_s"] == 0.0 for r in result["records"]), result["records"]
    assert "each process waited 0 s, idle" in (tmp_path / "r.md").read_text()


def test_every_system_follows_every_other_equally_often() -> None:
    # what a process leaves behind changes the next one's save: over a full period of rounds
    # each system runs right after each other one equally often (a fixed order, or a rotation,
    # always puts gpuckpt after raw-single)
    import itertools
    from collections import Counter

    from bench.compare.driver import SYSTEMS, round_order

    for n in (2, 3, 4, 5, 6):
        systems = SYSTEMS[:n]
        period = n if n % 2 == 0 else 2 * n
        orders = [round_order(systems, r) for r in range(period)]
        assert all(sorted(s.name for s in o) == sorted(s.name for s in systems) for o in orders)
        pairs = Counter((a.name, b.name) for o in orders for a, b in itertools.pairwise(o))
        assert set(pairs.values()) == {period // n}, (n, pairs)
        assert len(pairs) == n * (n - 1), (n, pairs)
        assert [s.name for s in round_order(systems, period)] == [s.name for s in orders[0]]
    assert round_order([], 3) == [] and [s.name for s in round_order(SYSTEMS[:1], 5)] == [SYSTEMS[0].name]
