"""Host save/load throughput of gpuckpt against raw file I/O, interleaved in one run.

Raw baselines (the ceiling on this machine, measured in the same run):

* ``raw-files``: one file per tensor, plain ``os.write`` of the tensor's bytes, then ``fsync``
  of every file and of the directory; load with ``readinto`` into preallocated arrays.
* ``raw-single``: all tensors into one file, one ``fsync``; load with ``readinto``.

gpuckpt is measured durable (its default ``sync="auto"``): ``save`` of the state dict,
and ``load`` in place into preallocated arrays (page cache warm). Each round runs
A B C ... in turn; medians, min and max over rounds are reported, with ratios to the
best raw baseline. Absolute numbers on a shared machine mean little; ratios do.
Every save starts after an ``os.sync()``; the run starts on a settled file
system (``--settle``), measures the state with many small files first, and sets
outputs with many files aside until the end (``bench.compare.common.set_aside``),
so that no system pays for another's dirty data or deleted files.

Usage: ``python bench/bench_host.py [--rounds 5] [--layers 24] [--small 10000] [--dir DIR] [--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for bench.compare

import gpuckpt
from bench.compare.common import SETTLE_S, set_aside, settle, warm_cache
from gpuckpt.cli.rawio import (
    raw_files_load,
    raw_files_save,
    raw_single_load,
    raw_single_save,
    tensors_of,
    timed,
)
from gpuckpt.device.arrays import is_array
from gpuckpt.state import flatten_state_dict
from gpuckpt.testing.states import gpt_state_dict, small_tensors_state_dict


def bench_state(label: str, sd: dict[str, Any], rounds: int, base: Path) -> dict[str, Any]:
    arrays = tensors_of(sd)
    nbytes = sum(a.nbytes for a in arrays)
    targets = [np.empty_like(a) for a in arrays]
    target_sd = {"_": None}
    leaves, _ = flatten_state_dict(sd, is_array)
    # an in-place load target with the same structure, arrays preallocated
    import copy

    target_sd = copy.deepcopy(sd)
    systems: dict[str, tuple[Callable[[Path], None], Callable[[Path], None]]] = {
        "raw-files": (lambda p: raw_files_save(arrays, p), lambda p: raw_files_load(targets, p)),
        "raw-single": (lambda p: raw_single_save(arrays, p), lambda p: raw_single_load(targets, p)),
        "gpuckpt": (lambda p: gpuckpt.save(sd, p) and None, lambda p: gpuckpt.load(target_sd, p)),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"save": [], "load": []} for k in systems}
    trash = base / ".trash"
    for r in range(rounds + 1):  # round 0 is a warm-up
        for name, (save, load) in systems.items():
            p = base / f"{label}-{name}-{r}"
            os.sync()  # nothing dirty from the previous system is flushed on this one's time
            ts = timed(lambda: save(p))
            warm_cache(os.fspath(p))  # warm means cached, whatever the save left (O_DIRECT leaves nothing)
            tl = timed(lambda: load(p))
            if r > 0:
                times[name]["save"].append(ts)
                times[name]["load"].append(tl)
            set_aside(p, trash)
    # the loads really happened: gpuckpt's target equals the source
    for a, b in zip(tensors_of(sd), tensors_of(target_sd), strict=True):
        assert a.tobytes() == b.tobytes()
    del leaves
    out: dict[str, Any] = {"label": label, "bytes": nbytes, "tensors": len(arrays), "systems": {}}
    for name, t in times.items():
        out["systems"][name] = {
            op: {
                "median_s": statistics.median(v),
                "min_s": min(v),
                "max_s": max(v),
                "gbps": nbytes / statistics.median(v) / 1e9,
            }
            for op, v in t.items()
        }
    for op in ("save", "load"):
        best = min(out["systems"][n][op]["median_s"] for n in ("raw-files", "raw-single"))
        for name in systems:
            out["systems"][name][op]["ratio_to_best_raw"] = best / out["systems"][name][op]["median_s"]
    # for many small tensors the target compares with one file per tensor
    out["gpuckpt_save_time_over_raw_files"] = (
        out["systems"]["gpuckpt"]["save"]["median_s"] / out["systems"]["raw-files"]["save"]["median_s"]
    )
    return out


def print_table(res: dict[str, Any]) -> None:
    print(f"\n{res['label']}: {res['tensors']} tensors, {res['bytes'] / 2**30:.3f} GiB")
    print(
        f"{'system':<12} {'save GB/s':>10} {'(min-max s)':>16} {'ratio':>6}   {'load GB/s':>10} {'(min-max s)':>16} {'ratio':>6}"
    )
    for name, s in res["systems"].items():
        sv, ld = s["save"], s["load"]
        print(
            f"{name:<12} {sv['gbps']:10.2f} {sv['min_s']:7.3f}-{sv['max_s']:<7.3f} {sv['ratio_to_best_raw']:6.2f}"
            f"   {ld['gbps']:10.2f} {ld['min_s']:7.3f}-{ld['max_s']:<7.3f} {ld['ratio_to_best_raw']:6.2f}"
        )
    print(f"gpuckpt save time / raw per-file save time: {res['gpuckpt_save_time_over_raw_files']:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--small", type=int, default=10_000, help="number of small tensors (0 to skip)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dir", help="directory on the file system to measure (default: a temp dir)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--settle",
        type=float,
        default=SETTLE_S,
        help="seconds to wait after a sync before measuring, for files deleted earlier to stop "
        "slowing down file creation (see bench.compare.common.SETTLE_S)",
    )
    args = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="gpuckpt-bench-", dir=args.dir))
    rng = np.random.default_rng(0)
    results = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "date": date.today().isoformat(),
        "versions": {"gpuckpt": gpuckpt.__version__, "numpy": np.__version__},
        "runs": [],
    }
    try:
        settle(base / ".trash", args.settle)
        # the state that creates many files first, before any deletion of this run
        if args.small:
            sd = small_tensors_state_dict(rng, args.small)
            results["runs"].append(bench_state(f"small-{args.small}", sd, args.rounds, base))
            print_table(results["runs"][-1])
            del sd
        if args.layers:
            sd = gpt_state_dict(rng, layers=args.layers, dtype=args.dtype)
            results["runs"].append(bench_state(f"gpt-{args.layers}L-{args.dtype}", sd, args.rounds, base))
            print_table(results["runs"][-1])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\n{results['machine']}, {results['date']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
