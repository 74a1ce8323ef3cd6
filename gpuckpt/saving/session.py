"""One save session, whoever runs it: one process, a background save, the ranks of a
distributed save, the DCP ``Writer``.

A save runs these steps, each in the process that owns it::

    session = SaveSession.begin(plan, writer, options, defer=...)   # claims the target,
                                                                     # writes array documents
    rows = session.write(jobs, documents=..., base=...)              # every process: its chunks
    metadata = session.commit(parts, checkpoint_id)                  # the process that began

:meth:`SaveSession.begin` claims the target (:meth:`CheckpointWriter.begin
<gpuckpt.storage.base.CheckpointWriter.begin>`) and writes the array documents,
except those of arrays written whole by one job (their chunk's I/O thread writes
them), or none where the store takes chunks before documents (each rank writes a
share of them alongside its chunks). :meth:`SaveSession.write` writes one
process's chunks and reports their rows of the chunk table with their records
(:func:`~gpuckpt.saving.writing.written_rows`); another rank writes through the writer
it attached with the save's token (:meth:`SaveSession.joined`).
:meth:`SaveSession.commit` merges every process's rows (each chunk exactly once),
writes the chunk table of a large save, makes the checkpoint's
:class:`~gpuckpt.format.metadata.Metadata` once, whole (its format version and every
entry of its planner data included: nothing changes it afterwards), and
publishes the root document. An error in any step aborts the writer: nothing is
published and an earlier checkpoint at the path is untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuckpt.format.metadata import Metadata
from gpuckpt.options import SaveOptions
from gpuckpt.planning.plan import SavePlan
from gpuckpt.planning.table import TableLayout
from gpuckpt.saving.commit import Written, commit_save, table_columns
from gpuckpt.saving.incremental import BaseIndex, open_base_for
from gpuckpt.saving.sources import Sources
from gpuckpt.saving.table_blocks import BlockReport, commit_blocks
from gpuckpt.saving.writing import (
    ChunkJob,
    bind_jobs,
    write_array_documents,
    write_chunks,
    writing,
    written_rows,
)
from gpuckpt.storage.base import CheckpointWriter

__all__ = ["SaveSession", "execute_save"]

Rows = tuple[np.ndarray, Mapping[str, np.ndarray]]


@dataclass(frozen=True, slots=True)
class SaveSession:
    """A save begun (or joined) through ``writer``; see the module docstring for its steps."""

    plan: SavePlan | None  # None in a process that joined (it needs only its own chunks)
    writer: CheckpointWriter
    options: SaveOptions
    #: whether this process began the save (it commits it, and aborts it on its own errors); a
    #: process that joined leaves both to the one that began it
    owner: bool = True

    @classmethod
    def begin(
        cls,
        plan: SavePlan,
        writer: CheckpointWriter,
        options: SaveOptions,
        *,
        defer: Collection[str] = (),
        documents: bool = True,
    ) -> tuple[SaveSession, dict[str, bytes]]:
        """Claim the target and write the array documents of ``plan`` but those of ``defer``
        (returned by array name, for :meth:`write` to write with their array's one chunk);
        with ``documents`` False none is written here."""
        with writing(writer):
            writer.begin()
            deferred = (
                write_array_documents(plan, writer, defer=defer, threads=options.threads) if documents else {}
            )
        return cls(plan, writer, options), deferred

    @classmethod
    def joined(cls, writer: CheckpointWriter, options: SaveOptions) -> SaveSession:
        """The session of a process that writes chunks into a save another process began
        (``writer`` attached with its token): it writes, and never commits nor aborts."""
        return cls(None, writer, options, owner=False)

    def write(
        self,
        jobs: Sequence[ChunkJob],
        *,
        documents: dict[str, bytes] | None = None,
        base: BaseIndex | None = None,
        first: Sequence[Callable[[], None]] = (),
    ) -> list[Written]:
        """Write this process's chunks (see :func:`~gpuckpt.saving.writing.write_chunks`); returns what
        writing each gave, in order. An error aborts the save (in the process that began it:
        another reports its error to that one)."""
        if not self.owner:
            return write_chunks(jobs, self.writer, self.options, documents=documents, base=base, first=first)
        with writing(self.writer):
            return write_chunks(jobs, self.writer, self.options, documents=documents, base=base, first=first)

    def rows(self, jobs: Sequence[ChunkJob], written: Sequence[Written]) -> Rows:
        """What this process reports of its writes (:func:`~gpuckpt.saving.writing.written_rows`)."""
        return written_rows(jobs, written)

    def commit(
        self,
        parts: Iterable[Rows] | Mapping[str, np.ndarray],
        checkpoint_id: str | None,
        *,
        plan: SavePlan | None = None,
        planner_extra: Mapping[str, Any] | None = None,
        table: bool | None = None,
    ) -> Metadata:
        """Merge every process's rows (or take the columns ``parts`` already merged), write the
        chunk table of a large save, and publish; returns the checkpoint's metadata.

        ``plan``: the plan as it ended (memory formats found while writing, the values and
        the state's structure known at the end); the begun one by default.
        ``planner_extra``: more entries of the metadata's ``planner_data``. ``table``: see
        :func:`~gpuckpt.saving.commit.commit_save`."""
        if not self.owner or self.plan is None:
            raise RuntimeError("only the process that began a save commits it")
        done = self.plan if plan is None else plan
        with writing(self.writer):
            columns = parts if isinstance(parts, Mapping) else table_columns(done, parts)
            return commit_save(
                done, columns, self.writer, checkpoint_id, table=table, planner_extra=planner_extra
            )

    def commit_blocks(
        self,
        reports: Sequence[BlockReport],
        checkpoint_id: str | None,
        layout: TableLayout,
        *,
        plan: SavePlan | None = None,
        planner_extra: Mapping[str, Any] | None = None,
    ) -> Metadata:
        """:meth:`commit` of a save whose chunk table is ordered in blocks, each stored by its
        rank (:mod:`gpuckpt.saving.table_blocks`): ``reports`` are every rank's. ``plan`` and
        ``planner_extra`` as for :meth:`commit`."""
        if not self.owner or self.plan is None:
            raise RuntimeError("only the process that began a save commits it")
        with writing(self.writer):
            return commit_blocks(
                self.plan if plan is None else plan,
                layout,
                reports,
                self.writer,
                checkpoint_id,
                documents=not self.writer.capabilities.documents_first,
                planner_extra=planner_extra,
            )

    def abort(self) -> None:
        """Remove what the save wrote (a published checkpoint is never touched)."""
        self.writer.abort()


def execute_save(
    plan: SavePlan,
    sources: Sources,
    writer: CheckpointWriter,
    options: SaveOptions,
    *,
    checkpoint_id: str | None = None,
    table: bool | None = None,
) -> Metadata:
    """A single-process save of ``plan`` from ``sources`` (the arrays the plan was described
    from, or a snapshot of them) through ``writer``: one session, begun, written and
    committed here. ``table``: see :func:`~gpuckpt.saving.commit.commit_save`."""
    (mine,) = plan.assignments
    base = open_base_for(options, plan.tensors)
    # single-chunk arrays get their directory and document from the I/O thread that writes
    # their chunk; the others' must exist before any chunk lands. Those an incremental save
    # may share with its base are written first too, in batches (their chunk is usually
    # linked, not written in a batch of small files)
    shared = set(base.arrays()) if base is not None else set()
    single = {t.name for t in plan.tensors if len(t.specs) == 1 and t.name not in shared}
    session, deferred = SaveSession.begin(plan, writer, options, defer=single)
    jobs = bind_jobs(mine, sources)
    written = session.write(jobs, documents=deferred, base=base)
    rows = [session.rows(jobs, written)]
    return session.commit(rows, checkpoint_id, planner_extra=options.planner_extra, table=table)
