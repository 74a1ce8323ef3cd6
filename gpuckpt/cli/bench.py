"""``gpuckpt bench``: a quick save/load throughput check against raw-file ceilings.

Measures, on this machine and in one run, gpuckpt's durable ``save`` and
in-place ``load`` of a GPT-like state against the raw baselines of
:mod:`gpuckpt.cli.rawio` (one fsynced file per tensor; one fsynced file
for all), and reports GB/s and ratios to the best raw baseline. With CuPy
and a CUDA device it also reports host<->device copy ceilings.

``--device`` reports the GPU figures instead, each with its ratio to the ceiling
of the same run (:mod:`gpuckpt.cli.device_bench`); without a GPU it says so and
exits 1.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import gpuckpt
from gpuckpt.cli.rawio import (
    raw_files_load,
    raw_files_save,
    raw_single_load,
    raw_single_save,
    tensors_of,
    timed,
)
from gpuckpt.cli.usage import UsageError
from gpuckpt.errors import DeviceUnavailableError
from gpuckpt.testing.states import gpt_state_dict

HELP = "measure save/load throughput against raw file I/O on this machine (a few seconds)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=int, default=128, help="approximate state size in MiB (128)")
    p.add_argument("--rounds", type=int, default=2, help="measured rounds after one warm-up (2)")
    p.add_argument("--dir", help="directory on the file system to measure (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--device",
        action="store_true",
        help="GPU figures instead: copy and disk ceilings, kernels, save/load/async ratios (needs a GPU)",
    )
    p.add_argument("--gib", type=float, default=None, help="--device: size of the device state in GiB (1)")
    p.add_argument("--no-cold", action="store_true", help="--device: skip cold reads (evicted page cache)")


def bench_state(sd: dict[str, Any], rounds: int, base: Path, threads: int | None = None) -> dict[str, Any]:
    """Median seconds and GB/s of save and load for gpuckpt and the raw baselines."""
    arrays = tensors_of(sd)
    nbytes = sum(a.nbytes for a in arrays)
    targets = [np.empty_like(a) for a in arrays]
    target_sd = copy.deepcopy(sd)
    systems: dict[str, tuple[Callable[[Path], object], Callable[[Path], object]]] = {
        "raw-files": (lambda p: raw_files_save(arrays, p), lambda p: raw_files_load(targets, p)),
        "raw-single": (lambda p: raw_single_save(arrays, p), lambda p: raw_single_load(targets, p)),
        "gpuckpt": (
            lambda p: gpuckpt.save(sd, p, threads=threads),
            lambda p: gpuckpt.load(target_sd, p, threads=threads),
        ),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"save": [], "load": []} for k in systems}
    for r in range(rounds + 1):  # round 0 warms up
        for name, (save, load) in systems.items():
            p = base / f"{name}-{r}"
            ts = timed(lambda save=save, p=p: save(p))  # type: ignore[misc]
            tl = timed(lambda load=load, p=p: load(p))  # type: ignore[misc]
            shutil.rmtree(p)
            if r:
                times[name]["save"].append(ts)
                times[name]["load"].append(tl)
    for a, b in zip(arrays, tensors_of(target_sd), strict=True):
        if a.tobytes() != b.tobytes():
            raise AssertionError("gpuckpt loaded different bytes than it saved")
    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(arrays), "systems": {}}
    for name, t in times.items():
        out["systems"][name] = {
            op: {"median_s": statistics.median(v), "gbps": nbytes / statistics.median(v) / 1e9}
            for op, v in t.items()
        }
    for op in ("save", "load"):
        best = min(out["systems"][n][op]["median_s"] for n in ("raw-files", "raw-single"))
        for s in out["systems"].values():
            s[op]["ratio_to_best_raw"] = best / s[op]["median_s"]
    return out


def gpu_ceilings(nbytes: int) -> dict[str, float] | None:
    """Host->device and device->host copy GB/s from pinned memory, or None without a GPU."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        dev = cupy.empty(nbytes, dtype=cupy.uint8)
        pinned = cupy.cuda.alloc_pinned_memory(nbytes)
        host = np.frombuffer(pinned, np.uint8, nbytes)
        res = {}

        def h2d() -> None:
            dev.set(host)

        def d2h() -> None:
            dev.get(out=host)

        for label, fn in (("h2d_gbps", h2d), ("d2h_gbps", d2h)):
            fn()
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            cupy.cuda.Device().synchronize()
            t = time.perf_counter() - t0
            res[label] = nbytes / t / 1e9
        return res
    except Exception:  # no CuPy, no driver, no device: no GPU ceilings
        return None


def run_device(args: argparse.Namespace) -> int:
    """``gpuckpt bench --device``: gpuckpt's figures on this GPU against the ceilings of the same
    run, or a clear refusal."""
    from gpuckpt.device import cuda

    if not cuda.gpu_available():
        raise DeviceUnavailableError(
            "bench --device: no usable GPU here (CuPy is missing, or no CUDA driver or device "
            "answers); run it on a machine with an NVIDIA GPU and CuPy (pip install 'gpuckpt[gpu]')"
        )
    gib = 1.0 if args.gib is None else args.gib
    if not gib > 0 or args.rounds < 1:
        raise UsageError("--gib must be positive and --rounds at least 1")
    from gpuckpt.cli.device_bench import measure, report

    base = Path(tempfile.mkdtemp(prefix="gpuckpt-bench-device-", dir=args.dir))
    try:
        res = measure(gib, args.rounds, base, cold=not args.no_cold, kernels=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(res, indent=2) if args.json else report(res))
    return 1 if res.get("errors") else 0


def run(args: argparse.Namespace) -> int:
    if args.device:
        return run_device(args)
    device_only = [f for f, given in (("--gib", args.gib is not None), ("--no-cold", args.no_cold)) if given]
    if device_only:
        raise UsageError(
            f"{' and '.join(device_only)} set{'s' if len(device_only) == 1 else ''} the --device "
            "figures only: add --device (needs a GPU), or use --size-mb for the host figures"
        )
    if args.size_mb < 1 or args.rounds < 1:
        raise UsageError("--size-mb and --rounds must be at least 1")
    # embedding 8000 x W plus layers of 12 W^2 floats: pick W for the size asked
    width = 256
    while (8000 * width + 2 * 12 * width * width) * 4 < args.size_mb * 2**20 and width < 8192:
        width += 128
    sd = gpt_state_dict(np.random.default_rng(0), vocab=8000, width=width, layers=2, mlp=4 * width)
    base = Path(tempfile.mkdtemp(prefix="gpuckpt-bench-", dir=args.dir))
    try:
        res = bench_state(sd, args.rounds, base, args.threads)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    res["gpu"] = gpu_ceilings(res["bytes"])
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(
        f"{res['tensors']} tensors, {res['bytes'] / 2**20:.0f} MiB, median of {args.rounds} rounds "
        f"in {args.dir or tempfile.gettempdir()}"
    )
    print(f"{'system':<11} {'save GB/s':>10} {'ratio':>6}   {'load GB/s':>10} {'ratio':>6}")
    for name, s in res["systems"].items():
        sv, ld = s["save"], s["load"]
        print(
            f"{name:<11} {sv['gbps']:10.2f} {sv['ratio_to_best_raw']:6.2f}   "
            f"{ld['gbps']:10.2f} {ld['ratio_to_best_raw']:6.2f}"
        )
    print("ratio: best raw baseline time / this system's time (1.00 = as fast as raw file I/O)")
    gpu = res["gpu"]
    if gpu is None:
        print("GPU ceilings: skipped (no CuPy with a CUDA device)")
    else:
        print(
            f"GPU ceilings (pinned host memory): host->device {gpu['h2d_gbps']:.1f} GB/s, "
            f"device->host {gpu['d2h_gbps']:.1f} GB/s"
        )
    return 0
