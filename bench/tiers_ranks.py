"""One rank of ``bench/bench_tiers.py``: 4 ranks as 2 simulated nodes, started by it under mpiexec
(or, with ``--transport gloo``, as 4 processes of a ``torch.distributed`` gloo group).

``mpiexec -n 4 python bench/tiers_ranks.py --out DIR --local BASE --root ROOT [--mib 256]
[--rounds 5] [--warmup 3] [--op-settle 3] [--transport mpi|gloo]``: rank ``r`` is on node
``n{r // 2}`` with the local tier ``BASE/n{r // 2}``; the root is ``ROOT``. With gloo the rank
and the group's address come from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, as ``torchrun`` sets them). Each rank writes what it measured to
``DIR/rank<R>.json`` (``{"error": traceback}`` if it failed, and the job is aborted). What is
measured, and how, is said in ``bench/bench_tiers.py``; the figures are made there.

The state helpers (:func:`tensor_rows`, :func:`rank_state`, :func:`plain_state`) are imported
by ``bench_tiers.py`` too; mpi4py and torch are imported only when a rank runs.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import gpuckpt  # noqa: E402
import gpuckpt.background as background_module  # noqa: E402
import gpuckpt.tiers.local as tiers_module  # noqa: E402
from bench.compare.common import cut_from, drop_cache  # noqa: E402
from gpuckpt.background import copy_host_arrays, host_arena_pool, host_order  # noqa: E402
from gpuckpt.device.staging import HostAllocator, StagingArena, aligned_bytes  # noqa: E402
from gpuckpt.format.parts import part_name  # noqa: E402
from gpuckpt.planning.tiers import replica_holders  # noqa: E402
from gpuckpt.runtime.runner import default_threads  # noqa: E402

RANKS = 4
#: MiB of each tensor of a rank's 256 MiB (scaled by --mib): a few MiB to tens of MiB
TENSOR_MIB = (48, 32, 32, 24, 24, 16, 16, 16, 8, 8, 8, 4, 4, 4, 4, 4, 2, 2)
#: ``--layout gpt``: a GPT-like state of 289 tensors, before scaling by --mib: an embedding of 16
#: MiB and 24 layers of 4 matrices (3, 1, 4 and 4 MiB) and 8 biases and norms (2-8 KiB each); a
#: rank's box of a bias is a row of :data:`COLS` floats or two (4-8 KiB)
GPT_LAYER_MIB = (3, 6 / 1024, 1, 2 / 1024, 2 / 1024, 2 / 1024, 2 / 1024, 2 / 1024, 4, 8 / 1024, 4, 2 / 1024)
GPT_MIB = (16, *(GPT_LAYER_MIB * 24))
LAYOUTS = {"mixed": TENSOR_MIB, "gpt": GPT_MIB}
COLS = 1024  # float32 columns: a row is 4 KiB


def node_of(rank: int) -> str:
    return f"n{rank // 2}"


def tensor_rows(mib: float, layout: str = "mixed") -> list[int]:
    """Rows (of :data:`COLS` float32) of each tensor of a state of about ``mib`` MiB, the
    tensors' sizes in the proportions of ``layout`` (:data:`LAYOUTS`)."""
    sizes = LAYOUTS[layout]
    scale = mib / sum(sizes)
    return [max(1, round(m * scale * (1 << 20) / (4 * COLS))) for m in sizes]


def _block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(1 << 22, dtype=np.float32)


def rank_state(rank: int, mib: float, step: int = 0, layout: str = "mixed") -> dict[str, Any]:
    """What ``rank`` holds: a row box of each global tensor (the FSDP layout), and the step."""
    block = _block(rank)
    model = {}
    for i, rows in enumerate(tensor_rows(mib, layout)):
        local = cut_from(block, (rows, COLS), 7919 * i)
        model[f"t{i:03d}"] = gpuckpt.ShardedArray(local, (rank * rows, 0), (RANKS * rows, COLS))
    return {"model": model, "step": step}


def empty_like(state: dict[str, Any]) -> dict[str, Any]:
    """A restore target of the same layout, every page touched (a model already in memory)."""
    model = {}
    for k, s in state["model"].items():
        model[k] = gpuckpt.ShardedArray(np.zeros_like(s.local), s.offsets, s.global_shape)
    return {"model": model, "step": -1}


def plain_state(mib: float, layout: str = "mixed") -> dict[str, Any]:
    """A single process's state of about ``mib`` MiB (the same tensor sizes, plain arrays)."""
    block = _block(99)
    rows = tensor_rows(mib, layout)
    arrays = {f"t{i:03d}": cut_from(block, (n, COLS), 7919 * i) for i, n in enumerate(rows)}
    return {"model": arrays, "step": 0}


def local_arrays(state: dict[str, Any]) -> list[np.ndarray]:
    return [s.local for s in state["model"].values()]


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# plain I/O: the ceilings ---------------------------------------------------------------------


def _write_file(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # over the bytes of the last round's
    try:
        while data.nbytes:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)


def plain_write(arrays: list[np.ndarray], d: Path, threads: int) -> None:
    """One file per array in the directory ``d``, written by ``threads`` threads, no fsync (the
    tier writes with ``sync="none"``; on tmpfs an fsync does nothing anyway). The files of the
    last call are overwritten in place (the same sizes): their pages are there, as those of
    the part files a tier reuses are, so the ceiling is the copy alone."""
    d.mkdir(exist_ok=True)
    with ThreadPoolExecutor(threads) as ex:
        jobs = [
            ex.submit(_write_file, d / f"{i}.bin", memoryview(a.reshape(-1).view(np.uint8)))
            for i, a in enumerate(arrays)
        ]
        for j in jobs:
            j.result()


def mapped_copy(arrays: list[np.ndarray], maps: list[mmap.mmap], threads: int) -> None:
    """Every array copied into its own file's map (:class:`TmpfsBuffers`: files of the same
    tmpfs, mapped and populated once, kept from round to round), by ``threads`` threads: the
    other plain way into the tier's file system, where ``write()`` costs more than the copy."""
    with ThreadPoolExecutor(threads) as ex:
        jobs = [
            ex.submit(np.copyto, np.frombuffer(m, np.uint8), a.reshape(-1).view(np.uint8))
            for a, m in zip(arrays, maps, strict=True)
        ]
        for j in jobs:
            j.result()


class HostCopies:
    """Figure 1's ceilings: a host copy of ``arrays`` (``copy_host_arrays``, a snapshot's own
    copy) into the snapshots' own staging memory, taken from their pool between saves
    (:meth:`into_pool`), or into memory of its own allocated once (:meth:`into_own`)."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays
        self.orders = [host_order(a) for a in arrays]
        self.need = sum(aligned_bytes(a.nbytes) for a in arrays)
        self.pool = host_arena_pool()
        self.own = StagingArena(HostAllocator())

    def into_pool(self) -> None:
        taken = self.pool.acquire(self.need)
        try:
            copy_host_arrays(self.arrays, self.orders, taken)
        finally:
            self.pool.release(taken)

    def into_own(self) -> None:
        self.own.reset(self.need)
        copy_host_arrays(self.arrays, self.orders, self.own)


def _read_file(path: Path, buf: np.ndarray) -> None:
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        while view.nbytes:
            n = f.readinto(view)
            if not n:
                raise EOFError(f"{path} ended early")
            view = view[n:]


def _each_file(
    read_one: Callable[[Path, np.ndarray], None], files: list[Path], bufs: list[np.ndarray], threads: int
) -> None:
    with ThreadPoolExecutor(threads) as ex:
        for j in [ex.submit(read_one, f, b) for f, b in zip(files, bufs, strict=True)]:
            j.result()


def plain_read(files: list[Path], bufs: list[np.ndarray], threads: int) -> None:
    """Every byte of ``files`` into the preallocated ``bufs``, by ``threads`` threads."""
    _each_file(_read_file, files, bufs, threads)


def _map_file(path: Path, buf: np.ndarray) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != buf.nbytes:
            raise EOFError(f"{path} holds {size} bytes, not {buf.nbytes}")
        if size:
            with mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ) as m:
                np.copyto(buf.reshape(-1).view(np.uint8), np.frombuffer(m, np.uint8))
    finally:
        os.close(fd)


def mapped_read(files: list[Path], bufs: list[np.ndarray], threads: int) -> None:
    """Every byte of ``files`` into the preallocated ``bufs`` out of new populated maps of
    them, by ``threads`` threads: the other plain way to read files of tmpfs, where ``read()``
    copies a base page at a time."""
    _each_file(_map_file, files, bufs, threads)


def evict(path: Path, machine_wide: bool = True) -> tuple[str, float]:
    """Drop ``path``'s files from the page cache: ``/proc/sys/vm/drop_caches`` where allowed
    (and ``machine_wide``), else ``posix_fadvise(DONTNEED)`` per file; returns the method and
    the fraction still resident. A smoke run evicts per file only: other tests running beside
    it rely on what they put in the page cache."""
    os.sync()
    if not machine_wide:
        return "posix_fadvise(DONTNEED) per file (a smoke run)", drop_cache(os.fspath(path))
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        method = "drop_caches"
    except OSError as exc:
        method = f"posix_fadvise(DONTNEED) per file (drop_caches refused: {exc.strerror})"
    return method, drop_cache(os.fspath(path))


# the rank's harness ---------------------------------------------------------------------------


class Harness:
    """Synchronisation of the timed operations on a communicator of the harness's own.

    Under MPI its barriers poll a non-blocking barrier with sleeps: MPICH's waits spin, and a
    rank spinning in the harness's barrier would take a core from a rank still being measured.
    Under gloo, a group of its own whose barrier blocks in a socket read.
    """

    def __init__(self, settle_s: float, transport: str = "mpi") -> None:
        self.settle_s = settle_s
        self.transport = transport
        if transport == "gloo":
            import torch.distributed as dist

            self._dist = dist
            self.group = dist.new_group(backend="gloo")
            self.rank = dist.get_rank()
            return
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD.Dup()
        self.rank = self.comm.Get_rank()

    def barrier(self) -> None:
        if self.transport == "gloo":
            self._dist.barrier(group=self.group)
            return
        req = self.comm.Ibarrier()
        while not req.Test():
            time.sleep(0.0005)

    def timed(self, fn: Callable[[], Any], start: Callable[[], Any] | None = None) -> float:
        """``fn()`` on every rank at once after a sync and the settle wait; this rank's seconds.

        ``start``: a collective called after the barrier, untimed, that starts every rank's
        ``fn`` together. The barrier polls with sleeps, and a rank woken while the others'
        threads already hold both cores may start 2-10 ms late (in 11 steps of 14, one rank or
        more, one-off trial); measured from its own start, it then competes with fewer ranks."""
        os.sync()
        time.sleep(self.settle_s)
        self.barrier()
        if start is not None:
            start()
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        self.barrier()
        return dt


class TierProbe:
    """Times of a manager's local tier per step, from wrappers around its own calls: the part's
    snapshot, its write from its start on the writer thread to the part committed, the
    replication round, every transfer round."""

    def __init__(self) -> None:
        self.marks: dict[str, dict[str, float]] = {}
        #: ``(start, end)`` of every exchange round (replications and restores' fetches: the
        #: transfer into memory, before any file is written)
        self.transfers: list[tuple[float, float]] = []
        original = tiers_module.async_save_with_options

        def timed_async(view: Any, path: Any, options: Any, coordinator: Any = None, **kw: Any) -> Any:
            t = time.perf_counter()
            fut = original(view, path, options, coordinator, **kw)
            self.marks.setdefault(Path(path).name, {}).update(snap0=t, snap1=time.perf_counter())
            return fut

        tiers_module.async_save_with_options = timed_async  # the tier looks it up at each call
        submit = background_module.submit

        def timed_submit(ex: Any, fn: Callable[[], Any], path: str, handover: Any = None) -> Any:
            def write() -> Any:  # on the writer thread: when the part's write really starts
                self.marks.setdefault(Path(path).name, {})["write0"] = time.perf_counter()
                return fn()

            return submit(ex, write, path, handover)

        background_module.submit = timed_submit  # async_save_with_options looks it up at each call

    def attach(self, tier: Any) -> None:
        finish, replicate, exchange, rank = tier._finish, tier._replicate, tier._round, tier.rank

        def timed_finish(step: int, written: Any, *rest: Any) -> None:
            # the part's write starts once every rank's snapshot is done, which the tier's
            # thread learns in _finish: its end is marked by the write's own future
            marks = self.marks.setdefault(part_name(step, rank), {})

            def committed(_: Any) -> None:
                marks["committed"] = time.perf_counter()

            if written is None:
                committed(None)
            else:
                written._future.add_done_callback(committed)
            finish(step, written, *rest)

        def timed_replicate(step: int) -> None:
            t = time.perf_counter()
            replicate(step)
            self.marks.setdefault(part_name(step, rank), {}).update(rep0=t, rep1=time.perf_counter())

        def timed_exchange(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            got = exchange(*a, **kw)
            self.transfers.append((t, time.perf_counter()))
            return got

        tier._finish, tier._replicate, tier._round = timed_finish, timed_replicate, timed_exchange


def _order(names: list[str], r: int) -> list[str]:
    return names if r % 2 == 0 else names[::-1]


class Rank:
    """What every phase of a rank uses: its coordinator, harness, state, directories, tier probe."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.h = Harness(args.op_settle, args.transport)
        if args.transport == "gloo":
            from gpuckpt.distributed import TorchCoordinator

            self.c: Any = TorchCoordinator()
        else:
            from gpuckpt.distributed import MPICoordinator

            self.c = MPICoordinator()
        self.rank, n = self.c.rank, self.c.world_size
        if n != RANKS:
            raise SystemExit(f"tiers_ranks.py runs as {RANKS} ranks (2 simulated nodes), not {n}")
        self.node = node_of(self.rank)
        self.local_dir = Path(args.local) / self.node
        self.root = Path(args.root)
        self.threads = default_threads()
        self.names = [node_of(r) for r in range(n)]
        self.state = rank_state(self.rank, args.mib, layout=args.layout)
        self.arrays = local_arrays(self.state)
        self.nbytes = sum(a.nbytes for a in self.arrays)
        self.probe = TierProbe()
        self.transport = self.c.duplicate()  # the ceilings' exchanges: a channel of their own
        # the step restored: the last saved, persisted to the root
        self.last = args.warmup + args.save_rounds + args.rounds

    def manager(self, **kw: Any) -> gpuckpt.CheckpointManager:
        mgr = gpuckpt.CheckpointManager(
            self.root, local_dir=self.local_dir, node=self.node, coordinator=self.c, **kw
        )
        assert mgr._tiered is not None
        self.probe.attach(mgr._tiered.tier)
        return mgr


def _bytes(arrays: list[np.ndarray]) -> list[memoryview]:
    return [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays]


class TmpfsBuffers:
    """Buffers of the given sizes in files of ``directory`` (the local tier's file system),
    mapped shared and populated once, kept for every round: the transport's own bandwidth
    between pages of the tier's kind (tmpfs: base pages, where the arrays of the figures'
    ceilings have transparent huge pages), shown beside figures 3 and 6."""

    def __init__(self, directory: Path, sizes: list[int]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.maps: list[mmap.mmap] = []
        for i, n in enumerate(sizes):
            fd = os.open(directory / f"b{i}", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, n)
                os.posix_fallocate(fd, 0, n)
                self.maps.append(mmap.mmap(fd, n, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
            finally:
                os.close(fd)

    def views(self) -> list[memoryview]:
        return [memoryview(m) for m in self.maps]

    def close(self) -> None:
        for m in self.maps:
            m.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def save_phase(k: Rank) -> dict[str, Any]:
    """Figures 1-3: save, the tier's write, replication; and their ceilings, interleaved."""
    h, rank, arrays = k.h, k.rank, k.arrays
    mgr = k.manager(replicas=1, persist_interval_steps=k.last, local_max_to_keep=2)
    tier = mgr._tiered.tier
    assert tier is not None
    copies = HostCopies(arrays)
    recv = {s: [np.zeros_like(a) for a in arrays] for s in tier.held}  # the peers' arrays: same sizes
    plain_dir = k.local_dir / f".plain-r{rank}"  # figure 2's ceiling: its files kept, overwritten
    sizes = [a.nbytes for a in arrays]
    plain_maps = TmpfsBuffers(k.local_dir / f".plainmap-r{rank}", sizes)  # figure 2's other ceiling
    send_files = TmpfsBuffers(k.local_dir / f".xsend-r{rank}", sizes)
    recv_files = {s: TmpfsBuffers(k.local_dir / f".xrecv-r{rank}-{s}", sizes) for s in tier.held}
    rounds: list[dict[str, Any]] = []
    for step in range(1, k.last + 1):
        rec: dict[str, Any] = {"step": step, "warmup": step <= k.args.warmup}
        # the steps after the warm-up ones measure figure 1 alone: its ceilings and the save
        rec["save_only"] = k.args.warmup < step <= k.args.warmup + k.args.save_rounds
        k.state["step"] = step

        def save(step: int = step, rec: dict[str, Any] = rec) -> None:
            rec["save_s"] = h.timed(lambda: mgr.save(step, k.state))
            tier.wait_for(step)
            mgr.wait()  # the drain of the last step too: nothing runs under the next operation
            m = k.probe.marks[part_name(step, rank)]
            rec["snapshot_s"] = m["snap1"] - m["snap0"]
            rec["write_s"] = m["committed"] - m["write0"]
            rec["replicate_s"] = m["rep1"] - m["rep0"]
            rec["part_bytes"] = tree_bytes(k.local_dir / part_name(step, rank))

        def write(rec: dict[str, Any] = rec) -> None:
            rec["plain_write_s"] = h.timed(lambda: plain_write(arrays, plain_dir, k.threads))

        def write_mapped(rec: dict[str, Any] = rec) -> None:
            rec["plain_mapped_s"] = h.timed(lambda: mapped_copy(arrays, plain_maps.maps, k.threads))

        def exchange(rec: dict[str, Any] = rec) -> None:
            sends = {dest: _bytes(arrays) for dest in tier.holders}
            recvs = {s: _bytes(bufs) for s, bufs in recv.items()}
            rec["exchange_s"] = h.timed(lambda: k.transport.exchange_buffers(sends, recvs))
            rec["exchange_bytes"] = k.nbytes * len(tier.holders)

        def exchange_tmpfs(rec: dict[str, Any] = rec) -> None:
            sends = {dest: send_files.views() for dest in tier.holders}
            recvs = {s: b.views() for s, b in recv_files.items()}
            rec["exchange_tmpfs_s"] = h.timed(lambda: k.transport.exchange_buffers(sends, recvs))
            for v in [*(x for vs in sends.values() for x in vs), *(x for vs in recvs.values() for x in vs)]:
                v.release()

        # figure 1's ceilings start on every rank together, after a collective of the ranks'
        # transport, as a save's copies do after its collective
        def together() -> None:
            k.transport.all_gather(None)

        def host_copy(rec: dict[str, Any] = rec) -> None:
            rec["copy_s"] = h.timed(copies.into_pool, start=together)
            rec["staging_bytes"] = copies.pool.reserved_bytes()

        def host_copy_own(rec: dict[str, Any] = rec) -> None:
            rec["copy_own_s"] = h.timed(copies.into_own, start=together)

        def host_copy_apart(rec: dict[str, Any] = rec) -> None:
            rec["copy_apart_s"] = h.timed(copies.into_pool)

        ops = {"copy": host_copy, "save": save, "copy_own": host_copy_own, "copy_apart": host_copy_apart}
        if not rec["save_only"]:
            ops.update(
                write=write, exchange=exchange, exchange_tmpfs=exchange_tmpfs, write_mapped=write_mapped
            )
        for name in _order(list(ops), step):
            ops[name]()
        rounds.append(rec)
    mgr.close()
    shutil.rmtree(plain_dir, ignore_errors=True)
    send_files.close()
    plain_maps.close()
    for b in recv_files.values():
        b.close()
    return {"save_rounds": rounds, "holders": tier.holders, "held": tier.held}


def restore_phase(k: Rank) -> dict[str, Any]:
    """Figures 4-6: restores from the tier, from the root cold, of a replaced node; and their
    ceilings, interleaved."""
    h, rank, last = k.h, k.rank, k.last
    target = empty_like(k.state)
    targets = local_arrays(target)
    expected = k.arrays  # what every array must hold after a restore (saved unchanged every step)

    def exact() -> bool:
        same = all(np.array_equal(a, b) for a, b in zip(targets, expected, strict=True))
        return bool(same and target["step"] == last)

    def clear() -> None:
        for a in targets:
            a.fill(0)
        target["step"] = -1

    part = k.local_dir / part_name(last, rank)
    files = sorted(f for f in part.rglob("*") if f.is_file())
    read_bufs = [np.zeros(f.stat().st_size, np.uint8) for f in files]
    root_mgr = gpuckpt.CheckpointManager(k.root, coordinator=k.c)
    # the replaced node n1's ranks, and the ranks that hold their replicas
    peers = {r: replica_holders(r, k.names, 1)[0] for r in range(RANKS) if node_of(r) == "n1"}
    one_sends = {r: k.arrays for r, holder in peers.items() if holder == rank}
    one_recvs = {peers[rank]: targets} if rank in peers else {}
    from_files = TmpfsBuffers(k.local_dir / f".xfrom-r{rank}", [a.nbytes for a in k.arrays])
    rounds: list[dict[str, Any]] = []
    for r in range(k.args.rounds + 1):  # round 0 is a warm-up
        rec: dict[str, Any] = {"round": r, "warmup": r == 0}

        def read(rec: dict[str, Any] = rec) -> None:
            rec["plain_read_s"] = h.timed(lambda: plain_read(files, read_bufs, k.threads))

        def read_mapped(rec: dict[str, Any] = rec) -> None:
            rec["mapped_read_s"] = h.timed(lambda: mapped_read(files, read_bufs, k.threads))

        def restore_tier(rec: dict[str, Any] = rec) -> None:
            m = k.manager()  # a new manager: a restarted job's
            clear()
            rec["tier_s"] = h.timed(lambda: m.restore(target))
            report = m.last_restore
            assert report is not None
            rec["tier_sources"] = sorted({p.where for p in report.parts.values()})
            rec["tier_exact"] = exact()
            m.close()

        def restore_root(rec: dict[str, Any] = rec) -> None:
            clear()
            if rank == 0:
                rec["evict"], rec["resident_after_evict"] = evict(
                    k.root / f"step_{last:08d}", machine_wide=not k.args.smoke
                )
            rec["root_s"] = h.timed(lambda: root_mgr.restore(target, step=last))
            rec["root_exact"] = exact()

        def restore_peer(rec: dict[str, Any] = rec) -> None:
            n1 = Path(k.args.local) / "n1"
            away = Path(k.args.local) / "n1.away"
            h.barrier()
            if rank == 2:  # the lowest rank of node n1: the node is replaced, its tier empty (the
                # old one moved aside, put back after the round, so that the other rounds find it)
                os.rename(n1, away)
            h.barrier()
            m = k.manager()
            clear()
            before = len(k.probe.transfers)
            rec["peer_s"] = h.timed(lambda: m.restore(target))
            report = m.last_restore
            assert report is not None and report.source == "tiers", report
            rec["peer_sources"] = {str(q): [p.where, p.holder] for q, p in sorted(report.parts.items())}
            rec["peer_report_s"] = report.parts[rank].seconds
            rec["peer_bytes"] = report.parts[rank].nbytes if rank in peers else 0
            rec["peer_exact"] = exact()
            rec["peer_transfer_s"] = sum(b - a for a, b in k.probe.transfers[before:])
            m.close()
            h.barrier()
            if rank == 2:
                shutil.rmtree(n1)
                os.rename(away, n1)
            h.barrier()

        def exchange_one_way(rec: dict[str, Any] = rec) -> None:
            sends = {d: _bytes(bufs) for d, bufs in one_sends.items()}
            recvs = {s: _bytes(bufs) for s, bufs in one_recvs.items()}
            rec["one_way_s"] = h.timed(lambda: k.transport.exchange_buffers(sends, recvs))
            rec["one_way_bytes"] = k.nbytes if rank in peers else 0

        def one_way_tmpfs(rec: dict[str, Any] = rec) -> None:
            # from files of the tier's file system (as a holder sends a replica) into the arrays
            sends = {d: from_files.views() for d in one_sends}
            recvs = {s: _bytes(bufs) for s, bufs in one_recvs.items()}
            rec["one_way_tmpfs_s"] = h.timed(lambda: k.transport.exchange_buffers(sends, recvs))
            for v in (x for vs in sends.values() for x in vs):
                v.release()

        def peer_least(rec: dict[str, Any] = rec) -> None:
            # the least a replaced node's restore does, plainly, no checks: each kept rank reads
            # its own part's files while it sends a replica from files of the tier's tmpfs, and
            # each replaced rank receives into its arrays; all at once, on the cores the
            # restore has (figure 6's bound on this machine)
            sends = {d: from_files.views() for d in one_sends}
            recvs = {s: _bytes(bufs) for s, bufs in one_recvs.items()}

            def least() -> None:
                with ThreadPoolExecutor(1) as ex:
                    own = ex.submit(mapped_read, files, read_bufs, k.threads) if rank not in peers else None
                    k.transport.exchange_buffers(sends, recvs)
                    if own is not None:
                        own.result()

            rec["peer_least_s"] = h.timed(least)
            for v in (x for vs in sends.values() for x in vs):
                v.release()

        ops = {"read": read, "read_mapped": read_mapped, "tier": restore_tier, "peer": restore_peer}
        ops.update(one_way=exchange_one_way, one_way_tmpfs=one_way_tmpfs, peer_least=peer_least)
        for name in _order(list(ops), r):
            ops[name]()
        rounds.append(rec)
    # the root's cold restores come after every other restore: the machine-wide eviction
    # leaves this VM slower for what follows it (see bench_tiers.py, "Settling")
    for rec in rounds:
        restore_root(rec)
    root_mgr.close()
    from_files.close()
    return {
        "restore_rounds": rounds,
        "peers": {str(q): v for q, v in peers.items()},
        "part_files": len(files),
        "part_bytes": sum(b.nbytes for b in read_bufs),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    k = Rank(args)
    out: dict[str, Any] = {"rank": k.rank, "node": k.node, "state_bytes": k.nbytes, "io_threads": k.threads}
    out.update(save_phase(k))
    out.update(restore_phase(k))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--local", required=True, help="the local tiers' parent: one directory per node")
    ap.add_argument("--root", required=True)
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="mixed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3, help="steps saved before the measured ones")
    ap.add_argument(
        "--save-rounds", type=int, default=0, help="steps after the warm-up that measure figure 1 alone"
    )
    ap.add_argument("--op-settle", type=float, default=3.0)
    ap.add_argument(
        "--smoke", action="store_true", help="evict the root's files per file, never machine-wide"
    )
    ap.add_argument("--transport", choices=("mpi", "gloo"), default="mpi")
    args = ap.parse_args(argv)
    if args.transport == "gloo":
        import torch.distributed as dist

        dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        rank = dist.get_rank()
    else:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    try:
        result = run(args)
    except BaseException:
        (args.out / f"rank{rank}.json").write_text(json.dumps({"error": traceback.format_exc()}))
        traceback.print_exc()
        sys.stderr.flush()
        if args.transport == "gloo":
            os._exit(1)  # the launcher ends the other ranks
        MPI.COMM_WORLD.Abort(1)
        return 1
    tmp = args.out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, args.out / f"rank{rank}.json")
    if args.transport == "gloo":
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
