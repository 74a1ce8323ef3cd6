"""A single-process save to ``s3://`` that stops or dies mid-upload (for test_s3_lease.py).

``python s3_writer_child.py MODE URL ENDPOINT MARKER SEED``: saves ``state(SEED)``
with a 3 s lease (S3 times have one-second resolution: room for a slow machine); once its first chunk is uploaded it writes MARKER, then
``kill`` SIGKILLs itself, ``stop`` SIGSTOPs itself (the test resumes it
later), ``fail`` fails the save (which then aborts) and ``plain`` goes on. A save that returns prints ``saved``; one that raises prints the
error's type and message and exits 3.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np

import gpuckpt
from gpuckpt.testing.s3server import s3_options


def state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # 1.5 MiB each: one chunk per I/O job, so that uploads go on after the first one
    return {f"t{i}": rng.standard_normal(3 << 17).astype(np.float32) for i in range(6)}


def main(mode: str, url: str, endpoint: str, marker: str, seed: str) -> None:
    fired = False

    def progress(done: int, total: int) -> None:
        nonlocal fired
        if done > 0 and not fired:
            fired = True
            Path(marker).write_text("uploading")
            if mode == "fail":
                raise RuntimeError("the save failed after its first chunk")
            if mode in ("kill", "stop"):
                os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)

    try:
        gpuckpt.save(
            state(int(seed)),
            url,
            storage_options=s3_options(endpoint, lease_seconds=3.0),
            progress=progress,
            threads=1,
        )
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    print("saved", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
