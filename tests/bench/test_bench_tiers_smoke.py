"""bench/bench_tiers.py runs end to end at toy size under mpiexec, and as a gloo group of torch.distributed
(figures are not checked: a smoke test)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.compare.common import find_mpiexec

REPO = Path(__file__).resolve().parents[2]
FIGURES = {"save", "write", "replicate", "restore", "root", "peer", "loop"}


MPIEXEC = find_mpiexec()
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None


_NO_MPI = pytest.mark.skipif(
    MPIEXEC is None or not HAVE_MPI4PY,
    reason="bench_tiers runs 4 ranks under mpiexec: it needs mpiexec and mpi4py (`pip install mpich mpi4py`); "
    f"found mpiexec={MPIEXEC!r}, mpi4py={'yes' if HAVE_MPI4PY else 'no'}",
)


@pytest.mark.parametrize(
    ("transport", "layout"),
    [
        pytest.param("mpi", "mixed", marks=_NO_MPI),
        pytest.param("mpi", "gpt", marks=_NO_MPI),
        pytest.param("gloo", "mixed", marks=pytest.mark.torch),
    ],
)
def test_bench_tiers_toy_run(tmp_path: Path, transport: str, layout: str) -> None:
    if transport == "gloo":
        pytest.importorskip("torch.distributed")
    out = tmp_path / "r.json"
    local = tmp_path / "local"
    local.mkdir()
    cmd = [sys.executable, str(REPO / "bench" / "bench_tiers.py"), "--quick", "--json", str(out)]
    cmd += ["--dir", str(tmp_path), "--local", str(local), "--transport", transport, "--layout", layout]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert (res["layout"], res["tensors_per_rank"]) == (layout, {"mixed": 18, "gpt": 289}[layout])
    assert f"in {res['tensors_per_rank']} tensors per rank ({layout})" in p.stdout
    # figure 7 as the issue words it needs steps that ran beside a drain: a toy run may have none
    assert FIGURES <= set(res["figures"]) <= FIGURES | {"loop_draining"}, set(res["figures"])
    for key, f in res["figures"].items():
        assert f["measured"] > 0 and f["ceiling"] > 0 and f["ratio"] > 0, (key, f)
        assert f["ceiling_what"] and f["target"] and f["met"] in ("yes", "NO"), (key, f)
    assert res["extras"]["every restore bit-exact"] is True
    # figure 1 takes the steps that measure it alone too; the other figures only the full rounds
    save = res["figures"]["save"]
    assert res["save_rounds"] == 1 and len(save["times_s"]) == len(save["ceiling_times_s"]) == 2
    assert len(res["figures"]["write"]["times_s"]) == 1
    assert save["slowest_rank"]["ratio"] > 0 and "1: the step's slowest rank (2 steps)" in p.stdout
    assert "and 1 of figure 1 alone" in p.stdout
    assert (
        all(r["copy_apart_s"] > 0 for r in save["per_rank"]) and "started after the barrier alone" in p.stdout
    )
    bounds = [v for k, v in res["extras"].items() if "bound here" in k or "if a tier restore took" in k]
    assert len(bounds) == 2 and all(v > 0 for v in bounds), res["extras"]
    # figure 4's ceiling is the faster of two plain reads, both shown
    reads = [v for k, v in res["extras"].items() if k.startswith("4: the plain read")]
    assert len(reads) == 2 and all(v > 0 for v in reads), res["extras"]
    assert res["figures"]["restore"]["ceiling_what"] == "faster plain read, same files"
    assert res["extras"]["replaced node's parts came from"] == {
        "0": ["local", None],
        "1": ["local", None],
        "2": ["peer", 0],
        "3": ["peer", 1],
    }
    for field in ("cpus", "cpu_model", "memory_gib", "kernel"):
        assert res["machine"][field], field
    assert res["machine"].get("git_commit") or not (REPO / ".git").exists()
    assert res["date"].endswith("UTC") and "local_is_tmpfs" in res and res["transport"] == transport
    # everything the run wrote was removed
    assert not any(q.name.startswith("gpuckpt-bench-tiers-") for q in [*tmp_path.iterdir(), *local.iterdir()])


@_NO_MPI
def test_bench_tier_gate_toy_run(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    cmd = [str(MPIEXEC), "-n", "4", sys.executable, str(REPO / "bench" / "bench_tier_gate.py")]
    cmd += ["--mib", "1", "--pairs", "2", "--warmup", "1", "--op-settle", "0", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["per_rank_median"]) == {"0", "1", "2", "3"}
    for arm in ("on", "off"):
        assert len(res["worst_rank_per_step"][arm]) == 2 and res["worst_rank_median"][arm] > 0
    assert "worst rank per step, median: gate on" in p.stdout
