"""bench/bench_coop_load.py runs end to end at toy size under mpiexec (the time is not checked: a smoke
test; the bytes are: each chunk read once by the job, from S3 and from a local directory)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.compare.common import find_mpiexec

REPO = Path(__file__).resolve().parents[2]
MPIEXEC = find_mpiexec()
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None


@pytest.mark.skipif(
    MPIEXEC is None or not HAVE_MPI4PY,
    reason="bench_coop_load runs 4 ranks under mpiexec: it needs mpiexec and mpi4py (`pip install mpich "
    f"mpi4py`); found mpiexec={MPIEXEC!r}, mpi4py={'yes' if HAVE_MPI4PY else 'no'}",
)
def test_bench_coop_load_toy_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_coop_load.py"), "--quick", "--json", str(out)]
    p = subprocess.run([*cmd, "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["figures"]) == {"s3_bytes", "local_bytes", "time"}
    for key, f in res["figures"].items():
        assert f["measured"] > 0 and f["ceiling"] > 0 and f["ratio"] > 0, (key, f)
        assert f["ceiling_what"] and f["target"] and f["met"] in ("yes", "NO"), (key, f)
    # bytes are exact whatever the machine's load: each stored chunk read once by the job
    assert res["figures"]["s3_bytes"]["ratio"] == 1.0 and res["figures"]["local_bytes"]["ratio"] == 1.0
    assert res["extras"]["local bytes with cooperative=False / needed"] == 4.0
    assert res["extras"]["every load bit-exact"] is True
    assert res["machine"]["cpus"] and res["date"].endswith("UTC")
    assert not any(q.name.startswith("gpuckpt-bench-coop-") for q in tmp_path.iterdir())
