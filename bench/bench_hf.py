"""Export to and import from the Hugging Face sharded layout against a plain copy of the same bytes.

A GPT-like float32 state of about ``--mib`` MiB (1 GiB by default: an 8192 x 1024 embedding and
21 layers of attention, MLP and norm weights) is saved by one process (``single``) and as a 4-rank
distributed checkpoint (``dist``: 4 in-process ranks of the threads coordinator, each holding a
quarter of every tensor's rows), and exported once to a Hugging Face directory (``hf``, the
source of the import). Each figure compares, in the same round, on the same files:

* export: ``gpuckpt.convert.convert(SRC, OUT, target_format="hf", max_shard_size=...)`` (shards
  of ``--shard-size``, default 256MB: several shards), for SRC = ``single`` and ``dist``;
* import: ``convert(hf, CKPT)`` (a gpuckpt save of the mapped shards);

each against a plain copy of the same bytes as the output holds: the ``hf`` directory's files
(the same shards an export writes; ``shutil.copyfile``, what ``cp`` does, each file fsync'd, then
the directory) into a new directory beside OUT, its source files in the same cache state as the
operation's. (Copying the checkpoint's own files instead would be an easier ceiling: the
4-rank checkpoint is hundreds of chunk files, each fsync'd.)

Warm: the source's files are read once first (in the page cache); cold: they are evicted with
``posix_fadvise(POSIX_FADV_DONTNEED)`` after ``os.sync()`` (``bench.compare.common.drop_cache``;
the fraction still resident, checked with ``mincore``, is printed). Every operation starts after
``os.sync()`` and an idle wait of ``--op-settle`` seconds; both sides end with their data fsync'd.
Rounds interleave the operation and its copy, in an order reversed every other round; the figure
is the median over rounds of copy time / operation time (>= 0.8: the target). Outputs are deleted
between operations (a few files each). The first round's exports are checked bit-exact (untimed).
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
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpuckpt
from bench.compare.common import cut_from, drop_cache, tree_files, warm_cache
from gpuckpt.convert import convert
from gpuckpt.distributed import run_ranks

TARGET = 0.8
RANKS = 4


def build_state(mib: int, seed: int = 0) -> dict[str, np.ndarray]:
    """About ``mib`` MiB of float32 weights in GPT-like shapes."""
    width = 1024 if mib >= 256 else 128
    vocab = 8 * width
    layer = (4 * width * width + 2 * width * 4 * width + 4 * width + 4 * width) * 4
    layers = max(1, round((mib * 2**20 - vocab * width * 4) / layer))
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, width))]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.self_attn.{n}_proj.weight", (width, width)) for n in ("q", "k", "v", "o")]
        shapes += [
            (f"{p}.mlp.up_proj.weight", (4 * width, width)),
            (f"{p}.mlp.down_proj.weight", (width, 4 * width)),
        ]
        shapes += [(f"{p}.mlp.up_proj.bias", (4 * width,))]
        shapes += [
            (f"{p}.{n}.weight", (width,)) for n in ("input_layernorm", "post_attention_layernorm", "norm")
        ]
    rng = np.random.default_rng(seed)
    block = (rng.standard_normal(4 << 20, dtype=np.float32) * np.float32(0.02)).astype(np.float32)
    offsets = rng.integers(0, 4 << 20, size=len(shapes))
    return {n: cut_from(block, s, int(o)) for (n, s), o in zip(shapes, offsets, strict=True)}


def save_distributed(state: dict[str, np.ndarray], path: Path) -> None:
    def rank(c: Any) -> None:
        part = {}
        for k, a in state.items():
            edges = np.linspace(0, a.shape[0], RANKS + 1).astype(int)
            lo, hi = int(edges[c.rank]), int(edges[c.rank + 1])
            offsets = (lo,) + (0,) * (a.ndim - 1)
            part[k] = gpuckpt.ShardedArray(np.ascontiguousarray(a[lo:hi]), offsets, a.shape)
        gpuckpt.save(part, path, coordinator=c)

    run_ranks(RANKS, rank)


def plain_copy(src: Path, dst: Path) -> None:
    """Every file of ``src`` copied into the new directory ``dst``, each fsync'd, then ``dst``."""
    dst.mkdir()
    for f in tree_files(str(src)):
        target = dst / os.path.relpath(f, src).replace("/", "_")
        shutil.copyfile(f, target)
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)


def timed(src: Path, mode: str, settle: float, fn: Callable[[], Any]) -> tuple[float, float]:
    """``(seconds, fraction of src resident before)`` of ``fn`` after the source is made ``mode``."""
    resident = drop_cache(str(src)) if mode == "cold" else warm_cache(str(src))
    if mode == "warm":
        resident = 1.0
    os.sync()
    time.sleep(settle)
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t, resident


def check_export(out: Path, state: dict[str, np.ndarray]) -> None:
    back = gpuckpt.load_state_dict(out)
    assert set(back) == set(state), "exported names differ"
    for k, v in state.items():
        assert back[k].tobytes() == v.tobytes(), f"{k} differs after export"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="size of the state (MiB, default 1024)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shard-size", default="256MB", help="max shard size of the exports (default 256MB)")
    ap.add_argument("--op-settle", type=float, default=2.0, help="idle seconds before each operation")
    ap.add_argument("--dir", help="working directory (default: a new one under the repository's parent)")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)

    base = (
        Path(args.dir)
        if args.dir
        else Path(tempfile.mkdtemp(prefix="bench-hf-", dir=Path(__file__).parents[2]))
    )
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=base))
    try:
        state = build_state(args.mib)
        nbytes = sum(a.nbytes for a in state.values())
        gpuckpt.save(state, work / "single")
        save_distributed(state, work / "dist")
        convert(work / "single", work / "hf", target_format="hf", max_shard_size=args.shard_size)
        shards = len(list((work / "hf").glob("model-*.safetensors")))
        print(
            f"state: {len(state)} float32 tensors, {nbytes / 2**30:.3f} GiB; exports of {shards} shards "
            f"(max {args.shard_size}); {RANKS}-rank source: {len(tree_files(str(work / 'dist')))} files; "
            f"{os.cpu_count()} CPUs, {platform.platform()}; load {os.getloadavg()}",
            flush=True,
        )
        ops: dict[str, tuple[Path, Callable[[Path], Any]]] = {
            "export single": (
                work / "single",
                lambda out: convert(work / "single", out, target_format="hf", max_shard_size=args.shard_size),
            ),
            "export dist": (
                work / "dist",
                lambda out: convert(work / "dist", out, target_format="hf", max_shard_size=args.shard_size),
            ),
            "import": (work / "hf", lambda out: convert(work / "hf", out)),
        }
        records: list[dict[str, Any]] = []
        for r in range(args.rounds):
            for mode in ("warm", "cold"):
                for name, (src, fn) in ops.items():
                    order = ("op", "copy") if r % 2 == 0 else ("copy", "op")
                    got: dict[str, tuple[float, float]] = {}
                    for side in order:
                        out = work / f"out-{side}"
                        remove(out)
                        os.sync()
                        if side == "op":
                            got[side] = timed(src, mode, args.op_settle, lambda out=out, fn=fn: fn(out))
                            if r == 0 and name.startswith("export"):
                                check_export(out, state)
                        else:
                            hf = work / "hf"
                            got[side] = timed(hf, mode, args.op_settle, lambda out=out: plain_copy(hf, out))
                        remove(out)
                    rec = {
                        "round": r,
                        "mode": mode,
                        "op": name,
                        "op_s": got["op"][0],
                        "copy_s": got["copy"][0],
                        "ratio": got["copy"][0] / got["op"][0],
                        "resident_before": got["op"][1],
                    }
                    records.append(rec)
                    print(
                        f"round {r} {mode} {name:14s} op {rec['op_s']:.3f} s  copy {rec['copy_s']:.3f} s  "
                        f"ratio {rec['ratio']:.2f}  (source resident before: {rec['resident_before']:.0%})",
                        flush=True,
                    )
        print(f"\n| figure | {'operation':>18} | {'plain copy':>18} | ratio (median) | target |")
        print("|---|---|---|---|---|")
        for mode in ("warm", "cold"):
            for name in ops:
                rows = [x for x in records if x["mode"] == mode and x["op"] == name]
                op_s = statistics.median(x["op_s"] for x in rows)
                copy_s = statistics.median(x["copy_s"] for x in rows)
                ratio = statistics.median(x["ratio"] for x in rows)
                verdict = "met" if ratio >= TARGET else "not met"
                print(
                    f"| {name}, {mode} | {op_s:.3f} s, {nbytes / op_s / 1e9:.2f} GB/s | "
                    f"{copy_s:.3f} s, {nbytes / copy_s / 1e9:.2f} GB/s | {ratio:.2f} "
                    f"(rounds {min(x['ratio'] for x in rows):.2f}-{max(x['ratio'] for x in rows):.2f}) | "
                    f">= {TARGET}: {verdict} |"
                )
        print(f"load average at the end: {os.getloadavg()}")
        if args.json:
            Path(args.json).write_text(
                json.dumps({"bytes": nbytes, "args": vars(args), "records": records}, indent=1)
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
