"""A child process for crash tests: saves on command so a test can SIGKILL it mid-way.

Run as ``python -m gpuckpt.testing.crash ROOT SEED MODE``. It saves a known
state to ``ROOT/good`` (printing ``good``), then starts the save named by
MODE (printing ``start``) and prints ``done`` when that save returned:

``new``        a different state to ``ROOT/next``;
``overwrite``  a different state over ``ROOT/good``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

import gpuckpt


def make_state(seed: int, ntensors: int = 24, elems: int = 64 * 1024) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {f"w{i}": rng.standard_normal(elems).astype(np.float32) for i in range(ntensors)},
        "seed": seed,
    }


def main(argv: list[str]) -> None:
    root, seed, mode = Path(argv[0]), int(argv[1]), argv[2]
    if not (root / "good").exists():
        gpuckpt.save(make_state(seed), root / "good", sync="file")
    print("good", flush=True)
    state = make_state(seed + 1)
    print("start", flush=True)
    if mode == "new":
        gpuckpt.save(state, root / "next", sync="file", chunk_bytes=16 * 1024)
    elif mode == "overwrite":
        gpuckpt.save(state, root / "good", sync="file", chunk_bytes=16 * 1024, overwrite=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
