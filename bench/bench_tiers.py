"""The local tier of a distributed CheckpointManager against ceilings measured in the same run.

4 ranks as 2 simulated nodes on this machine (rank ``r`` on node ``n{r // 2}``), started under
``mpiexec -n 4 python bench/tiers_ranks.py`` (MPICoordinator: the transport is MPI's
``Isend``/``Irecv``), each rank holding a row box of each of 18 global float32 tensors (1-48
MiB per rank of 256 MiB; ``--mib`` scales them) and a plain value. The local tiers are on
``/dev/shm`` (tmpfs; elsewhere a temp dir, and the table says so), the root in a temp dir on
the disk. ``CheckpointManager(root, local_dir=..., node=..., coordinator=..., replicas=1,
local_max_to_keep=2)``; only the last step is persisted to the root (its drain runs between
measurements, never under one). Each figure is a ratio to a ceiling measured in the same run,
on the same bytes, by the same ranks at the same time:

1. ``save`` blocks: ``mgr.save(step, state)`` against a host copy of the same arrays
   (``gpuckpt.background.copy_host_arrays``, the snapshot's own copy) into the snapshots' own
   staging memory (taken from their pool, ``gpuckpt.background.host_arena_pool``, between
   saves), per rank (the worst rank is shown); target <= 1.1. On this VM two allocations of
   the same size need not copy equally fast (four 256 MiB arenas of one process, filled by
   turns: medians 13.1-16.1 ms in one run, 16.9-18.2 in another): a ceiling copying into memory
   of its own would compare the product with a luckier or unluckier allocation. That copy is
   shown per rank too. A save's copies start on every rank together, right after its
   collective; the ceilings' copies do too: after the harness's barrier, a collective of the
   ranks' transport (``all_gather``, untimed) starts them. After the barrier alone (which polls
   with sleeps) a rank woken while the others' copies held both cores started 2-10 ms late in
   11 steps of 14 (one-off trial: starts 5.6-8.5 ms apart at the median, against 0.3 ms after
   the collective and 0.7 ms for the saves), and, timed from its own start, copied
   beside fewer ranks: per-rank copy medians 74.7-80.3 ms against 76.3-81.7 ms started
   together. That copy is shown per rank too ("started after the barrier alone"). Four ranks
   copying on two cores make each rank's copy vary by +-20% from step to step, so beside the
   5 rounds of every figure, ``--save-rounds`` steps (default 12) after the warm-up measure
   figure 1 alone (the save and the three copies, in an order reversed every other step), and
   figure 1 takes its medians over all of them. Shown too: per step, the slowest rank's save
   against the slowest rank's copy (a data-parallel step waits for its slowest rank).
2. the tier's write: from the part's write starting on the writer thread to the part committed
   in the tier (timed by wrappers around the calls the tier makes: ``gpuckpt.background.submit``
   and ``LocalTier._finish``; see ``bench/tiers_ranks.py``'s ``TierProbe``) against the
   faster, in each rank's round, of two plain copies of the same arrays into files in the same
   tmpfs directory, by as many threads as the save's I/O threads: ``os.write``, and a copy
   (``np.copyto``) into maps of the files kept from round to round (as the tier writes through
   kept maps on tmpfs); target >= 0.8. The ceilings' files are kept from round to round and
   overwritten in place (their pages allocated once, in the warm-up), as the tier writes each
   part into the files of the part its step retires: all are the copy alone.
3. replication: the replication round (``LocalTier._replicate``, wrapped) against
   ``exchange_buffers`` of the same arrays between the same pairs (each rank sends one part and
   receives one), on a duplicate of the same coordinator; bytes per second per rank; target >= 0.7.
   The ceiling's arrays are NumPy's, in transparent huge pages; the tier's files are tmpfs
   pages of 4 KiB, and MPI's single-copy transfer pins the sender's pages one by one. Shown
   beside it (not a figure): the same exchange between files of the tier's tmpfs, mapped and
   populated once (as the tier keeps its maps), and replication against that.
4. restore from the local tier (a new manager per restore, as a restarted job's) against the
   faster plain read of the same part files from tmpfs into preallocated buffers (same
   threads): ``read()``, or a copy out of new populated maps of the files (on tmpfs, ``read()``
   copies a base page at a time, at about half the speed of a copy out of a map); target >= 0.8.
5. restore from the tier against restoring the same step from the root cold (a manager
   without a tier, ``restore(step=...)``), its files evicted first: ``drop_caches`` is tried
   and, where refused (in a container), ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file, the
   fraction still resident checked with ``mincore``; time ratio, target >= 5. Shown too: the
   root's cold restore against figure 4's faster plain read, the figure a tier restore as fast
   as a plain read of its files (and checking nothing) would reach here.
6. a replaced node: n1's local tier moved aside (an empty tier; put back after the round, so
   that the other rounds find it as before), 4 ranks (new managers) restore, n1's parts
   fetched from their replicas on n0; bytes of a part per second of the whole restore against
   the transport's per-rank bandwidth of figure 3; target >= 0.7. Shown too: the fetch alone
   (``LocalTier._round``, wrapped: the transfer, straight into the restored arrays, which
   the load then checks in place), one-way ``exchange_buffers`` on the same pairs, one-way from
   files of the tier's tmpfs into the arrays (a holder sends from such files), and the restore
   against figure 3's exchange between tmpfs files; and the least such a restore does, plainly:
   each kept rank reads its own part's files (out of new populated maps, as figure 4's mapped
   plain read) while it sends the replica it holds from files of the tier's tmpfs, each
   replaced rank receives into its arrays, all ranks at once and nothing checked, against
   figure 3's transport: figure 6's bound on this machine, where the kept ranks' reads and the
   transfers share its cores.
7. a single-process training loop (numpy 512x512 float32 matmuls, about 0.1 s a step; this
   process, no MPI) with ``CheckpointManager(root, local_dir=..., replicas=0,
   persist_interval_steps=P*K, save_interval_steps=K)`` saving every K-th step to the tier
   (``--every``, default 10) and every P-th save also to the root (``--persist-every``, default
   5), blocks of P*K steps (one drain each) interleaved A/B with the same loop without checkpoints;
   block time ratio, target <= 1.10; and, as the issue words the target ("slows by at most 10%
   while its drain runs"), the mean step that ran beside a drain from its start to its end
   against the mean step without checkpoints ("7 steps while a drain runs"). The drain thread
   runs at nice 19 (``Workers(nice=19)``, ``gpuckpt.runtime.workers``); the nice value (and the
   SCHED_IDLE policy, where set) of every gpuckpt thread is sampled mid-block and printed.

Every restore is checked bit-exact (untimed). Each rank's times come back as JSON; for figures
2-6 a round's time is the slowest rank's (a step is done when every rank is), and the figure
takes the median over rounds.

Settling: each timed operation starts, on every rank, after ``os.sync()`` and an idle wait
of ``--op-settle`` seconds (default 3: this VM hands memory freed for about 2 s back to its
host, and touching it again costs a host fault per page; see ``bench.compare.common.OP_SETTLE_S``;
retention and deletions free hundreds of MiB between operations), then a barrier. The harness's
barriers poll a non-blocking barrier with sleeps: MPICH's waits spin, and a spinning rank would
take a core from one being measured. Rounds interleave the operations compared, in an order
reversed every other round. Warm-up: the first ``--warmup`` steps (default 3 =
``local_max_to_keep`` + 1: until then the tiers grow, and their writes and receptions meet
memory this VM has not backed yet, 2-10x slower in trials; their times stay in the JSON) and the
first round of restores and of figure 7. The root's cold restores (figure 5) run after all the
other restores, their rounds in a row: one ``drop_caches`` left this VM slower for everything
after it, for the rest of the run (a replaced node's restore over gloo, 4 ranks x 256 MiB, 10 in
a row with one ``drop_caches`` before the fifth: 204-248 ms before it, 284-339 ms after it,
every one; the transfer took the extra time), while the ceilings of the other figures were
measured before any eviction. The disk sees a few dozen files per persisted step and
no deletion before the end, so no ext4 settling wait is needed (see
``bench.compare.common.SETTLE_S``).

Limits: the 4 ranks share this machine's 2 cores and its memory bandwidth, so every figure is
of ranks taking turns on the CPU (a real node gives each rank its cores, and a copy to another
node crosses a network, not memory); MPICH's own waits spin (the product's collectives, and
the transport ceiling alike), which costs CPU time here that idle cores would absorb on a real
node. Absolute numbers mean little; ratios to the ceilings do.

``--layout gpt``: the same figures on a GPT-like state of 289 tensors per rank (an embedding, 24
layers of 4 matrices of 1-4 MiB and 8 biases and norms of one or two 4 KiB rows each, scaled to
``--mib``), where each tensor's own costs (its files, documents, messages) weigh beside its bytes.

Usage: ``python bench/bench_tiers.py [--mib 256] [--layout mixed|gpt] [--rounds 5] [--save-rounds 12] [--warmup 3]
[--op-settle 3] [--every 10] [--persist-every 5] [--step-s 0.1] [--local DIR] [--dir DIR] [--json OUT] [--quick]``
(``--quick``: 4 MiB per rank, 1 round and 1 step of figure 1 alone after 1 warm-up step, no settling, the root evicted per file and never
machine-wide: a smoke test, which runs beside other tests).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import gpuckpt  # noqa: E402
from bench.compare.common import OP_SETTLE_S, find_mpiexec  # noqa: E402
from bench.compare.common import machine_info as common_machine_info  # noqa: E402
from bench.tiers_ranks import LAYOUTS, RANKS, TierProbe, plain_state, tensor_rows  # noqa: E402
from gpuckpt.format.parts import part_name  # noqa: E402
from gpuckpt.storage.stores import file_system_type  # noqa: E402

RANK_SCRIPT = Path(__file__).resolve().parent / "tiers_ranks.py"
TARGETS = {
    "save": ("<=", 1.1),
    "write": (">=", 0.8),
    "replicate": (">=", 0.7),
    "restore": (">=", 0.8),
    "root": (">=", 5.0),
    "peer": (">=", 0.7),
    "loop": ("<=", 1.10),
    "loop_draining": ("<=", 1.10),
}


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path``, or ``"?"``."""
    return file_system_type(path) or "?"


def machine_info(mpiexec: str | None) -> dict[str, Any]:
    info = common_machine_info(REPO)
    if mpiexec:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            v = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
            first = v.stdout.strip().split("\n")[0].strip()
            version = next(
                (ln.split(":", 1)[1].strip() for ln in v.stdout.split("\n") if "Version:" in ln), ""
            )
            info["mpiexec"] = f"mpiexec {first.split()[0] if first else ''} {version}".strip()
    else:
        with contextlib.suppress(ImportError):
            import torch

            info["torch"] = torch.__version__
    return info


def _median(v: list[float]) -> float:
    return statistics.median(v) if v else float("nan")


# the MPI job ----------------------------------------------------------------------------------


def _rank_arguments(local: Path, root: Path, args: argparse.Namespace) -> list[str]:
    """What every rank of ``bench/tiers_ranks.py`` is given, whatever the transport."""
    out = ["--local", str(local), "--root", str(root), "--mib", str(args.mib), "--layout", args.layout]
    out += ["--rounds", str(args.rounds), "--op-settle", str(args.op_settle), "--warmup", str(args.warmup)]
    out += ["--save-rounds", str(args.save_rounds)]
    return out + (["--smoke"] if args.quick else [])


def run_ranks(
    mpiexec: str, out: Path, local: Path, root: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    cmd = [mpiexec, "-n", str(RANKS), sys.executable, str(RANK_SCRIPT), "--out", str(out)]
    cmd += _rank_arguments(local, root, args)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("HYDRA_LAUNCHER", "fork")  # one machine: never ssh
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise SystemExit(
            f"the ranks ran past {args.timeout} s and were killed; output:\n{output[-4000:]}"
        ) from None
    return _results(out, proc.returncode, output)


def _results(out: Path, returncode: int, output: str) -> list[dict[str, Any]]:
    results = []
    for r in range(RANKS):
        f = out / f"rank{r}.json"
        res = json.loads(f.read_text()) if f.exists() else {"error": "no result"}
        if "error" in res or returncode != 0:
            raise SystemExit(
                f"rank {r} failed (exit status {returncode}): {res.get('error', '')}\n{output[-4000:]}"
            )
        results.append(res)
    return results


def run_gloo_ranks(out: Path, local: Path, root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The same ranks as 4 processes of a ``torch.distributed`` gloo group on loopback (the
    environment ``torchrun`` would give them); the first rank to fail ends the others."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(RANK_SCRIPT), "--out", str(out), "--transport", "gloo"]
    cmd += _rank_arguments(local, root, args)
    logs = [out / f"rank{r}.log" for r in range(RANKS)]
    procs = []
    for r in range(RANKS):
        env = dict(os.environ, PYTHONUNBUFFERED="1", RANK=str(r), WORLD_SIZE=str(RANKS))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        with open(logs[r], "w") as log:
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
    deadline = time.monotonic() + args.timeout
    returncode = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                returncode = failed[0] if failed else -signal.SIGKILL
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    returncode = returncode or next((p.returncode for p in procs if p.returncode), 0)
    output = "".join(f"--- rank {r}\n" + log.read_text()[-2000:] for r, log in enumerate(logs))
    return _results(out, returncode, output)


def _rounds(ranks: list[dict[str, Any]], key: str, field: str, save_only: bool = False) -> list[list[float]]:
    """``field`` of every rank, per measured (not warm-up) round: ``[[rank0, rank1, ...], ...]``;
    with ``save_only``, the steps that measure figure 1 alone too."""
    n = len(ranks[0][key])
    rows = [ranks[0][key][i] for i in range(n)]
    return [
        [float(rk[key][i][field]) for rk in ranks]
        for i in range(n)
        if not rows[i]["warmup"] and (save_only or not rows[i].get("save_only"))
    ]


def _slowest(ranks: list[dict[str, Any]], key: str, field: str, only: list[int] | None = None) -> list[float]:
    """Per measured round, the slowest rank's ``field`` (of the ranks ``only``, default all)."""
    return [
        max(v for i, v in enumerate(row) if only is None or i in only) for row in _rounds(ranks, key, field)
    ]


def _time_figure(
    label: str, what: str, times: list[float], ctimes: list[float], ratio: float
) -> dict[str, Any]:
    return {
        "figure": label,
        "unit": "s",
        "measured": _median(times),
        "ceiling": _median(ctimes),
        "ceiling_what": what,
        "ratio": ratio,
        "times_s": times,
        "ceiling_times_s": ctimes,
    }


def _rate_figure(
    label: str, what: str, nbytes: float, times: list[float], cbytes: float, ctimes: list[float]
) -> dict[str, Any]:
    """A bandwidth figure: bytes per rank over the median of the rounds' slowest-rank times."""
    m, c = nbytes / _median(times) / 1e9, cbytes / _median(ctimes) / 1e9
    return {
        "figure": label,
        "unit": "GB/s",
        "measured": m,
        "ceiling": c,
        "ceiling_what": what,
        "ratio": m / c,
        "bytes_per_rank": nbytes,
        "ceiling_bytes_per_rank": cbytes,
        "times_s": times,
        "ceiling_times_s": ctimes,
    }


def figures_of_ranks(ranks: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Figures 1-6 and the extras, from the ranks' JSON."""
    figs: dict[str, Any] = {}
    part = _median([x for row in _rounds(ranks, "save_rounds", "part_bytes") for x in row])
    state = float(ranks[0]["state_bytes"])

    # 1: per rank, medians over the measured steps; the worst rank's
    per_rank = []
    steps = {
        f: _rounds(ranks, "save_rounds", f, save_only=True)
        for f in ("save_s", "copy_s", "snapshot_s", "copy_own_s", "copy_apart_s")
    }
    for i, rk in enumerate(ranks):
        save, copy, snap, own, apart = ([row[i] for row in rows] for rows in steps.values())
        per_rank.append(
            {
                "rank": rk["rank"],
                "save_s": _median(save),
                "copy_s": _median(copy),
                "copy_own_s": _median(own),
                "copy_apart_s": _median(apart),
                "snapshot_s": _median(snap),
                "ratio": _median(save) / _median(copy),
                "times_s": save,
                "ceiling_times_s": copy,
            }
        )
    worst = max(per_rank, key=lambda x: x["ratio"])
    figs["save"] = _time_figure(
        f"1 save blocks (worst: rank {worst['rank']})",
        "host copy of the state",
        worst["times_s"],
        worst["ceiling_times_s"],
        worst["ratio"],
    )
    figs["save"]["per_rank"] = per_rank
    # shown beside it: per step, the slowest rank's save against the slowest rank's copy (a
    # data-parallel step waits for its slowest rank)
    slow_save = [max(row) for row in steps["save_s"]]
    slow_copy = [max(row) for row in steps["copy_s"]]
    figs["save"]["slowest_rank"] = {
        "save_s": _median(slow_save),
        "copy_s": _median(slow_copy),
        "ratio": _median(slow_save) / _median(slow_copy),
    }
    # 2: the faster plain copy of each rank and round (write() over the files, or a copy into
    # kept maps of them), the round's slowest rank
    plain = zip(
        _rounds(ranks, "save_rounds", "plain_write_s"),
        _rounds(ranks, "save_rounds", "plain_mapped_s"),
        strict=True,
    )
    figs["write"] = _rate_figure(
        "2 tier write",
        "faster plain copy, same tmpfs",
        part,
        _slowest(ranks, "save_rounds", "write_s"),
        state,
        [max(min(a, b) for a, b in zip(w, m, strict=True)) for w, m in plain],
    )
    xbytes = _median([x for row in _rounds(ranks, "save_rounds", "exchange_bytes") for x in row])
    xtimes = _slowest(ranks, "save_rounds", "exchange_s")
    figs["replicate"] = _rate_figure(
        "3 replication",
        "exchange_buffers, same pairs",
        part,
        _slowest(ranks, "save_rounds", "replicate_s"),
        xbytes,
        xtimes,
    )
    rbytes = float(ranks[0]["part_bytes"])
    tier_t = _slowest(ranks, "restore_rounds", "tier_s")
    # 4: the faster plain read of each rank and round (read() into the buffers, or a copy out of
    # new populated maps of the files), the round's slowest rank
    reads = zip(
        _rounds(ranks, "restore_rounds", "plain_read_s"),
        _rounds(ranks, "restore_rounds", "mapped_read_s"),
        strict=True,
    )
    read_t = [max(min(a, b) for a, b in zip(r, m, strict=True)) for r, m in reads]
    figs["restore"] = _rate_figure(
        "4 restore from the tier",
        "faster plain read, same files",
        rbytes,
        tier_t,
        rbytes,
        read_t,
    )
    root_t = _slowest(ranks, "restore_rounds", "root_s")
    figs["root"] = _time_figure(
        "5 restore: tier vs root cold",
        "root restore, cold",
        tier_t,
        root_t,
        _median(root_t) / _median(tier_t),
    )
    figs["root"]["ratio_is"] = "ceiling / measured (times faster)"
    replaced = [int(r) for r in ranks[0]["peers"]]
    pbytes = _median([x for row in _rounds(ranks, "restore_rounds", "peer_bytes") for x in row if x])
    figs["peer"] = _rate_figure(
        "6 replaced node's restore",
        "transport of figure 3",
        pbytes,
        _slowest(ranks, "restore_rounds", "peer_s"),
        xbytes,
        xtimes,
    )

    extras: dict[str, Any] = {}
    staged = [x for row in _rounds(ranks, "save_rounds", "staging_bytes") for x in row]
    extras[
        "1: staging memory of a rank's snapshots, which its ceiling copies into (max bytes; state bytes)"
    ] = [
        int(max(staged)),
        int(state),
    ]
    for what, field in (("write() over files", "plain_write_s"), ("a copy into kept maps", "plain_mapped_s")):
        t = _slowest(ranks, "save_rounds", field)
        extras[f"2: the plain copy by {what}, GB/s per rank"] = state / _median(t) / 1e9
    fetch = _slowest(ranks, "restore_rounds", "peer_transfer_s", replaced)
    extras["6: the fetch alone (LocalTier._round), GB/s per replaced rank"] = pbytes / _median(fetch) / 1e9
    one = _slowest(ranks, "restore_rounds", "one_way_s")
    extras["6: one-way exchange_buffers on the same pairs, GB/s per receiving rank"] = (
        state / _median(one) / 1e9
    )
    xt = _slowest(ranks, "save_rounds", "exchange_tmpfs_s")
    rt = _slowest(ranks, "save_rounds", "replicate_s")
    extras[
        "3, 6: exchange_buffers of figure 3 between files of the tier's tmpfs (base pages), GB/s per rank"
    ] = xbytes / _median(xt) / 1e9
    extras["3: replication against that exchange (ratio)"] = (part / _median(rt)) / (xbytes / _median(xt))
    ot = _slowest(ranks, "restore_rounds", "one_way_tmpfs_s")
    extras["6: one-way exchange_buffers from files of the tier's tmpfs, GB/s per receiving rank"] = (
        state / _median(ot) / 1e9
    )
    pt = _slowest(ranks, "restore_rounds", "peer_s")
    extras["6: replaced node's restore against the exchange of figure 3 between tmpfs files (ratio)"] = (
        _median(xt) / xbytes * pbytes / _median(pt)
    )
    # what these figures could reach here at all: a tier restore at the plain read's speed; a
    # replaced node's restore doing only the reads and the transfer it needs, no checks
    extras["4: the plain read by read(), GB/s per rank"] = (
        rbytes / _median(_slowest(ranks, "restore_rounds", "plain_read_s")) / 1e9
    )
    extras["4: the plain read out of new populated maps, GB/s per rank"] = (
        rbytes / _median(_slowest(ranks, "restore_rounds", "mapped_read_s")) / 1e9
    )
    extras[
        "5: the root cold restore against the faster plain read (figure 5 if a tier restore took no longer)"
    ] = _median(root_t) / _median(read_t)
    lt = _slowest(ranks, "restore_rounds", "peer_least_s")
    extras[
        "6: the least restore of a replaced node, plain (kept ranks read their parts while "
        "sending, replaced ranks receive), GB/s per replaced rank"
    ] = pbytes / _median(lt) / 1e9
    extras["6: that least restore against the transport of figure 3 (figure 6's bound here)"] = (
        pbytes / _median(lt)
    ) / (xbytes / _median(xtimes))
    warm = [[float(x[f]) for x in ranks[0]["save_rounds"] if x["warmup"]] for f in ("write_s", "replicate_s")]
    extras["2, 3: warm-up steps (not in the figures): write s, replication s (rank 0)"] = [
        [round(v, 3) for v in w] for w in warm
    ]
    ev = [x for x in ranks[0]["restore_rounds"] if "evict" in x and not x["warmup"]]
    extras["5: root eviction"] = ev[0]["evict"] if ev else "?"
    extras["5: fraction of the root's pages still cached after eviction (max)"] = (
        max(x["resident_after_evict"] for x in ev) if ev else float("nan")
    )
    extras["every restore bit-exact"] = all(
        x.get(k, True)
        for rk in ranks
        for x in rk["restore_rounds"]
        for k in ("tier_exact", "root_exact", "peer_exact")
    )
    extras["tier restores read local parts only"] = all(
        x["tier_sources"] == ["local"] for rk in ranks for x in rk["restore_rounds"]
    )
    extras["replaced node's parts came from"] = ranks[0]["restore_rounds"][-1]["peer_sources"]
    extras["part bytes per rank"] = int(part)
    extras["part files per rank"] = ranks[0]["part_files"]
    extras["I/O threads per rank (save, load, plain ceilings)"] = ranks[0]["io_threads"]
    return figs, extras


# figure 7: a training loop in this process ------------------------------------------------------


def _thread_nice() -> dict[str, str]:
    """The nice value (and SCHED_IDLE where set) of every gpuckpt thread of this process."""
    out = {}
    for t in threading.enumerate():
        if not t.name.startswith("gpuckpt") or t.native_id is None:
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            out[t.name] = f"nice {fields[16]}" + (" SCHED_IDLE" if fields[38] == "5" else "")
    return out


def _draining(mgr: gpuckpt.CheckpointManager) -> bool:
    drain = mgr._tiered._drain
    return drain is not None and not drain[1].done()


def loop_bench(work: Path, local: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Figure 7: the same loop with and without checkpoints, in blocks, interleaved A/B."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 512), dtype=np.float32)
    b = rng.standard_normal((512, 512), dtype=np.float32)
    c = np.empty_like(a)

    def compute(m: int) -> None:
        for _ in range(m):
            np.matmul(a, b, out=c)

    compute(20)
    t = time.perf_counter()
    compute(50)
    matmuls = max(1, round(args.step_s / ((time.perf_counter() - t) / 50)))
    state = plain_state(args.mib, args.layout)
    k = args.every
    block = args.persist_every * k
    probe = TierProbe()  # when each part's snapshot returned: what of a save call was the snapshot
    mgr = gpuckpt.CheckpointManager(
        work / "loop-root",
        local_dir=local / "loop",
        replicas=0,
        persist_interval_steps=block,
        save_interval_steps=k,
        max_to_keep=2,
    )
    drains: list[float] = []  # from a drain's start (the save call) to its commit at the root
    submit = mgr._tiered._drains.submit

    def timed_submit(fn: Any, *a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        fut = submit(fn, *a, **kw)
        fut.add_done_callback(lambda _: drains.append(time.perf_counter() - t))
        return fut

    mgr._tiered._drains.submit = timed_submit  # type: ignore[method-assign]
    step = k - 1  # every checkpointed block starts with a save: its last save's drain runs inside it
    plain_t: list[float] = []
    plain_compute: list[float] = []
    plain_steps: list[float] = []  # each step of the loop without checkpoints
    draining_steps: list[float] = []  # each step of the loop with checkpoints that ran beside a drain
    ckpt_t: list[float] = []
    ckpt_compute: list[float] = []
    saves_s: list[float] = []
    snaps_s: list[float] = []
    backlog: list[float] = []
    nice: dict[str, str] = {}
    sampled_while_draining: list[bool] = []

    def plain(measured: bool) -> None:
        os.sync()
        time.sleep(args.op_settle)
        comp = 0.0
        t0 = time.perf_counter()
        steps = []
        for _ in range(block):
            s = time.perf_counter()
            compute(matmuls)
            steps.append(time.perf_counter() - s)
        comp = sum(steps)
        if measured:
            plain_t.append(time.perf_counter() - t0)
            plain_compute.append(comp)
            plain_steps.extend(steps)

    def with_checkpoints(measured: bool) -> None:
        nonlocal step
        os.sync()
        time.sleep(args.op_settle)
        comp, saves, first = 0.0, [], len(drains)
        steps_while_draining: list[float] = []
        t0 = time.perf_counter()
        for i in range(block):
            step += 1
            state["step"] = step
            s = time.perf_counter()
            draining = _draining(mgr)
            if mgr.save(step, state):
                saves.append(time.perf_counter() - s)
                m = probe.marks.get(part_name(step, 0), {})
                if measured and "snap1" in m:
                    snaps_s.append(m["snap1"] - m["snap0"])
            s2 = time.perf_counter()
            compute(matmuls)
            comp += time.perf_counter() - s2
            if draining and _draining(mgr):  # the drain ran from the step's start to its end
                steps_while_draining.append(time.perf_counter() - s)
            if i == k + k // 2:  # half-way between two saves
                drain = mgr._tiered._drain
                sampled_while_draining.append(drain is not None and not drain[1].done())
                nice.update(_thread_nice())
        elapsed = time.perf_counter() - t0
        w = time.perf_counter()
        mgr.wait()  # untimed: what still ran when the block ended
        if measured:
            ckpt_t.append(elapsed)
            ckpt_compute.append(comp)
            draining_steps.extend(steps_while_draining)
            saves_s.extend(saves)
            backlog.append(time.perf_counter() - w)
        else:
            del drains[first:]

    for r in range(args.rounds + 1):  # round 0 is a warm-up
        pair = [plain, with_checkpoints]
        for fn in pair if r % 2 == 0 else reversed(pair):
            fn(r > 0)
    mgr.close()
    return {
        "figure": "7 training loop, checkpoints on",
        "unit": "s",
        "measured": _median(ckpt_t) / block,
        "ceiling": _median(plain_t) / block,
        "ceiling_what": "the same loop, no checkpoints",
        "ratio": _median(ckpt_t) / _median(plain_t),
        "times_s": [x / block for x in ckpt_t],
        "ceiling_times_s": [x / block for x in plain_t],
        "compute_only_ratio": _median(ckpt_compute) / _median(plain_compute),
        # the reading: steps while the drain runs, against steps without checkpoints
        "while_draining_ratio": (
            statistics.mean(draining_steps) / statistics.mean(plain_steps) if draining_steps else None
        ),
        "steps_while_draining_s": draining_steps,
        "plain_steps_s": plain_steps,
        "matmuls_per_step": matmuls,
        "save_every": k,
        "persist_every_saves": args.persist_every,
        "block_steps": block,
        "save_call_s": saves_s,
        "snapshot_in_save_s": snaps_s,
        "drain_s": drains,
        "backlog_s": backlog,
        "thread_nice": nice,
        "sampled_while_draining": sampled_while_draining,
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "OpenBLAS default (one per core)"),
    }


def draining_figure(loop: dict[str, Any]) -> dict[str, Any]:
    """Figure 7 as the issue words it: the loop's steps while a drain runs (from a step's start
    to its end), against the steps of the loop without checkpoints; means of single steps."""
    busy, plain = loop["steps_while_draining_s"], loop["plain_steps_s"]
    return {
        "figure": "7 steps while a drain runs",
        "unit": "s",
        "measured": statistics.mean(busy),
        "ceiling": statistics.mean(plain),
        "ceiling_what": "steps of the loop, no checkpoints",
        "ratio": loop["while_draining_ratio"],
        "times_s": busy,
        "ceiling_times_s": plain,
        "steps": len(busy),
    }


# output -----------------------------------------------------------------------------------------


def verdict(key: str, ratio: float) -> tuple[str, str]:
    op, target = TARGETS[key]
    met = ratio <= target if op == "<=" else ratio >= target
    return f"{op} {target:g}", "yes" if met else "NO"


def _spread(v: list[float]) -> str:
    return f"{min(v):.3f}-{max(v):.3f}" if v else "-"


def print_table(res: dict[str, Any]) -> None:
    m = res["machine"]
    print(
        f"\n{res['date']}  {m.get('cpu_model', '?')}, {m['cpus']} CPUs, {m.get('memory_gib', '?')} GiB, kernel {m['kernel']}"
    )
    print(
        f"state {res['state_mib_per_rank']:g} MiB in {res.get('tensors_per_rank', 18)} tensors per rank "
        f"({res.get('layout', 'mixed')}) x {RANKS} ranks (2 simulated nodes); local tiers: "
        f"{res['local_dir_kind']}; root: {res['root_fs']}; {res['rounds']} rounds after {res['warmup']} warm-up "
        f"steps and {res.get('save_rounds', 0)} of figure 1 alone (restores: 1 warm-up round); "
        f"{res['op_settle_s']:g} s settle before each timed operation"
    )
    if res.get("transport") == "gloo":
        transport = f"transport: gloo (torch.distributed {m.get('torch', '?')}, TCP on loopback)"
    else:
        transport = f"transport: MPI ({m.get('mpiexec', 'mpiexec')})"
    print(f"command: {res['command']}; commit {m.get('git_commit', '?')}; {transport}")
    head = (
        f"{'figure':<33} {'measured':>11} {'(rounds, s)':>13}  {'ceiling':<30} {'':>11} {'(rounds, s)':>13} "
        f"{'ratio':>6} {'target':>7} {'met':>3}"
    )
    print(head)
    print("-" * len(head))
    for key, f in res["figures"].items():
        unit = f["unit"]
        target, met = verdict(key, f["ratio"])
        print(
            f"{f['figure']:<33} {f['measured']:7.3f} {unit:<4}{_spread(f['times_s']):>13}  {f['ceiling_what']:<30} "
            f"{f['ceiling']:7.3f} {unit:<4}{_spread(f['ceiling_times_s']):>13} {f['ratio']:6.2f} {target:>7} {met:>3}"
        )
    print(
        "GB/s: bytes of one rank's part (ceilings: of its arrays) per second of the round's slowest rank; "
        "figure 5's ratio: ceiling / measured"
    )
    print()
    for f in res["figures"]["save"]["per_rank"]:
        print(
            f"  1: rank {f['rank']}: save {f['save_s']:.3f} s ({_spread(f['times_s'])}), of which the part's "
            f"snapshot {f['snapshot_s']:.3f} s; host copy {f['copy_s']:.3f} s ({_spread(f['ceiling_times_s'])}); "
            f"ratio {f['ratio']:.2f}; host copy into memory of its own {f['copy_own_s']:.3f} s; host copy "
            f"started after the barrier alone {f['copy_apart_s']:.3f} s (ratio {f['save_s'] / f['copy_apart_s']:.2f})"
        )
    slow = res["figures"]["save"].get("slowest_rank")
    if slow is not None:
        n = len(res["figures"]["save"]["times_s"])
        print(
            f"  1: the step's slowest rank ({n} steps): save {slow['save_s']:.3f} s, host copy "
            f"{slow['copy_s']:.3f} s; ratio {slow['ratio']:.2f}"
        )
    for k, v in res["extras"].items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    loop = res["figures"].get("loop")
    if loop:
        print(
            f"  7: {loop['matmuls_per_step']} matmuls of 512x512 per step, a save every {loop['save_every']} "
            f"steps, every {loop['persist_every_saves']}th save also to the root; "
            f"blocks of {loop['block_steps']} steps; BLAS threads: {loop['blas_threads']}"
        )
        print(
            f"  7: steps while a drain ran: {len(loop['steps_while_draining_s'])} of "
            f"{len(loop['save_call_s']) * loop['save_every']} measured steps"
        )
        print(
            f"  7: compute-only time ratio {loop['compute_only_ratio']:.3f}; save call "
            f"{_median(loop['save_call_s']):.3f} s median ({_spread(loop['save_call_s'])}), of which the snapshot "
            f"{_median(loop['snapshot_in_save_s']):.3f} s; a drain (save call to root commit) "
            f"{_median(loop['drain_s']):.3f} s median ({_spread(loop['drain_s'])}); still running at a block's "
            f"end: {_spread(loop['backlog_s'])} s"
        )
        print(
            "  7: how the drain is kept out of the way: its thread lowers its own priority to nice 19 "
            "(Workers(nice=19), gpuckpt.runtime.workers), and the I/O threads it starts inherit it; sampled half-way "
            f"between saves (drain running: {loop['sampled_while_draining']}): {loop['thread_nice']}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=256, help="MiB of state per rank")
    ap.add_argument(
        "--layout",
        choices=sorted(LAYOUTS),
        default="mixed",
        help="the tensors' sizes: 18 of 2-48 MiB (mixed), or 289 of a GPT-like model (gpt)",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--save-rounds",
        type=int,
        default=12,
        help="steps after the warm-up that measure figure 1 alone (its save and ceilings), beside the rounds",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="steps saved before the measured ones (the tiers grow to their steady size: local_max_to_keep + 1)",
    )
    ap.add_argument(
        "--op-settle", type=float, default=OP_SETTLE_S, help="idle seconds before each timed operation"
    )
    ap.add_argument("--every", type=int, default=10, help="figure 7: a save every this many steps")
    ap.add_argument(
        "--persist-every", type=int, default=5, help="figure 7: every this many saves also go to the root"
    )
    ap.add_argument("--step-s", type=float, default=0.1, help="figure 7: seconds of matmuls per step")
    ap.add_argument("--local", type=Path, default=None, help="parent of the local tiers (default /dev/shm)")
    ap.add_argument("--dir", type=Path, default=None, help="parent of the root (default: the temp dir)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds the ranks may run")
    ap.add_argument("--quick", action="store_true", help="4 MiB per rank, 1 round, no settling (smoke test)")
    ap.add_argument(
        "--transport",
        choices=("mpi", "gloo"),
        default="mpi",
        help="the coordinator of the ranks: MPICoordinator under mpiexec, or TorchCoordinator over a "
        "torch.distributed gloo group on loopback (needs torch)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.mib, args.rounds, args.warmup, args.op_settle, args.every, args.step_s = 4, 1, 1, 0.0, 2, 0.02
        args.save_rounds = 1
        args.timeout = min(args.timeout, 240)
    mpiexec = find_mpiexec() if args.transport == "mpi" else None
    if args.transport == "gloo" and importlib.util.find_spec("torch") is None:
        print("bench_tiers --transport gloo needs torch (`pip install gpuckpt[torch]`)")
        return 2
    if args.transport == "mpi" and (mpiexec is None or importlib.util.find_spec("mpi4py") is None):
        print(f"bench_tiers needs mpiexec and mpi4py (`pip install mpich mpi4py`); found mpiexec={mpiexec!r}")
        return 2
    shm = Path("/dev/shm")
    local_parent = args.local or (
        shm if shm.is_dir() and fs_type(shm) == "tmpfs" else Path(tempfile.gettempdir())
    )
    kind = fs_type(local_parent)
    local = Path(tempfile.mkdtemp(prefix="gpuckpt-bench-tiers-", dir=local_parent))
    work = Path(tempfile.mkdtemp(prefix="gpuckpt-bench-tiers-", dir=args.dir))
    res: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(mpiexec),
        "transport": args.transport,
        "quick": args.quick,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "save_rounds": args.save_rounds,
        "op_settle_s": args.op_settle,
        "state_mib_per_rank": args.mib,
        "layout": args.layout,
        "tensors_per_rank": len(tensor_rows(args.mib, args.layout)),
        "local_dir": str(local),
        "local_dir_kind": f"tmpfs ({local_parent})"
        if kind == "tmpfs"
        else f"NOT tmpfs: {kind} at {local_parent} (no tmpfs found)",
        "local_is_tmpfs": kind == "tmpfs",
        "root_fs": f"{fs_type(work)} at {work.parent}",
        "targets": {k: f"{op} {t}" for k, (op, t) in TARGETS.items()},
    }
    try:
        out = work / "ranks-out"
        out.mkdir()
        if mpiexec is not None:
            ranks = run_ranks(mpiexec, out, local, work / "root", args)
        else:
            ranks = run_gloo_ranks(out, local, work / "root", args)
        res["ranks"] = ranks
        res["figures"], res["extras"] = figures_of_ranks(ranks)
        shutil.rmtree(work / "root", ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir()
        res["figures"]["loop"] = loop = loop_bench(work, local, args)
        if loop["while_draining_ratio"] is not None:
            res["figures"]["loop_draining"] = draining_figure(loop)
    finally:
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    for key, f in res["figures"].items():
        f["target"], f["met"] = verdict(key, f["ratio"])
    print_table(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
