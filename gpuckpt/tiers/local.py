"""One rank's side of the local tier (see :mod:`gpuckpt.tiers`): its part of each step
written to the node's ``local_dir``, replicated to its holders, retired; its restore."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import socket
import stat
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any, BinaryIO

import gpuckpt.api as api
import gpuckpt.pending as pending
from gpuckpt.background import async_save_with_options
from gpuckpt.distributed.coordinator import Coordinator, describe_error
from gpuckpt.errors import (
    CheckpointCorruptedError,
    CheckpointExistsError,
    DistributedError,
    InvalidOptionError,
    MetadataError,
    TierBudgetError,
)
from gpuckpt.format.documents import MAX_ROOT_DOCUMENT_BYTES, ROOT_KEY
from gpuckpt.format.parts import PART_KEY, PartRecord, parse_part_name, part_name
from gpuckpt.options import SaveOptions
from gpuckpt.planning.boxes import LocalTensor, plan_tensors
from gpuckpt.planning.plan import PlanMemo
from gpuckpt.planning.tiers import Choice, CopySeen, choose, nodes_of, replica_holders, tier_retention
from gpuckpt.runtime.collector import paused_gc
from gpuckpt.runtime.workers import Workers
from gpuckpt.saving.sources import TensorMemo, describe_state
from gpuckpt.storage.base import NotRegularFileError
from gpuckpt.storage.local import fsutil
from gpuckpt.storage.local.fileio import write_all
from gpuckpt.storage.local.filemaps import FileMaps
from gpuckpt.storage.stores import file_system_type, in_memory, open_root
from gpuckpt.tiers.exchange import PartExchange
from gpuckpt.tiers.files import ReceiveBuffer, Received, raise_open_files_limit, tree_bytes
from gpuckpt.tiers.parts import (
    Boxes,
    LayoutMemo,
    copy_values_back,
    holds,
    layout_of,
    part_view,
    sharded_from_part,
)
from gpuckpt.tiers.report import PartSource, RestoreReport

__all__ = ["LocalTier"]

#: the file in a local_dir that the node's lowest rank locks while its manager is open
LOCK_NAME = ".lock"
#: the file in a local_dir naming the root whose steps the tier holds (see LocalTier._claim)
ROOT_RECORD = ".root"
#: the largest root record read (a root's name is a path or a URL)
_ROOT_RECORD_MAX = 64 * 1024

#: errors of a copy that mean the copy is damaged or gone (the restore skips it), not a misuse
_DAMAGE = (CheckpointCorruptedError, MetadataError, FileNotFoundError)


def _read_root_record(path: Path) -> tuple[str | None, str | None]:
    """The root a tier's record names (None where there is no record), and why the record
    does not read (None where it does or there is none); a link is never followed."""
    try:
        fd = fsutil.open_regular(os.fspath(path))
    except NotRegularFileError:  # (a FileNotFoundError: before it)
        return None, "not a regular file"
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, exc.strerror or str(exc)
    try:
        raw = os.read(fd, _ROOT_RECORD_MAX + 1)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw) if len(raw) <= _ROOT_RECORD_MAX else None
    except ValueError:
        doc = None
    if not (isinstance(doc, dict) and doc.get("format") == 1 and isinstance(doc.get("root"), str)):
        return None, 'not {"format": 1, "root": NAME}'
    return doc["root"], None


def _write_root_record(path: Path, root: str) -> None:
    """Make ``path`` name ``root``, durably, in one rename (never written through a link)."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, json.dumps({"format": 1, "root": root}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsutil.fsync_dir(path.parent)


class WriteGate:
    """Holds a part's write on the tier's writer thread until every rank's snapshot of the step
    is done (:meth:`open`, called by the tier's thread after a barrier), at most twice as long as
    this rank's own snapshot took.

    The snapshots are the part of a save that blocks training: a rank that finished its copy
    first would otherwise write beside the copies of the ranks sharing its node's cores and
    memory bandwidth (4 MPI ranks on 2 cores: the slowest rank's save 1.44x a plain copy of
    its state, 1.16x held; bench/RESULTS.md, 2026-12-04). The bound keeps a rank from waiting
    on a far slower one, and keeps ranks that are threads of one process from waiting on each
    other's staging memory: held writes keep their snapshots' arenas, which a snapshot of
    another of those ranks may wait for."""

    #: the least a write is held for (a tiny state's snapshot takes microseconds)
    MIN_HOLD_S = 0.05

    def __init__(self) -> None:
        self._snapped = threading.Event()
        self._open = threading.Event()
        self._took = 0.0

    def snapshot_took(self, seconds: float) -> None:
        """This rank's snapshot is done (or failed), in ``seconds``."""
        self._took = seconds
        self._snapped.set()

    def open(self) -> None:
        """Every rank's snapshot is done: the write goes."""
        self._open.set()

    def hold(self) -> None:
        """Wait (on the writer thread) for :meth:`open`, at most twice this rank's snapshot."""
        self._snapped.wait()
        self._open.wait(max(2 * self._took, self.MIN_HOLD_S))


class LocalTier(PartExchange):
    """One rank's side of the local tier (see the module docstring); made by the manager.

    ``queries`` carries the foreground collectives (the caller's thread), ``background``
    the replication rounds (the tier's thread): two duplicates of the job's coordinator.
    ``root`` is the canonical name of the manager's root (its resolved absolute path, or its
    URL): a tier holds the steps of one root (:meth:`_claim`); rank 0's name is every rank's.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike[str],
        *,
        queries: Coordinator,
        background: Coordinator,
        node: str | None,
        replicas: int,
        keep: int,
        options: SaveOptions,
        root: str,
    ) -> None:
        self.check_arguments(local_dir, replicas, keep, node)
        self.queries, self.background = queries, background
        self.rank, self.world_size = queries.rank, queries.world_size
        self.dir = Path(local_dir).absolute()
        self.node = node if node is not None else socket.gethostname()
        self.keep, self.replicas = keep, replicas
        self.options = options.replace(
            sync="none", base=None, content_hash=False, overwrite=True, storage_options=None
        )
        # what a rank finds wrong with its directory is raised on every rank (the others would
        # wait for it in the collectives below)
        where: tuple[str, int, int] = ("", 0, 0)
        problem = self.path_problem(self.dir)
        if problem is None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                st = self.dir.stat()
                where = (str(self.dir.resolve()), st.st_dev, st.st_ino)
            except OSError as exc:
                problem = (
                    f"local_dir {self.dir} cannot be made or opened ({exc.strerror or exc}): pass a "
                    "directory this process can create and write (tmpfs or a node-local disk)"
                )
        if problem is not None:
            problem = f"rank {self.rank} (node {self.node!r}): {problem}"
        seen = queries.all_gather((self.node, *where, problem, root))
        self.root: str = seen[0][5]
        problems = [s[4] for s in seen if s[4] is not None]
        if problems:
            raise InvalidOptionError(problem or problems[0])
        self._store = open_root(self.dir)
        self.node_names = [s[0] for s in seen]
        self._check_directories([s[:4] for s in seen])
        self.node_ranks = next(ranks for ranks in nodes_of(self.node_names) if self.rank in ranks)
        self.leader = self.node_ranks[0] == self.rank
        self.holders = replica_holders(self.rank, self.node_names, replicas) if replicas else []
        #: the ranks whose replicas this rank holds
        self.held = [
            r
            for r in range(self.world_size)
            if replicas and self.rank in replica_holders(r, self.node_names, replicas)
        ]
        #: the node's lock on its tier (held by the node's lowest rank): one manager per local_dir
        self._lock: BinaryIO | None = None
        taken, held = None, []
        if self.leader:  # (under the lock: no other manager writes the tier meanwhile)
            taken = self._take_lock()
            if taken is None:
                held = self.steps()
                taken = self._claim(held)
                if taken is not None:
                    held = []
        claims = queries.all_gather((taken, held, str(self.dir), self.node))
        refusals = [m for m, _, _, _ in claims if m is not None]
        if refusals:
            self._release_lock()
            raise InvalidOptionError(refusals[0])
        #: the steps the nodes' tiers held when the manager opened: step -> where (the same on
        #: every rank: the manager refuses to save over them, see TieredSaves)
        self.found: dict[int, list[str]] = {}
        for _, steps, where, node in claims:
            for s in steps:
                self.found.setdefault(s, []).append(f"{where} (node {node!r})")
        for leftover in self.dir.glob(f".recv-r{self.rank}-*"):  # this rank's receptions a crash cut short
            shutil.rmtree(leftover, ignore_errors=True)
        if self.leader:  # what dead saves left (never a live save's: see CheckpointRoot.cleanup)
            self._store.cleanup()
        # the part's write and the tier's thread (replication, retention) keep the caller's
        # priority: the next save waits for them, and at nice 19 a loop that keeps every core
        # busy starves them (save calls of 0.43 s against 0.02 s in a trial); the drain, which
        # only a persist step waits for, runs at nice 19 (see CheckpointManager)
        self._thread = Workers(1, "gpuckpt-tier")
        # an exchange round holds a file descriptor per file of the parts it moves
        raise_open_files_limit()
        self._file_maps = FileMaps()
        # parts are written through kept maps of the files they reuse where the tier is on
        # tmpfs, whose write() costs about three times a copy into mapped pages (FileMaps)
        self._writes_mapped = file_system_type(self.dir) == "tmpfs"
        self._writer = Workers(1, "gpuckpt-tier-write")
        self._jobs: dict[int, Future[None]] = {}
        #: steps whose tier work failed here, once :meth:`settled` took their jobs
        self._failed: set[int] = set()
        #: steps being drained to root: retention keeps them
        self.pinned: set[int] = set()
        self._budget_checked = False
        #: this rank's last layout and its tensors' description; every rank's layouts when the
        #: ranks' boxes were last checked to tile their tensors
        self._described: tuple[str, Sequence[LocalTensor]] | None = None
        #: the layout digests and tensor descriptions of this rank's parts (:meth:`begin`)
        self._layouts = LayoutMemo()
        self._tensor_memo = TensorMemo()
        self._plans = PlanMemo()
        self._tiled: tuple[str, ...] | None = None
        #: writes of parts restores fetched from peers (:meth:`_keep_fetched`)
        self._fetched: list[Future[None]] = []
        #: the arrays the last drain read its part into, and the part's shape (:meth:`_read_into_kept`)
        self._drain_buffers: tuple[str, dict[str, Any]] | None = None
        queries.barrier()  # nobody writes before every leader has cleaned up

    @staticmethod
    def check_arguments(local_dir: str | os.PathLike[str], replicas: Any, keep: Any, node: Any) -> None:
        """Refuse, before anything is made, what a tier cannot take (:class:`InvalidOptionError`)."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise InvalidOptionError(f"replicas must be an integer >= 0, got {replicas!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
            raise InvalidOptionError(
                f"local_max_to_keep must be an integer >= 2 (the step being written and the last "
                f"complete one), got {keep!r}"
            )
        if node is not None and (not isinstance(node, str) or not node):
            raise InvalidOptionError(f"node must be a non-empty string or None, got {node!r}")
        text = os.fspath(local_dir)
        if not text or "\0" in text:
            what = "a NUL character, which no path holds" if text else "an empty path (the current directory)"
            raise InvalidOptionError(
                f"local_dir must name a directory, got {what}: pass a path such as /dev/shm/run1"
            )

    @staticmethod
    def path_problem(local_dir: str | os.PathLike[str]) -> str | None:
        """What this process finds wrong with ``local_dir`` as it is now (a file, a path it
        cannot reach), or None; nodes may differ, so a job gathers every rank's."""
        path = Path(local_dir)
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return None  # made by the tier
        except OSError as exc:  # a name too long, a file on the way, a place not searchable
            return (
                f"local_dir {str(path)[:200]!r} cannot be used ({exc.strerror or exc}): pass a directory "
                "this process can create and write (tmpfs or a node-local disk)"
            )
        if not stat.S_ISDIR(mode):
            return f"local_dir {path} is not a directory: pass a directory (it is made if missing)"
        return None

    def _take_lock(self) -> str | None:
        """Lock the tier for this manager (``flock`` of ``local_dir/.lock``, released by
        :meth:`close` or when the process ends, however it ends); what refuses it, or None.
        Two managers on one tier would write parts of the same names over each other's. A file
        system without ``flock`` (some network ones) leaves the tier unlocked."""
        lock = self.dir / LOCK_NAME
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(lock, flags, 0o644)
        except OSError as exc:  # a link (ELOOP), a folder (EISDIR), a place not writable
            return (
                f"local_dir {self.dir}: its lock file {lock} cannot be opened ({exc.strerror}; never "
                "followed where it is a symbolic link): remove what is there, or give the manager "
                "another local_dir"
            )
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else "a file that other names share"
            return (
                f"local_dir {self.dir}: its lock file {lock} is {what}, which the manager never "
                "writes into: remove it, or give the manager another local_dir"
            )
        f = os.fdopen(fd, "r+b")  # held open while the manager is
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            with contextlib.suppress(OSError, ValueError):
                f.seek(0)
                holder = f" (process {int(f.read(32).decode().strip() or 0)} holds it)"
            f.close()
            return (
                f"local_dir {self.dir} is the tier of another CheckpointManager that is open{holder}: "
                "give each run (and each manager) its own local_dir, or close the other manager first"
            )
        except OSError:  # no flock here: unlocked, as before
            f.close()
            return None
        f.truncate(0)
        f.write(f"{os.getpid()}\n".encode())
        f.flush()
        self._lock = f
        return None

    def _claim(self, steps: list[int]) -> str | None:
        """Record the manager's root as the root of the tier's steps (``local_dir/.root``),
        unless the tier holds steps of another root, or steps that name none (written before
        the tier recorded its root, or with that record unreadable): what refuses the tier, or
        None. A restore takes the newest step of the tiers, and a tier left by another run
        (``local_dir`` reused) would give that run's state to this one. Only the name is
        compared: the root is never read for it (a restore on a replaced node works with the
        root moved away). ``steps``: the tier's steps, as listed under the lock."""
        record = self.dir / ROOT_RECORD
        recorded, unreadable = _read_root_record(record)
        if recorded == self.root:
            return None
        if steps:
            shown = f"{steps[:10]}{' ...' if len(steps) > 10 else ''}"
            if recorded is not None:
                whose = f"of another root, {recorded}"
            elif unreadable is not None:
                whose = f"whose root is unknown (its record {record} cannot be read: {unreadable})"
            else:
                whose = f"whose root is unknown (no {record}: saved by a gpuckpt that did not record it)"
            return (
                f"local_dir {self.dir} (node {self.node!r}) holds step(s) {shown} {whose}; this "
                f"manager's root is {self.root}: a local tier holds the steps of one root (restored, "
                "they would be another run's state). Give each run its own local_dir, or delete "
                f"those steps (the step_* folders of {self.dir}) if they are not needed"
            )
        try:
            _write_root_record(record, self.root)
        except OSError as exc:
            return (
                f"local_dir {self.dir}: the record of its root, {record}, cannot be written "
                f"({exc.strerror or exc}): remove what is there, or give the manager another local_dir"
            )
        return None

    def _release_lock(self) -> None:
        """Unlock the tier (a manager dropped without ``close`` unlocks it when collected)."""
        if self._lock is not None:
            self._lock.close()  # (releases the flock)
            self._lock = None

    def _check_directories(self, seen: list[tuple[str, str, int, int]]) -> None:
        by_node: dict[str, set[tuple[int, int]]] = {}
        for node, _path, dev, ino in seen:
            by_node.setdefault(node, set()).add((dev, ino))
        for node, dirs in by_node.items():
            if len(dirs) > 1:
                raise InvalidOptionError(
                    f"the ranks of node {node!r} name {len(dirs)} different local_dir directories; "
                    "every rank of a node must pass the same local_dir"
                )
        owners: dict[tuple[int, int], set[str]] = {}
        for node, _path, dev, ino in seen:
            owners.setdefault((dev, ino), set()).add(node)
        for key, nodes in owners.items():
            if len(nodes) > 1:
                path = next(p for n, p, d, i in seen if (d, i) == key)
                raise InvalidOptionError(
                    f"nodes {sorted(nodes)} share the local_dir {path}: a node's tier must be its own "
                    "(give each simulated node its own directory, or pass node= consistently)"
                )

    # writing ---------------------------------------------------------------------------

    def check_budget(self, nbytes: int, error: BaseException | None = None) -> None:
        """Collective: refuse, on every rank and before anything is written, part sizes the
        nodes' tiers cannot hold ``keep`` steps of, plus one being drained, replicas included
        (at the first save); a rank's ``error`` (its state could not be described) raised on
        every rank instead."""
        sizes = self.queries.all_gather(
            (nbytes, self._free_bytes(), None if error is None else describe_error(error))
        )
        failures = {r: s[2] for r, s in enumerate(sizes) if s[2] is not None}
        if failures:
            if self.world_size == 1 and error is not None:
                raise error
            raise DistributedError(failures, self.world_size) from error
        problems = []
        for ranks in nodes_of(self.node_names):
            held = [r for r in range(self.world_size) if r not in ranks and self._holds(ranks, r)]
            # the steps kept, and the one a drain may hold beside them (see tier_retention)
            need = (self.keep + 1) * (sum(sizes[r][0] for r in ranks) + sum(sizes[r][0] for r in held))
            free = sizes[ranks[0]][1]
            if need > free:
                problems.append(
                    f"node {self.node_names[ranks[0]]!r} needs {need:,} bytes "
                    f"((local_max_to_keep={self.keep} + 1 being drained) x ({len(ranks)} parts + "
                    f"{len(held)} replicas)) and has {free:,} free"
                )
        if problems:
            raise TierBudgetError(
                "the local tier cannot hold its steps: "
                + "; ".join(problems)
                + "; keep fewer steps (local_max_to_keep), pass replicas=0, or use a larger local_dir"
            )

    def _holds(self, ranks: list[int], r: int) -> bool:
        return bool(self.replicas) and any(
            h in ranks for h in replica_holders(r, self.node_names, self.replicas)
        )

    def _free_bytes(self) -> int:
        """Free bytes for new parts: the file system's, plus what the tier holds (retention
        frees it), capped on tmpfs by the memory the system has available."""
        st = os.statvfs(self.dir)
        free = st.f_bavail * st.f_frsize
        held = tree_bytes(self.dir)
        total = free + held
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            available = int(info["MemAvailable"].split()[0]) * 1024
            if file_system_type(self.dir) == "tmpfs":
                total = min(total, available + held)
        except (OSError, KeyError, ValueError):
            pass
        return total

    @paused_gc()
    def begin(self, step: int, state: Any, save_id: str) -> None:
        """Snapshot this rank's part of ``step`` and write, replicate and retire in the background.

        Every rank takes part in the same collectives whatever fails where: a state this rank
        cannot describe (a key that is not a string, two entries of one name) fails the step on
        every rank, as a failed write does. The cyclic garbage collector is paused meanwhile
        (as :func:`~gpuckpt.background.async_save_with_options` pauses it): describing a state
        of many tensors makes objects by the thousand, and collections that walk them all
        again took a 10,000-tensor save's description from 70 to 170 ms."""
        error: BaseException | None = None
        written: Any = None
        view: dict[str, Any] = {}
        boxes: Boxes = {}
        layout, nbytes = "", 0
        described: Any = None
        try:
            view, boxes = part_view(state)
            # described once: the part's save takes the description its layout came from
            described = describe_state(view, allow_pickle=self.options.allow_pickle, memo=self._tensor_memo)
            layout, nbytes = self._layouts.layout_and_bytes(described[0].tensors, described[1], boxes)
            if self._described is None or self._described[0] != layout:
                self._described = (layout, describe_state(state, allow_pickle=True)[0].tensors)
        except Exception as exc:  # the others learn of it in the step's first collective
            error = exc
        if not self._budget_checked:
            self.check_budget(nbytes, error)
            self._budget_checked = True
        gate = WriteGate()
        if error is None:
            error = self._foreign_problem(step)
        if error is None:
            record = PartRecord(step, save_id, self.rank, self.world_size, self.node, layout, boxes)
            options = self.options.replace(planner_extra={PART_KEY: record.to_json()})
            self._writer.submit(gate.hold)  # the part's write queues behind it
            began = time.monotonic()
            try:
                written = async_save_with_options(
                    view,
                    self.dir / part_name(step, self.rank),
                    options,
                    writer_thread=self._writer,
                    reuse_files_of=self._retired_part(step),
                    file_maps=self._file_maps if self._writes_mapped else None,
                    described=described,
                    plans=self._plans,
                )
            except Exception as exc:  # the others learn of it in the step's first collective
                error = exc
            finally:
                gate.snapshot_took(time.monotonic() - began)
        tensors = self._described[1] if self._described is not None and error is None else ()
        job = self._jobs[step] = self._thread.submit(
            self._finish, step, written, error, layout, tensors, gate
        )
        # exit waits for it as for a queued save (every rank's exit does: the rounds meet)
        pending.keep_until_exit(
            job, f"step {step} in the local tier {self.dir} (rank {self.rank}'s part and its replicas)"
        )

    def _foreign_problem(self, step: int) -> BaseException | None:
        """Why this rank's part of ``step`` may not be written where it goes, or None: a folder
        of that name holding another program's files (the tier replaces its own parts, and
        its retention deletes a part's folder whole: never what it did not write)."""
        name = part_name(step, self.rank)
        others = self._store.foreign_entries(name)  # (none where nothing is there)
        if not others:
            return None
        return CheckpointExistsError(
            f"{self.dir / name}, where the local tier writes this rank's part of step {step}, holds "
            f"{len(others)} entries that are not a gpuckpt checkpoint's (e.g. {others[:3]}); the tier "
            "writes nothing beside them: move them out of the local_dir, or save under another step"
        )

    def _retired_part(self, step: int) -> Path | None:
        """This rank's part of the oldest step that the tier's retention deletes once ``step``
        is in (never a pinned one: being drained), whose files the part of ``step`` is written
        into, as a replica is into the copy it retires: on tmpfs new files cost page
        allocation and zeroing, about as much again as the copy (see :meth:`_recycled`).
        The part leaves the tier in one rename when the write begins; if the write then
        fails, that step, which this one retires anyway, has lost this rank's part. So only
        while a newer step stays whose tier work is done without error (a step still in
        flight may yet fail on another rank and be deleted): this rank then never holds less
        than one complete step, whatever happens to this one; otherwise the part goes into new
        files."""
        parts = self._parts()
        present = {s for s, _ in parts} | {step}
        retired = tier_retention(present, self.keep, step, set(self.pinned) | {step})
        stays = [s for s, r in parts if r == self.rank and s < step and s not in retired]
        if not stays or not self._settled_ok(max(stays)):
            return None
        for old in retired:
            name = part_name(old, self.rank)
            if self._store.is_committed(name):
                return self.dir / name
        return None

    def _settled_ok(self, step: int) -> bool:
        """Whether ``step``'s tier work here is over without error (no job: an earlier
        manager's step, or one whose job :meth:`settled` already took; a failed step's parts
        are deleted, and one whose parts could not be deleted is remembered as failed)."""
        if step in self._failed:
            return False
        job = self._jobs.get(step)
        return job is None or (job.done() and not job.cancelled() and job.exception() is None)

    def _finish(
        self,
        step: int,
        written: Any,
        error: BaseException | None,
        layout: str,
        tensors: Sequence[LocalTensor],
        gate: WriteGate,
    ) -> None:
        """The tier thread's work for ``step``: the part written once every rank's snapshot is
        done, committed everywhere, the ranks' boxes checked to tile each tensor (where a rank's
        layout changed), replicated, old steps retired. Every collective runs on every rank,
        whatever failed where.

        The first barrier opens the part's :class:`WriteGate`."""
        try:
            self.background.idle_barrier()
        finally:
            gate.open()
        try:
            if written is not None:
                written.result()
        except Exception as exc:
            error = exc
        try:
            self.background.idle_barrier()  # the ranks' writes end apart: the first wait long
            reports = self.background.all_gather((None if error is None else describe_error(error), layout))
            failures = {r: e for r, (e, _) in enumerate(reports) if e is not None}
            if failures:
                raise DistributedError(failures, self.world_size) from error
            self._check_tiling(tuple(lay for _, lay in reports), tensors)
            self._replicate(step)
        except BaseException:
            self._delete_step(step, [self.rank, *self.held])
            self._file_maps.forget_deleted()
            raise
        try:  # after the collectives: a failure here is this node's, warned about
            parts = self._parts()
            retired = tier_retention({s for s, _ in parts}, self.keep, step, self.pinned | {step})
            if self.leader:
                self._delete_steps(retired)
            # a kept map holds its file's memory: the maps of the retired parts' files go now, on
            # every rank of the node, whether or not its lowest rank has deleted them yet
            doomed = set(retired)
            self._file_maps.forget_deleted(
                self.dir / name
                for name in (part_name(s, r) for s, r in parts if s in doomed)
                if self._maps_within(name)
            )
        except OSError as exc:
            warnings.warn(f"the local tier {self.dir} could not retire old steps: {exc}", stacklevel=1)

    def _maps_within(self, name: str) -> bool:
        """Whether the tier's folder ``name`` may hold files whose maps this rank keeps: its own
        parts, the replicas it holds, anything not a part (temporaries); the doomed parts among
        them are walked before their deletion (:meth:`FileMaps.forget_deleted`). The other ranks
        of the node have parts there too, and walking them would cost each rank the whole
        node's files; a map of one of their files (a part sent by this rank in a restore) is
        dropped at the first round after its file is deleted."""
        parsed = parse_part_name(name)
        return parsed is None or parsed[1] == self.rank or parsed[1] in self.held

    def _check_tiling(self, layouts: tuple[str, ...], tensors: Sequence[LocalTensor]) -> None:
        """Collective (tier thread): where any rank's layout changed since the last check, every
        rank's tensors gathered and planned as a distributed save plans them, which raises the
        same :class:`~gpuckpt.errors.UnsupportedValueError` on every rank for boxes that overlap,
        leave a tensor uncovered, or ranks that disagree on a tensor's shape or dtype (a step
        of the tier is a distributed checkpoint in parts: its drain would fail on them)."""
        if layouts == self._tiled:
            return
        everyone = self.background.all_gather(tensors)
        for _ in plan_tensors(everyone, chunk_bytes=self.options.chunk_bytes):
            pass
        self._tiled = layouts

    def wait_for(self, step: int) -> None:
        """Block until ``step``'s tier work is done (its error stays for :meth:`settled`)."""
        job = self._jobs.get(step)
        if job is not None:
            job.exception()

    def job(self, step: int) -> Future[None] | None:
        return self._jobs.get(step)

    def settled(self) -> dict[int, BaseException]:
        """The steps whose tier work ended in an error, and the error (forgets them)."""
        out = {}
        for step, job in list(self._jobs.items()):
            if job.done():
                del self._jobs[step]
                exc = job.exception()
                if exc is not None:
                    out[step] = exc
                    self._failed.add(step)
                    pending.taken(job)  # (the caller reports it)
        return out

    def close(self) -> None:
        """End the tier's threads once their queued work is done (the parts a restore fetched
        are written before this returns: a closed manager leaves its tier as restored)."""
        for job in self._fetched:
            job.exception()
        self._fetched.clear()
        pending.taken(*self._jobs.values())  # (closing waited for them and reported what it could)
        try:
            self._thread.submit(self._file_maps.close)  # after the rounds queued before it
        except RuntimeError:  # closed before: no round is left to run
            self._file_maps.close()
        self._thread.shutdown(wait=False)
        self._writer.shutdown(wait=False)
        self._release_lock()
        self._drain_buffers = None

    def wait_all(self) -> None:
        """Block until every step's tier work is done (errors stay for :meth:`settled`), and
        the writes of parts fetched by a restore."""
        for job in [*self._jobs.values(), *self._fetched]:
            job.exception()
        self._fetched.clear()

    def _replicate(self, step: int) -> None:
        """Send this rank's part of ``step`` to its holders; receive the parts it holds."""
        self._transfer(step, {h: self.rank for h in self.holders}, self.held, self.background, recycle=True)

    # listing and retention ---------------------------------------------------------------

    def _parts(self) -> list[tuple[int, int]]:
        """``(step, rank)`` of every committed part in this node's tier."""
        out = []
        for name in self._store.children():
            parsed = parse_part_name(name)
            if parsed is not None and self._store.is_committed(name):
                out.append(parsed)
        return out

    def steps(self) -> list[int]:
        return sorted({s for s, _ in self._parts()})

    def _delete_steps(self, steps: list[int]) -> None:
        doomed = set(steps)
        names = [part_name(s, r) for s, r in self._parts() if s in doomed]
        if names:
            self._store.delete(names)

    def _delete_step(self, step: int, ranks: list[int]) -> None:
        """Delete this node's copies of the parts of ``ranks`` at ``step`` (those there are)."""
        names = [part_name(step, r) for r in sorted(set(ranks))]
        with contextlib.suppress(OSError):
            self._store.delete([n for n in names if self._store.is_committed(n)])

    def _node_of(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s node."""
        return next(ranks for ranks in nodes_of(self.node_names) if rank in ranks)

    def inventory(self) -> list[CopySeen]:
        """Every committed part in this node's tier whose record reads, as this rank sees it."""
        return self._inventory()[0]

    def _inventory(self) -> tuple[list[CopySeen], list[str]]:
        """:meth:`inventory`, and what was passed over: committed parts whose root document does
        not read, or whose record names another step or rank than the part's name."""
        out, passed = [], []
        for name in self._store.children():
            parsed = parse_part_name(name)
            if parsed is None:
                continue
            step, rank = parsed
            if not self._store.is_committed(name):  # a part's name, no checkpoint's root document
                passed.append(f"step {step} part of rank {rank} in {self.dir}: not a committed checkpoint")
                continue
            root = self.dir / name / ROOT_KEY
            try:
                with open(root, "rb") as f:  # (a document too large is refused unread)
                    raw = f.read(MAX_ROOT_DOCUMENT_BYTES + 1)
                rec = PartRecord.from_root_document(raw, str(root))
            except Exception as exc:  # a damaged part's root document: not a copy (its chunks
                # are checked when it is loaded)
                passed.append(f"step {step} part of rank {rank} in {self.dir}: {describe_error(exc)}")
                continue
            if rec is None or (rec.step, rec.rank) != (step, rank):
                what = "no part record" if rec is None else f"a record of step {rec.step}, rank {rec.rank}"
                passed.append(f"step {step} part of rank {rank} in {self.dir}: it holds {what}")
                continue
            out.append(CopySeen(rec.step, rec.save_id, rec.rank, rec.world_size, rec.layout, self.rank))
        return out, passed

    # restoring -------------------------------------------------------------------------

    def _read_into_kept(self, path: Path, shape: str) -> dict[str, Any]:
        """The part at ``path``, loaded into the arrays the last drain read into where the
        part's ``shape`` (its layout, structure and keys) is the same (new memory on each
        drain costs a page fault per page, which a virtual machine's host may serve slowly
        and no thread priority keeps from the training threads), else into new arrays; kept
        for the next drain."""
        kept, self._drain_buffers = self._drain_buffers, None
        if kept is not None and kept[0] == shape:
            try:
                api.load(kept[1], path, allow_pickle=self.options.allow_pickle)
                self._drain_buffers = kept
                return kept[1]
            except Exception:  # read anew below: what it finds wrong, it raises
                pass
        del kept
        loaded = api.load_state_dict(path, allow_pickle=self.options.allow_pickle)
        self._drain_buffers = (shape, loaded)
        return loaded

    def read_part(self, step: int) -> Any:
        """This rank's part of ``step`` as the state it was saved from (``ShardedArray`` boxes
        again), every chunk checked: what the drain saves to the root."""
        path = self.dir / part_name(step, self.rank)
        metadata = api.read_metadata(path)
        record = PartRecord.from_planner_data(metadata.planner_data)
        if record is None:
            raise MetadataError(f"{path} is not a part of a local tier (its metadata has no {PART_KEY!r})")
        # arrays alone (the layout) would not do: a plain value added under a new key would
        # not be read into the last drain's dict, nor a tuple become a list again
        shape = json.dumps(
            [record.layout, metadata.planner_data.get("structure"), sorted(metadata.state_dict_metadata)]
        )
        loaded = self._read_into_kept(path, shape)
        return sharded_from_part(loaded, record.boxes)

    def restore(
        self,
        state: Any,
        root_latest: Callable[[], int | None],
        load_options: dict[str, Any],
        *,
        only: int | None = None,
    ) -> tuple[Choice, RestoreReport | None, tuple[str, ...]]:
        """Collective: load the newest complete step of the tiers (``only``: that step) into
        ``state``; returns the choice (``"root"`` or ``"none"``: nothing was read, nothing
        deleted: the caller loads the root's step, then calls :meth:`abandon_newer`), the
        report (None unless the tiers served), and the copies passed over (damaged, or whose
        record does not read), the same on every rank. A state a rank cannot describe fails
        the restore on every rank."""
        c = self.queries
        undescribed: BaseException | None = None
        view: dict[str, Any] = {}
        boxes: Boxes = {}
        layout = ""
        try:
            view, boxes = part_view(state)
            layout = layout_of(view, boxes)
        except Exception as exc:  # raised on every rank after the first collective
            undescribed = exc
        skipped: list[str] = []
        self.wait_all()  # (a part an earlier restore fetched is in the tier before it is listed)
        latest_root = root_latest()
        for _attempt in range(4 * self.world_size + 4):
            # one all_gather: the parts each node's lowest rank lists (the node's other ranks see
            # the same directory), and every rank's layout (or why it has none)
            gathered = c.all_gather(
                (
                    self._inventory() if self.leader else ([], []),
                    layout,
                    None if undescribed is None else describe_error(undescribed),
                )
            )
            for (_, passed), _, _ in gathered:
                skipped.extend(p for p in passed if p not in skipped)
            failures = {r: g[2] for r, g in enumerate(gathered) if g[2] is not None}
            if failures:
                if self.world_size == 1 and undescribed is not None:
                    raise undescribed
                raise DistributedError(failures, self.world_size) from undescribed
            copies = [
                dataclasses.replace(cp, holder=holder)
                for (seen, _), _, _ in gathered
                for cp in seen
                if only in (None, cp.step)
                for holder in self._node_of(cp.holder)
            ]
            layouts = [lay for _, lay, _ in gathered]
            choice = choose(copies, layouts, self.node_names, latest_root)
            newer = [
                s
                for s in choice.other_layout
                if choice.source != "tiers" and (choice.step is None or s > choice.step)
            ]
            if newer:  # (the same on every rank): do the ranks' states fit in those parts?
                asks = [s for s in newer if self.rank in choice.other_layout[s]]
                fits = [f for found in c.all_gather(self._fits(view, boxes, asks)) for f in found]
                choice = choose(copies, layouts, self.node_names, latest_root, fits)
            if choice.source != "tiers":
                return choice, None, tuple(skipped)
            assert choice.step is not None
            step, senders = choice.step, choice.senders
            started = time.perf_counter()
            sends = {r: r for r, h in senders.items() if h == self.rank and r != self.rank}
            mine = senders[self.rank]
            fetched: list[Received] = []
            path = self.dir / part_name(step, self.rank)
            local: Future[None] | None = None
            error: BaseException | None = None  # (the round's, checked with the load's below)
            if any(h != r for r, h in senders.items()):  # (the same on every rank: no round if none)
                # into the state's arrays where they allow it, the rest into a buffer of its own
                # (kept for the tier's copy, written after the restore returns)
                receive = [] if mine == self.rank else [mine]

                def load_own(path: Path = path) -> None:
                    # this rank's own part is loaded while the round serves the replicas it
                    # holds: a restore then takes the longer of the two, not both one after the
                    # other (the transport's copy runs mostly on the receiving ranks); started
                    # once the manifests are exchanged, whose round it would slow (where ranks
                    # share cores, the transfer began 5-20 ms later behind the load's threads)
                    nonlocal local
                    local = self._writer.submit(api.load, view, path, **load_options)

                try:
                    own = load_own if mine == self.rank else None
                    buffer = ReceiveBuffer()
                    fetched, error = self._round(step, sends, receive, c, buffer, into=view, listed=own)
                finally:  # (no load still writes into the state when an error is raised)
                    if local is not None:
                        wait([local])
            nbytes = 0
            round_failed = error is not None  # (then its part is not loaded: a failure, not damage)
            if not round_failed:
                try:
                    if fetched:  # loaded from the bytes received, not written to files and read back
                        (got,) = fetched
                        with in_memory(got.as_files()) as url:
                            api.load(view, url, **load_options)
                        nbytes = got.nbytes
                    else:
                        if local is None:
                            api.load(view, path, **load_options)
                        else:
                            local.result()
                        nbytes = tree_bytes(path)
                    copy_values_back(state, view)
                except Exception as exc:
                    error = exc
            seconds = time.perf_counter() - started
            damaged = not round_failed and isinstance(error, _DAMAGE)
            report = None if error is None else (damaged, describe_error(error), mine)
            outcomes = c.all_gather((report, nbytes if error is None else 0, seconds))
            bad = {r: o[0] for r, o in enumerate(outcomes) if o[0] is not None}
            if not bad:
                parts = {
                    r: PartSource(
                        r,
                        "local" if senders[r] == r else "peer",
                        None if senders[r] == r else senders[r],
                        self.node_names[senders[r]],
                        int(outcomes[r][1]),
                        float(outcomes[r][2]),
                    )
                    for r in range(self.world_size)
                }
                self.abandon_newer(step)
                for got in fetched:
                    if not got.placed:  # (bytes received into the state are the job's now)
                        self._keep_fetched(step, got)
                served = RestoreReport(step, "tiers", choice.save_id, parts, tuple(skipped))
                return choice, served, served.skipped
            if not all(b[0] for b in bad.values()):
                if self.world_size == 1 and error is not None:
                    raise error  # one process: its own error, as a load without a tier raises it
                # the failures, not the damage they may have caused (a part that could not be
                # sent arrives as zeros of its sizes, and does not check)
                failures = {r: b[1] for r, b in bad.items() if not b[0]}
                raise DistributedError(failures, self.world_size) from error
            # damaged copies: the reader's, and the sender's it came from, are deleted; choose again
            for r, (_, what, holder) in sorted(bad.items()):
                skipped.append(f"step {step} part of rank {r} (copy of rank {holder}'s node): {what}")
                if self.rank in (r, holder):
                    self._delete_step(step, [r])
            c.barrier()
        raise DistributedError(
            {self.rank: "no undamaged copy found after deleting damaged ones"}, self.world_size
        )

    def _fits(self, view: dict[str, Any], boxes: Boxes, steps: list[int]) -> list[tuple[int, str, int]]:
        """``(step, save_id, rank)`` of this rank's parts of ``steps`` in its node's tier that hold
        every array of its present state (``view``, ``boxes``) as it is (a subset of what was
        saved: loaded as a load of the root's step would load it); a part this node lacks, or
        whose metadata does not read, does not fit."""
        out = []
        for step in steps:
            path = self.dir / part_name(step, self.rank)
            try:
                if not self._store.is_committed(path.name):
                    continue
                metadata = api.read_metadata(path)
                record = PartRecord.from_planner_data(metadata.planner_data)
                if record is None or (record.step, record.rank, record.world_size) != (
                    step,
                    self.rank,
                    self.world_size,
                ):
                    continue
                if holds(view, boxes, dict(metadata.state_dict_metadata), record.boxes):
                    out.append((step, record.save_id, self.rank))
            except Exception:  # (a damaged part is skipped by the load that reads it)
                continue
        return out

    def abandon_newer(self, step: int) -> None:
        """Collective, once ``step`` is restored: tier steps newer than it are an abandoned line,
        deleted on every node (else a later restore could take them for newer than the steps
        saved from here on)."""
        if self.leader:
            self._delete_steps([s for s in self.steps() if s > step])
        self.queries.idle_barrier()
