"""Worker processes for the concurrency tests (not collected by pytest).

``save PATH SEED OVERWRITE GO_FILE [REPEAT]`` waits until GO_FILE exists, then
saves ``state(SEED + i)`` REPEAT times and prints one result line per save:
``ok``, or ``exists`` for a CheckpointExistsError, or ``error TYPE MESSAGE``.
``load PATH SECONDS`` loads in a loop and prints ``ok SEED``, ``typed TYPE``
or ``bad ...`` (a mixed or wrong result) per load.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import gpuckpt


def state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {f"w{i}": rng.standard_normal(40_000).astype(np.float32) for i in range(12)},
        "seed": seed,
    }


def consistent(got: dict[str, Any]) -> bool:
    want = state(int(got["seed"]))
    return all(got["model"][k].tobytes() == v.tobytes() for k, v in want["model"].items())


def main(argv: list[str]) -> None:
    if argv[0] == "save":
        path, seed, overwrite, go = Path(argv[1]), int(argv[2]), argv[3] == "1", Path(argv[4])
        repeat = int(argv[5]) if len(argv) > 5 else 1
        states = [state(seed + i) for i in range(repeat)]
        while not go.exists():
            time.sleep(0.001)
        for s in states:
            try:
                gpuckpt.save(s, path, overwrite=overwrite, sync="file", chunk_bytes=32 << 10)
                print("ok", flush=True)
            except gpuckpt.CheckpointExistsError:
                print("exists", flush=True)
            except Exception as exc:
                print("error", type(exc).__name__, str(exc).replace("\n", " "), flush=True)
    elif argv[0] == "load":
        path, until = Path(argv[1]), time.monotonic() + float(argv[2])
        while time.monotonic() < until:
            try:
                got = gpuckpt.load_state_dict(path)
            except gpuckpt.GpuckptError as exc:
                print("typed", type(exc).__name__, flush=True)
                continue
            except Exception as exc:
                print("bad untyped", type(exc).__name__, str(exc).replace("\n", " "), flush=True)
                continue
            print(f"ok {got['seed']}" if consistent(got) else f"bad mixed {got['seed']}", flush=True)
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
