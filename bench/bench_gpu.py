"""GPU save/load throughput of gpuckpt against ceilings measured in the same run.

The measurement is :func:`gpuckpt.cli.device_bench.measure` (also behind
``gpuckpt bench --device``): ceilings D2H, H2D, D2D, disk write+fsync, warm and
cold reads; save, the load pipeline warm and cold, async_save blocking time
with pinned and with device staging, and a CheckpointManager's local tier on
tmpfs (its save's blocking time, a restore from it into device arrays). This
script writes ``bench_gpu.json``
for ``bench/gpu_summary.py`` and prints the figures.

Usage: ``python bench/bench_gpu.py [--gib 2] [--rounds 3] [--no-cold] [--dir DIR] [--out DIR]``;
exits 0 with a message when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a source checkout without an install


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="size of the device state")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-read ceiling and the cold load")
    ap.add_argument("--dir", help="file system to measure (default: a temp dir)")
    ap.add_argument("--out", help="write bench_gpu.json here")
    args = ap.parse_args(argv)

    from gpuckpt.device import cuda

    if not cuda.gpu_available():
        print("bench_gpu: no CuPy or no CUDA device here; nothing to measure")
        return 0
    from gpuckpt.cli.device_bench import measure

    base = Path(tempfile.mkdtemp(prefix="gpuckpt-gpubench-", dir=args.dir))
    res = measure(args.gib, args.rounds, base, cold=not args.no_cold, tiers=True)
    c, g = res["ceilings_GBps"], res["gpuckpt"]
    print(f"\nGPU benchmark on {res['device']}, state {g['state_bytes'] / 2**30:.2f} GiB")
    print(json.dumps({"ceilings_GBps": c, "gpuckpt": g}, indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_gpu.json").write_text(json.dumps(res, indent=2))
    if res.get("errors"):  # the other figures are written; the step still fails
        print(f"bench_gpu: figures that failed: {json.dumps(res['errors'], indent=2)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
