"""Incremental saves (``base=``) against full saves of the same state, in the same run.

Two states:

* ``lora``: the GPT-like weights of ``bench.compare.common.build_state("gpt")``
  (1.25 GiB of float32) frozen, and rank-16 adapters (A: 16 x width, B: width x 16)
  on every attention matrix (q, k, v, o of every layer) with their two Adam
  moments, all changed between saves (one "training step": every adapter and
  moment gets new values).
* ``all-changed``: the GPT-like weights, every tensor changed between saves.

Measured, each round alternating the two saves being compared, every save after
an ``os.sync()`` and durable (the default ``sync="auto"``):

* ``lora``: a full save (no base) and an incremental save (``base=`` the previous
  checkpoint, which recorded its hashes) of the same state: time, and bytes
  written (the sizes of the files the save created: for an incremental save the
  chunk files with one link, plus every document). Ratios: incremental time / full
  time (target <= 0.25), incremental bytes / changed bytes (target <= 1.02, the
  changed bytes being the adapters' and moments' chunk files and every document).
* ``all-changed``: a save with ``base=`` (nothing can be reused; every chunk is
  hashed and probed) against a save without: time ratio (target <= 1.05).
  The floor of an incremental save, measured too: a save of the changed tensors
  alone (the adapters and moments, without the frozen weights), the same files.
* ``chain``: 20 incremental steps of the ``lora`` state (each step's base the one
  before), bytes written per save, against the bytes of a full save.

Settling the file system: deleting files makes creating files slow for a while
on this file system (ext4; see ``bench.compare.common.SETTLE_S``). The run starts
with a sync and a wait of ``--settle`` seconds (default 361). Checkpoints (about
1,700 files each, not tens of thousands) are deleted only between rounds, never
between the saves a round compares, each deletion followed by ``os.sync()``; the
chain's checkpoints are kept until its last save. Every timed save starts after
``os.sync()``, and the saves compared change order from round to round, so that
drift hits them alike.

Usage: ``python bench/bench_incremental.py [--rounds 5] [--steps 20] [--settle 361]
[--dir DIR] [--json OUT] [--plot PNG] [--quick]`` (``--quick``: the toy GPT shapes, for a
smoke test); ``--replot JSON --plot PNG`` draws the chain of a saved run again.
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
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import gpuckpt  # noqa: E402
from bench.compare.common import SETTLE_S, build_state, settle  # noqa: E402

RANK = 16


def lora_adapters(weights: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """Rank-16 A and B for every attention matrix, and their two Adam moments, at ``step``."""
    rng = np.random.default_rng(1000 + step)
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if ".attn." not in name or w.ndim != 2:
            continue
        rows, cols = w.shape
        for part, shape in (("lora_A", (RANK, cols)), ("lora_B", (rows, RANK))):
            base = f"{name}.{part}"
            out[f"adapters.{base}"] = rng.standard_normal(shape, dtype=np.float32)
            out[f"optim.{base}.exp_avg"] = rng.standard_normal(shape, dtype=np.float32)
            out[f"optim.{base}.exp_avg_sq"] = np.abs(rng.standard_normal(shape, dtype=np.float32))
    return out


def lora_state(weights: dict[str, np.ndarray], step: int) -> dict[str, Any]:
    return {"model": weights, **_nest(lora_adapters(weights, step)), "step": step}


def _nest(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    top: dict[str, dict[str, np.ndarray]] = {}
    for k, v in flat.items():
        head, _, rest = k.partition(".")
        top.setdefault(head, {})[rest] = v
    return top


def own_bytes(path: Path) -> tuple[int, int]:
    """``(bytes in files this checkpoint created, bytes in all its files)``: a file with more than
    one link was shared from a base, not written."""
    own = total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(root, f))
            total += st.st_size
            if st.st_nlink == 1:
                own += st.st_size
    return own, total


def timed_save(state: dict[str, Any], path: Path, **kw: Any) -> float:
    os.sync()
    t = time.perf_counter()
    gpuckpt.save(state, path, **kw)
    return time.perf_counter() - t


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()


def _median(v: list[float]) -> float:
    return statistics.median(v) if v else float("nan")


def bench_lora(work: Path, weights: dict[str, np.ndarray], rounds: int) -> dict[str, Any]:
    """Full and incremental saves of the same LoRA-like state, alternating."""
    step = 0
    base = work / "lora-base"
    gpuckpt.save(lora_state(weights, step), base, content_hash=True)
    full_t: list[float] = []
    incr_t: list[float] = []
    only_t: list[float] = []
    full_b: list[int] = []
    incr_b: list[int] = []
    changed_b: list[int] = []
    for r in range(rounds):
        step += 1
        state = lora_state(weights, step)
        order: list[tuple[str, Callable[[], None]]] = []

        def full(r: int = r, state: dict[str, Any] = state) -> None:
            p = work / f"lora-full-{r}"
            full_t.append(timed_save(state, p))
            full_b.append(own_bytes(p)[0])

        def incr(r: int = r, state: dict[str, Any] = state) -> None:
            p = work / f"lora-incr-{r}"
            incr_t.append(timed_save(state, p, base=base, content_hash=True))
            own, _ = own_bytes(p)
            incr_b.append(own)
            # what changed: the adapters' and moments' files and every document
            changed = 0
            for root, _dirs, files in os.walk(p):
                for f in files:
                    q = Path(root) / f
                    if f == "zarr.json" or q.parent.name.startswith(("adapters.", "optim.")):
                        changed += q.stat().st_size
            changed_b.append(changed)

        def only_changed(r: int = r, state: dict[str, Any] = state) -> None:
            # the floor of an incremental save: a save of the changed tensors alone
            p = work / f"lora-only-{r}"
            only_t.append(timed_save({k: v for k, v in state.items() if k != "model"}, p))

        order = [("full", full), ("incr", incr), ("only", only_changed)]
        for _, fn in order if r % 2 == 0 else reversed(order):
            fn()
        # deletions only between rounds: neither save of a round follows a deletion of the round
        remove(work / f"lora-full-{r}")
        remove(work / f"lora-only-{r}")
        remove(base)
        os.rename(work / f"lora-incr-{r}", base)  # the next round's base: this step's checkpoint
    remove(base)
    return {
        "full save s": _median(full_t),
        "incremental save s": _median(incr_t),
        "full bytes": int(_median([float(b) for b in full_b])),
        "incremental bytes": int(_median([float(b) for b in incr_b])),
        "changed bytes": int(_median([float(b) for b in changed_b])),
        "changed tensors alone save s": _median(only_t),
        "incremental / full time": _median(incr_t) / _median(full_t),
        "incremental / changed-alone time": _median(incr_t) / _median(only_t),
        "incremental / changed bytes": _median([float(b) for b in incr_b])
        / _median([float(b) for b in changed_b]),
        "raw": {"full s": full_t, "incremental s": incr_t, "changed alone s": only_t},
    }


def bench_all_changed(work: Path, weights: dict[str, np.ndarray], rounds: int) -> dict[str, Any]:
    """Every tensor changed: a save with a base (nothing reusable) against one without."""
    state = {"model": {k: v.copy() for k, v in weights.items()}, "step": 0}
    base = work / "all-base"
    gpuckpt.save(state, base, content_hash=True)
    with_t: list[float] = []
    without_t: list[float] = []
    for r in range(rounds):
        for v in state["model"].values():
            v += np.float32(1e-3)  # one step: every byte of every tensor changes
        state["step"] = r + 1

        def with_base(r: int = r) -> None:
            p = work / f"all-with-{r}"
            with_t.append(timed_save(state, p, base=base))
            assert own_bytes(p)[0] == own_bytes(p)[1], "a chunk was reused in the all-changed state"

        def without_base(r: int = r) -> None:
            p = work / f"all-without-{r}"
            without_t.append(timed_save(state, p))

        pair = [with_base, without_base]
        for fn in pair if r % 2 == 0 else reversed(pair):
            fn()
        remove(work / f"all-with-{r}")
        remove(work / f"all-without-{r}")
    remove(base)
    return {
        "save with base s": _median(with_t),
        "save without base s": _median(without_t),
        "with / without base time": _median(with_t) / _median(without_t),
        "raw": {"with base s": with_t, "without base s": without_t},
    }


def bench_chain(work: Path, weights: dict[str, np.ndarray], steps: int) -> dict[str, Any]:
    """Bytes written per save over ``steps`` incremental saves, each on the one before."""
    per_step: list[dict[str, Any]] = []
    prev: Path | None = None
    full_bytes = 0
    for step in range(steps):
        p = work / f"chain-{step:03d}"
        t = timed_save(lora_state(weights, step), p, base=prev, content_hash=True)
        own, total = own_bytes(p)
        full_bytes = max(full_bytes, total)
        per_step.append({"step": step, "incremental bytes": own, "full bytes": total, "s": t})
        prev = p  # kept to the end: no deletion between the chain's saves
    for step in range(steps):
        remove(work / f"chain-{step:03d}")
    return {"steps": per_step, "full bytes": full_bytes}


def plot_chain(res: dict[str, Any], png: Path) -> None:
    """Bytes written per save over the chain, full against incremental (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = res["chain"]["steps"]
    x = [s["step"] for s in steps]
    mib = 1 << 20
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar([i - 0.2 for i in x], [s["full bytes"] / mib for s in steps], 0.4, label="full save")
    ax.bar([i + 0.2 for i in x], [s["incremental bytes"] / mib for s in steps], 0.4, label="incremental save")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB written")
    ax.set_title(f"LoRA-like state, bytes written per save ({res['date']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--settle", type=float, default=SETTLE_S, help="seconds to wait after the first sync")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="toy GPT shapes (a smoke test)")
    ap.add_argument("--plot", type=Path, default=None, help="draw the chain's bytes per save (PNG)")
    ap.add_argument("--replot", type=Path, default=None, help="only draw --plot from this saved JSON")
    args = ap.parse_args(argv)
    if args.replot is not None:
        plot_chain(json.loads(args.replot.read_text()), args.plot or args.replot.with_suffix(".png"))
        return 0
    parent = args.dir or Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="gpuckpt-bench-incr-", dir=parent))
    res: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "quick": args.quick,
        "settle_s": args.settle,
    }
    try:
        settle(work / ".trash", args.settle)
        weights = build_state("gpt", quick=args.quick)
        res["state bytes"] = sum(int(a.nbytes) for a in weights.values())
        res["adapter bytes"] = sum(int(a.nbytes) for a in lora_adapters(weights, 0).values())
        res["lora"] = bench_lora(work, weights, args.rounds)
        res["all-changed"] = bench_all_changed(work, weights, args.rounds)
        res["chain"] = bench_chain(work, weights, args.steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lo, al = res["lora"], res["all-changed"]
    print(f"{res['date']}  {res['machine']}  state {res['state bytes'] / 2**30:.2f} GiB")
    print(
        f"lora: full {lo['full save s']:.3f} s, incremental {lo['incremental save s']:.3f} s "
        f"(ratio {lo['incremental / full time']:.3f}, target <= 0.25); the changed tensors alone "
        f"{lo['changed tensors alone save s']:.3f} s (ratio {lo['incremental / changed-alone time']:.3f}); "
        f"bytes full {lo['full bytes']}, "
        f"incremental {lo['incremental bytes']}, changed {lo['changed bytes']} "
        f"(ratio {lo['incremental / changed bytes']:.4f}, target <= 1.02)"
    )
    print(
        f"all changed: with base {al['save with base s']:.3f} s, without {al['save without base s']:.3f} s "
        f"(ratio {al['with / without base time']:.3f}, target <= 1.05)"
    )
    chain = res["chain"]["steps"]
    print(
        "chain bytes per step (incremental / full): " + ", ".join(f"{s['incremental bytes']}" for s in chain)
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    if args.plot:
        plot_chain(res, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
