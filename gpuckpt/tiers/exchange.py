"""Parts moved between ranks: one exchange round of parts' files over the coordinator's
transport, received straight into files of this node's tier (replicas), or into a restore's
own arrays (:mod:`gpuckpt.tiers.placement`) and a buffer for the rest, then published into the
tier.

:class:`PartExchange` is the part of :class:`~gpuckpt.tiers.local.LocalTier` that does it;
it uses the tier's directory, store, retention and threads.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import gpuckpt.pending as pending
from gpuckpt.distributed.coordinator import Coordinator, describe_error
from gpuckpt.distributed.exchange import pack_small_buffers
from gpuckpt.format.documents import MAX_ROOT_DOCUMENT_BYTES, ROOT_KEY
from gpuckpt.format.parts import part_name
from gpuckpt.planning.tiers import tier_retention
from gpuckpt.runtime.workers import Workers
from gpuckpt.storage.base import CheckpointRoot
from gpuckpt.storage.local.fsutil import move_directory
from gpuckpt.tiers.files import (
    FileMaps,
    ReceiveBuffer,
    Received,
    mapped,
    part_files,
    receiving_files,
    with_open_files_hint,
    write_copies,
    write_received,
)
from gpuckpt.tiers.placement import message_sizes, placement

__all__ = ["PartExchange"]


class PartExchange:
    """Exchange rounds of parts and their publication (see the module docstring)."""

    # what the tier provides
    dir: Path
    rank: int
    keep: int
    pinned: set[int]
    _store: CheckpointRoot
    _thread: Workers
    #: maps of the tier's large files kept from round to round (:class:`FileMaps`)
    _file_maps: FileMaps
    #: writes of parts restores fetched from peers (:meth:`_keep_fetched`)
    _fetched: list[Future[None]]
    #: ``(step, rank)`` of every committed part in this node's tier
    _parts: Callable[[], list[tuple[int, int]]]

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
        from each rank in ``receive_from`` the part it sends, straight into files of this
        node's tier, committed there under its name. ``recycle``: a received part goes into the
        files of the copy of the same rank's part that this step retires (:meth:`_recycled`),
        not into new ones."""
        made: list[Path] = []

        def files_at(whose: int) -> Path:
            tmp = self.dir / f".recv-r{self.rank}-{secrets.token_hex(4)}"
            made.append(tmp)
            if not (recycle and self._recycled(step, whose, tmp)):
                tmp.mkdir()
            return tmp

        try:
            # (a buffer only where a part's files could not be made: the round then fails)
            received = self._exchange(step, sends, receive_from, c, ReceiveBuffer(), files_at=files_at)
            self._publish(step, received, c)
        finally:  # (a committed part's directory is no longer there)
            for tmp in made:
                shutil.rmtree(tmp, ignore_errors=True)

    def _exchange(
        self,
        step: int,
        sends: dict[int, int],
        receive_from: list[int],
        c: Coordinator,
        buffer: ReceiveBuffer,
        *,
        files_at: Callable[[int], Path] | None = None,
    ) -> list[Received]:
        """:meth:`_round`, then its error check: what failed on any rank raised on every rank
        (nothing received is used unless every rank succeeded)."""
        received, error = self._round(step, sends, receive_from, c, buffer, files_at=files_at)
        c.all_reduce_errors(error)
        return received

    def _round(
        self,
        step: int,
        sends: dict[int, int],
        receive_from: list[int],
        c: Coordinator,
        buffer: ReceiveBuffer,
        *,
        into: dict[str, Any] | None = None,
        files_at: Callable[[int], Path] | None = None,
        listed: Callable[[], None] | None = None,
    ) -> tuple[list[Received], BaseException | None]:
        """The exchange of :meth:`_transfer`, into ``buffer``: returns the parts received, not
        yet written anywhere (valid until ``buffer`` is cut again), or, with ``files_at``
        (whose part -> a new directory of the tier), received into files in that directory
        (:func:`~gpuckpt.tiers.files.receiving_files`; ``buffer`` only where that failed).

        Files go from a read-only memory map of the sender's file into the receiver's files
        or the receive buffer: one copy by the transport. Maps of large files are kept for the
        next rounds (:class:`~gpuckpt.tiers.files.FileMaps`). ``into`` (a restore's state, as
        :func:`part_view` gives it; the same on every rank: None or not): this rank's own part
        is received into its arrays where :func:`~gpuckpt.tiers.placement.placement` allows,
        the rest into ``buffer``. Every rank takes part in every exchange whatever failed
        where: what failed here still sends and receives the sizes announced (zeros, scratch
        memory), so that every transport's round completes. ``listed``: called once the
        manifests are exchanged, before the transfer (a restore starts its own part's load
        there).

        Also returns this rank's first error, or None. The caller checks the round on every
        rank before it uses what was received anywhere but in this process (:meth:`_exchange`;
        a restore checks it in its own collective after its load, so that a rank whose
        transfer is over checks its part while others still receive)."""
        errors: list[BaseException] = []
        manifests: dict[int, Any] = {}
        try:
            for dest, whose in sends.items():
                files = self._manifest(step, whose)
                root = self._root_document(step, whose, files) if into is not None else None
                manifests[dest] = (whose, files, root)
        except Exception as exc:
            errors.append(exc)
            manifests = {dest: None for dest in sends}
        got = c.exchange_objects(manifests, receive_from)
        if listed is not None:
            try:
                listed()
            except Exception as exc:  # (raised on every rank after the round, as any failure here)
                errors.append(exc)
        maps: list[mmap.mmap] = []
        out_buffers = self._outgoing(step, manifests, maps, errors)
        incoming = {src: m for src, m in got.items() if m is not None}
        in_buffers, received, mapped_in = self._incoming(step, incoming, buffer, maps, errors, into, files_at)
        try:
            # a part's documents and checksum trailers travel packed into one message per pair
            # (pack_small_buffers): for a GPT-like part of 289 tensors, 98 messages, not 578
            packed_out, packed_in, finish = pack_small_buffers(out_buffers, in_buffers)
            done = False
            try:
                c.exchange_buffers(packed_out, packed_in)
                done = True
            finally:
                del packed_out, packed_in
                finish(done)
        except Exception as exc:  # a mismatch is raised on the receiver, after every message arrived
            errors.append(exc)
        finally:
            for views in [*out_buffers.values(), mapped_in]:
                for v in views:
                    if isinstance(v, memoryview):  # (zeros stand in for a part that failed here)
                        v.release()
            for m in maps:
                with contextlib.suppress(BufferError):  # a transport still holds a view: closed later
                    m.close()
        missing = [s for s in receive_from if got.get(s) is None]
        if missing:
            errors.append(FileNotFoundError(f"ranks {missing} had no part of step {step} to send"))
        first = None
        if errors:  # (an error of the process's limit on open files says how many the round maps)
            moved = [m for m in [*manifests.values(), *incoming.values()] if m is not None]
            first = with_open_files_hint(errors[0], sum(len(m[1]) for m in moved))
        return received, first

    def _outgoing(
        self, step: int, manifests: dict[int, Any], maps: list[mmap.mmap], errors: list[BaseException]
    ) -> dict[int, list[Any]]:
        """The messages to each destination of ``manifests``: views of the sent files, mapped
        (maps appended to ``maps``), or zeros of the sizes announced where mapping failed (the
        error appended to ``errors``)."""
        out: dict[int, list[Any]] = {}
        for dest, m in manifests.items():
            if m is None:
                continue
            try:
                out[dest] = mapped(self.dir / part_name(step, m[0]), m[1], maps, self._file_maps)
            except Exception as exc:
                errors.append(exc)
                out[dest] = [bytes(n) for rel, size in m[1] for n in message_sizes(rel, size)]
        return out

    def _incoming(
        self,
        step: int,
        incoming: dict[int, Any],
        buffer: ReceiveBuffer,
        maps: list[mmap.mmap],
        errors: list[BaseException],
        into: dict[str, Any] | None,
        files_at: Callable[[int], Path] | None,
    ) -> tuple[dict[int, list[Any]], list[Received], list[memoryview]]:
        """Where each source's messages are received (see :meth:`_exchange`): the receive
        buffers by source, the parts as they will be once received, and the views of mapped
        files among the buffers (released once the round is over)."""
        targets = {
            src: self._targets(m[2], into, step) if into is not None and m[0] == self.rank else {}
            for src, m in incoming.items()
        }
        in_files: dict[int, tuple[Path, list[list[memoryview]], list[tuple[str, memoryview]]]] = {}
        for source, (whose, files, _root) in incoming.items():
            if files_at is None:
                break
            try:
                tmp = files_at(whose)
                copies: list[tuple[str, memoryview]] = []
                views = receiving_files(tmp, files, maps, self._file_maps, copies)
                in_files[source] = (tmp, views, copies)
            except Exception as exc:  # received into the buffer, and the round fails
                errors.append(exc)
        plans = {
            src: self._messages(m[1], targets[src]) for src, m in incoming.items() if src not in in_files
        }
        cut = buffer.cutter(sum(n for plan in plans.values() for sizes in plan for n in sizes if n > 0))
        in_buffers: dict[int, list[Any]] = {}
        received: list[Received] = []
        for source, (whose, files, _root) in incoming.items():
            if source in in_files:
                tmp, views, copies = in_files[source]
                in_buffers[source] = [v for vs in views for v in vs]
                received.append(Received(whose, files, [], directory=tmp, copies=copies))
                continue
            pieces = [
                [cut(n) if n > 0 else targets[source][rel] for n in sizes]
                for (rel, _), sizes in zip(files, plans[source], strict=True)
            ]
            in_buffers[source] = [p for ps in pieces for p in ps]
            placed = any(n < 0 for sizes in plans[source] for n in sizes)
            received.append(Received(whose, files, pieces, placed=placed))
        mapped_in = [v for src in in_files for v in in_buffers[src]]
        return in_buffers, received, mapped_in

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

    def _publish(self, step: int, received: list[Received], c: Coordinator) -> None:
        """Collective: commit the parts ``received`` (into files of this node's tier: a round
        that received any into the buffer failed) under their names; a publication that failed
        on any rank fails the round on every rank."""
        published: BaseException | None = None
        try:
            for got in received:
                assert got.directory is not None
                write_copies(got.directory, got.copies)
                self._commit_received(got.directory, part_name(step, got.whose))
        except Exception as exc:
            published = exc
        c.all_reduce_errors(published)  # (an idle wait where a transport's waits spin)

    def _write_part(self, step: int, got: Received) -> None:
        """Write the part ``got``, received into a buffer, into new files of the tier and
        commit it under its name."""
        tmp = self.dir / f".recv-r{self.rank}-{secrets.token_hex(4)}"
        try:
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
                self._write_part(step, got)
            except Exception as exc:
                warnings.warn(
                    f"the local tier {self.dir} could not keep the part of rank {got.whose} at step {step} "
                    f"fetched from a peer ({describe_error(exc)}); the peer's copy remains",
                    stacklevel=1,
                )

        job = self._thread.submit(write)
        self._fetched.append(job)
        pending.keep_until_exit(job, f"rank {got.whose}'s part of step {step} in the local tier {self.dir}")

    def _manifest(self, step: int, whose: int) -> list[tuple[str, int]]:
        root = self.dir / part_name(step, whose)
        if not self._store.is_committed(part_name(step, whose)):
            raise FileNotFoundError(f"no committed part of rank {whose} at step {step} in {self.dir}")
        return part_files(root)

    def _recycled(self, step: int, whose: int, tmp: Path) -> bool:
        """Move to ``tmp`` this node's copy of ``whose``'s part of the oldest step that the
        tier's retention deletes once ``step`` is in (none: nothing moves), to be overwritten.

        The received bytes then go into pages the file system already holds: on tmpfs new
        files cost page allocation and zeroing, about as much again as the copy itself
        (0.096 s against 0.049 s per 256 MiB written on a 2-vCPU VM). The step
        it comes from is retired by this step anyway (with ``local_max_to_keep`` steps, the
        one before the last complete step), never a pinned one (being drained); the move
        takes the copy out of the tier in one rename, and a crash before the commit leaves
        a ``.recv-`` directory that the next start removes. Returns whether a copy moved."""
        present = {s for s, _ in self._parts()} | {step}
        for old in tier_retention(present, self.keep, step, set(self.pinned) | {step}):
            name = part_name(old, whose)
            if self._store.is_committed(name):
                # (deleted meanwhile, or a link to a directory elsewhere: new files)
                return move_directory(self.dir / name, tmp)
        return False

    def _commit_received(self, tmp: Path, name: str) -> None:
        """Publish the part received under ``tmp`` as ``name`` (an older copy is replaced)."""
        if self._store.is_committed(name):  # an older copy (an abandoned line): replaced
            self._store.delete([name])
        os.rename(tmp, self.dir / name)
