"""Small states against the file system's own floor, measured in the same run.

Two states: ``tiny`` (20 tensors of 4-64 KiB) and ``small`` (10,000 tensors of
4-64 KiB, ``--small N`` to change). For each, every round runs, in turn:

* ``floor``: the very files and directories of gpuckpt's checkpoint (copied, bytes
  and names, from a warm-up save) created with plain ``os`` calls under a temporary
  name, made durable, renamed into place and the parent directory fsynced. Durable
  two ways: ``floor-fsync`` fsyncs every file as written and every directory at the
  end (only for states of at most ``--fsync-floor-files`` files, default 1000: here
  one fsync costs 1-5 ms, so 20,000 of them take a minute); ``floor-syncfs`` runs
  one ``syncfs``. The floor is the faster of the two (per round). Its load opens, reads and closes every chunk file into preallocated
  buffers, without checking anything.
* ``gpuckpt``: ``gpuckpt.save`` (durable, the defaults), ``gpuckpt.load`` in place
  (warm: page cache full), the same after evicting the files (cold), and
  ``gpuckpt.load_state_dict`` (warm, allocating).

Ratios are gpuckpt's median over the floor's median. Then the first calls of a
process: a fresh interpreter imports gpuckpt (untimed), saves the tiny state four
times, and another loads a tiny checkpoint four times; the first call over the
median of the later ones is reported.

Settling the file system: deleting tens of thousands of files makes creating files
slow for minutes afterwards on this file system (ext4 skips recently freed inodes;
see ``bench.compare.common.SETTLE_S``). So the run starts with a sync and a wait of
``--settle`` seconds (default 361) for files deleted before it to stop mattering;
during the run nothing with many files is deleted: outputs are moved aside (one
rename, ``bench.compare.common.set_aside``) and deleted after the last measurement. Floor and gpuckpt alternate within each round, so
that whatever drift remains hits both. Every save starts after an ``os.sync()``.

Usage: ``python bench/bench_small.py [--rounds 3] [--small 10000] [--settle 361] [--dir DIR] [--json OUT]``
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for bench.compare

import gpuckpt
from bench.compare.common import SETTLE_S, drop_cache, set_aside, settle, warm_cache
from gpuckpt.format.checksum import crc32c_backend
from gpuckpt.storage.local import batchio, crccopy


def small_state(n: int, seed: int) -> dict[str, np.ndarray]:
    """``n`` float32 tensors of 4-64 KiB."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1024, 16 * 1024 + 1, size=n)
    return {f"t{i:05d}": rng.standard_normal(int(s), dtype=np.float32) for i, s in enumerate(sizes)}


def tree_of(path: Path) -> tuple[list[str], list[tuple[str, bytes]]]:
    """Directories (parents first) and files (with their bytes) of a checkpoint, relative to it."""
    dirs: list[str] = []
    files: list[tuple[str, bytes]] = []
    for root, dnames, fnames in os.walk(path):
        rel = os.path.relpath(root, path)
        dirs += [os.path.normpath(os.path.join(rel, d)) for d in sorted(dnames)]
        files += [
            (os.path.normpath(os.path.join(rel, f)), Path(root, f).read_bytes()) for f in sorted(fnames)
        ]
    return dirs, files


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _fsync_path(p: str) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def floor_save(dirs: list[str], files: list[tuple[str, bytes]], path: Path, mode: str) -> None:
    """Create the tree under a temporary name, make it durable (``mode``), publish it by a rename."""
    tmp = f"{path.parent}/.{path.name}.tmp"
    os.mkdir(tmp)
    for d in dirs:
        os.mkdir(f"{tmp}/{d}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for rel, data in files:
        fd = os.open(f"{tmp}/{rel}", flags, 0o644)
        try:
            os.write(fd, data)
            if mode == "fsync":
                os.fsync(fd)
        finally:
            os.close(fd)
    if mode == "fsync":
        for d in reversed(dirs):
            _fsync_path(f"{tmp}/{d}")
        _fsync_path(tmp)
    else:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            if _libc.syncfs(fd) != 0:
                raise OSError(ctypes.get_errno(), "syncfs failed", tmp)
        finally:
            os.close(fd)
    os.rename(tmp, path)
    _fsync_path(os.fspath(path.parent))


def floor_load(chunks: list[tuple[str, np.ndarray]], path: Path) -> None:
    """Open, read and close every chunk file into its preallocated buffer."""
    for rel, buf in chunks:
        fd = os.open(f"{path}/{rel}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.readv(fd, [buf])
        finally:
            os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _stats(v: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}


def bench_state(
    label: str, sd: dict[str, np.ndarray], rounds: int, base: Path, trash: Path, fsync_floor_files: int
) -> dict[str, Any]:
    targets = {k: np.empty_like(v) for k, v in sd.items()}
    ref = base / f"{label}-ref"
    gpuckpt.save(sd, ref)  # warm-up, and the tree the floor copies
    dirs, files = tree_of(ref)
    chunk_files = [
        (rel, np.empty(len(data), np.uint8)) for rel, data in files if os.path.basename(rel) != "zarr.json"
    ]
    set_aside(ref, trash)
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "floor-fsync save",
            "floor-syncfs save",
            "floor save",
            "floor warm load",
            "floor cold load",
            "gpuckpt save",
            "gpuckpt warm load",
            "gpuckpt cold load",
            "gpuckpt load_state_dict",
        )
    }
    for r in range(rounds):
        saves = {}
        for mode in ("fsync", "syncfs") if len(files) <= fsync_floor_files else ("syncfs",):
            p = base / f"{label}-floor-{mode}-{r}"
            os.sync()
            saves[mode] = timed(lambda p=p, mode=mode: floor_save(dirs, files, p, mode))
            times[f"floor-{mode} save"].append(saves[mode])
            if mode == "syncfs":
                warm_cache(os.fspath(p))
                times["floor warm load"].append(timed(lambda p=p: floor_load(chunk_files, p)))
                drop_cache(os.fspath(p))
                times["floor cold load"].append(timed(lambda p=p: floor_load(chunk_files, p)))
            set_aside(p, trash)
        times["floor save"].append(min(saves.values()))
        p = base / f"{label}-gpuckpt-{r}"
        os.sync()
        times["gpuckpt save"].append(timed(lambda p=p: gpuckpt.save(sd, p)))
        warm_cache(os.fspath(p))
        times["gpuckpt warm load"].append(timed(lambda p=p: gpuckpt.load(targets, p)))
        times["gpuckpt load_state_dict"].append(timed(lambda p=p: gpuckpt.load_state_dict(p)))
        drop_cache(os.fspath(p))
        times["gpuckpt cold load"].append(timed(lambda p=p: gpuckpt.load(targets, p)))
        set_aside(p, trash)
    for k, v in sd.items():  # the loads really happened
        assert targets[k].tobytes() == v.tobytes(), k
    times = {k: v for k, v in times.items() if v}
    out: dict[str, Any] = {
        "label": label,
        "tensors": len(sd),
        "bytes": sum(v.nbytes for v in sd.values()),
        "directories": len(dirs) + 1,
        "files": len(files),
        "times": {k: _stats(v) for k, v in times.items()},
    }
    med = {k: v["median_s"] for k, v in out["times"].items()}
    out["ratios"] = {
        "save / floor save": med["gpuckpt save"] / med["floor save"],
        **(
            {"save / floor-fsync save": med["gpuckpt save"] / med["floor-fsync save"]}
            if "floor-fsync save" in med
            else {}
        ),
        "warm load / floor warm load": med["gpuckpt warm load"] / med["floor warm load"],
        "cold load / floor cold load": med["gpuckpt cold load"] / med["floor cold load"],
        "load_state_dict / floor warm load": med["gpuckpt load_state_dict"] / med["floor warm load"],
    }
    return out


_FIRST_SAVES = """
    import json, sys, time, numpy as np
    import gpuckpt
    rng = np.random.default_rng(1)
    sd = {f"t{i}": rng.standard_normal(int(n), dtype=np.float32) for i, n in enumerate(rng.integers(1024, 16385, 20))}
    out = []
    for i in range(4):
        t = time.perf_counter(); gpuckpt.save(sd, f"{sys.argv[1]}/s{i}"); out.append(time.perf_counter() - t)
    print(json.dumps(out))
"""


def first_calls(base: Path, runs: int) -> dict[str, Any]:
    """First save and first load of a fresh process against the later ones (tiny state)."""
    saves, loads = [], []
    for r in range(runs):
        d = base / f"first-{r}"
        d.mkdir()
        for code, into in ((_FIRST_SAVES, saves), (_FIRST_LOADS_FRESH, loads)):
            p = subprocess.run(
                [sys.executable, "-c", textwrap.dedent(code), os.fspath(d)],
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            )
            into.append(json.loads(p.stdout))
        shutil.rmtree(d)
    first_save = statistics.median(s[0] for s in saves)
    later_save = statistics.median(t for s in saves for t in s[1:])
    first_load = statistics.median(s[0] for s in loads)
    later_load = statistics.median(t for s in loads for t in s[1:])
    return {
        "first save s": first_save,
        "later save s": later_save,
        "first save / later save": first_save / later_save,
        "first load s": first_load,
        "later load s": later_load,
        "first load / later load": first_load / later_load,
        "raw": {"saves": saves, "loads": loads},
    }


# the load process must not have loaded anything before its first timed load: it reads the
# shapes from the files' documents with the standard library only
_FIRST_LOADS_FRESH = """
    import json, os, sys, time
    import numpy as np
    import gpuckpt
    root = sys.argv[1] + "/s0"
    sd = {}
    for name in sorted(os.listdir(root)):
        if os.path.isdir(f"{root}/{name}"):
            doc = json.load(open(f"{root}/{name}/zarr.json"))
            sd[doc["attributes"]["gpuckpt"]["fqn"]] = np.empty(doc["shape"], np.float32)
    out = []
    for i in range(4):
        t = time.perf_counter(); gpuckpt.load(sd, f"{sys.argv[1]}/s{i}"); out.append(time.perf_counter() - t)
    print(json.dumps(out))
"""


def print_results(res: dict[str, Any]) -> None:
    print(
        f"\n{res['label']}: {res['tensors']} tensors, {res['bytes'] / 2**20:.1f} MiB, "
        f"{res['directories']} directories + {res['files']} files"
    )
    for k, v in res["times"].items():
        print(f"  {k:<26} {v['median_s'] * 1e3:9.1f} ms  ({v['min_s'] * 1e3:.1f}-{v['max_s'] * 1e3:.1f})")
    for k, v in res["ratios"].items():
        print(f"  {k:<36} {v:6.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the small state (tiny: 4x as many)")
    ap.add_argument("--small", type=int, default=10_000, help="tensors of the small state (0 to skip)")
    ap.add_argument("--first-runs", type=int, default=3, help="fresh processes for the first-call figures")
    ap.add_argument(
        "--fsync-floor-files",
        type=int,
        default=1000,
        help="measure the fsync-each floor up to this many files",
    )
    ap.add_argument("--dir", help="directory on the file system to measure (default: a temp dir)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--settle", type=float, default=SETTLE_S, help="seconds to wait after deleting earlier leftovers"
    )
    args = ap.parse_args(argv)
    parent = Path(args.dir or tempfile.gettempdir())
    base = Path(tempfile.mkdtemp(prefix="gpuckpt-bench-small-", dir=parent))
    trash = base / ".trash"
    results: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": {
            "gpuckpt": gpuckpt.__version__,
            "numpy": np.__version__,
            "crc32c": crc32c_backend(),
            "copy-with-crc": crccopy.instruction_set(),
            "batchio": batchio.instance().isa if batchio.available() else "off",  # type: ignore[union-attr]
        },
        "settle_s": args.settle,
        "runs": [],
    }
    try:
        t = time.perf_counter()
        settle(trash, args.settle)
        results["settle_waited_s"] = time.perf_counter() - t
        results["first_calls"] = first_calls(base, args.first_runs)
        fc = results["first_calls"]
        print(
            f"tiny, fresh process: first save {fc['first save s'] * 1e3:.1f} ms, later {fc['later save s'] * 1e3:.1f} ms "
            f"({fc['first save / later save']:.2f}x); first load {fc['first load s'] * 1e3:.1f} ms, "
            f"later {fc['later load s'] * 1e3:.1f} ms"
        )
        results["runs"].append(
            bench_state("tiny", small_state(20, 1), 4 * args.rounds, base, trash, args.fsync_floor_files)
        )
        print_results(results["runs"][-1])
        if args.small:
            results["runs"].append(
                bench_state(
                    "small", small_state(args.small, 2), args.rounds, base, trash, args.fsync_floor_files
                )
            )
            print_results(results["runs"][-1])
    finally:
        shutil.rmtree(base, ignore_errors=True)  # with what was set aside: after the last measurement
    print(f"\n{results['machine']}, {results['date']}; {results['versions']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
