"""The local tier of a distributed :class:`~gpuckpt.CheckpointManager`: parts, replicas, recovery.

Each saved step is written by every rank to its node's ``local_dir`` (tmpfs or node-local
NVMe) as a *part*: an ordinary single-process gpuckpt checkpoint of what the rank holds
(each ``ShardedArray`` box as an array of the box's shape), with a record of what it is a
part of (:mod:`gpuckpt.format.parts`), named ``step_00000120.rank_00002``. gpuckpt,
zarr-python and TensorStore read a part as any checkpoint.

After a rank's part is committed, a background thread sends its files to the rank that
holds its replica on another node (:func:`gpuckpt.planning.tiers.replica_holders`), over
the coordinator's own transport (MPI, gloo through torch.distributed, or threads in tests);
gpuckpt opens no socket of its own. A failure of any rank's write or replication fails the
step on every rank: each deletes what it wrote of it.

A restore (:meth:`LocalTier.choose` and :meth:`LocalTier.read`) lists the parts every node
holds, takes the newest step whose every rank's part has a copy somewhere (never a mix of
steps), fetches the parts a rank's node lacks (a replaced node) from the ranks that hold
them, and loads each part with every chunk checked; a copy that fails its checks is deleted
and the choice made again without it.

Retention: the lowest rank of each node deletes the oldest steps of its ``local_dir``
(own parts and replicas) beyond ``local_max_to_keep``, never a step being drained to root.
A rank receiving a replica first takes the copy of the same rank's part that this step
retires out of the tier and writes the received files over its files (pages the file system
already holds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import mmap
import os
import secrets
import shutil
import socket
import stat
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gpuckpt.api as api
from gpuckpt.background import async_save_with_options
from gpuckpt.device.arrays import adapt, is_array
from gpuckpt.device.sharded import ShardedArray, is_dtensor, is_sharded_leaf, sharded_boxes
from gpuckpt.distributed.coordinator import Coordinator, describe_error
from gpuckpt.errors import (
    CheckpointCorruptedError,
    DistributedError,
    InvalidOptionError,
    MetadataError,
    TierBudgetError,
)
from gpuckpt.format.parts import PART_KEY, PartRecord, parse_part_name, part_name
from gpuckpt.options import SaveOptions
from gpuckpt.planning.tiers import Choice, CopySeen, choose, nodes_of, replica_holders, tier_retention
from gpuckpt.runtime.workers import Workers
from gpuckpt.state import flatten_state_dict
from gpuckpt.storage.local.fileio import write_all
from gpuckpt.storage.stores import file_system_type, open_root

__all__ = ["LocalTier", "PartSource", "RestoreReport", "layout_of", "part_view"]

#: errors of a copy that mean the copy is damaged or gone (the restore skips it), not a misuse
_DAMAGE = (CheckpointCorruptedError, MetadataError, FileNotFoundError)

Boxes = dict[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]


# a rank's state as a part ------------------------------------------------------------


_DESCEND = object()


def _rebuilt(value: Any, prefix: str, leaf: Callable[[Any, str], Any]) -> Any:
    """``value`` with what ``leaf(item, fqn)`` returns for each item it takes (anything but
    ``_DESCEND``), in new dicts, lists and tuples on the way; the FQNs of a state dict."""
    out = leaf(value, prefix)
    if out is not _DESCEND:
        return out
    if isinstance(value, dict):
        return {k: _rebuilt(v, f"{prefix}.{k}" if prefix else str(k), leaf) for k, v in value.items()}
    if isinstance(value, list | tuple) and not is_array(value):
        kids = [_rebuilt(v, f"{prefix}.{i}" if prefix else str(i), leaf) for i, v in enumerate(value)]
        return kids if isinstance(value, list) else tuple(kids)
    return value


def part_view(state: Any) -> tuple[dict[str, Any], Boxes]:
    """``state`` with each ``ShardedArray`` leaf replaced by its local array (a list of them for
    several boxes), sharing every array and value; and each sharded FQN's boxes."""
    boxes: Boxes = {}

    def local(value: Any, fqn: str) -> Any:
        if not is_sharded_leaf(value):
            return _DESCEND
        found = sharded_boxes(value)
        boxes[fqn] = tuple((b.offsets, b.global_shape) for b in found)
        return found[0].local if isinstance(value, ShardedArray) else [b.local for b in found]

    return _rebuilt(state, "", local), boxes


def sharded_from_part(loaded: Any, boxes: Boxes) -> Any:
    """The inverse of :func:`part_view` for a loaded part: arrays under a sharded FQN become
    ``ShardedArray`` boxes again."""

    def sharded(value: Any, fqn: str) -> Any:
        if fqn not in boxes:
            return _DESCEND
        found = boxes[fqn]
        if isinstance(value, list | tuple):  # saved as a list of boxes (of one or more)
            return [ShardedArray(a, o, g) for a, (o, g) in zip(value, found, strict=True)]
        ((offsets, shape),) = found
        return ShardedArray(value, offsets, shape)

    return _rebuilt(loaded, "", sharded)


def copy_values_back(target: Any, loaded: Any) -> None:
    """Put the plain values a load left in ``loaded`` (a :func:`part_view` of ``target``) into
    ``target``'s containers; arrays were filled in place."""
    if isinstance(target, dict):
        items: Any = target.items()
    elif isinstance(target, list | tuple):
        items = enumerate(target)
    else:
        return
    for key, value in list(items):
        got = loaded[key]
        if is_sharded_leaf(value) or is_array(value) or is_dtensor(value):
            continue
        if isinstance(value, dict) or (isinstance(value, list | tuple) and _holds_containers(value)):
            copy_values_back(value, got)
        elif not isinstance(target, tuple):
            target[key] = got


def _holds_containers(value: list[Any] | tuple[Any, ...]) -> bool:
    return any(isinstance(v, dict | list | tuple) or is_array(v) or is_sharded_leaf(v) for v in value)


def layout_of(view: dict[str, Any], boxes: Boxes) -> str:
    """A digest of a part's layout: every array's FQN, shape and dtype, every box."""
    leaves, _ = flatten_state_dict(view, is_array)
    arrays = []
    for fqn, leaf in sorted(leaves.items()):
        if is_array(leaf.value):
            a = adapt(leaf.value)
            arrays.append([fqn, list(a.shape), str(a.dtype)])
    text = json.dumps([arrays, sorted((k, [list(map(list, b)) for b in v]) for k, v in boxes.items())])
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def part_bytes(view: dict[str, Any]) -> int:
    """The bytes of a part's arrays (what a part costs its tier, plain values aside)."""
    leaves, _ = flatten_state_dict(view, is_array)
    total = 0
    for leaf in leaves.values():
        if is_array(leaf.value):
            a = adapt(leaf.value)
            total += a.dtype.itemsize * math.prod(a.shape)
    return total


# what a restore reports ---------------------------------------------------------------


@dataclass(frozen=True)
class PartSource:
    """Where one rank's part of a restored step came from."""

    rank: int
    where: str  # "local", "peer" or "root"
    holder: int | None = None  # the rank that sent it ("peer")
    node: str | None = None
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class RestoreReport:
    """What :meth:`~gpuckpt.CheckpointManager.restore` read, identical on every rank."""

    step: int
    source: str  # "tiers" or "root"
    save_id: str | None = None
    parts: dict[int, PartSource] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()


# the tier -------------------------------------------------------------------------------


class LocalTier:
    """One rank's side of the local tier (see the module docstring); made by the manager.

    ``queries`` carries the foreground collectives (the caller's thread), ``background``
    the replication rounds (the tier's thread): two duplicates of the job's coordinator.
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
    ) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise InvalidOptionError(f"replicas must be an integer >= 0, got {replicas!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
            raise InvalidOptionError(
                f"local_max_to_keep must be an integer >= 2 (the step being written and the last "
                f"complete one), got {keep!r}"
            )
        if node is not None and (not isinstance(node, str) or not node):
            raise InvalidOptionError(f"node must be a non-empty string or None, got {node!r}")
        self.queries, self.background = queries, background
        self.rank, self.world_size = queries.rank, queries.world_size
        self.dir = Path(local_dir).absolute()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.node = node if node is not None else socket.gethostname()
        self.keep, self.replicas = keep, replicas
        self.options = options.replace(
            sync="none", base=None, content_hash=False, overwrite=True, storage_options=None
        )
        self._store = open_root(self.dir)
        for leftover in self.dir.glob(f".recv-r{self.rank}-*"):  # this rank's receptions a crash cut short
            shutil.rmtree(leftover, ignore_errors=True)
        st = self.dir.stat()
        seen = queries.all_gather((self.node, str(self.dir.resolve()), st.st_dev, st.st_ino))
        self.node_names = [s[0] for s in seen]
        self._check_directories(seen)
        self.node_ranks = next(ranks for ranks in nodes_of(self.node_names) if self.rank in ranks)
        self.leader = self.node_ranks[0] == self.rank
        if self.leader:  # what dead saves left (never a live save's: see CheckpointRoot.cleanup)
            self._store.cleanup()
        self.holders = replica_holders(self.rank, self.node_names, replicas) if replicas else []
        #: the ranks whose replicas this rank holds
        self.held = [
            r
            for r in range(self.world_size)
            if replicas and self.rank in replica_holders(r, self.node_names, replicas)
        ]
        # the part's write and the tier's thread (replication, retention) keep the caller's
        # priority: the next save waits for them, and at nice 19 a loop that keeps every core
        # busy starves them (save calls of 0.43 s against 0.02 s in a trial); the drain, which
        # only a persist step waits for, runs at nice 19 (see CheckpointManager)
        self._thread = Workers(1, "gpuckpt-tier")
        self._writer = Workers(1, "gpuckpt-tier-write")
        self._jobs: dict[int, Future[None]] = {}
        #: steps being drained to root: retention keeps them
        self.pinned: set[int] = set()
        self._budget_checked = False
        #: where replicas and fetched parts arrive before they are written to the tier
        self._received = bytearray()
        queries.barrier()  # nobody writes before every leader has cleaned up

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

    def check_budget(self, nbytes: int) -> None:
        """Collective: refuse, on every rank and before anything is written, part sizes the
        nodes' tiers cannot hold ``keep`` steps of, replicas included (at the first save)."""
        sizes = self.queries.all_gather((nbytes, self._free_bytes()))
        problems = []
        for ranks in nodes_of(self.node_names):
            held = [r for r in range(self.world_size) if r not in ranks and self._holds(ranks, r)]
            need = self.keep * (sum(sizes[r][0] for r in ranks) + sum(sizes[r][0] for r in held))
            free = sizes[ranks[0]][1]
            if need > free:
                problems.append(
                    f"node {self.node_names[ranks[0]]!r} needs {need:,} bytes (local_max_to_keep={self.keep} "
                    f"x {len(ranks)} parts + {len(held)} replicas) and has {free:,} free"
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

    def begin(self, step: int, state: Any, save_id: str) -> None:
        """Snapshot this rank's part of ``step`` and write, replicate and retire in the background."""
        view, boxes = part_view(state)
        if not self._budget_checked:
            self.check_budget(part_bytes(view))
            self._budget_checked = True
        record = PartRecord(
            step, save_id, self.rank, self.world_size, self.node, layout_of(view, boxes), boxes
        )
        options = self.options.replace(planner_extra={PART_KEY: record.to_json()})
        error: BaseException | None = None
        try:
            written = async_save_with_options(
                view, self.dir / part_name(step, self.rank), options, writer_thread=self._writer
            )
        except Exception as exc:  # the others learn of it in the step's first collective
            error, written = exc, None
        self._jobs[step] = self._thread.submit(self._finish, step, written, error)

    def _finish(self, step: int, written: Any, error: BaseException | None) -> None:
        """The tier thread's work for ``step``: the part committed everywhere, replicated, old
        steps retired. Every collective runs on every rank, whatever failed where."""
        try:
            if written is not None:
                written.result()
        except Exception as exc:
            error = exc
        try:
            self.background.idle_barrier()  # the ranks' writes end apart: the first wait long
            self.background.all_reduce_errors(error)
            self._replicate(step)
        except BaseException:
            self._delete_step(step, [self.rank, *self.held])
            raise
        if self.leader:  # after the collectives: a failure here is this node's, warned about
            try:
                present = {s for s, _ in self._parts()}
                self._delete_steps(tier_retention(present, self.keep, step, self.pinned | {step}))
            except OSError as exc:
                warnings.warn(f"the local tier {self.dir} could not retire old steps: {exc}", stacklevel=1)

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
        return out

    def close(self) -> None:
        """End the tier's threads once their queued work is done."""
        self._thread.shutdown(wait=False)
        self._writer.shutdown(wait=False)

    def wait_all(self) -> None:
        """Block until every step's tier work is done (errors stay for :meth:`settled`)."""
        for job in list(self._jobs.values()):
            job.exception()

    def _replicate(self, step: int) -> None:
        """Send this rank's part of ``step`` to its holders; receive the parts it holds."""
        self._transfer(step, {h: self.rank for h in self.holders}, self.held, self.background, recycle=True)

    def _transfer(
        self,
        step: int,
        sends: dict[int, int],
        receive_from: list[int],
        c: Coordinator,
        *,
        recycle: bool = False,
    ) -> None:
        """One round on ``c``: ``sends[dest] = rank whose part of step to send to dest``; receive
        from each rank in ``receive_from`` the part it sends (committed here under its name).
        ``recycle``: a received part is written into the files of the copy of the same rank's
        part that this step retires (:meth:`_recycled`), not into new ones.

        Files go from a read-only memory map of the sender's file into a writable map of the
        receiver's new file, sized beforehand: one copy by the transport, nothing zero-filled.
        Every rank takes part in every exchange whatever failed where, and the round ends in
        one error check."""
        error: BaseException | None = None
        manifests: dict[int, Any] = {}
        try:
            for dest, whose in sends.items():
                manifests[dest] = (whose, self._manifest(step, whose))
        except Exception as exc:
            error = exc
            manifests = {dest: None for dest in sends}
        got = c.exchange_objects(manifests, receive_from)
        out_buffers: dict[int, list[Any]] = {}
        in_buffers: dict[int, list[Any]] = {}
        maps: list[mmap.mmap] = []
        receptions: list[tuple[Path, int, list[tuple[str, int]]]] = []
        # what failed here still sends and receives the sizes announced (zeros, scratch memory),
        # so that every transport's round completes; the round's error check then fails it
        for dest, m in manifests.items():
            if m is not None:
                try:
                    out_buffers[dest] = self._mapped(self.dir / part_name(step, m[0]), m[1], maps)
                except Exception as exc:
                    error = error or exc
                    out_buffers[dest] = [bytes(size) for _, size in m[1] if size]
        incoming = {src: m for src, m in got.items() if m is not None}
        cut = self._receive_buffer(sum(size for m in incoming.values() for _, size in m[1]))
        for source, (whose, files) in incoming.items():
            tmp = self.dir / f".recv-r{self.rank}-{secrets.token_hex(4)}"
            receptions.append((tmp, whose, files))
            in_buffers[source] = [cut(size) for _, size in files if size]
        try:
            c.exchange_buffers(out_buffers, in_buffers)
        except Exception as exc:  # a mismatch is raised on the receiver, after every message arrived
            error = error or exc
        finally:
            for sent in out_buffers.values():
                for v in sent:
                    if isinstance(v, memoryview):  # (zeros stand in for a part that failed here)
                        v.release()
            for m in maps:
                with contextlib.suppress(BufferError):  # a transport still holds a view: closed later
                    m.close()
        missing = [s for s in receive_from if got.get(s) is None]
        if missing and error is None:
            error = FileNotFoundError(f"ranks {missing} had no part of step {step} to send")
        try:
            c.all_reduce_errors(error)  # nothing received is published unless every rank succeeded
            published: BaseException | None = None
            try:
                for (tmp, whose, files), bufs in zip(receptions, in_buffers.values(), strict=True):
                    if recycle and self._recycled(step, whose, tmp):
                        try:
                            self._write_received(tmp, files, bufs)
                        except OSError:  # a copy of another layout (a directory for a file): anew
                            shutil.rmtree(tmp)
                            self._write_received(tmp, files, bufs)
                    else:
                        self._write_received(tmp, files, bufs)
                    self._commit_received(tmp, part_name(step, whose))
            except Exception as exc:
                published = exc
            c.idle_barrier()  # senders and ranks that received little wait for the others' writes
            c.all_reduce_errors(published)  # a publication that failed here fails the round everywhere
        finally:
            for tmp, _, _ in receptions:
                shutil.rmtree(tmp, ignore_errors=True)

    def _manifest(self, step: int, whose: int) -> list[tuple[str, int]]:
        root = self.dir / part_name(step, whose)
        if not self._store.is_committed(part_name(step, whose)):
            raise FileNotFoundError(f"no committed part of rank {whose} at step {step} in {self.dir}")
        files = []
        for dirpath, _dirs, names in os.walk(root):
            for n in sorted(names):
                p = Path(dirpath) / n
                files.append((str(p.relative_to(root)), p.stat().st_size))
        return sorted(files)

    @staticmethod
    def _mapped(root: Path, files: list[tuple[str, int]], maps: list[mmap.mmap]) -> list[Any]:
        """Read-only memory maps of the non-empty ``files`` under ``root`` (appended to ``maps``),
        as views; populated at once (the part is in the page cache: no fault per page)."""
        views = []
        for rel, size in files:
            if not size:
                continue
            fd = os.open(root / rel, os.O_RDONLY)
            try:
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                m = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            maps.append(m)
            views.append(memoryview(m))
        return views

    def _receive_buffer(self, total: int) -> Callable[[int], memoryview]:
        """A cutter of the tier's receive buffer (kept from round to round: its pages are mapped
        once, not faulted in again for every replica), grown to ``total`` bytes: each call
        returns the next ``size`` bytes."""
        if len(self._received) < total:
            self._received = bytearray(total)
        view = memoryview(self._received)
        at = 0

        def cut(size: int) -> memoryview:
            nonlocal at
            at += size
            return view[at - size : at]

        return cut

    def _recycled(self, step: int, whose: int, tmp: Path) -> bool:
        """Move to ``tmp`` this node's copy of ``whose``'s part of the oldest step that the
        tier's retention deletes once ``step`` is in (none: nothing moves), to be overwritten.

        The received bytes then go into pages the file system already holds: on tmpfs a
        ``write()`` into new files costs page allocation and zeroing, about as much again
        as the copy itself (0.096 s against 0.049 s per 256 MiB on a 2-vCPU VM). The step
        it comes from is retired by this step anyway (with ``local_max_to_keep`` steps, the
        one before the last complete step), never a pinned one (being drained); the move
        takes the copy out of the tier in one rename, and a crash before the commit leaves
        a ``.recv-`` directory that the next start removes. Returns whether a copy moved."""
        present = {s for s, _ in self._parts()} | {step}
        for old in tier_retention(present, self.keep, step, set(self.pinned) | {step}):
            name = part_name(old, whose)
            if self._store.is_committed(name):
                try:
                    os.rename(self.dir / name, tmp)
                except FileNotFoundError:  # deleted meanwhile: new files
                    return False
                return True
        return False

    @staticmethod
    def _write_received(tmp: Path, files: list[tuple[str, int]], bufs: list[memoryview]) -> None:
        """The files of a received part under ``tmp``, from the receive buffer: written over
        the files of a recycled copy already there (see :meth:`_recycled`), new files
        otherwise; any other file of a recycled copy is deleted."""
        it = iter(bufs)
        tmp.mkdir(exist_ok=True)
        wanted = set()
        for rel, size in files:
            if ".." in Path(rel).parts or Path(rel).is_absolute() or not isinstance(size, int) or size < 0:
                raise CheckpointCorruptedError(f"a received part names the file {rel!r} of {size!r} bytes")
            path = tmp / rel
            wanted.add(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = _open_recycled(path)
            if fd is None:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                if size:
                    write_all(fd, next(it))
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        for dirpath, dirs, names in os.walk(tmp, topdown=False):
            for n in names:
                if Path(dirpath) / n not in wanted:
                    os.unlink(Path(dirpath) / n)
            for d in dirs:
                with contextlib.suppress(OSError):  # removed only when empty
                    os.rmdir(Path(dirpath) / d)

    def _commit_received(self, tmp: Path, name: str) -> None:
        """Publish the part received under ``tmp`` as ``name`` (an older copy is replaced)."""
        if self._store.is_committed(name):  # an older copy (an abandoned line): replaced
            self._store.delete([name])
        os.rename(tmp, self.dir / name)

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
        out = []
        for step, rank in self._parts():
            try:
                md = api.read_metadata(self.dir / part_name(step, rank))
                rec = PartRecord.from_planner_data(md.planner_data)
            except Exception:  # a damaged part's root document: not a copy
                continue
            if rec is None or (rec.step, rec.rank) != (step, rank):
                continue
            out.append(CopySeen(rec.step, rec.save_id, rec.rank, rec.world_size, rec.layout, self.rank))
        return out

    # restoring -------------------------------------------------------------------------

    def read_part(self, step: int) -> Any:
        """This rank's part of ``step`` as the state it was saved from (``ShardedArray`` boxes
        again), every chunk checked: what the drain saves to the root."""
        path = self.dir / part_name(step, self.rank)
        record = PartRecord.from_planner_data(api.read_metadata(path).planner_data)
        if record is None:
            raise MetadataError(f"{path} is not a part of a local tier (its metadata has no {PART_KEY!r})")
        loaded = api.load_state_dict(path, allow_pickle=self.options.allow_pickle)
        return sharded_from_part(loaded, record.boxes)

    def restore(
        self,
        state: Any,
        root_latest: Callable[[], int | None],
        load_options: dict[str, Any],
        *,
        only: int | None = None,
    ) -> tuple[Choice, RestoreReport | None]:
        """Collective: load the newest complete step of the tiers (``only``: that step) into
        ``state``; returns the choice (``"root"`` or ``"none"``: nothing was read) and the report."""
        c = self.queries
        view, boxes = part_view(state)
        layout = layout_of(view, boxes)
        skipped: list[str] = []
        latest_root = root_latest()
        for _attempt in range(4 * self.world_size + 4):
            # one all_gather: the parts each node's lowest rank lists (the node's other ranks see
            # the same directory), and every rank's layout
            gathered = c.all_gather((self.inventory() if self.leader else [], layout))
            copies = [
                dataclasses.replace(cp, holder=holder)
                for seen, _ in gathered
                for cp in seen
                if only in (None, cp.step)
                for holder in self._node_of(cp.holder)
            ]
            layouts = [lay for _, lay in gathered]
            choice = choose(copies, layouts, self.node_names, latest_root)
            if choice.source == "root":
                assert choice.step is not None
                self._abandon_newer(choice.step)
            if choice.source != "tiers":
                return choice, None
            assert choice.step is not None
            step, senders = choice.step, choice.senders
            started = time.perf_counter()
            sends = {r: r for r, h in senders.items() if h == self.rank and r != self.rank}
            mine = senders[self.rank]
            if any(h != r for r, h in senders.items()):  # (the same on every rank: no round if none)
                self._transfer(step, sends, [] if mine == self.rank else [mine], c)
            path = self.dir / part_name(step, self.rank)
            error: BaseException | None = None
            try:
                api.load(view, path, **load_options)
                copy_values_back(state, view)
            except Exception as exc:
                error = exc
            seconds = time.perf_counter() - started
            damaged = isinstance(error, _DAMAGE)
            report = None if error is None else (damaged, describe_error(error), mine)
            c.idle_barrier()  # parts fetched from peers take longer than local ones
            outcomes = c.all_gather((report, tree_bytes(path) if error is None else 0, seconds))
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
                self._abandon_newer(step)
                return choice, RestoreReport(step, "tiers", choice.save_id, parts, tuple(skipped))
            if not all(b[0] for b in bad.values()):
                failures = {r: b[1] for r, b in bad.items()}
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

    def _abandon_newer(self, step: int) -> None:
        """Tier steps newer than the one restored are an abandoned line: deleted on every node
        (else a later restore could take them for newer than the steps saved from here on)."""
        if self.leader:
            self._delete_steps([s for s in self.steps() if s > step])
        self.queries.idle_barrier()


def _open_recycled(path: Path) -> int | None:
    """``path`` opened for writing over its bytes if it is a regular file (never through a
    link, never blocking on a special file), else None: nothing there, or what was there
    removed."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:  # a link (ELOOP), a directory (EISDIR), ...
        _remove(path)
        return None
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    _remove(path)
    return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def tree_bytes(path: Path) -> int:
    """The bytes of the files below ``path`` (a part, a tier)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
