"""Saves and loads on ``s3://`` against the object-store client's own puts and gets, same run.

The S3-protocol server is moto's, on loopback, in a thread of this process
(``gpuckpt.testing.s3server``); nothing leaves the machine. The state is the
GPT-like one of ``bench/compare`` (``build_state("gpt")``, 1.25 GiB), or its
first tensors up to ``--size`` MiB.

For each round:

* ``gpuckpt``: ``gpuckpt.save`` to a new prefix (the defaults, ``--threads``
  I/O threads), then ``gpuckpt.load`` into preallocated arrays (every CRC32C
  checked);
* ``raw``: the very objects gpuckpt stored (same keys and sizes) put with
  ``obstore.put`` from a pool of the same number of threads, with the same
  multipart layout (``plan_parts``, parts in flight), then read back with
  ``obstore.get`` into preallocated buffers. No claim, no documents, no
  checksums: the ceiling of the client on this server.

The ratio is gpuckpt's throughput over the raw client's (1.0: as fast).
``--ranks N`` runs the same comparison with N MPI ranks (``mpiexec``), each
rank saving and loading a row block of every tensor (a distributed save and
a resharded load of the same layout), against raw puts and gets of each
rank's share of the objects. Then, through a counting proxy
(``gpuckpt.testing.faultproxy``, no faults), the requests of one save and one
load by kind, for each chunk size of ``--sweep`` (MiB).

Last, a ``CheckpointManager`` (async saves, every step kept) on roots already
holding each number of committed steps of ``--manager-steps`` (copies of one
small checkpoint), through the counting proxy: how long opening the root
takes, how long each save blocks its caller (median of ``--manager-saves``,
the previous save already finished: the listing, the step checks and the
snapshot), and the requests of one save (and its background writing) by kind. The ratio is the blocking time with the most steps over that
with the fewest (1.0: the steps kept cost a save nothing).

Usage: ``python bench/bench_s3.py [--size 1280] [--rounds 2] [--ranks 3] [--threads 8]
[--sweep 16,64,256] [--manager-steps 10,1000] [--manager-saves 5] [--json OUT]``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for bench.compare

import gpuckpt
from bench.compare.common import build_state, state_bytes
from gpuckpt.storage.s3.client import DEFAULT_PART_BYTES, DEFAULT_PARTS_IN_FLIGHT, plan_parts
from gpuckpt.testing.faultproxy import FaultProxy
from gpuckpt.testing.s3server import copy_prefix, loopback_env, s3_options, s3_server

BUCKET = "bench"
MIB = 1 << 20


def select_state(size_mib: float) -> dict[str, np.ndarray]:
    """The GPT-like state, or its first tensors (in order) up to ``size_mib`` (below the first
    tensor's 125 MiB: its first rows)."""
    return build_state("gpt", max_bytes=size_mib * MIB)


def _store(endpoint: str, prefix: str) -> Any:
    from obstore.store import S3Store

    o = s3_options(endpoint)
    return S3Store(
        BUCKET,
        prefix=prefix,
        endpoint=o["endpoint_url"],
        region=o["region"],
        access_key_id=o["aws_access_key_id"],
        secret_access_key=o["aws_secret_access_key"],
        client_options={"allow_http": True},
    )


def _objects(endpoint: str, prefix: str) -> list[tuple[str, int]]:
    import obstore as obs

    return sorted((m["path"], m["size"]) for batch in obs.list(_store(endpoint, prefix)) for m in batch)


def _wipe(endpoint: str, prefix: str) -> None:
    import obstore as obs

    keys = [k for k, _ in _objects(endpoint, prefix)]
    if keys:
        obs.delete(_store(endpoint, prefix), keys)


def _payload(objects: list[tuple[str, int]], state: dict[str, np.ndarray]) -> list[memoryview]:
    """A view of ``size`` bytes of the state for each object (the same bytes gpuckpt uploads)."""
    flat = [memoryview(a.reshape(-1)).cast("B") for a in state.values()]
    views, i, pos = [], 0, 0
    for _, size in objects:
        if pos + size > flat[i].nbytes:
            i, pos = (i + 1) % len(flat), 0
        if size > flat[i].nbytes:
            views.append(memoryview(bytearray(size)))
            continue
        views.append(flat[i][pos : pos + size])
        pos += size
    return views


def raw_put(
    endpoint: str, prefix: str, objects: list[tuple[str, int]], views: list[memoryview], threads: int
) -> float:
    import obstore as obs

    store = _store(endpoint, prefix)

    def put(kv: tuple[tuple[str, int], memoryview]) -> None:
        (key, size), view = kv
        # the part layout gpuckpt uses for an object of this size
        nparts, part = plan_parts(size, DEFAULT_PART_BYTES)
        if nparts == 1:
            obs.put(store, key, view, use_multipart=False)
        else:
            at_once = min(nparts, DEFAULT_PARTS_IN_FLIGHT)
            obs.put(store, key, view, use_multipart=True, chunk_size=part, max_concurrency=at_once)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, zip(objects, views, strict=True)))
    return time.perf_counter() - t0


def raw_get(endpoint: str, prefix: str, objects: list[tuple[str, int]], threads: int) -> float:
    import obstore as obs

    store = _store(endpoint, prefix)
    dests = [np.empty(size, np.uint8) for _, size in objects]

    def get(i: int) -> None:
        res = obs.get(store, objects[i][0])
        pos, dest = 0, dests[i]
        for piece in res.stream(min_chunk_size=4 * MIB):
            view = np.frombuffer(memoryview(piece), np.uint8)
            dest[pos : pos + view.size] = view
            pos += view.size

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, range(len(objects))))
    return time.perf_counter() - t0


def single_process(
    endpoint: str, state: dict[str, np.ndarray], threads: int, chunk_bytes: int
) -> dict[str, float]:
    run = f"sp-{uuid.uuid4().hex[:8]}"
    url = f"s3://{BUCKET}/{run}/gpuckpt"
    opts = s3_options(endpoint)
    t0 = time.perf_counter()
    gpuckpt.save(state, url, storage_options=opts, threads=threads, chunk_bytes=chunk_bytes)
    save_s = time.perf_counter() - t0
    targets = {k: np.empty_like(v) for k, v in state.items()}
    t0 = time.perf_counter()
    gpuckpt.load(targets, url, storage_options=opts, threads=threads)
    load_s = time.perf_counter() - t0
    assert all(np.array_equal(targets[k], v) for k, v in state.items())
    del targets
    objects = _objects(endpoint, f"{run}/gpuckpt")
    raw_prefix = f"{run}/raw"
    put_s = raw_put(endpoint, raw_prefix, objects, _payload(objects, state), threads)
    get_s = raw_get(endpoint, raw_prefix, objects, threads)
    _wipe(endpoint, run)
    return {"gpuckpt save s": save_s, "raw put s": put_s, "gpuckpt load s": load_s, "raw get s": get_s}


# -- ranks -------------------------------------------------------------------------------------------


def _rows(n: int, rank: int, ranks: int) -> tuple[int, int]:
    per = -(-n // ranks)
    return min(rank * per, n), min((rank + 1) * per, n)


def rank_worker(
    endpoint: str, size_mib: float, threads: int, chunk_bytes: int, rounds: int, out: str
) -> None:
    from mpi4py import MPI

    from gpuckpt.distributed import MPICoordinator

    comm = MPI.COMM_WORLD
    c = MPICoordinator()
    rank, ranks = c.rank, c.world_size
    full = select_state(size_mib)
    mine = {}
    for k, v in full.items():
        a, b = _rows(v.shape[0], rank, ranks)
        mine[k] = gpuckpt.ShardedArray(np.ascontiguousarray(v[a:b]), (a,) + (0,) * (v.ndim - 1), v.shape)
    opts = s3_options(endpoint)
    results: list[dict[str, float]] = []

    def timed(fn: Any) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        comm.Barrier()
        return time.perf_counter() - t0

    for r in range(rounds):
        run = comm.bcast(f"mr-{uuid.uuid4().hex[:8]}-{r}" if rank == 0 else None, root=0)
        url = f"s3://{BUCKET}/{run}/gpuckpt"
        save_s = timed(
            functools.partial(
                gpuckpt.save,
                mine,
                url,
                coordinator=c,
                storage_options=opts,
                threads=threads,
                chunk_bytes=chunk_bytes,
            )
        )
        targets = {
            k: gpuckpt.ShardedArray(np.empty_like(s.local), s.offsets, s.global_shape)
            for k, s in mine.items()
        }
        load = functools.partial(
            gpuckpt.load, targets, url, coordinator=c, storage_options=opts, threads=threads
        )
        load_s = timed(load)
        assert all(np.array_equal(targets[k].local, s.local) for k, s in mine.items())
        targets = {}
        objects = comm.bcast(_objects(endpoint, f"{run}/gpuckpt") if rank == 0 else None, root=0)
        share = objects[rank::ranks]
        views = _payload(share, {k: s.local for k, s in mine.items()})
        put_s = timed(functools.partial(raw_put, endpoint, f"{run}/raw", share, views, threads))
        get_s = timed(functools.partial(raw_get, endpoint, f"{run}/raw", share, threads))
        comm.Barrier()
        if rank == 0:
            _wipe(endpoint, run)
        results.append(
            {"gpuckpt save s": save_s, "raw put s": put_s, "gpuckpt load s": load_s, "raw get s": get_s}
        )
    if rank == 0:
        Path(out).write_text(json.dumps(results))


# -- requests ------------------------------------------------------------------------------------------


def request_counts(
    endpoint: str, state: dict[str, np.ndarray], threads: int, chunk_mib: float
) -> dict[str, Any]:
    url = f"s3://{BUCKET}/rq-{uuid.uuid4().hex[:8]}/ck"
    with FaultProxy(endpoint) as proxy:
        opts = s3_options(proxy.endpoint)
        t0 = time.perf_counter()
        gpuckpt.save(state, url, storage_options=opts, threads=threads, chunk_bytes=int(chunk_mib * MIB))
        save_s = time.perf_counter() - t0
        save = proxy.reset_counts()
        t0 = time.perf_counter()
        gpuckpt.load(
            {k: np.empty_like(v) for k, v in state.items()}, url, storage_options=opts, threads=threads
        )
        load_s = time.perf_counter() - t0
        load = proxy.reset_counts()
    _wipe(endpoint, url.removeprefix(f"s3://{BUCKET}/").rsplit("/", 1)[0])
    return {
        "chunk MiB": chunk_mib,
        "save": save,
        "load": load,
        "save s (proxied)": save_s,
        "load s (proxied)": load_s,
    }


def manager_saves(endpoint: str, kept: int, saves: int) -> dict[str, Any]:
    """A manager on a root holding ``kept`` committed steps, through the counting proxy: opening
    it, how long each save blocks (the previous one finished), and the requests of one save."""
    base = f"mg-{uuid.uuid4().hex[:8]}"
    first = f"{base}/step_{0:08d}"
    gpuckpt.save({"step": 0}, f"s3://{BUCKET}/{first}", storage_options=s3_options(endpoint))
    copy_prefix(endpoint, BUCKET, first, [f"{base}/step_{s:08d}" for s in range(1, kept)])
    state = {"w": np.zeros(1024, np.float32), "step": 0}
    with FaultProxy(endpoint) as proxy:
        t0 = time.perf_counter()
        mgr = gpuckpt.CheckpointManager(f"s3://{BUCKET}/{base}", storage_options=s3_options(proxy.endpoint))
        open_s = time.perf_counter() - t0
        opened = proxy.reset_counts()
        blocked = []
        for step in range(kept, kept + saves):
            t0 = time.perf_counter()
            mgr.save(step, state)
            blocked.append(time.perf_counter() - t0)
            mgr.wait()
        proxy.reset_counts()
        mgr.save(kept + saves, state)
        mgr.wait()
        saved = proxy.reset_counts()
        mgr.close()
    _wipe(endpoint, base)
    return {
        "steps kept": kept,
        "open s": round(open_s, 3),
        "save blocks s": round(statistics.median(blocked), 4),
        "open requests": opened,
        "save requests": saved,
    }


def _summary(runs: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        **{k: round(v, 3) for k, v in med.items()},
        "gpuckpt save MB/s": round(nbytes / med["gpuckpt save s"] / 1e6, 1),
        "raw put MB/s": round(nbytes / med["raw put s"] / 1e6, 1),
        "gpuckpt load MB/s": round(nbytes / med["gpuckpt load s"] / 1e6, 1),
        "raw get MB/s": round(nbytes / med["raw get s"] / 1e6, 1),
        "save / raw put": round(med["raw put s"] / med["gpuckpt save s"], 3),
        "load / raw get": round(med["raw get s"] / med["gpuckpt load s"], 3),
        # each round's own ratios: single rounds on a shared machine swing widely
        "rounds save / raw put": [round(r["raw put s"] / r["gpuckpt save s"], 3) for r in runs],
        "rounds load / raw get": [round(r["raw get s"] / r["gpuckpt load s"], 3) for r in runs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--size", type=float, default=1280.0, help="MiB of the GPT-like state (default: all 1.25 GiB)"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=3, help="MPI ranks of the distributed run (0: skip it)")
    ap.add_argument("--threads", type=int, default=8, help="I/O threads of gpuckpt and of the raw pool")
    ap.add_argument("--chunk-mb", type=float, default=64.0, help="chunk size of the timed runs (MiB)")
    ap.add_argument("--sweep", default="16,64,256", help="chunk sizes (MiB) whose requests are counted")
    ap.add_argument(
        "--manager-steps", default="10,1000", help="committed steps a manager's root holds, per run"
    )
    ap.add_argument("--manager-saves", type=int, default=5, help="manager saves timed per root")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    ap.add_argument("--rank-worker", nargs=6, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.update(loopback_env())
    if args.rank_worker:
        endpoint, size, threads, chunk, rounds, out = args.rank_worker
        rank_worker(endpoint, float(size), int(threads), int(chunk), int(rounds), out)
        return
    state = select_state(args.size)
    nbytes = state_bytes(state)
    chunk_bytes = int(args.chunk_mb * MIB)
    res: dict[str, Any] = {
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "state": {"tensors": len(state), "bytes": nbytes},
        "threads": args.threads,
        "chunk MiB": args.chunk_mb,
    }
    with s3_server(BUCKET) as endpoint:
        single_process(endpoint, dict(list(state.items())[:2]), args.threads, chunk_bytes)  # warm-up
        runs = [single_process(endpoint, state, args.threads, chunk_bytes) for _ in range(args.rounds)]
        res["single process"] = _summary(runs, nbytes)
        print(json.dumps(res["single process"], indent=1), flush=True)
        if args.ranks > 1:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "ranks.json")
                mpiexec = Path(sys.executable).parent / "mpiexec"
                cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", str(args.ranks), sys.executable]
                cmd += [
                    __file__,
                    "--rank-worker",
                    endpoint,
                    str(args.size),
                    str(args.threads),
                    str(chunk_bytes),
                ]
                cmd += [str(args.rounds), out]
                env = {**os.environ, "HYDRA_LAUNCHER": "fork"}
                subprocess.run(cmd, check=True, timeout=3600, env=env)
                res[f"{args.ranks} ranks"] = _summary(json.loads(Path(out).read_text()), nbytes)
            print(json.dumps(res[f"{args.ranks} ranks"], indent=1), flush=True)
        res["requests"] = [
            request_counts(endpoint, state, args.threads, float(mib)) for mib in args.sweep.split(",") if mib
        ]
        for r in res["requests"]:
            print(json.dumps(r), flush=True)
        kept = [int(n) for n in args.manager_steps.split(",") if n]
        if kept:
            runs = [manager_saves(endpoint, n, args.manager_saves) for n in kept]
            res["manager"] = {
                "runs": runs,
                "save blocks, most / fewest steps": round(
                    runs[-1]["save blocks s"] / runs[0]["save blocks s"], 2
                ),
            }
            print(json.dumps(res["manager"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
