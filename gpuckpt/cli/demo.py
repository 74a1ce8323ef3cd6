"""The main job: train with periodic checkpoints, get killed mid-save, resume, verify bit-exact.

A small NumPy MLP is trained with Adam on synthetic data, next to a GPT-like
state of a few hundred MB (an embedding table fine-tuned one row per step,
plus frozen layers) so that checkpoint throughput means something. A
:class:`~gpuckpt.CheckpointManager` saves every few steps in the background.
The training runs in a child process that is killed with SIGKILL right after
it starts a save; the demo then resumes from the latest committed step,
finishes the run, and checks that the final state is bit-exact with an
uninterrupted reference run.

Run ``gpuckpt demo [DIR]`` (or ``python -m gpuckpt.cli demo [DIR]``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from gpuckpt.cli.progressbar import progress_for
from gpuckpt.cli.usage import UsageError
from gpuckpt.device.arrays import is_array
from gpuckpt.errors import DeviceUnavailableError
from gpuckpt.format.checksum import crc32c_backend
from gpuckpt.manager import CheckpointManager
from gpuckpt.state import flatten_state_dict
from gpuckpt.storage.local.crccopy import instruction_set
from gpuckpt.testing.states import gpt_state_dict
from gpuckpt.verify import verify_checkpoint

__all__ = ["add_arguments", "build_state", "run", "train_step"]

HELP = "train a small model with checkpoints, kill it mid-save, resume, and verify the result bit-exact"
_IN, _HIDDEN, _OUT, _BATCH = 64, 128, 10, 256


def array_module(device: str = "auto") -> Any:
    """NumPy, or CuPy when ``device`` is ``"gpu"`` (or ``"auto"`` and a GPU answers)."""
    from gpuckpt.device.cuda import gpu_available, import_cupy

    if device == "gpu":
        cupy = import_cupy()
        if not gpu_available():
            raise DeviceUnavailableError(
                "--device gpu needs a CUDA device, and CuPy found none (no driver, or no GPU); "
                "run with --device host, or on a machine with an NVIDIA GPU"
            )
        return cupy
    if device == "auto" and gpu_available():
        return import_cupy()
    return np


def _to(xp: Any, value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to(xp, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to(xp, v) for v in value]
    return xp.asarray(value) if isinstance(value, np.ndarray) else value


def _host(x: Any) -> Any:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x


def build_state(seed: int = 0, layers: int = 2, width: int = 1024, xp: Any = np) -> dict[str, Any]:
    """Initial training state: MLP weights, Adam moments, a GPT-like payload, counters.

    Built with NumPy's generator (the same bits everywhere), then moved to ``xp``'s memory.
    """
    rng = np.random.default_rng(seed)
    model = {
        "w1": (rng.standard_normal((_IN, _HIDDEN), dtype=np.float32) * np.float32(0.1)),
        "b1": np.zeros(_HIDDEN, np.float32),
        "w2": (rng.standard_normal((_HIDDEN, _OUT), dtype=np.float32) * np.float32(0.1)),
        "b2": np.zeros(_OUT, np.float32),
    }
    payload = gpt_state_dict(rng, vocab=32000, width=width, layers=layers, mlp=4 * width)["model"]
    state: dict[str, Any] = _to(
        xp,
        {
            "model": model,
            "optimizer": {
                "exp_avg": {k: np.zeros_like(v) for k, v in model.items()},
                "exp_avg_sq": {k: np.zeros_like(v) for k, v in model.items()},
                "lr": 1e-2,
                "betas": (0.9, 0.999),
                "eps": 1e-8,
            },
            "payload": payload,
            "data_seed": seed + 1,
            "step": 0,
            "loss": float("nan"),
        },
    )
    return state


def train_step(state: dict[str, Any], step: int) -> None:
    """One Adam step on a batch drawn from ``step``: deterministic given the state."""
    m, opt = state["model"], state["optimizer"]
    xp = np if isinstance(m["w1"], np.ndarray) else array_module("gpu")
    rng = np.random.default_rng([state["data_seed"], step])
    x_host = rng.standard_normal((_BATCH, _IN), dtype=np.float32)
    y_host = (x_host[:, :_OUT] * np.arange(1, _OUT + 1, dtype=np.float32)).argmax(axis=1)
    x, y = xp.asarray(x_host), xp.asarray(y_host)
    rows = xp.arange(_BATCH)
    h_pre = x @ m["w1"] + m["b1"]
    h = xp.maximum(h_pre, np.float32(0))
    logits = h @ m["w2"] + m["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    p = xp.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-xp.log(p[rows, y] + np.float32(1e-12)).mean())
    d = p
    d[rows, y] -= 1
    d /= np.float32(_BATCH)
    dh = (d @ m["w2"].T) * (h_pre > 0)
    grads = {"w2": h.T @ d, "b2": d.sum(axis=0), "w1": x.T @ dh, "b1": dh.sum(axis=0)}
    b1, b2 = opt["betas"]
    t = step  # Adam's bias correction: the global step
    for k, g in grads.items():
        ea, eas = opt["exp_avg"][k], opt["exp_avg_sq"][k]
        ea *= np.float32(b1)
        ea += np.float32(1 - b1) * g
        eas *= np.float32(b2)
        eas += np.float32(1 - b2) * g * g
        m_hat = ea / np.float32(1 - b1**t)
        v_hat = eas / np.float32(1 - b2**t)
        m[k] -= np.float32(opt["lr"]) * m_hat / (xp.sqrt(v_hat) + np.float32(opt["eps"]))
    emb = state["payload"]["embed"]["weight"]
    emb[step % emb.shape[0], :_HIDDEN] += np.float32(loss) * m["w1"][0]  # fine-tune one row
    state["step"] = step
    state["loss"] = loss


def _nbytes(state: dict[str, Any]) -> int:
    leaves, _ = flatten_state_dict(state, is_array)
    return sum(v.value.nbytes for v in leaves.values() if is_array(v.value))


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """FQNs whose values differ in bits, dtype, shape or type (plain values by ``==`` on their repr)."""
    la, _ = flatten_state_dict(a, is_array)
    lb, _ = flatten_state_dict(b, is_array)
    bad = sorted(set(la) ^ set(lb))
    for k in sorted(set(la) & set(lb)):
        x, y = _host(la[k].value), _host(lb[k].value)
        if is_array(x) or is_array(y):
            if (
                not (is_array(x) and is_array(y))
                or x.dtype != y.dtype
                or x.shape != y.shape
                or x.tobytes() != y.tobytes()
            ):
                bad.append(k)
        elif type(x) is not type(y) or repr(x) != repr(y):
            bad.append(k)
    return bad


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "dir", nargs="?", help="where to keep the checkpoints (default: a temporary directory, removed)"
    )
    p.add_argument("--steps", type=int, default=24, help="training steps in all (24)")
    p.add_argument("--save-every", type=int, default=4, help="checkpoint interval in steps (4)")
    p.add_argument(
        "--kill-at",
        type=int,
        default=12,
        help="kill the training right after it starts this step's save (12)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=2,
        help="GPT-like payload layers, ~48 MB each over a 131 MB embedding (2)",
    )
    p.add_argument("--keep", type=int, default=2, help="max_to_keep of the manager (2)")
    p.add_argument(
        "--device",
        choices=("auto", "host", "gpu"),
        default="auto",
        help="where the model lives: the GPU if one answers (auto), else host memory",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def _worker(args: argparse.Namespace, root: Path) -> int:
    state = build_state(layers=args.layers, xp=array_module(args.device))
    with CheckpointManager(root, max_to_keep=args.keep, save_interval_steps=args.save_every) as mgr:
        for step in range(1, args.steps + 1):
            train_step(state, step)
            saved = mgr.save(step, state)
            print(f"step {step} {'saving' if saved else 'trained'}", flush=True)
    return 0


def _run_child(args: argparse.Namespace, root: Path) -> tuple[int | None, str]:
    """Train in a child process; SIGKILL it once it reports starting the save of ``--kill-at``."""
    cmd = [
        sys.executable,
        "-m",
        "gpuckpt.cli",
        "demo",
        "--worker",
        str(root.parent),
        "--steps",
        str(args.steps),
        "--save-every",
        str(args.save_every),
        "--layers",
        str(args.layers),
        "--keep",
        str(args.keep),
        "--device",
        args.device,
    ]
    with tempfile.TemporaryFile() as err:
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        assert child.stdout is not None
        killed_at = None
        for line in child.stdout:
            if line.strip() == f"step {args.kill_at} saving":
                # kill mid-write: once the save's temporary directory exists (or soon after)
                deadline = time.monotonic() + 2.0
                prefix = f".step_{args.kill_at:08d}."
                while time.monotonic() < deadline and not any(
                    p.name.startswith(prefix) for p in root.iterdir()
                ):
                    time.sleep(0.001)
                child.send_signal(signal.SIGKILL)
                killed_at = args.kill_at
                break
        child.wait()
        child.stdout.close()
        if killed_at is None and child.returncode != 0:
            err.seek(0)
            lines = err.read().decode(errors="replace").strip().splitlines()
            raise RuntimeError(
                f"the training process failed (exit {child.returncode}): {lines[-1] if lines else ''}"
            )
    return killed_at, " ".join(cmd[1:])


def run(args: argparse.Namespace) -> int:
    for name in ("steps", "save_every", "kill_at", "layers", "keep"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gpuckpt-demo-"))
    root = work / "checkpoints"
    if args.worker:
        return _worker(args, root)
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(17, "the demo needs an empty checkpoint directory", os.fspath(root))
    try:
        return _main_job(args, root)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def _main_job(args: argparse.Namespace, root: Path) -> int:
    xp = array_module(args.device)
    where = "GPU (CuPy arrays, pinned staging)" if xp is not np else "host (NumPy)"
    print(
        f"device: {where}; CRC32C: {crc32c_backend()}; one-pass checked load: {instruction_set()}; "
        f"checkpoints in {root}",
        flush=True,
    )
    print(
        f"1. training {args.steps} steps in a child process, saving every {args.save_every} ...", flush=True
    )
    killed_at, _cmd = _run_child(args, root)
    if killed_at is None:
        print("   the run finished before it could be interrupted (--kill-at beyond --steps?)")
    else:
        print(f"   killed it with SIGKILL right after step {killed_at} started its background save")

    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
    mgr = CheckpointManager(root, max_to_keep=args.keep, save_interval_steps=args.save_every)
    left_after = [p.name for p in root.iterdir() if p.name.startswith(".")]
    steps = mgr.all_steps()
    latest = mgr.latest_step()
    if latest is None:
        print("FAILED: no committed checkpoint survived the interruption", file=sys.stderr)
        return 1
    print(
        f"2. committed steps on disk: {steps}; temporaries of interrupted saves: {len(leftovers)} found, "
        f"{len(leftovers) - len(left_after)} removed when the manager opened the directory"
    )
    bar = progress_for("   load", quiet=args.quiet)
    t0 = time.perf_counter()
    state = mgr.restore_state_dict(progress=bar, device="cpu" if xp is np else "cuda")
    t_load = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    nbytes = _nbytes(state)
    print(
        f"3. resumed from step {latest}: {nbytes / 1e6:.0f} MB loaded in {t_load:.2f} s "
        f"({nbytes / t_load / 1e9:.2f} GB/s)"
    )

    block = t_save = 0.0
    for step in range(latest + 1, args.steps + 1):
        train_step(state, step)
        t0 = time.perf_counter()
        if mgr.save(step, state, force=step == args.steps):
            t_block = time.perf_counter() - t0
            block += t_block
            mgr.wait() if step == args.steps else None
            t_save = time.perf_counter() - t0
    mgr.close()
    last = mgr.latest_step()
    print(f"4. trained to step {args.steps}; training waited {block:.2f} s in save() in all")
    if t_save:
        print(
            f"   last save: {nbytes / 1e6:.0f} MB committed (fsynced) in {t_save:.2f} s "
            f"({nbytes / t_save / 1e9:.2f} GB/s), "
            f"training blocked {t_block:.2f} s of it (snapshot)"
        )
    bar = progress_for("   verify", quiet=args.quiet)
    t0 = time.perf_counter()
    report = verify_checkpoint(mgr.step_path(last if last is not None else args.steps), progress=bar)
    t_verify = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    print(
        f"5. verify step {last}: {'OK' if report.ok else 'DAMAGED'} ({report.chunks} chunks, "
        f"{report.bytes_checked / t_verify / 1e9:.2f} GB/s)"
    )

    t0 = time.perf_counter()
    reference = build_state(layers=args.layers, xp=xp)
    for step in range(1, args.steps + 1):
        train_step(reference, step)
    bad = compare(state, reference)
    on_disk = compare(mgr.restore_state_dict(), reference)
    print(f"6. uninterrupted reference run: {time.perf_counter() - t0:.2f} s")
    if bad or on_disk or not report.ok:
        print(
            f"FAILED: {len(bad)} entries differ in memory, {len(on_disk)} on disk, "
            f"e.g. {(bad or on_disk)[:5]}",
            file=sys.stderr,
        )
        return 1
    print(
        f"OK: the resumed run is bit-exact with the uninterrupted one "
        f"({nbytes / 1e6:.0f} MB, loss {state['loss']:.4f})"
    )
    return 0
