"""The comparison driver: interleaved rounds of fresh measurement processes, then the report.

Per state, per round, per system, one fresh process
(``python -m bench.compare.runner``, in the project's interpreter or in the
peer environment) builds the same seeded state and measures that system.
Rounds interleave the systems, each round in another order (a Williams design:
every system runs right after every other one equally often); round 0 is a warm-up and
is discarded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.compare.common import OP_SETTLE_S, SETTLE_S, settle

REPO = Path(__file__).resolve().parents[2]
PEER_HOME = Path(os.environ.get("GPUCKPT_PEERS", "/tmp/gpuckpt-peers"))
PEER_PYTHON = PEER_HOME / "py311" / "bin" / "python"
PEER_BASE_PYTHON = os.environ.get("GPUCKPT_PEER_BASE_PYTHON", "python3.11")
REQUIREMENTS = Path(__file__).with_name("requirements-peers.txt")

LOAD_OPS = "save,load_warm,load_cold"


@dataclass(frozen=True)
class System:
    """One entry of the rotation: where it runs, what it measures, what it needs."""

    name: str
    env: str  # "main" (this interpreter) or "peer" (the Python 3.11 venv)
    ops: str
    needs: tuple[str, ...] = ()


SYSTEMS = [
    System("dd", "main", "ceiling"),
    System("raw-files", "main", LOAD_OPS),
    System("raw-single", "main", LOAD_OPS),
    System("gpuckpt", "main", LOAD_OPS, ("gpuckpt",)),
    System("gpuckpt-async", "main", "async", ("gpuckpt",)),
    # the same with the other setting of GPUCKPT_DIRECT_IO (sync saves direct, async saves
    # buffered): opt-in, by --systems
    System("gpuckpt-direct", "main", LOAD_OPS, ("gpuckpt",)),
    System("gpuckpt-async-buffered", "main", "async", ("gpuckpt",)),
    # loads through pread + a CRC library instead of the native copy-with-CRC loop
    System("gpuckpt-pread", "main", LOAD_OPS, ("gpuckpt",)),
    System("tensorstore", "main", LOAD_OPS, ("tensorstore",)),
    System("torch-save", "peer", LOAD_OPS, ("torch",)),
    System("safetensors", "peer", LOAD_OPS, ("torch", "safetensors")),
    System("dcp-t1", "peer", LOAD_OPS, ("torch",)),
    System("dcp-t2", "peer", LOAD_OPS, ("torch",)),
    System("dcp-async", "peer", "async", ("torch",)),
    # DCP's own API with gpuckpt as its storage layer (gpuckpt.dcp)
    System("dcp-gpuckpt", "peer", LOAD_OPS, ("torch", "gpuckpt.dcp")),
    System("dcp-gpuckpt-async", "peer", "async", ("torch", "gpuckpt.dcp")),
    System("orbax", "peer", LOAD_OPS, ("orbax.checkpoint",)),
]
ASYNC_SYSTEMS = {"gpuckpt-async", "gpuckpt-async-buffered", "dcp-async", "dcp-gpuckpt-async"}
#: run only when named in --systems
OPT_IN_SYSTEMS = {"gpuckpt-direct", "gpuckpt-async-buffered", "gpuckpt-pread"}


def setup_peers(base_python: str = PEER_BASE_PYTHON) -> int:
    """Create the peer venv (Python 3.11) and install torch, safetensors, gpuckpt, then orbax where it installs."""
    PEER_HOME.mkdir(parents=True, exist_ok=True)
    venv = PEER_HOME / "py311"
    if not PEER_PYTHON.exists():
        subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    pip = [str(PEER_PYTHON), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-r", str(REQUIREMENTS)], check=True)
    # gpuckpt itself (Python 3.11 is supported), for the dcp-gpuckpt systems: its dependencies,
    # and its zarr data types; the runs import it from this checkout (PYTHONPATH)
    rc = subprocess.run([*pip, "-e", str(REPO)]).returncode
    if rc != 0:
        print("gpuckpt did not install in the peer environment: dcp-gpuckpt will be skipped", file=sys.stderr)
    # orbax pulls in jax; a failure leaves it out of the comparison, not the others
    rc = subprocess.run([*pip, "orbax-checkpoint"]).returncode
    if rc != 0:
        print("orbax-checkpoint did not install: it will be skipped", file=sys.stderr)
    print(f"peer environment ready: {PEER_PYTHON}")
    return 0


def interpreter(env: str) -> str:
    return sys.executable if env == "main" else str(PEER_PYTHON)


_PROBE = """
import importlib, json, sys
errs = {}
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as exc:
        errs[m] = f"{type(exc).__name__}: {exc}"
print(json.dumps(errs))
"""


def probe(systems: list[System]) -> tuple[list[System], dict[str, str]]:
    """The systems whose interpreter and imports are available, and why the others are skipped.

    One process per interpreter tries every module its systems need.
    """
    skipped: dict[str, str] = {}
    if not PEER_PYTHON.exists():
        for s in systems:
            if s.env == "peer":
                skipped[s.name] = f"peer environment absent ({PEER_PYTHON}); create it with --setup"
    errors: dict[str, dict[str, str]] = {}
    for env in {s.env for s in systems if s.name not in skipped}:
        mods = sorted({"numpy", *(m for s in systems if s.env == env for m in s.needs)})
        r = subprocess.run([interpreter(env), "-c", _PROBE, *mods], capture_output=True, text=True)
        try:
            errors[env] = json.loads(r.stdout.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            errors[env] = {m: (r.stderr.strip().splitlines() or ["interpreter failed"])[-1] for m in mods}
    ok: list[System] = []
    for s in systems:
        if s.name in skipped:
            continue
        bad = {m: e for m, e in errors[s.env].items() if m in ("numpy", *s.needs)}
        if bad:
            skipped[s.name] = "; ".join(
                f"cannot import {m} in {interpreter(s.env)} ({e})" for m, e in bad.items()
            )
        else:
            ok.append(s)
    return ok, skipped


def round_order(systems: list[System], rnd: int) -> list[System]:
    """The order of the systems in round ``rnd``: the rows of a Williams design.

    What the previous process left behind changes the next one's save (the
    memory it freed, and when: see :data:`bench.compare.common.OP_SETTLE_S`);
    with one fixed order a system always followed the same other one (gpuckpt
    right after raw-single, dcp-gpuckpt after DCP's own systems). Here, over
    ``n`` rounds (``2n`` for an odd number ``n`` of systems), every system
    runs right after every other one equally often (a rotation alone would
    keep the same neighbours).
    """
    n = len(systems)
    if n < 2:
        return list(systems)
    # first row 0, 1, n-1, 2, n-2, ...; row r adds r (mod n); odd n: the reversed rows follow
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    period = n if n % 2 == 0 else 2 * n
    r = rnd % period
    row = [(i + r) % n for i in first]
    if r >= n:
        row = [(i + r - n) % n for i in first][::-1]
    return [systems[i] for i in row]


def run_one(
    s: System, state: str, rnd: int, workdir: Path, quick: bool, seed: int, settle_op: float = OP_SETTLE_S
) -> list[dict[str, Any]]:
    """One fresh measurement process; its result records (an error record if it failed).

    Outputs with many files go to ``workdir/.trash`` and are deleted between
    states (see :func:`gpuckpt.cli.rawio.set_aside`)."""
    ops = s.ops
    cmd = [interpreter(s.env), "-m", "bench.compare.runner", s.name, "--state", state, "--ops", ops]
    cmd += [
        "--dir",
        str(workdir),
        "--round",
        str(rnd),
        "--seed",
        str(seed),
        "--trash",
        str(workdir / ".trash"),
        "--settle-op",
        str(settle_op),
    ]
    if quick:
        cmd.append("--quick")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("PYTHONWARNINGS", "ignore")
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    recs = [json.loads(line[9:]) for line in p.stdout.splitlines() if line.startswith("@@RESULT ")]
    if p.returncode != 0 or not recs:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        recs.append({"system": s.name, "state": state, "round": rnd, "op": "run", "error": tail})
    for r in recs:
        if "error" in r:
            print(f"  ! {s.name} {state} r{rnd} {r.get('op')}: {r['error']}", file=sys.stderr)
    return recs


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def wait_idle(threshold: float, timeout_s: float, poll_s: float = 30.0) -> tuple[bool, str]:
    """Poll the 1-minute load average until it is below ``threshold`` (or ``timeout_s`` passes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        la = loadavg()
        if float(la.split()[0]) < threshold:
            return True, la
        if time.monotonic() >= deadline:
            return False, la
        print(f"load average {la}: waiting for < {threshold}", file=sys.stderr)
        time.sleep(poll_s)


def code_state() -> str:
    """The commit under test, and whether gpuckpt's sources differ from it."""
    try:
        head = subprocess.run(
            ["git", "log", "-1", "--format=%h %ci"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "gpuckpt"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}" + (" + uncommitted changes under gpuckpt/" if dirty else " (gpuckpt/ clean)")


def merged(files: list[Path]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Records and metadata from several runs' JSON files; each state comes from the last file that has it."""
    runs = [json.loads(f.read_text()) for f in files]
    owner: dict[str, int] = {}
    for i, run in enumerate(runs):
        for r in run["records"]:
            if "state" in r:
                owner[r["state"]] = i
    records = [r for i, run in enumerate(runs) for r in run["records"] if owner.get(r.get("state", "")) == i]
    meta = dict(runs[-1]["meta"])
    meta["runs"] = [
        {**run["meta"], "states": sorted({s for s, i2 in owner.items() if i2 == i}), "file": str(files[i])}
        for i, run in enumerate(runs)
        if i in owner.values()
    ]
    return records, meta


def machine_info(workdir: Path) -> dict[str, str]:
    """nproc, memory, the disk and file system under ``workdir``, kernel."""
    info = {"nproc": str(os.cpu_count()), "kernel": platform.release(), "machine": platform.machine()}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory"] = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    du = shutil.disk_usage(workdir)
    info["disk"] = f"{du.total / 1e9:.0f} GB, {du.free / 1e9:.0f} GB free"
    try:
        df = subprocess.run(["df", "--output=source,fstype", str(workdir)], capture_output=True, text=True)
        src, fstype = df.stdout.splitlines()[1].split()
        dev = Path(src).name
        rot = Path(f"/sys/block/{dev}/queue/rotational")
        kind = {"0": "non-rotational", "1": "reported rotational"}.get(
            rot.read_text().strip() if rot.exists() else "", ""
        )
        info["disk"] += f", {src} ({fstype}{', ' + kind if kind else ''})"
    except (OSError, ValueError, IndexError):
        pass
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
        info["cpu"] = cpu
    except (OSError, StopIteration):
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    ap.add_argument("--setup", action="store_true", help="create the peer environment and exit")
    ap.add_argument("--quick", action="store_true", help="toy sizes, 1 round, no warm-up (smoke test)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up round)")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up rounds (discarded)")
    ap.add_argument(
        "--states",
        default="small,gpt,gpt-adam",
        help="in this order; the one with many small files first, before this run deletes anything",
    )
    ap.add_argument(
        "--settle",
        type=float,
        default=SETTLE_S,
        help="seconds to wait (after a sync) before the first measurement, for files deleted "
        "earlier to stop slowing down file creation",
    )
    ap.add_argument(
        "--settle-op",
        type=float,
        default=OP_SETTLE_S,
        help="seconds each measurement process waits, idle, before every timed operation, so that "
        "memory freed before it is in the same state for every system (0 with --quick)",
    )
    ap.add_argument("--async-states", default="gpt,small", help="states the async systems run on")
    ap.add_argument("--systems", default=",".join(s.name for s in SYSTEMS if s.name not in OPT_IN_SYSTEMS))
    ap.add_argument("--dir", help="where checkpoints are written (default: a temp dir on /tmp's disk)")
    ap.add_argument("--out", default=str(REPO / "bench" / "out"), help="folder for the raw JSON records")
    ap.add_argument("--md", default=str(REPO / "bench" / "runs" / "RESULTS-compare.md"))
    ap.add_argument("--plot", default=str(REPO / "bench" / "runs" / "compare_plot.png"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait-idle", type=float, default=0, help="seconds to wait for a quiet machine first")
    ap.add_argument("--idle-load", type=float, default=0.7, help="1-minute load average counted as quiet")
    ap.add_argument(
        "--from-records",
        help="comma-separated compare.json files: write the report from them instead of measuring "
        "(each state is taken from the last file that has it)",
    )
    args = ap.parse_args(argv)
    if args.setup:
        return setup_peers()

    from bench.compare.report import write_report

    if args.from_records:
        recs, meta0 = merged([Path(f) for f in args.from_records.split(",")])
        write_report(recs, meta0, Path(args.md), Path(args.plot) if args.plot else None)
        print(Path(args.md).read_text())
        return 0

    rounds, warmup = (1, 0) if args.quick else (args.rounds, args.warmup)
    if args.settle_op < 0:
        ap.error(f"--settle-op must be >= 0 seconds, got {args.settle_op}")
    settle_op = 0.0 if args.quick else args.settle_op
    wanted = [n for n in args.systems.split(",") if n]
    unknown = set(wanted) - {s.name for s in SYSTEMS}
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; known: {[s.name for s in SYSTEMS]}")
    systems, skipped = probe([s for s in SYSTEMS if s.name in wanted])
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", file=sys.stderr)
    states = [s for s in args.states.split(",") if s]
    async_states = set(args.async_states.split(","))
    base = Path(tempfile.mkdtemp(prefix="gpuckpt-compare-", dir=args.dir))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    idle: tuple[bool, str] | None = None
    if args.wait_idle > 0:
        idle = wait_idle(args.idle_load, args.wait_idle)
    meta: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m bench.compare " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(base),
        "load_before": loadavg(),
        "code_before": code_state(),
        "idle_wait": None
        if idle is None
        else {"reached": idle[0], "load": idle[1], "threshold": args.idle_load},
        "rounds": rounds,
        "warmup": warmup,
        "quick": args.quick,
        "settle_op_s": settle_op,
        "skipped": skipped,
        "python_main": platform.python_version(),
        "peer_python": str(PEER_PYTHON),
    }
    records: list[dict[str, Any]] = []
    stem = "compare-quick" if args.quick else "compare"
    if not args.quick and args.states != "small,gpt,gpt-adam":
        stem += "-" + args.states.replace(",", "-")
    jsonl = out / f"{stem}.jsonl"
    t_start = time.monotonic()
    try:
        with jsonl.open("w") as f:
            settle(base / ".trash", 0.0 if args.quick else args.settle)
            for state in states:
                for rnd in range(warmup + rounds):
                    print(f"{state} round {rnd}{' (warm-up)' if rnd < warmup else ''}", file=sys.stderr)
                    for s in round_order(systems, rnd):
                        if s.name in ASYNC_SYSTEMS and state not in async_states:
                            continue
                        for r in run_one(s, state, rnd, base, args.quick, args.seed, settle_op):
                            r["warmup"] = rnd < warmup
                            records.append(r)
                            f.write(json.dumps(r) + "\n")
                            f.flush()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    meta["load_after"] = loadavg()
    meta["code_after"] = code_state()
    meta["wall_s"] = round(time.monotonic() - t_start, 1)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    write_report(records, meta, Path(args.md), Path(args.plot) if args.plot else None)
    print(Path(args.md).read_text())
    return 0
