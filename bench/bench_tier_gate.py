"""Figure 1 of bench_tiers with the local tier's write gate on and off, step by step in one run.

A tiered ``save`` blocks for the rank's snapshot; the part's write then runs in the background.
``gpuckpt.tiers.local.WriteGate`` holds that write until every rank's snapshot is done (at most
twice the rank's own snapshot). This runs the ranks of ``bench/tiers_ranks.py`` (4 MPI ranks as
2 simulated nodes, ``--mib`` per rank, replicas on the other node, tiers on tmpfs) and
alternates the gate on (even steps) and off (odd steps: ``WriteGate.hold`` returns at once),
after ``--warmup`` steps. Each step times a host copy of the rank's arrays into a staging arena
allocated once (the ceiling of figure 1), then ``mgr.save``, each after ``os.sync()``, the
settle wait and a barrier (``Harness.timed``); the tier's work of the step is waited for before
the next. Printed: each rank's median of save / copy with the gate on and off, and the median
over steps of the worst rank's ratio. A paired comparison: both arms see the same machine, in
alternation, so the machine's drift falls on both.

Usage: ``mpiexec -n 4 python bench/bench_tier_gate.py [--mib 256] [--pairs 12] [--warmup 3]
[--op-settle 3] [--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.tiers_ranks import Rank  # noqa: E402
from gpuckpt.background import copy_host_arrays, host_order  # noqa: E402
from gpuckpt.device.staging import HostAllocator, StagingArena, aligned_bytes  # noqa: E402
from gpuckpt.tiers.local import WriteGate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--pairs", type=int, default=12, help="measured steps with the gate on (and as many off)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--op-settle", type=float, default=3.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    work = Path(tempfile.mkdtemp(prefix="gpuckpt-gate-")) if world.Get_rank() == 0 else None
    tiers = "/dev/shm" if Path("/dev/shm").is_dir() else None  # (else the temp dir)
    shm = Path(tempfile.mkdtemp(prefix="gpuckpt-gate-", dir=tiers)) if world.Get_rank() == 0 else None
    work, shm = world.bcast((work, shm))
    ns = argparse.Namespace(
        op_settle=args.op_settle,
        transport="mpi",
        local=str(shm),
        root=str(work / "root"),
        mib=args.mib,
        layout="mixed",
    )
    ns.warmup, ns.rounds, ns.save_rounds = args.warmup, args.pairs, 0
    k = Rank(ns)
    hold = WriteGate.hold
    mgr = k.manager(replicas=1, persist_interval_steps=10**9, local_max_to_keep=2)
    arrays, arena = k.arrays, StagingArena(HostAllocator())
    orders = [host_order(a) for a in arrays]
    ratios: dict[str, list[float]] = {"on": [], "off": []}

    def copy() -> None:
        arena.reset(sum(aligned_bytes(a.nbytes) for a in arrays))
        copy_host_arrays(arrays, orders, arena)

    for step in range(1, args.warmup + 2 * args.pairs + 1):
        on = step % 2 == 0
        WriteGate.hold = hold if on else (lambda self: None)  # type: ignore[method-assign]
        k.state["step"] = step
        c = k.h.timed(copy)
        s = k.h.timed(lambda step=step: mgr.save(step, k.state))
        assert mgr._tiered is not None
        mgr._tiered.tier.wait_for(step)
        if step > args.warmup:
            ratios["on" if on else "off"].append(s / c)
    WriteGate.hold = hold  # type: ignore[method-assign]
    mgr.wait()
    mgr.close()
    every = k.c.all_gather(ratios)
    if k.rank == 0:
        n = min(len(every[0]["on"]), len(every[0]["off"]))
        worst = {arm: [max(r[arm][i] for r in every) for i in range(n)] for arm in ("on", "off")}
        out: dict[str, Any] = {
            "mib_per_rank": args.mib,
            "pairs": args.pairs,
            "per_rank_median": {
                str(r): {arm: statistics.median(d[arm]) for arm in ("on", "off")} for r, d in enumerate(every)
            },
            "worst_rank_per_step": worst,
            "worst_rank_median": {arm: statistics.median(v) for arm, v in worst.items()},
        }
        for r, d in out["per_rank_median"].items():
            print(f"rank {r}: save / host copy, median: gate on {d['on']:.2f}, off {d['off']:.2f}")
        wm = out["worst_rank_median"]
        print(f"worst rank per step, median: gate on {wm['on']:.2f}, off {wm['off']:.2f}")
        print("  on: ", " ".join(f"{x:.2f}" for x in worst["on"]))
        print("  off:", " ".join(f"{x:.2f}" for x in worst["off"]))
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
