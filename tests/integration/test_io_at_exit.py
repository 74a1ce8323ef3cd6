"""Loads, resharding loads and verification work from exit handlers, like saves.

While the interpreter exits, a ``concurrent.futures`` pool refuses work
("cannot schedule new futures after interpreter shutdown"); every pipeline
runs its jobs on gpuckpt's own workers instead (:mod:`gpuckpt.runtime.runner`), which
take work until the process ends. Each scenario runs in a real subprocess,
bounded by a timeout that kills its process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, sys
import numpy as np
root = sys.argv[1]
w = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)

def at_exit():
    import gpuckpt
    from gpuckpt.device.host_backend import HostBackend
    from gpuckpt.device.sharded import ShardedArray
    from gpuckpt.verify import verify_checkpoint

    back = gpuckpt.load_state_dict(root)
    print("load_state_dict", np.array_equal(back["w"], w), flush=True)
    target = {"w": np.zeros_like(w)}
    gpuckpt.load(target, root)
    print("load", np.array_equal(target["w"], w), flush=True)
    rows = {"w": ShardedArray(np.zeros((40, 1024), np.float32), (20, 0), w.shape)}
    gpuckpt.load(rows, root)
    print("reshard", np.array_equal(rows["w"].local, w[20:60]), flush=True)
    dev = gpuckpt.load_state_dict(root, device=HostBackend())
    print("device", np.array_equal(dev["w"], w), flush=True)
    print("verify", verify_checkpoint(root).ok, flush=True)

import gpuckpt
gpuckpt.save({"w": w}, root, chunk_bytes=16 << 10, sync="none")  # 16 chunks: several jobs
atexit.register(at_exit)  # exit handlers run after concurrent.futures pools stopped taking work
"""


MANY_SMALL = """
import atexit, sys
import numpy as np
root = sys.argv[1]
# more chunk files than one thread checks (gpuckpt.storage.local.batchio.PARALLEL_STAT_MIN), more
# than a load checks on a thread of its own (gpuckpt.loading.checks.BACKGROUND_CHECK_MIN)
state = {f"t{i}": np.full(4, i, np.float32) for i in range(2100)}

def at_exit():
    import gpuckpt
    from gpuckpt.storage.local import batchio

    print("native", batchio.available(), flush=True)
    target = {k: np.zeros(4, np.float32) for k in state}
    gpuckpt.load(target, root)
    print("load", all(np.array_equal(target[k], v) for k, v in state.items()), flush=True)
    back = gpuckpt.load_state_dict(root)
    print("load_state_dict", all(np.array_equal(back[k], v) for k, v in state.items()), flush=True)

import gpuckpt
gpuckpt.save(state, root, sync="none")
atexit.register(at_exit)
"""


def _run_at_exit(script: str, root: Path) -> list[str]:
    """The lines a child running ``script`` (with ``root`` as its argument) printed; fails
    when it hung, failed or printed a traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("GPUCKPT_DIRECT_IO", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the child hung (killed after 120 s); stderr:\n{err}") from None
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    return out.split("\n")


def test_loads_and_verify_run_from_an_exit_handler(tmp_path: Path) -> None:
    assert _run_at_exit(SCRIPT, tmp_path / "c") == [
        "load_state_dict True",
        "load True",
        "reshard True",
        "device True",
        "verify True",
        "",
    ]


def test_loads_of_many_small_tensors_run_from_an_exit_handler(tmp_path: Path) -> None:
    """Checking thousands of chunk files takes threads of gpuckpt's own pools (none can be
    started while the interpreter exits: a thread of its own made such a load fail there)."""
    lines = _run_at_exit(MANY_SMALL, tmp_path / "c")
    assert lines[1:] == ["load True", "load_state_dict True", ""]
    assert lines[0] in ("native True", "native False")
