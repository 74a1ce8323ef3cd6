"""The GPU check's CPU-side parts: the script's dry run, the summary writer
and the kernel table's rows.  Format tests on made-up numbers, never results:
the measurements need a GPU (bench/gpu_check.sh on one)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gpuckpt.device import kernels as K

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH = REPO_ROOT / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and the like look their module up
    spec.loader.exec_module(module)
    return module


summary_mod = _load("gpu_summary")
bench_kernels = _load("bench_kernels")

ROW_FIELDS = {"direction", "dtype", "shape", "box", "MiB", "GBps", "percent_of_copy", "speedup_vs_cupy"}


def _row(mib: float, percent: float, speedup: float, group: str = "main") -> dict:
    return {
        "direction": "to_contiguous",
        "dtype": "uint8",
        "shape": [8, 3, 64, 64],
        "box": None,
        "group": group,
        "path": "pixel",
        "bytes": int(mib * (1 << 20)),
        "GBps": percent * 10,
        "cupy_GBps": percent * 10 / speedup,
        "fraction_of_copy": percent / 100,
        "speedup_vs_cupy": speedup,
    }


def test_dry_run_writes_a_format_test_summary(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, COMMIT="f00dcafe")
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*-summary.json")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-summary\.json", path.name)
    summary = json.loads(path.read_text())
    # Marked as what it is, in the JSON and in the table.
    assert summary["kind"] == "format-test" and "not a measurement" in summary["note"]
    assert summary["device"] == "FORMAT TEST, NO GPU"
    assert summary["commit"] == "f00dcafe" and summary["date"] == path.name[:10]
    assert "FORMAT-TEST" in proc.stdout.splitlines()[0]
    # The table comes last: the targets line, then where the JSON went.
    tail = proc.stdout.strip().splitlines()[-3:]
    assert tail[0].startswith("targets: ") and tail[-1] == f"wrote {path}"
    # The benchmarks ran and said that there is nothing to measure here.
    assert "nothing to measure" in (tmp_path / "bench_kernels.txt").read_text()
    assert summary["steps"] == {"bench-kernels": "ok (dry run)", "bench-gpu": "ok (dry run)"}
    for row in summary["kernels"]["rows"]:
        assert set(row) >= ROW_FIELDS


def test_summary_fields_and_targets() -> None:
    kernels = {
        "device": "X",
        "copy_GBps": 4000.0,
        "rows": [
            _row(1, 5, 1.2),
            _row(16, 85, 3.0),
            _row(256, 81, 9.0),
            _row(64, 40, 2.0, group="odd"),  # fallbacks: reported, not in the 80% target
        ],
        "rows_skipped": [{"shape": [1, 3, 4, 4]}],
    }
    gpu = {
        "device": "X",
        "ceilings_GBps": {
            "d2h_pinned": 54.0,
            "h2d_pinned": 53.0,
            "d2d_read_plus_write": 3400.0,
            "disk_write_fsync": 1.0,
            "disk_read_warm": 20.0,
        },
        "gpuckpt": {
            "save_ratio_to_min_d2h_disk": 0.9,
            "load_ratio_to_min_h2d_warm_read": 0.79,
            "async_block_ratio_to_one_d2h": 1.1,
            "async_device_block_ratio_to_one_d2d": 1.21,
        },
    }
    s = summary_mod.build_summary(
        date="2026-12-01", commit="abc", kernels=kernels, gpu=gpu, steps={"gpu-tests": "ok"}
    )
    assert s["format"] == summary_mod.FORMAT and s["kind"] == "measurement"
    assert (s["date"], s["commit"], s["device"]) == ("2026-12-01", "abc", "X")
    # The D2D ceiling is the kernel table's own copy (same process, same run).
    assert s["ceilings_GBps"]["d2d_read_plus_write"] == 4000.0
    assert s["ceilings_GBps"]["d2h_pinned"] == 54.0 and s["ceilings_GBps"]["disk_read_cold"] is None
    rows = s["kernels"]["rows"]
    assert all(set(r) >= ROW_FIELDS for r in rows)
    assert [r["MiB"] for r in rows] == [1, 16, 256, 64]
    assert [r["percent_of_copy"] for r in rows] == pytest.approx([5, 85, 81, 40])
    assert rows[3]["missed"] == ["<80% of copy"] and s["kernels"]["rows_skipped"] == 1
    met = s["targets"]["met"]
    assert met["kernels_16MiB_at_80pct_of_copy"] is True  # the odd row does not count
    assert met["kernels_1MiB_not_slower_than_cupy"] is True
    assert (met["save"], met["load_warm"], met["load_cold"]) == (True, False, None)
    assert (met["async_save_host"], met["async_save_device"]) == (True, False)

    # One main row under 80% at 16 MiB, one 1 MiB row slower than CuPy.
    kernels["rows"] = [_row(16, 79.9, 3.0), _row(1, 50, 0.99)]
    met = summary_mod.build_summary(date="d", commit="c", kernels=kernels, gpu=None, steps={})["targets"][
        "met"
    ]
    assert met["kernels_16MiB_at_80pct_of_copy"] is False
    assert met["kernels_1MiB_not_slower_than_cupy"] is False
    assert met["save"] is None  # bench_gpu did not run: not measured, not met


def test_summary_without_any_bench_output(tmp_path: Path) -> None:
    # Both benchmarks failed: the summary still gets written, all null.
    out = tmp_path / "s.json"
    rc = summary_mod.main(
        [
            "--kernels",
            str(tmp_path / "missing.json"),
            "--gpu",
            str(tmp_path / "missing2.json"),
            "--step",
            "bench-kernels=FAILED(rc=1)",
            "--out",
            str(out),
            "--date",
            "2026-12-01",
        ]
    )
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["device"] == "unknown" and s["kernels"]["rows"] == []
    assert set(s["targets"]["met"].values()) == {None}
    assert s["steps"] == {"bench-kernels": "FAILED(rc=1)"}


def test_kernel_table_covers_the_target_matrix() -> None:
    itemsize = {"uint8": 1, "float16": 2, "float32": 4, "float64": 8}
    seen = set()
    for shape, dtype, box, group in bench_kernels.cases(quick=False):
        es = itemsize[dtype]
        offsets, sizes = K.normalize_box(box, shape)  # a valid box
        nbytes = math.prod(sizes) * es
        plane = math.prod(shape[2:])
        plan = K.plan_box_copy(shape, offsets, sizes, es)
        assert plan.path == K.choose_path(shape, sizes, es, offsets)
        if group == "main":  # C = 3, 4: pixel; C = 64, 256: micro-tiles
            assert plan.path == ("pixel" if shape[1] <= K.PIXEL_MAX_CHANNELS else "micro")
        if group == "main":
            # at least the size it stands for (the targets start at 1 and 16 MiB)
            mib = min((1, 16, 256), key=lambda m: abs(nbytes - m * (1 << 20)))
            assert mib * (1 << 20) <= nbytes <= 1.5 * mib * (1 << 20), (shape, dtype, nbytes)
            assert plane % 16 == 0, shape  # 16-byte units for every element size
            seen.add((shape[1], es, len(shape), mib))
        elif group == "odd":
            assert plane % 2 == 1, shape
    want = {
        (c, es, nd, mib)
        for c in (3, 4, 64, 256)
        for es in (1, 2, 4, 8)
        for nd in (4, 5)
        for mib in (1, 16, 256)
    }
    assert seen == want


def test_gpu_check_fits_its_time() -> None:
    # The steps' limits add up to well under 8 minutes (a GPU machine is lent
    # for about 15 in all, start included), and the kernel table's own budget
    # ends it before its step's limit.
    script = (BENCH / "gpu_check.sh").read_text()
    real = script.split('if [ "$DRY" = 1 ]; then', 1)[1].split("\nfi\n", 1)[1]
    limits = [int(n) for n in re.findall(r"\btimeout (\d+)", real)]
    assert len(limits) == 7 and sum(limits) <= 450, limits
    budget = re.search(r"bench_kernels\.py --out \"\$OUT\" --budget-s (\d+)", real)
    kernel_limit = re.search(r"step bench-kernels timeout (\d+)", real)
    assert budget and kernel_limit and int(budget.group(1)) + 30 <= int(kernel_limit.group(1))


def test_everything_the_gpu_check_runs_exists() -> None:
    """What the script runs on a lent GPU (where a mistake costs the session's device time):
    every module it runs with ``-m``, and every test file, script and folder it names, exists."""
    script = (REPO_ROOT / "bench" / "gpu_check.sh").read_text()
    modules = set(re.findall(r'"\$PY" -m (gpuckpt[\w.]*)', script))
    assert "gpuckpt.cli" in modules, modules
    for module in sorted(modules):
        assert importlib.util.find_spec(module) is not None, (
            f"gpu_check.sh runs -m {module}, which does not exist"
        )
    paths = set(re.findall(r"(?<![\w/$])((?:tests|bench)/[\w/.]+)", script))
    assert any(p.startswith("tests/") for p in paths) and any(p.startswith("bench/") for p in paths), paths
    missing = sorted(p for p in paths if not (REPO_ROOT / p).exists())
    assert not missing, f"gpu_check.sh names paths that do not exist: {missing}"


_TIER_FIGURES = """
import json, sys, types
import numpy as np
from pathlib import Path
# the one CuPy call the tier figures make beyond the arrays' own methods, on host arrays standing in
sys.modules["cupy"] = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(synchronize=lambda: None)))
from gpuckpt.cli.device_bench import _tier_figures
rng = np.random.default_rng(0)
state = {"layers": [{"w": rng.standard_normal(1 << 18).astype(np.float32)} for _ in range(3)]}
targets = {"layers": [{"w": np.empty(1 << 18, np.float32)} for _ in range(3)]}
print(json.dumps(_tier_figures(state, targets, Path(sys.argv[1]), 2, 10.0, 5.0)))
"""


def test_the_tier_figures_of_the_gpu_run_run_on_host_arrays(tmp_path: Path) -> None:
    """The GPU run's local-tier figures (gpuckpt.cli.device_bench._tier_figures), on host arrays
    in place of device arrays: saves, a restore checked bit-exact from the tier, nothing left."""
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-c", _TIER_FIGURES, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(proc.stdout)
    assert fig["tier_save_block_s"] > 0 and fig["tier_restore_GBps"] > 0
    state_bytes = 3 * (1 << 18) * 4
    assert fig["tier_save_block_ratio_to_one_d2h"] == pytest.approx(
        fig["tier_save_block_s"] / (state_bytes / 10e9)
    )
    assert list(tmp_path.iterdir()) == []
    assert not any(p.name.startswith("gpuckpt-gpubench-tier-") for p in Path(fig["tier_dir"]).iterdir())
