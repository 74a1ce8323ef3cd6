"""The main job: save a realistic model state, reload it, verify it bit-exact, report throughput.

Run ``python -m gpuckpt.demo [DIR]`` (or ``make demo``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import gpuckpt
from gpuckpt.device.arrays import is_array
from gpuckpt.state import flatten_state_dict
from gpuckpt.testing.states import gpt_state_dict


def _tensors(sd: dict[str, Any]) -> dict[str, np.ndarray]:
    leaves, _ = flatten_state_dict(sd, is_array)
    return {k: v.value for k, v in leaves.items() if is_array(v.value)}


def build_state(layers: int, seed: int = 0) -> dict[str, Any]:
    """A GPT-like model (float32 master weights, a bfloat16 copy of the attention
    weights, a channels-last conv stem) plus Adam moments and training counters."""
    rng = np.random.default_rng(seed)
    state = gpt_state_dict(rng, layers=layers, with_optimizer=False)
    state["model"]["stem"] = rng.standard_normal((8, 56, 56, 64), dtype=np.float32).transpose(0, 3, 1, 2)
    state["bf16_attn"] = [
        {k: v.astype(ml_dtypes.bfloat16) for k, v in layer["attn"].items()} for layer in state["model"]["layers"]
    ]
    state["rng"] = {"bit_generator": "PCG64", "state": int(rng.integers(0, 2**62))}
    state["step"] = 12_345
    return state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuckpt.demo", description=__doc__)
    ap.add_argument("dir", nargs="?", help="where to write the checkpoint (default: a temporary directory)")
    ap.add_argument("--layers", type=int, default=12, help="transformer layers (24 gives ~1.3 GiB)")
    args = ap.parse_args(argv)

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gpuckpt-demo-"))
    path = work / "checkpoint"
    print(f"building a GPT-like state with {args.layers} layers ...", flush=True)
    state = build_state(args.layers)
    tensors = _tensors(state)
    nbytes = sum(t.nbytes for t in tensors.values())
    print(f"  {len(tensors)} tensors, {nbytes / 2**30:.2f} GiB (float32, bfloat16, channels-last)")

    t0 = time.perf_counter()
    gpuckpt.save(state, path, overwrite=True)
    t_save = time.perf_counter() - t0
    print(f"save  (fsynced, atomic): {t_save:6.2f} s  {nbytes / t_save / 1e9:6.2f} GB/s  -> {path}")

    t0 = time.perf_counter()
    loaded = gpuckpt.load_state_dict(path)
    t_new = time.perf_counter() - t0
    print(f"load_state_dict        : {t_new:6.2f} s  {nbytes / t_new / 1e9:6.2f} GB/s")

    target = build_state(args.layers, seed=1)  # same shapes, other values
    t0 = time.perf_counter()
    gpuckpt.load(target, path)
    t_in = time.perf_counter() - t0
    print(f"load in place          : {t_in:6.2f} s  {nbytes / t_in / 1e9:6.2f} GB/s")

    bad = []
    for got in (loaded, target):
        g = _tensors(got)
        for k, v in tensors.items():
            if g[k].tobytes() != v.tobytes() or g[k].dtype != v.dtype or g[k].strides != v.strides:
                bad.append(k)
        if got["step"] != state["step"] or got["rng"] != state["rng"]:
            bad.append("<plain values>")
    stem = loaded["model"]["stem"]
    md = gpuckpt.read_metadata(path)
    print(f"memory format of model.stem: {md.state_dict_metadata['model.stem'].properties.memory_format.name}"
          f" (restored strides {stem.strides})")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    if bad:
        print(f"FAILED: {len(bad)} entries differ, e.g. {bad[:5]}", file=sys.stderr)
        return 1
    print(f"verified: all {len(tensors)} tensors and plain values bit-exact after both loads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
