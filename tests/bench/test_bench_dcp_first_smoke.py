"""bench/bench_dcp_first.py runs end to end at toy size (figures are not checked: a smoke test).

The run needs torch (``torch`` marker: the torch suite's interpreter runs it); the
checks of its arguments do not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "bench" / "bench_dcp_first.py")


@pytest.mark.torch
def test_toy_run_of_every_system_with_one_and_two_ranks(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "r.json"
    cmd = [sys.executable, SCRIPT, "--quick", "--cases", "gpt:1,adam:2", "--dir", str(tmp_path)]
    cmd += ["--json", str(out), "--md", str(tmp_path / "r.md")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    cases = {c["case"]: c for c in res["cases"]}
    assert set(cases) == {"gpt, 1 rank", "adam, 2 ranks"}
    assert set(cases["gpt, 1 rank"]["systems"]) == {
        "save-gpuckpt",
        "save-fs",
        "load-gpuckpt",
        "load-fs",
        "load-native",
        "read-plain",
    }
    # one process per rank: the single-process systems are measured with one rank only
    assert set(cases["adam, 2 ranks"]["systems"]) == {"save-gpuckpt", "save-fs", "load-gpuckpt", "load-fs"}
    assert set(cases["gpt, 1 rank"]["ratios"]) == {"save", "load", "native"}
    assert set(cases["adam, 2 ranks"]["ratios"]) == {"save", "load"}
    for rec in res["records"]:
        assert len(rec["calls"]) == 1 and rec["calls"][0]["seconds"] > 0, rec
        if rec["system"].startswith("load-"):
            assert rec["verified"] is True, rec  # the loaded tensors are the state's
        if rec["system"].startswith("save-"):
            assert rec["files"] >= 1 and rec["disk_bytes"] > 0, rec
    adam_saves = [r for r in res["records"] if r["case"] == "adam, 2 ranks" and r["op"].startswith("save")]
    assert adam_saves and all(r["world"] == 2 for r in adam_saves)
    report = (tmp_path / "r.md").read_text()
    assert "first dcp.save <= 1.2x FileSystemWriter's" in report and "first dcp.load <= 0.5x" in report
    # every output was removed, including the reference checkpoints and what was set aside
    assert not any(q.name.startswith("gpuckpt-bench-dcp-first-") for q in tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cases", "gpt:0"], "expected STATE:RANKS"),
        (["--cases", "llama:1"], "expected STATE:RANKS"),
        (["--ops", "save-gpuckpt,copy"], "unknown --ops ['copy']"),
        (["--variant", "old"], "expected LABEL=PATH"),
        (["--variant", "old=/nonexistent"], "/nonexistent/gpuckpt is not a directory"),
        (["--variant", "crc=;GPUCKPT_CRC32C"], "expected LABEL=PATH"),
        (["--rounds", "0"], "--rounds and --calls >= 1"),
        (["--variants-only"], "--variants-only needs at least one --variant"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    tmp_path: Path, args: list[str], message: str
) -> None:
    p = subprocess.run(
        [sys.executable, SCRIPT, *args, "--dir", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.torch
def test_a_variant_runs_beside_the_checkout_with_its_environment(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "r.json"
    cmd = [sys.executable, SCRIPT, "--quick", "--cases", "gpt:1", "--ops", "load-native,read-plain"]
    cmd += ["--variant", f"same={REPO};GPUCKPT_CRCCOPY=off", "--dir", str(tmp_path), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    (case,) = res["cases"]
    assert set(case["systems"]) == {"load-native", "load-native@same", "read-plain"}
    assert set(case["ratios"]) == {"native", "native@same"}
    versions = res["versions"]
    assert "copy-with-CRC: none" in versions["load-native@same"], versions  # its environment applied
