"""One rank's side of the local tier (see :mod:`gpuckpt.tiers`): its part of each step
written to the node's ``local_dir``, replicated to its holders, retired; its restore."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import secrets
import shutil
import socket
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import gpuckpt.api as api
from gpuckpt.background import async_save_with_options
from gpuckpt.distributed.coordinator import Coordinator, describe_error
from gpuckpt.errors import (
    CheckpointCorruptedError,
    DistributedError,
    InvalidOptionError,
    MetadataError,
    TierBudgetError,
)
from gpuckpt.format.documents import MAX_ROOT_DOCUMENT_BYTES, ROOT_KEY
from gpuckpt.format.parts import PART_KEY, PartRecord, parse_part_name, part_name
from gpuckpt.options import SaveOptions
from gpuckpt.planning.tiers import Choice, CopySeen, choose, nodes_of, replica_holders, tier_retention
from gpuckpt.runtime.workers import Workers
from gpuckpt.storage.stores import file_system_type, in_memory, open_root
from gpuckpt.tiers.files import ReceiveBuffer, Received, mapped, tree_bytes, write_received
from gpuckpt.tiers.parts import copy_values_back, layout_of, part_bytes, part_view, sharded_from_part
from gpuckpt.tiers.placement import message_sizes, placement
from gpuckpt.tiers.report import PartSource, RestoreReport

__all__ = ["LocalTier"]

#: errors of a copy that mean the copy is damaged or gone (the restore skips it), not a misuse
_DAMAGE = (CheckpointCorruptedError, MetadataError, FileNotFoundError)


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
        self._received = ReceiveBuffer()
        #: writes of parts restores fetched from peers (:meth:`_keep_fetched`)
        self._fetched: list[Future[None]] = []
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
        """End the tier's threads once their queued work is done (the parts a restore fetched
        are written before this returns: a closed manager leaves its tier as restored)."""
        for job in self._fetched:
            job.exception()
        self._fetched.clear()
        self._thread.shutdown(wait=False)
        self._writer.shutdown(wait=False)

    def wait_all(self) -> None:
        """Block until every step's tier work is done (errors stay for :meth:`settled`), and
        the writes of parts fetched by a restore."""
        for job in [*self._jobs.values(), *self._fetched]:
            job.exception()
        self._fetched.clear()

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
        from each rank in ``receive_from`` the part it sends, committed here under its name.
        ``recycle``: a received part is written into the files of the copy of the same rank's
        part that this step retires (:meth:`_recycled`), not into new ones."""
        received = self._exchange(step, sends, receive_from, c, self._received)
        self._publish(step, received, c, recycle=recycle)

    def _exchange(
        self,
        step: int,
        sends: dict[int, int],
        receive_from: list[int],
        c: Coordinator,
        buffer: ReceiveBuffer,
        *,
        into: dict[str, Any] | None = None,
    ) -> list[Received]:
        """The exchange of :meth:`_transfer`, into ``buffer``: returns the parts received, not
        yet written anywhere (valid until ``buffer`` is cut again).

        Files go from a read-only memory map of the sender's file into the receive buffer:
        one copy by the transport. ``into`` (a restore's state, as :func:`part_view` gives it;
        the same on every rank: None or not): this rank's own part is received into its
        arrays where :func:`~gpuckpt.tiers.placement.placement` allows, the rest into
        ``buffer``. Every rank takes part in every exchange whatever failed where, and the
        round ends in one error check (raised on every rank)."""
        error: BaseException | None = None
        manifests: dict[int, Any] = {}
        try:
            for dest, whose in sends.items():
                files = self._manifest(step, whose)
                root = self._root_document(step, whose, files) if into is not None else None
                manifests[dest] = (whose, files, root)
        except Exception as exc:
            error = exc
            manifests = {dest: None for dest in sends}
        got = c.exchange_objects(manifests, receive_from)
        out_buffers: dict[int, list[Any]] = {}
        in_buffers: dict[int, list[Any]] = {}
        maps: list[mmap.mmap] = []
        received: list[Received] = []
        # what failed here still sends and receives the sizes announced (zeros, scratch memory),
        # so that every transport's round completes; the round's error check then fails it
        for dest, m in manifests.items():
            if m is not None:
                try:
                    out_buffers[dest] = mapped(self.dir / part_name(step, m[0]), m[1], maps)
                except Exception as exc:
                    error = error or exc
                    out_buffers[dest] = [bytes(n) for rel, size in m[1] for n in message_sizes(rel, size)]
        incoming = {src: m for src, m in got.items() if m is not None}
        targets = {
            src: self._targets(m[2], into, step) if into is not None and m[0] == self.rank else {}
            for src, m in incoming.items()
        }
        plans = {src: self._messages(m[1], targets[src]) for src, m in incoming.items()}
        cut = buffer.cutter(sum(n for plan in plans.values() for sizes in plan for n in sizes if n > 0))
        for source, (whose, files, _root) in incoming.items():
            pieces = [
                [cut(n) if n > 0 else targets[source][rel] for n in sizes]
                for (rel, _), sizes in zip(files, plans[source], strict=True)
            ]
            in_buffers[source] = [p for ps in pieces for p in ps]
            placed = any(n < 0 for sizes in plans[source] for n in sizes)
            received.append(Received(whose, files, pieces, placed=placed))
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
        c.all_reduce_errors(error)  # nothing received is used unless every rank succeeded
        return received

    def _root_document(self, step: int, whose: int, files: list[tuple[str, int]]) -> bytes | None:
        """The root document of ``whose``'s part of ``step`` here, sent with its manifest to a
        restore (None if it is missing or too large: nothing is placed then)."""
        size = dict(files).get(ROOT_KEY)
        if size is None or size > MAX_ROOT_DOCUMENT_BYTES:
            return None
        return (self.dir / part_name(step, whose) / ROOT_KEY).read_bytes()

    def _targets(self, root: bytes | None, into: dict[str, Any], step: int) -> dict[str, Any]:
        """Which of this rank's arrays take which chunk file of its part (see :mod:`placement`);
        none where the root document did not come or does not read (the load says why)."""
        if root is None:
            return {}
        try:
            return placement(root, f"{part_name(step, self.rank)}/{ROOT_KEY} (received)", into)
        except Exception:
            return {}

    @staticmethod
    def _messages(files: list[tuple[str, int]], targets: dict[str, Any]) -> list[list[int]]:
        """The sizes of each file's messages to cut from the receive buffer; ``-1`` where a
        message goes straight into the array ``targets`` has for that file."""
        plan = []
        for rel, size in files:
            sizes = message_sizes(rel, size)
            t = targets.get(rel)
            if t is not None and len(sizes) == 2 and sizes[0] == t.nbytes:
                sizes = [-1, sizes[1]]
            plan.append(sizes)
        return plan

    def _publish(self, step: int, received: list[Received], c: Coordinator, *, recycle: bool) -> None:
        """Collective: write the parts ``received`` into this node's tier and commit them; a
        publication that failed on any rank fails the round on every rank."""
        published: BaseException | None = None
        try:
            for got in received:
                self._write_part(step, got, recycle=recycle)
        except Exception as exc:
            published = exc
        c.idle_barrier()  # senders and ranks that received little wait for the others' writes
        c.all_reduce_errors(published)

    def _write_part(self, step: int, got: Received, *, recycle: bool) -> None:
        """Write the received part ``got`` into the tier and commit it under its name."""
        tmp = self.dir / f".recv-r{self.rank}-{secrets.token_hex(4)}"
        try:
            if recycle and self._recycled(step, got.whose, tmp):
                try:
                    write_received(tmp, got.files, got.pieces)
                except OSError:  # a copy of another layout (a directory for a file): anew
                    shutil.rmtree(tmp)
                    write_received(tmp, got.files, got.pieces)
            else:
                write_received(tmp, got.files, got.pieces)
            self._commit_received(tmp, part_name(step, got.whose))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _keep_fetched(self, step: int, got: Received) -> None:
        """Write a part a restore fetched from a peer into this node's tier, on the tier's
        thread (before any later step's retention there), after the restore has returned:
        until then the peer's copy is the one there is. A failure is warned about: the
        restore is done, and the next save writes this rank's part anew."""

        def write() -> None:
            try:
                self._write_part(step, got, recycle=False)
            except Exception as exc:
                warnings.warn(
                    f"the local tier {self.dir} could not keep the part of rank {got.whose} at step {step} "
                    f"fetched from a peer ({describe_error(exc)}); the peer's copy remains",
                    stacklevel=1,
                )

        self._fetched.append(self._thread.submit(write))

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
            root = self.dir / part_name(step, rank) / ROOT_KEY
            try:
                with open(root, "rb") as f:  # (a document too large is refused unread)
                    raw = f.read(MAX_ROOT_DOCUMENT_BYTES + 1)
                rec = PartRecord.from_root_document(raw, str(root))
            except Exception:  # a damaged part's root document: not a copy (its chunks are
                continue  # checked when it is loaded)
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
        self.wait_all()  # (a part an earlier restore fetched is in the tier before it is listed)
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
            fetched: list[Received] = []
            if any(h != r for r, h in senders.items()):  # (the same on every rank: no round if none)
                # into the state's arrays where they allow it, the rest into a buffer of its own
                # (kept for the tier's copy, written after the restore returns)
                receive = [] if mine == self.rank else [mine]
                fetched = self._exchange(step, sends, receive, c, ReceiveBuffer(), into=view)
            path = self.dir / part_name(step, self.rank)
            error: BaseException | None = None
            nbytes = 0
            try:
                if fetched:  # loaded from the bytes received, not written to files and read back
                    (got,) = fetched
                    with in_memory(got.as_files()) as url:
                        api.load(view, url, **load_options)
                    nbytes = got.nbytes
                else:
                    api.load(view, path, **load_options)
                    nbytes = tree_bytes(path)
                copy_values_back(state, view)
            except Exception as exc:
                error = exc
            seconds = time.perf_counter() - started
            damaged = isinstance(error, _DAMAGE)
            report = None if error is None else (damaged, describe_error(error), mine)
            c.idle_barrier()  # parts fetched from peers take longer than local ones
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
                self._abandon_newer(step)
                for got in fetched:
                    if not got.placed:  # (bytes received into the state are the job's now)
                        self._keep_fetched(step, got)
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
