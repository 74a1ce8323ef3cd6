"""The first call of a process: DCP through gpuckpt against DCP's own file system storage.

Each measurement is a fresh process that imports what it needs (torch,
``torch.distributed.checkpoint``, gpuckpt and ``gpuckpt.dcp``), builds its
state, and then times one call; interpreter start, imports and the state are
not counted. Per case (a state and a number of ranks), every round runs, each
in its own process and in another order each round (the rows of a Williams
design, ``bench.compare.driver.round_order``):

* ``save-gpuckpt``: ``dcp.save`` with ``gpuckpt.dcp.Writer`` (its defaults: durable);
* ``save-fs``: ``dcp.save`` with ``FileSystemWriter`` (its defaults: ``sync_files=True``,
  one thread);
* ``load-gpuckpt`` / ``load-fs``: ``dcp.load`` in place (preallocated, touched targets)
  through ``gpuckpt.dcp.Reader`` / ``FileSystemReader``, page cache warm;
* ``load-native``: ``gpuckpt.load`` in place of the same tensors (one process);
* ``read-plain``: the ceiling of ``load-native``: every chunk file of that native
  checkpoint opened, read with one ``readv`` into its own preallocated, touched buffer
  and closed, checking nothing (the same files and bytes ``gpuckpt.load`` reads; its
  ``zarr.json`` documents aside).

With 2 ranks (gloo, launched as torchrun would: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), every rank holds the whole state (replicated, as
with DDP: DCP spreads the writes over the ranks) and times the call between two
barriers; a measurement's time is the slowest rank's, its CPU time the sum over
the ranks (``os.times``: user + system, all threads).

States: ``gpt`` (GPT-like float32 weights, 241 tensors, 1.06 GiB: an embedding and 20
layers of attention, MLP, biases and norms) and ``adam`` (a small transformer's
parameters and AdamW state from ``torch.distributed.checkpoint.state_dict.get_state_dict``
after one step: 230 tensors, 0.43 GB, and the optimizer's plain values).

Ratios are of medians over the measured rounds, against the ceilings of the same
run, with the targets: first ``dcp.save`` through gpuckpt <= 1.2x ``FileSystemWriter``'s,
first ``dcp.load`` <= 0.5x ``FileSystemReader``'s, ``gpuckpt.load`` >= 0.9x the
speed of the plain read (time <= plain / 0.9).

Settling this VM. It hands memory that has been free for about 2 s back to its host
(touching it again then costs a host page fault per page), so every process waits
``--settle-op`` seconds (default 3), idle, right before its timed call, and every save
starts after an ``os.sync()``. Deleting many files slows down file creations for
minutes on this file system (ext4 skips recently freed inodes), which would charge the
many-file gpuckpt saves for the outputs of earlier rounds: the run starts with a sync
and a wait of ``--settle`` seconds (default 361, ``bench.compare.common.SETTLE_S``), and
no output is deleted until the last measurement: each is moved aside (one rename)
unless the file system has less than 16 GiB free, then deleted at the end.

``--variant LABEL=PATH[;NAME=VALUE...]`` adds a gpuckpt from another source tree (``PATH``
first on ``PYTHONPATH``, e.g. an older commit from ``git archive``; empty: this checkout),
with the environment variables given (e.g. ``GPUCKPT_CRC32C=crc32c``), as more systems of
the same run, interleaved with the others.

Usage (in an environment with torch: ``.venv311``)::

    python bench/bench_dcp_first.py [--cases gpt:1,adam:1,adam:2] [--rounds 5] [--warmup 1]
        [--settle 361] [--settle-op 3] [--no-sync] [--calls 1] [--variant 'old=/tmp/old;NAME=VALUE']
        [--dir DIR] [--json OUT] [--md OUT] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# the repository, for bench.compare: last, so that a variant's gpuckpt (first on PYTHONPATH) wins
sys.path.append(str(REPO))

from bench.compare.common import (  # noqa: E402
    OP_SETTLE_S,
    SETTLE_S,
    cut_from,
    fingerprint,
    settle,
    tree_files,
    warm_cache,
)
from bench.compare.driver import loadavg, round_order  # noqa: E402

OPS = ("save-gpuckpt", "save-fs", "load-gpuckpt", "load-fs", "load-native", "read-plain")
SINGLE_PROCESS = ("load-native", "read-plain")  # measured in the cases of one rank only
TARGETS = {  # (system, ceiling, most allowed time ratio, wording)
    "save": ("save-gpuckpt", "save-fs", 1.2, "first dcp.save <= 1.2x FileSystemWriter's"),
    "load": ("load-gpuckpt", "load-fs", 0.5, "first dcp.load <= 0.5x FileSystemReader's"),
    "native": ("load-native", "read-plain", 1 / 0.9, "first gpuckpt.load >= 0.9x a plain read"),
}
#: outputs are moved aside (deleted at the end) while the file system has this much free
ASIDE_FREE_BYTES = 16 << 30
_BLOCK = 4 << 20  # elements of the seeded block every GPT tensor is cut from


# states (built in each measurement process) ------------------------------------------


def gpt_shapes(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """241 tensors (an embedding, 20 layers of 12), 1.06 GiB of float32; toy sizes with ``quick``."""
    vocab, width, layers, mlp = (512, 64, 2, 256) if quick else (32000, 1024, 20, 4096)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed.weight", (vocab, width))]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.attn.{n}", (width, width)) for n in ("q", "k", "v", "o")]
        shapes += [(f"{p}.mlp.up", (width, mlp)), (f"{p}.mlp.down", (mlp, width))]
        shapes += [(f"{p}.mlp.up_bias", (mlp,)), (f"{p}.mlp.down_bias", (width,))]
        shapes += [(f"{p}.{n}.{w}", (width,)) for n in ("norm1", "norm2") for w in ("weight", "bias")]
    return shapes


def gpt_state(quick: bool) -> dict[str, Any]:
    """The GPT-like state as ``{fqn: float32 array}``, the same bytes in every process."""
    import numpy as np

    rng = np.random.default_rng(0)
    block = (rng.standard_normal(_BLOCK, dtype=np.float32) * np.float32(0.02)).astype(np.float32)
    shapes = gpt_shapes(quick)
    offsets = rng.integers(0, _BLOCK, size=len(shapes))
    return {
        name: cut_from(block, shape, int(off)) for (name, shape), off in zip(shapes, offsets, strict=True)
    }


def adam_state(quick: bool) -> dict[str, Any]:
    """A small transformer's state and its AdamW state after one step, as
    ``get_state_dict`` gives them: ``{"model": {...}, "optim": {"state": ..., "param_groups": ...}}``
    (35.3 M parameters: 0.43 GB with both moments)."""
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    width, vocab, layers, seq = (32, 256, 1, 16) if quick else (512, 32000, 6, 1024)
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)

    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def build_state(kind: str, quick: bool, torch_tensors: bool) -> dict[str, Any]:
    if kind == "gpt":
        state = gpt_state(quick)
        if torch_tensors:
            import torch

            return {k: torch.from_numpy(v) for k, v in state.items()}
        return state
    if kind == "adam":
        return adam_state(quick)
    raise ValueError(f"unknown state {kind!r}; expected gpt or adam")


def tensors_of(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The tensors (or arrays) of a nested state, by dotted path, as NumPy arrays."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(tensors_of(v, name + "."))
        elif hasattr(v, "numpy") and hasattr(v, "dtype"):
            out[name] = v.detach().numpy()
        elif hasattr(v, "dtype") and hasattr(v, "shape"):
            out[name] = v
    return out


# one measurement process ----------------------------------------------------------------


def _rusage() -> tuple[float, int, int]:
    import resource

    t = os.times()
    r = resource.getrusage(resource.RUSAGE_SELF)
    return t.user + t.system, r.ru_minflt, r.ru_majflt


class _Collections:
    """The garbage collector's runs while installed (``gc.callbacks``): a full collection walks
    every object of the process (a few hundred thousand after importing torch: ~0.1 s here), and
    lands in whatever code allocates when it comes due."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.runs.append((int(info["generation"]), time.perf_counter() - self._start))

    def summary(self) -> dict[str, Any]:
        return {
            "gc_s": sum(s for _, s in self.runs),
            "gc_full": sum(1 for g, _ in self.runs if g == 2),
            "gc_full_s": sum(s for g, s in self.runs if g == 2),
        }


def child(spec: dict[str, Any]) -> None:
    """Build the state, wait, time ``spec["op"]`` ``spec["calls"]`` times, print one record."""
    op, kind, quick = spec["op"], spec["state"], spec["quick"]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    import numpy as np

    dist = dcp = gpuckpt = None
    if op != "read-plain":
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
    if op in ("save-gpuckpt", "load-gpuckpt", "load-native"):
        import gpuckpt
        import gpuckpt.dcp

        tree = spec.get("tree")
        if tree is not None and not Path(gpuckpt.__file__).resolve().is_relative_to(Path(tree).resolve()):
            raise RuntimeError(
                f"this process imported {gpuckpt.__file__}, not the variant's gpuckpt in {tree}"
            )
    if world > 1:
        assert dist is not None
        dist.init_process_group("gloo", rank=rank, world_size=world)

    sync = spec["sync"]
    out_paths = [f"{spec['out']}-{i}" for i in range(spec["calls"])]
    expected = None
    if op.startswith("save"):
        state = build_state(kind, quick, torch_tensors=True)
    elif op == "read-plain":
        files = sorted(f for f in tree_files(spec["ref"]) if os.path.basename(f) != "zarr.json")
        buffers = [np.ones(os.path.getsize(f), np.uint8) for f in files]  # allocated and touched
        warm_cache(spec["ref"])
    else:
        state = build_state(kind, quick, torch_tensors=op != "load-native")
        expected = fingerprint(tensors_of(state))
        for a in tensors_of(state).values():  # the targets: the same structure, zeroed (touched)
            a[...] = 0
        if op == "load-native":
            state = tensors_of(state)
        warm_cache(spec["ref"])

    def call(i: int) -> None:
        if op == "save-gpuckpt":
            w = gpuckpt.dcp.Writer(out_paths[i], sync="auto" if sync else "none")  # type: ignore[union-attr]
            dcp.save(state, storage_writer=w)  # type: ignore[union-attr]
        elif op == "save-fs":
            w = dcp.FileSystemWriter(out_paths[i], sync_files=sync)  # type: ignore[union-attr]
            dcp.save(state, storage_writer=w)  # type: ignore[union-attr]
        elif op == "load-gpuckpt":
            dcp.load(state, storage_reader=gpuckpt.dcp.Reader(spec["ref"]))  # type: ignore[union-attr]
        elif op == "load-fs":
            dcp.load(state, storage_reader=dcp.FileSystemReader(spec["ref"]))  # type: ignore[union-attr]
        elif op == "load-native":
            gpuckpt.load(state, spec["ref"])  # type: ignore[union-attr]
        elif op == "read-plain":
            for f, buf in zip(files, buffers, strict=True):
                fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if os.readv(fd, [buf]) != buf.nbytes:
                        raise OSError(f"short read of {f}")
                finally:
                    os.close(fd)
        else:
            raise ValueError(f"unknown operation {op!r}")

    calls = []
    for i in range(spec["calls"]):
        if op.startswith("save"):
            os.sync()
        time.sleep(spec["settle_op"])
        if world > 1:
            dist.barrier()  # type: ignore[union-attr]
        collections = _Collections()
        gc.callbacks.append(collections)
        cpu0, minflt0, majflt0 = _rusage()
        at = time.monotonic()  # to match with system-wide traces (perf record -k CLOCK_MONOTONIC)
        t0 = time.perf_counter()
        call(i)
        if world > 1:
            dist.barrier()  # type: ignore[union-attr]
        seconds = time.perf_counter() - t0
        cpu1, minflt1, majflt1 = _rusage()
        gc.callbacks.remove(collections)
        calls.append(
            {
                "seconds": seconds,
                "cpu_s": cpu1 - cpu0,
                "minflt": minflt1 - minflt0,
                "majflt": majflt1 - majflt0,
                "monotonic": at,
                **collections.summary(),
            }
        )
    verified = None
    if expected is not None:
        verified = fingerprint(tensors_of(state)) == expected
    record = {
        "op": op,
        "rank": rank,
        "world": world,
        "pid": os.getpid(),
        "calls": calls,
        "verified": verified,
    }
    if dcp is not None:
        import torch

        record["torch"] = torch.__version__
    if op.startswith("save") and rank == 0:
        files = tree_files(out_paths[0])
        record["files"] = len(files)
        record["disk_bytes"] = sum(os.path.getsize(f) for f in files)
    if op in ("save-gpuckpt", "load-gpuckpt", "load-native"):
        from gpuckpt.format.checksum import crc32c_backend
        from gpuckpt.storage.local.crccopy import instruction_set

        record["version"] = (
            f"gpuckpt {gpuckpt.__version__} from {Path(gpuckpt.__file__).parent}, "  # type: ignore[union-attr]
            f"CRC32C: {crc32c_backend()}, copy-with-CRC: {instruction_set()}"
        )
    sys.stdout.write("@@RESULT " + json.dumps(record) + "\n")
    sys.stdout.flush()
    if world > 1:
        dist.destroy_process_group()  # type: ignore[union-attr]
    os._exit(0)  # gloo's teardown has aborted a rank on a loaded machine (see bench/compare)


def prepare(spec: dict[str, Any]) -> None:
    """Write the reference checkpoints the loads read: through DCP (both storages) and native."""
    import torch.distributed.checkpoint as dcp

    import gpuckpt
    import gpuckpt.dcp

    state = build_state(spec["state"], spec["quick"], torch_tensors=True)
    refs = spec["refs"]
    dcp.save(state, storage_writer=gpuckpt.dcp.Writer(refs["load-gpuckpt"]))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(refs["load-fs"]))
    gpuckpt.save(tensors_of(state), refs["load-native"])
    print("@@RESULT " + json.dumps({"tensors": len(tensors_of(state))}), flush=True)


# the driver ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Variant:
    """The gpuckpt a process runs: this checkout (``path`` None) or another source tree, and
    environment variables set for it."""

    label: str = ""
    path: str | None = None
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``LABEL=PATH[;NAME=VALUE...]``; raises ValueError."""
        label, sep, rest = text.partition("=")
        path, *assignments = rest.split(";")
        pairs = [a.split("=", 1) for a in assignments]
        if not sep or not label or any(len(a) != 2 or not a[0] for a in pairs):
            raise ValueError("expected LABEL=PATH[;NAME=VALUE...]")
        if path and not Path(path, "gpuckpt").is_dir():
            raise ValueError(f"{path}/gpuckpt is not a directory")
        return cls(label, os.path.abspath(path) if path else None, tuple((a[0], a[1]) for a in pairs))


def run_processes(spec: dict[str, Any], world: int, variant: Variant, mode: str) -> list[dict[str, Any]]:
    """Run ``world`` processes of ``spec``; their records."""
    env = {**os.environ, **dict(variant.env)}
    paths = [p for p in (variant.path, str(REPO), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, mode, json.dumps(spec)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    records = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        got = [json.loads(line[9:]) for line in out.splitlines() if line.startswith("@@RESULT ")]
        if p.returncode != 0 or not got:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{mode} {spec} failed ({p.returncode}):\n{err[-3000:]}")
        records += got
    return records


def combine(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One measurement from each rank's record: the slowest rank's time, the ranks' CPU summed."""
    ncalls = len(records[0]["calls"])
    calls = [
        {
            "seconds": max(r["calls"][i]["seconds"] for r in records),
            "cpu_s": sum(r["calls"][i]["cpu_s"] for r in records),
            "minflt": sum(r["calls"][i]["minflt"] for r in records),
            "majflt": sum(r["calls"][i]["majflt"] for r in records),
            "monotonic": min(r["calls"][i]["monotonic"] for r in records),
            "gc_s": max(r["calls"][i]["gc_s"] for r in records),
            "gc_full": max(r["calls"][i]["gc_full"] for r in records),
            "gc_full_s": max(r["calls"][i]["gc_full_s"] for r in records),
        }
        for i in range(ncalls)
    ]
    first = next(r for r in records if r["rank"] == 0)
    out = {k: v for k, v in first.items() if k not in ("calls", "rank", "verified")}
    out["calls"] = calls
    out["verified"] = None if first["verified"] is None else all(r["verified"] for r in records)
    return out


def aside(path: Path, trash: Path) -> None:
    """Move a finished output into ``trash`` (deleted at the end), or delete it now when space is short."""
    if not path.exists():
        return
    if shutil.disk_usage(path.parent).free >= ASIDE_FREE_BYTES:
        trash.mkdir(exist_ok=True)
        os.rename(path, trash / f"{path.name}-{time.monotonic_ns()}")
    else:
        shutil.rmtree(path, ignore_errors=True)
    os.sync()


def _stats(v: list[float]) -> dict[str, float]:
    return {"median": statistics.median(v), "min": min(v), "max": max(v)}


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def summarize(case: str, records: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Medians per system and the ratios to the ceilings of the same run."""
    systems: dict[str, dict[str, Any]] = {}
    for rec in records:
        s = systems.setdefault(rec["system"], {"first": [], "first_cpu": [], "later": [], "rounds": {}})
        s["first"].append(rec["calls"][0]["seconds"])
        s["first_cpu"].append(rec["calls"][0]["cpu_s"])
        s["later"] += [c["seconds"] for c in rec["calls"][1:]]
        s["rounds"][rec["round"]] = rec["calls"][0]["seconds"]
    table = {
        name: {
            "first_s": _stats(s["first"]),
            "first_cpu_s": _stats(s["first_cpu"]),
            **({"later_s": _stats(s["later"])} if s["later"] else {}),
            "n": len(s["first"]),
        }
        for name, s in systems.items()
    }
    ratios = {}
    for key, (system, ceiling, most, wording) in TARGETS.items():
        for v in variants:
            name = system + (f"@{v}" if v else "")
            if name not in systems or ceiling not in systems:
                continue
            ratio = _ratio(table[name]["first_s"]["median"], table[ceiling]["first_s"]["median"])
            per_round = [
                _ratio(systems[name]["rounds"][r], systems[ceiling]["rounds"][r])
                for r in systems[name]["rounds"]
                if r in systems[ceiling]["rounds"]
            ]
            ratios[f"{key}{'@' + v if v else ''}"] = {
                "system": name,
                "ceiling": ceiling,
                "ratio": ratio,
                "per_round": _stats(per_round),
                "cpu_ratio": _ratio(
                    table[name]["first_cpu_s"]["median"], table[ceiling]["first_cpu_s"]["median"]
                ),
                "target": most,
                "met": ratio <= most,
                "wording": wording,
            }
    return {"case": case, "systems": table, "ratios": ratios}


def report(results: dict[str, Any]) -> str:
    lines = [
        "# First calls of a process: gpuckpt.dcp against DCP's file system storage",
        "",
        f"- run: {results['date']}, `{results['command']}`, {results['elapsed_s']:.0f} s",
        f"- machine: {results['machine']}; load average before {results['load_before']}, "
        f"after {results['load_after']}",
        f"- {results['rounds']} measured round(s) after {results['warmup']} warm-up round(s), each "
        f"measurement a fresh process, timed after imports; each process waited {results['settle_op']} s, "
        f"idle, before its call; settled {results['settle_waited_s']:.0f} s first; durable saves: "
        f"{results['sync']}",
        *(f"- {k}: {v}" for k, v in results["versions"].items()),
        "",
    ]
    for s in results["cases"]:
        lines += [
            f"## {s['case']}",
            "",
            "| system | first call s (median; min-max) | CPU s (median) | later calls s |",
            "|---|---|---|---|",
        ]
        for name, t in sorted(s["systems"].items()):
            f, c = t["first_s"], t["first_cpu_s"]
            later = f"{t['later_s']['median']:.3f}" if "later_s" in t else "-"
            lines.append(
                f"| {name} | {f['median']:.3f} ({f['min']:.3f}-{f['max']:.3f}) | {c['median']:.3f} | {later} |"
            )
        lines += [
            "",
            "| target | ratio of medians (per round: min-max) | CPU ratio | verdict |",
            "|---|---|---|---|",
        ]
        for r in s["ratios"].values():
            pr = r["per_round"]
            lines.append(
                f"| {r['wording']}: {r['system']} / {r['ceiling']} <= {r['target']:.2f} | {r['ratio']:.2f} "
                f"({pr['min']:.2f}-{pr['max']:.2f}) | {r['cpu_ratio']:.2f} | {'met' if r['met'] else 'missed'} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(json.loads(argv[1]))
        return 0
    if argv[:1] == ["--prepare"]:
        prepare(json.loads(argv[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="gpt:1,adam:1,adam:2", help="STATE:RANKS,... (states: gpt, adam)")
    ap.add_argument("--ops", default=",".join(OPS), help="systems to measure (default: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and discarded")
    ap.add_argument("--calls", type=int, default=1, help="calls per process (the first is the figure)")
    ap.add_argument("--no-sync", action="store_true", help="saves without durability on both sides")
    ap.add_argument("--settle", type=float, default=SETTLE_S, help="seconds to wait first (see above)")
    ap.add_argument("--settle-op", type=float, default=OP_SETTLE_S, help="idle seconds before each call")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="LABEL=PATH[;NAME=VALUE...]: another gpuckpt source tree (PATH empty: this one) and environment",
    )
    ap.add_argument(
        "--variants-only",
        action="store_true",
        help="measure gpuckpt in the --variant trees only, not this one",
    )
    ap.add_argument("--quick", action="store_true", help="toy sizes, no settling, one round")
    ap.add_argument("--dir", help="directory on the file system to measure (default: a temp dir)")
    ap.add_argument("--json", help="write the records and results here")
    ap.add_argument("--md", help="write the report here")
    args = ap.parse_args(argv)
    if args.quick:
        args.settle, args.settle_op, args.rounds, args.warmup = 0.0, 0.0, 1, 0
    if args.settle < 0 or args.settle_op < 0 or args.rounds < 1 or args.calls < 1:
        ap.error("--settle and --settle-op must be >= 0, --rounds and --calls >= 1")
    variants = [] if args.variants_only else [Variant()]
    for v in args.variant:
        try:
            variants.append(Variant.parse(v))
        except ValueError as exc:
            ap.error(f"--variant {v!r}: {exc}")
    if not variants:
        ap.error("--variants-only needs at least one --variant")
    ops = [o for o in args.ops.split(",") if o]
    if unknown := set(ops) - set(OPS):
        ap.error(f"unknown --ops {sorted(unknown)}; expected some of {', '.join(OPS)}")
    cases = []
    for c in args.cases.split(","):
        kind, _, ranks = c.partition(":")
        if kind not in ("gpt", "adam") or not ranks.isdigit() or int(ranks) < 1:
            ap.error(f"--cases {c!r}: expected STATE:RANKS with STATE gpt or adam")
        cases.append((kind, int(ranks)))

    started = time.perf_counter()
    base = Path(tempfile.mkdtemp(prefix="gpuckpt-bench-dcp-first-", dir=args.dir))
    trash = base / ".trash"
    results: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python bench/bench_dcp_first.py", *argv]),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "load_before": loadavg(),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "settle_op": args.settle_op,
        "sync": not args.no_sync,
        "cases": [],
        "records": [],
        "versions": {},
    }
    try:
        t = time.perf_counter()
        settle(trash, args.settle)
        results["settle_waited_s"] = time.perf_counter() - t
        refs: dict[str, dict[str, str]] = {}
        for kind in dict.fromkeys(k for k, _ in cases):
            refs[kind] = {
                op: str(base / f"ref-{kind}-{op}") for op in ("load-gpuckpt", "load-fs", "load-native")
            }
            run_processes(
                {"state": kind, "quick": args.quick, "refs": refs[kind]}, 1, variants[0], "--prepare"
            )
            refs[kind]["read-plain"] = refs[kind]["load-native"]
        for kind, world in cases:
            case = f"{kind}, {world} rank{'s' if world > 1 else ''}"
            systems = [
                (op, variant)
                for op in ops
                if not (world > 1 and op in SINGLE_PROCESS)
                for variant in (
                    variants if op in ("save-gpuckpt", "load-gpuckpt", "load-native") else [Variant()]
                )
            ]
            records = []
            for rnd in range(args.warmup + args.rounds):
                for op, variant in round_order(systems, rnd):  # type: ignore[arg-type]
                    name = op + (f"@{variant.label}" if variant.label else "")
                    out = base / f"out-{kind}-{world}-{name}-{rnd}"
                    spec = {
                        "op": op,
                        "state": kind,
                        "quick": args.quick,
                        "sync": not args.no_sync,
                        "calls": args.calls,
                        "settle_op": args.settle_op,
                        "out": str(out),
                        "ref": refs[kind].get(op, ""),
                        "tree": variant.path,
                    }
                    rec = combine(run_processes(spec, world, variant, "--child"))
                    rec.update(system=name, case=case, round=rnd - args.warmup)
                    if rec.get("verified") is False:
                        raise RuntimeError(f"{name} ({case}): the loaded tensors differ from the state")
                    if "version" in rec:
                        results["versions"][name] = rec["version"]
                    for i in range(args.calls):
                        aside(Path(f"{out}-{i}"), trash)
                    print(
                        f"{case} round {rnd - args.warmup:+d} {name}: "
                        + ", ".join(f"{c['seconds']:.3f} s (CPU {c['cpu_s']:.2f})" for c in rec["calls"]),
                        file=sys.stderr,
                        flush=True,
                    )
                    if rnd >= args.warmup:
                        records.append(rec)
            results["records"] += records
            results["cases"].append(summarize(case, records, [v.label for v in variants]))
    finally:
        shutil.rmtree(base, ignore_errors=True)  # with what was set aside: after the last measurement
    results["load_after"] = loadavg()
    results["elapsed_s"] = time.perf_counter() - started
    text = report(results)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
