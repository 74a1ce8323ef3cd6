"""A manager's saves and restores through a local tier (:mod:`gpuckpt.tiers`): every step to
the tier, every ``persist_interval_steps``-th drained to the root in the background, the
failures of that background work raised on every rank, restores from the tiers first.

A save blocks for one collective: every rank's report of its background work (failed tier
steps and drains, whether a drain still runs), with rank 0's view of the root and the save's
id. The drain runs on its own thread at nice 19 and saves the step from the parts in the
tier, never staged from the device again; retention at the root applies once every rank's
drain has ended.

Ctrl-C (``SIGINT``) stops a save only before its first collective or once it is over: it is
held from that collective until the step's background work is queued, the part's snapshot
included (a rank that stopped between would leave the others' tier and drain threads
waiting, in their collectives, for work it never queued). The manager's next collective on a
rank that an interrupt stopped waits for the others no longer than the grace of
:mod:`gpuckpt.distributed.mpi` (they may have left the job), and its ``call`` label tells
whether they stopped at the same point.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import gpuckpt.api as api
import gpuckpt.pending as pending
from gpuckpt.distributed.coordinator import Coordinator, CoordinatorError, describe_error, disagreement
from gpuckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DistributedError,
    GpuckptError,
    StepOrderError,
)
from gpuckpt.format.metadata import STATE_DICT_TYPE
from gpuckpt.manager.steps import StepRoot, different_steps, step_name
from gpuckpt.options import SaveOptions
from gpuckpt.runtime.interrupts import after_interrupt, held_interrupts
from gpuckpt.runtime.workers import Workers
from gpuckpt.tiers import LocalTier, PartSource, RestoreReport, part_bytes, part_view

__all__ = ["TieredSaves"]


def _failures(error: BaseException, rank: int) -> dict[int, str]:
    """Rank -> what failed, for an error of background work on ``rank`` (a collective's
    :class:`~gpuckpt.errors.DistributedError` names the ranks where it began)."""
    if isinstance(error, DistributedError):
        return dict(error.failures)
    return {rank: describe_error(error)}


def _own(error: BaseException, doing: str) -> BaseException:
    """The error a single process raised itself (a collective of one wraps it in a
    :class:`DistributedError` whose cause it is), noting what the background work was doing."""
    error = _cause(error)
    error.add_note(f"(while {doing}, in the manager's background work)")
    return error


def _cause(error: BaseException) -> BaseException:
    """The exception a collective of one process wrapped (itself, when it is not wrapped)."""
    while isinstance(error, DistributedError) and error.__cause__ is not None:
        error = error.__cause__
    return error


def _unused_steps(other_layout: dict[int, tuple[int, ...]], chosen: int | None) -> str:
    """What to add to a restore's error where newer tier steps were passed over because some
    ranks' states do not fit them (else nothing)."""
    newer = {s: r for s, r in other_layout.items() if chosen is None or s > chosen}
    if not newer:
        return ""
    ranks = sorted({r for rs in newer.values() for r in rs})
    return (
        f"; the local tiers hold step(s) {sorted(newer)} for every rank, saved from a state whose "
        f"arrays, shapes, dtypes or ShardedArray boxes differ from the present state of rank(s) {ranks}: "
        "restore into the state those steps were saved from (they were left in the tiers)"
    )


def _other_jobs(other_ranks: dict[int, tuple[int, ...]], chosen: int | None, ranks: int) -> str:
    """What to add to a restore's error where tier steps were passed over because a job of
    another number of ranks saved them (else nothing)."""
    newer = {s: z for s, z in other_ranks.items() if chosen is None or s > chosen}
    if not newer:
        return ""
    sizes = sorted({z for zs in newer.values() for z in zs})
    return (
        f"; the local tiers hold step(s) {sorted(newer)[:20]} saved by a job of "
        f"{' or '.join(map(str, sizes))} ranks (this job has {ranks}): restart with {sizes[-1]} ranks "
        "to restore them, or delete them (the step_* folders of the local_dirs) to start this job's own line"
    )


class TieredSaves:
    """One rank's steps through its local tier; made by :class:`~gpuckpt.CheckpointManager`.

    ``steps`` is the manager's view of the root (its ``queries`` coordinator carries the
    foreground collectives), ``saves`` the coordinator of the drains' saves to the root."""

    def __init__(
        self,
        steps: StepRoot,
        tier: LocalTier,
        *,
        saves: Coordinator,
        options: SaveOptions,
        persist_interval_steps: int | None,
        root: Any,
    ) -> None:
        assert steps.queries is not None
        self.steps, self.tier, self.saves = steps, tier, saves
        self.queries: Coordinator = steps.queries
        self.options = options
        self.persist_interval_steps = persist_interval_steps
        self.root = root
        self._drains = Workers(1, "gpuckpt-drain", nice=19)
        self._drain: tuple[int, Any] | None = None
        #: background work whose failure every rank has raised already: ("tier" | "drain", step)
        self._reported: set[tuple[str, int]] = set()
        #: the step last given to the tier
        self.last: int | None = None
        #: why the ranks can no longer gather (they were found in different calls), or None
        self.out_of_step: str | None = None
        #: an interrupt ended a call here since the ranks last gathered in agreement: the next
        #: gather waits for them no longer than the grace
        self._interrupted = False
        #: tier steps found when the manager opened that no restore has taken or abandoned
        #: since: step -> where. They may be another job's (other ranks, another layout): a
        #: save of a step up to the newest of them is refused, never written over them
        self.guarded: dict[int, list[str]] = dict(tier.found)

    # saving -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _noting_interrupts(self, *, half_done: str | None = None) -> Iterator[None]:
        """Note an interrupt (an exception that is not an ``Exception``) that ends the block:
        the ranks may have stopped at other points. ``half_done``: the block's collectives may
        be left half done, and the ranks are out of step for good (this text says where)."""
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._interrupted = True
                if half_done is not None and self.out_of_step is None:
                    self.out_of_step = (
                        f"rank {self.queries.rank} was interrupted (Ctrl-C) in {half_done}, whose "
                        "collectives the ranks may have left at different points: end the job and "
                        "start it again"
                    )
            raise

    def save(self, step: int, state_dict: STATE_DICT_TYPE) -> None:
        """A save through the local tier: one report of every rank's background work, the step
        checks on the agreed view, the part's snapshot; the drain of a persist step."""
        with self._noting_interrupts():
            self._save(step, state_dict)

    def _save(self, step: int, state_dict: STATE_DICT_TYPE) -> None:
        if self.last is not None:
            # one step in flight, as for saves to the root: its snapshot memory is reused, and
            # its outcome is known on every rank before the next one starts
            self.tier.wait_for(self.last)
        persist = step % (self.persist_interval_steps or 1) == 0
        if persist and self._drain is not None:
            # a persist step waits for the previous drain (the root keeps up with the persist
            # steps, or the saves slow down; none is skipped): this rank's here, where Ctrl-C
            # may still stop the save, the others' in the collective below
            self._drain[1].exception()
        with held_interrupts():  # (see the module docstring)
            self._save_held(step, state_dict, persist)

    def _save_held(self, step: int, state_dict: STATE_DICT_TYPE, persist: bool) -> None:
        # the save blocks for one collective: every rank's report of its background work, with
        # rank 0's view of the root and the save's id (the view may hold old steps that the
        # retention of a drain joined here deletes: the checks below look at this step and
        # newer ones only)
        try:
            idle, (steps, save_id) = self.gather(
                wait_tier=False,
                wait_drain=False,
                agreed=lambda: (self.steps.view(step), uuid.uuid4().hex),
                step=step,
                call="save",
            )
            if not idle and persist:
                # the previous drain still runs on another rank: it is waited for
                self.gather(wait_tier=False, wait_drain=True, call="save, waiting for the drain")
        except Exception as exc:  # (earlier steps' failures, or the checks: this step is not taken)
            exc.add_note(f"step {step} was not saved: this call raised the failure above; save it again")
            raise
        existing = steps.get(step)
        if existing is not None or (self.last is not None and step == self.last):
            where = f"under {self.root}" if existing else "in the local tier"
            raise CheckpointExistsError(
                f"step {step} is already saved ({where}); each step is saved once: "
                "save under another step number"
            )
        newer = sorted(s for s in steps if s > step)
        if self.last is not None and self.last > step:
            newer.append(self.last)
        if newer:
            raise StepOrderError(
                f"step {step} is older than step(s) {sorted(newer)[:10]} already saved (under {self.root} "
                "or in the local tier); steps only move forward: to roll back, restore the earlier "
                "step and delete the newer ones under the root"
            )
        if self.guarded and step <= max(self.guarded):
            raise self._guarded_error(step, sorted(self.guarded))
        self.tier.begin(step, state_dict, save_id)
        self.last = step
        if persist:
            self._start_drain(step)

    def _guarded_error(self, step: int, guarded: list[int]) -> GpuckptError:
        """The error of a save of ``step`` up to tier steps found at open (``guarded``)."""
        where = sorted({w for s in guarded for w in self.guarded[s]})
        shown = f"{guarded[:10]}{' ...' if len(guarded) > 10 else ''}"
        text = (
            f"the local tiers held step(s) {shown} in {', '.join(where)} when this manager opened, and "
            f"no restore of it has taken them or passed them by since: they may be another job's "
            f"(saved by another number of ranks, or from a state of another layout), and saving "
            f"step {step} would write over them or behind them. Restore them with the job layout "
            "that saved them (mgr.restore), or delete them (those step_* folders) to start a new line"
        )
        if step in self.guarded:
            return CheckpointExistsError(text)
        return StepOrderError(text)

    def gather(
        self,
        *,
        wait_tier: bool = True,
        wait_drain: bool = True,
        agreed: Callable[[], Any] | None = None,
        step: int | None = None,
        call: str = "wait() or close()",
        asked: tuple[int | None] | None = None,
    ) -> tuple[bool, Any]:
        """Collective: every rank's failed background work (tier steps, drains) raised on every
        rank, once; a drain that ended on every rank joins the root (its retention applied).
        Waits for the tier's work and the drain first where asked. Returns whether no drain
        is running on any rank, and ``agreed()`` as run on rank 0 (see :meth:`StepRoot.agreed`),
        which travels in the same collective (None without it).

        ``call`` names the manager's call that gathers: ranks in different calls (after an
        interrupt or an error that some ranks caught and others did not) are a
        :class:`CoordinatorError` on every rank, before anything else of the report is used.
        Ctrl-C is held from the collective until its reports are acted on (not in the waits
        before it): see :mod:`gpuckpt.runtime.interrupts`. After an interrupt ended a call on
        this rank, the collective waits for the others no longer than the grace (the job's
        coordinator then refuses every later collective: see :mod:`gpuckpt.distributed.mpi`).

        ``asked`` (:meth:`meet`'s): the step this rank's call asks for, compared across the
        ranks; the background work's failures are then left for the next save or wait."""
        with self._noting_interrupts():
            if self.out_of_step is not None:
                raise CoordinatorError(self.out_of_step)
            if wait_tier:
                self.tier.wait_all()
            if wait_drain and self._drain is not None:
                self._drain[1].exception()
            bounded = after_interrupt() if self._interrupted else contextlib.nullcontext()
            with held_interrupts(), bounded:
                gathered = self._gathered(agreed, step, call, asked)
            self._interrupted = False  # (the ranks met in the same call)
            return gathered

    def meet(self, call: str, asked: int | None, agreed: Callable[[], Any] | None = None) -> Any:
        """Collective, the first of a restore or a delete: the ranks meet in ``call``, asking for
        the same step (``asked``; None: the newest), once the tier's work and the drain are
        done; ``agreed()`` as run on rank 0 (see :meth:`gather`). Ranks in different calls are
        a :class:`CoordinatorError` on every rank (the same collective as a save's or a
        close's), different steps a :class:`StepOrderError`, before anything is read or
        deleted. The background work's failures stay for the next save or wait to raise."""
        return self.gather(agreed=agreed, call=call, asked=(asked,))[1]

    def _gathered(
        self,
        agreed: Callable[[], Any] | None,
        step: int | None,
        call: str,
        asked: tuple[int | None] | None,
    ) -> tuple[bool, Any]:
        """:meth:`gather` from its collective on (with ``asked``, :meth:`meet`'s: the steps are
        compared, and the background work's failures are neither taken nor raised)."""
        report = asked is None
        failed: dict[tuple[str, int], BaseException] = {}
        if report:
            failed = {("tier", s): e for s, e in self.tier.settled().items()}
        running = False
        if self._drain is not None:
            drained, fut = self._drain
            if not fut.done():
                running = True
            elif report:
                pending.taken(fut)  # (its failure is reported here)
                exc = fut.exception()
                if exc is not None:
                    failed[("drain", drained)] = exc
        # what failed where: a collective's error names the ranks that failed it
        mine = {k: _failures(e, self.queries.rank) for k, e in failed.items() if k not in self._reported}
        outcome, error = self.steps.run_on_rank0(agreed) if agreed is not None else (None, None)
        reports = self.queries.all_gather((mine, running, outcome, step if asked is None else asked, call))
        calls = disagreement([r[4] for r in reports], str)
        if calls is not None:
            # out of step for good: the next collective would pair with another call's
            self.out_of_step = (
                f"the ranks are in different calls of the manager ({calls}): every rank calls save, "
                "wait, restore, delete and close in the same order; after an interrupt (Ctrl-C) or an error "
                "that some ranks caught and others did not, end the job and start it again"
            )
            raise CoordinatorError(self.out_of_step)
        if asked is not None:
            differ = disagreement([r[3][0] for r in reports])
            if differ is not None:  # (before anything is read or deleted, on every rank)
                raise StepOrderError(
                    f"the ranks asked {call} for different steps ({differ}; None: the newest): every "
                    f"rank passes the same step= in the same call of {call}"
                )
            return not running, None if agreed is None else self.steps.outcome_of_rank0(reports[0][2], error)
        failures: dict[int, str] = {}
        for errs, _, _, _, _ in reports:
            for (kind, s), by_rank in sorted(errs.items()):
                self._reported.add((kind, s))
                what = "writing the local tier" if kind == "tier" else "persisting"
                for rank, message in by_rank.items():
                    failures.setdefault(rank, f"{what} step {s}: {message}")
        idle = not any(r[1] for r in reports)
        if idle and self._drain is not None:
            drained, fut = self._drain
            self._drain = None
            self.tier.pinned.discard(drained)
            ok = fut.exception() is None and fut.result()

            def joined() -> None:
                if ok:  # committed at root: it counts for retention from now on
                    self.steps.committed(drained)
                    self.steps.retire(drained, self.steps.view(None))

            self.steps.agreed(joined)
        if failures:
            if self.queries.world_size == 1 and len(mine) == 1:
                # one process: its own error, typed as a manager without a tier raises it
                ((kind, s),) = mine
                raise _own(
                    failed[(kind, s)],
                    f"{'writing the local tier' if kind == 'tier' else 'persisting'} step {s}",
                )
            raise DistributedError(failures, self.queries.world_size)
        different = None if step is None else different_steps([r[3] for r in reports])
        if different is not None:  # (before anything of the step is taken, on every rank)
            raise different
        return idle, None if agreed is None else self.steps.outcome_of_rank0(reports[0][2], error)

    def wait(self) -> None:
        """Block until the tier's work and the drain in flight are done (errors kept, not raised)."""
        self.tier.wait_all()
        if self._drain is not None:
            self._drain[1].exception()

    def _start_drain(self, step: int) -> None:
        """Persist ``step`` to the root in the background, from the parts in the local tier."""
        tier = self.tier
        tier.pinned.add(step)
        job = tier.job(step)
        path = self.steps.store.child(step_name(step))
        options, coord = self.options, self.saves

        def drain() -> bool:
            if job is not None and job.exception() is not None:
                # the step failed on every rank (a tier step fails in a collective): it was
                # reported as such, and there is nothing to persist
                return False
            error: BaseException | None = None
            state: Any = None
            try:
                state = tier.read_part(step)
            except Exception as exc:  # every rank joins the save's first collective, failed or not
                error = exc
            coord.all_reduce_errors(error)  # (an idle wait where a transport's waits spin)
            api.save_with_options(state, path, options, coord)
            return True

        fut = self._drains.submit(drain)
        pending.keep_until_exit(fut, f"step {step} to the root {path} (its drain from the local tier)")
        self._drain = (step, fut)

    def close(self) -> None:
        """End the tier's and the drain's threads (their work is done or failed by now)."""
        self.tier.close()
        if self._drain is not None:
            pending.taken(self._drain[1])
        self._drains.shutdown(wait=False)

    # restoring ------------------------------------------------------------------------

    def restore(
        self,
        state_dict: STATE_DICT_TYPE,
        step: int | None,
        options: dict[str, Any],
        resolve: Callable[[int], str],
    ) -> tuple[int, RestoreReport]:
        """The newest step complete in the tiers (or ``step``), else the root's (``resolve``
        gives a committed step's name there); returns the step and where its parts came from.
        An interrupt leaves the ranks out of step (its collectives are not held)."""
        # the first collective: every rank in restore, asking for the same step (failures of the
        # background work stay for the next save or wait to raise)
        steps: dict[int, str] = self.meet("restore", step, lambda: self.steps.view(None))
        with self._noting_interrupts(half_done="a restore"):

            def root_latest() -> int | None:
                if step is not None:
                    return step if step in steps else None
                return max(steps, default=None)

            choice, report, skipped = self.tier.restore(state_dict, root_latest, dict(options), only=step)
            if choice.step is not None:  # the line goes on from here: newer tier steps were deleted
                self.last = choice.step
            if report is not None:
                assert choice.step is not None
                self.guarded = {}  # (taken, or deleted as newer)
                return choice.step, report
            unused = _unused_steps(choice.other_layout, choice.step) + _other_jobs(
                choice.other_ranks, choice.step, self.queries.world_size
            )
            if choice.source == "none":
                # steps no job can restore (some rank's part missing everywhere) are passed by
                if step is None:
                    restorable = {*choice.other_layout, *choice.other_ranks, *choice.ambiguous}
                    self.guarded = {s: w for s, w in self.guarded.items() if s in restorable}
                    what = "no step is complete"
                    fix = unused or "; save one first"
                else:
                    what, fix = f"step {step} is neither complete", unused
                raise CheckpointNotFoundError(
                    f"{what} in the local tiers nor committed under {self.root}{fix}"
                )
            assert choice.step is not None
            name = resolve(choice.step)
            options.setdefault("storage_options", self.options.store_options() or None)
            started = time.perf_counter()
            try:
                api.load(state_dict, self.steps.store.child(name), coordinator=self.queries, **options)
            except Exception as exc:  # (nothing of the tiers was deleted)
                # one process: its own error, not one rank's report
                error = _cause(exc) if self.queries.world_size == 1 else exc
                if unused:
                    error.add_note(f"restoring step {choice.step} of the root{unused}")
                if error is exc:
                    raise
                raise error from None
            seconds = time.perf_counter() - started
            # the line goes on from the root's step: the tiers' newer steps are an abandoned line
            self.tier.abandon_newer(choice.step)
            self.guarded = {}
            try:
                nbytes = part_bytes(part_view(state_dict)[0])  # (what the rank's arrays hold)
            except Exception:  # (loaded: only a count the report cannot make)
                nbytes = 0
            loaded = self.queries.all_gather((nbytes, seconds))
            sources = {r: PartSource(r, "root", nbytes=n, seconds=t) for r, (n, t) in enumerate(loaded)}
            return choice.step, RestoreReport(choice.step, "root", None, sources, skipped)

    def local_steps(self) -> list[int]:
        """The steps this rank's node holds in its local tier (not a collective)."""
        return self.tier.steps()
