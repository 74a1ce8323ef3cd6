"""Cooperative loads: bytes read from the store, and the time of a replicated load on 4 ranks.

A replicated state (``--mib`` MiB, default 1 GiB: 16 float32 tensors, gpuckpt's default chunks of
64 MiB) is saved once to ``s3://`` (moto's S3 server on loopback, in a thread of this process,
``gpuckpt.testing.s3server``) and to a local directory. Then two jobs of 4 MPI ranks
(``mpiexec -n 4``, ``MPICoordinator``), every rank loading the whole state into its own arrays
(the replicas of a data-parallel job):

1. bytes: one cooperative load from ``s3://`` through a counting proxy
   (``gpuckpt.testing.faultproxy``, no faults): bytes of chunk objects the store served, against
   the stored bytes of the chunk objects the job needs (every chunk once; listed from the
   server), target 1.00; the same for the local directory, counted by
   ``gpuckpt.testing.reads.count_chunk_reads`` in every rank (summed), target 1.00; and, shown,
   the bytes of a load with ``cooperative=False`` (4.00: each rank reads everything).
2. time, from the S3 server without the proxy: the cooperative load on 4 ranks (from the barrier
   before to the barrier after) against one rank loading the same state alone, the other ranks
   idle; target <= 1.3. Shown too: 4 ranks each loading alone at the same time
   (``cooperative=False``), the same three from the local directory (its files in the page cache),
   and, as the transport's floor on this machine, ``MPI_Bcast`` of the
   arrays from one rank to the others (no store, no checks). Rounds interleave the loads, in an
   order reversed every other round; medians. Every load is checked bit-exact (CRC32C of each
   array against the saved one, untimed).

Every figure is a ratio to a ceiling measured in the same run. Idle ranks wait in a barrier that
polls with sleeps (MPICH's own waits spin and would take a core from the rank measured).

Limits: the 4 ranks, the S3 server and the rest of the machine share its cores; the server is
one Python process (its GIL): on a real object store each reader has its own bandwidth, and
reading once what 4 ranks need can only help more there. The chunks travel between the ranks
over MPI's shared-memory transport.

Usage: ``python bench/bench_coop_load.py [--mib 1024] [--rounds 3] [--ranks 4] [--json OUT]
[--quick]`` (``--quick``: 16 MiB in 4 MiB chunks, 1 round: a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository, for bench.compare

import gpuckpt  # noqa: E402
from bench.compare.common import find_mpiexec  # noqa: E402
from bench.compare.common import machine_info as common_machine_info  # noqa: E402
from gpuckpt.format.checksum import crc32c  # noqa: E402
from gpuckpt.testing.s3server import loopback_env, s3_options, s3_server  # noqa: E402

BUCKET = "coop"
MIB = 1 << 20
NTENSORS = 16


def make_state(mib: float) -> dict[str, np.ndarray]:
    """``NTENSORS`` float32 tensors of ``mib`` MiB in all, each of its own values."""
    rows = max(1, int(mib * MIB / NTENSORS / 4 / 1024))
    return {
        f"layer{i:02d}.w": (np.arange(rows * 1024, dtype=np.float32) * (i + 1) % 7919).reshape(rows, 1024)
        for i in range(NTENSORS)
    }


def crcs(state: dict[str, np.ndarray]) -> dict[str, int]:
    return {k: crc32c(v) for k, v in state.items()}


def _quiet_barrier(comm: Any) -> None:
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


# -- the ranks ---------------------------------------------------------------------------------------


def rank_worker(spec_file: str) -> None:
    from mpi4py import MPI

    from gpuckpt.distributed import MPICoordinator
    from gpuckpt.testing.reads import count_chunk_reads

    spec = json.loads(Path(spec_file).read_text())
    comm = MPI.COMM_WORLD
    c = MPICoordinator()
    rank = c.rank
    shapes = {k: tuple(v) for k, v in spec["shapes"].items()}
    targets = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    for a in targets.values():
        a.fill(0)  # touched once: the loads write into memory already backed

    def exact() -> bool:
        ok = crcs(targets) == {k: int(v) for k, v in spec["crcs"].items()}
        for a in targets.values():
            a.fill(0)
        return ok

    def timed(fn: Any, *, everyone: bool = True) -> float:
        _quiet_barrier(comm)
        t0 = time.perf_counter()
        if everyone or rank == 0:
            fn()
        _quiet_barrier(comm)
        return time.perf_counter() - t0

    out: dict[str, Any] = {}
    opts = s3_options(spec["endpoint"])
    if spec["mode"] == "bytes":
        proxy_opts = s3_options(spec["proxy"])
        with count_chunk_reads() as s3_counted:
            gpuckpt.load(targets, spec["url"], coordinator=c, storage_options=proxy_opts)
        out["s3 exact"] = exact()
        with count_chunk_reads() as local_counted:
            gpuckpt.load(targets, spec["local"], coordinator=c, cooperative=True)
        out["local exact"] = exact()
        with count_chunk_reads() as each_counted:
            gpuckpt.load(targets, spec["local"], coordinator=c, cooperative=False)
        out["each exact"] = exact()
        out["s3 counted"] = sum(c.all_gather(s3_counted.nbytes))
        out["local counted"] = sum(c.all_gather(local_counted.nbytes))
        out["each counted"] = sum(c.all_gather(each_counted.nbytes))
    else:
        runs: list[dict[str, float]] = []
        checks: list[bool] = []
        phases = {
            "solo": (lambda: gpuckpt.load(targets, spec["url"], storage_options=opts), False),
            "coop": (lambda: gpuckpt.load(targets, spec["url"], coordinator=c, storage_options=opts), True),
            "each": (
                lambda: gpuckpt.load(
                    targets, spec["url"], coordinator=c, storage_options=opts, cooperative=False
                ),
                True,
            ),
            # the same from the local directory, its files in the page cache
            "solo local": (lambda: gpuckpt.load(targets, spec["local"]), False),
            "coop local": (
                lambda: gpuckpt.load(targets, spec["local"], coordinator=c, cooperative=True),
                True,
            ),
            "each local": (
                lambda: gpuckpt.load(targets, spec["local"], coordinator=c, cooperative=False),
                True,
            ),
        }

        def bcast() -> None:  # the transport's floor: rank 0's arrays to every rank, raw MPI
            for a in targets.values():
                comm.Bcast(a, root=0)

        for r in range(spec["rounds"]):
            order = list(phases) if r % 2 == 0 else list(reversed(phases))
            times: dict[str, float] = {}
            for name in order:
                fn, everyone = phases[name]
                times[name] = timed(fn, everyone=everyone)
                ok = exact() if everyone or rank == 0 else True
                checks.append(all(c.all_gather(ok)))
            times["bcast"] = timed(bcast)
            exact()  # zeros again
            runs.append(times)
        out["runs"] = runs
        out["exact"] = all(checks)
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(out))


# -- the driver --------------------------------------------------------------------------------------


def _chunk_objects(endpoint: str, prefix: str) -> dict[str, int]:
    import boto3

    client = boto3.client("s3", **_boto(endpoint))
    found: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for o in page.get("Contents", []):
            if not o["Key"].endswith("zarr.json"):
                found[f"/{BUCKET}/{o['Key']}"] = int(o["Size"])
    return found


def _boto(endpoint: str) -> dict[str, Any]:
    return {
        "endpoint_url": endpoint,
        "region_name": "us-east-1",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
    }


def machine_info() -> dict[str, Any]:
    info = common_machine_info(REPO)
    with contextlib.suppress(OSError):
        info["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _job(mpiexec: str, ranks: int, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    spec_file = tmp / f"spec-{spec['mode']}.json"
    spec["out"] = str(tmp / f"out-{spec['mode']}.json")
    spec_file.write_text(json.dumps(spec))
    cmd = [mpiexec, "-n", str(ranks), sys.executable, __file__, "--rank-worker", str(spec_file)]
    env = {**loopback_env(), "HYDRA_LAUNCHER": "fork", "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, timeout=3600, env=env)
    result: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
    return result


def _figure(measured: float, ceiling: float, what: str, target: str, met: bool, unit: str) -> dict[str, Any]:
    return {
        "measured": measured,
        "ceiling": ceiling,
        "ratio": round(measured / ceiling, 3),
        "ceiling_what": what,
        "unit": unit,
        "target": target,
        "met": "yes" if met else "NO",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=1024.0, help="MiB of the replicated state")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where the local checkpoint goes (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    ap.add_argument("--quick", action="store_true", help="16 MiB in 4 MiB chunks, 1 round (a smoke test)")
    ap.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_worker:
        rank_worker(args.rank_worker)
        return
    os.environ.update(loopback_env())
    mpiexec = find_mpiexec()
    if mpiexec is None:
        sys.exit("bench_coop_load needs mpiexec and mpi4py (pip install mpich mpi4py)")
    mib, rounds, chunk_bytes = (16.0, 1, 4 * MIB) if args.quick else (args.mib, args.rounds, 64 * MIB)
    state = make_state(mib)
    nbytes = sum(v.nbytes for v in state.values())
    res: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "state": {"tensors": len(state), "bytes": nbytes, "chunk_bytes": chunk_bytes},
        "ranks": args.ranks,
        "rounds": rounds,
    }
    from gpuckpt.testing.faultproxy import FaultProxy

    with (
        tempfile.TemporaryDirectory(prefix="gpuckpt-bench-coop-", dir=args.dir) as tmp_name,
        s3_server(BUCKET) as endpoint,
        FaultProxy(endpoint, rate=0.0) as proxy,
    ):
        tmp = Path(tmp_name)
        url, local = f"s3://{BUCKET}/ckpt", str(tmp / "ckpt")
        gpuckpt.save(state, url, storage_options=s3_options(endpoint), chunk_bytes=chunk_bytes)
        gpuckpt.save(state, local, chunk_bytes=chunk_bytes)
        spec: dict[str, Any] = {
            "endpoint": endpoint,
            "proxy": proxy.endpoint,
            "url": url,
            "local": local,
            "shapes": {k: list(v.shape) for k, v in state.items()},
            "crcs": crcs(state),
            "rounds": rounds,
        }
        del state
        stored = _chunk_objects(endpoint, "ckpt/")
        stored_bytes = sum(stored.values())
        local_bytes = sum(
            p.stat().st_size for p in Path(local).rglob("*") if p.is_file() and p.name != "zarr.json"
        )
        proxy.reset_counts()
        got = _job(mpiexec, args.ranks, {**spec, "mode": "bytes"}, tmp)
        served = sum(n for path, n in proxy.get_bytes_by_path.items() if path in stored)
        timing = _job(mpiexec, args.ranks, {**spec, "mode": "time"}, tmp)
    runs = timing["runs"]
    med = {k: statistics.median(r[k] for r in runs) for k in ("solo", "coop", "each")}
    s3_ratio = served / stored_bytes
    local_ratio = got["local counted"] / local_bytes
    time_ratio = med["coop"] / med["solo"]
    res["figures"] = {
        "s3_bytes": _figure(
            served,
            stored_bytes,
            "stored bytes of the chunk objects the job needs (each once)",
            "== 1.00",
            abs(s3_ratio - 1) < 1e-9,
            "bytes",
        ),
        "local_bytes": _figure(
            got["local counted"],
            local_bytes,
            "stored bytes of the chunk files the job needs (each once)",
            "== 1.00",
            abs(local_ratio - 1) < 1e-9,
            "bytes",
        ),
        "time": _figure(
            med["coop"],
            med["solo"],
            "one rank loading the same state alone from the same server",
            "<= 1.3",
            time_ratio <= 1.3,
            "s",
        ),
    }
    res["extras"] = {
        "bytes counted by the ranks' readers (s3, cooperative)": got["s3 counted"],
        "local bytes with cooperative=False / needed": round(got["each counted"] / local_bytes, 3),
        "4 ranks each alone (cooperative=False) / one rank alone, time": round(med["each"] / med["solo"], 3),
        "MPI Bcast of the state from one rank to the others (no store) / one rank alone, time": round(
            statistics.median(r["bcast"] for r in runs) / med["solo"], 3
        ),
        "local, page cache: median seconds one rank alone / cooperative / each alone": [
            round(statistics.median(r[k] for r in runs), 3)
            for k in ("solo local", "coop local", "each local")
        ],
        "median seconds": {k: round(v, 3) for k, v in med.items()},
        "rounds": runs,
        "every load bit-exact": bool(
            got["s3 exact"] and got["local exact"] and got["each exact"] and timing["exact"]
        ),
    }
    print(f"{'figure':<12} {'measured':>14} {'ceiling':>14} {'ratio':>7}  target   met  ceiling is")
    for key, f in res["figures"].items():
        print(
            f"{key:<12} {f['measured']:>14.4g} {f['ceiling']:>14.4g} {f['ratio']:>7.3f}  "
            f"{f['target']:<8} {f['met']:<4} {f['ceiling_what']}"
        )
    for key, value in res["extras"].items():
        if key != "rounds":
            print(f"{key}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
