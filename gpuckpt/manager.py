"""A directory of step checkpoints: periodic saves, retention, restore of the latest.

Layout::

    ROOT/
      step_00000040/      a committed checkpoint (its zarr.json exists)
      step_00000080/
      .step_00000120.gpuckpt-tmp-...   a save in flight or interrupted: ignored

The root may also be an object-store prefix (``s3://bucket/run1``): the
steps are the prefixes under it (``s3://bucket/run1/step_00000040``), each a
checkpoint published by its root document (see
:mod:`gpuckpt.storage.s3.root`).

Step directories are named ``step_<step>`` (zero-padded to 8 digits) and
are ordered by their number, never by name; plain integer names (``42``)
are read too. A step counts only once it is committed, so an interrupted or
failed save is never returned by :meth:`CheckpointManager.latest_step`.
Retention runs only after a newer save's commit has been observed, and it
never deletes the latest committed step nor the step just saved.

The steps form one line: a save of a step older than a committed step is
refused (:class:`~gpuckpt.StepOrderError`), so the step last saved is always
the latest. To continue training from an earlier step (a roll-back), delete
the newer steps with :meth:`CheckpointManager.delete` first.

What a save costs does not grow with the steps kept. Telling a committed
step from a save in flight, a dead save or another program's Zarr store
takes a probe of its root document (on an object store a request: a ranged
GET of its first bytes, which also tells a gpuckpt root document from another
program's ``zarr.json``), and a root may hold thousands of steps
(``max_to_keep=None``, or ``keep_period`` over a long run). A listing cannot
replace the probe: it shows a child's name, never what its root document
says. So the manager probes every child named like a step once, when it
opens the root (in parallel), and remembers what it found; then each save,
retention pass or query lists the root once (one delimited listing on an
object store) and probes only what that listing shows it does not know:

* a name it has not seen (another process's save, or a foreign store that
  appeared since) is probed, identity check included;
* a step it committed, or found committed, is taken as committed while its
  name stays in the listing, without a probe: a checkpoint is published
  once, and a deletion (this manager's or another process's) ends by
  removing the name, so a step deleted behind the manager's back leaves its
  steps at the next listing (on an object store, where a deletion removes
  the root document first and the name last, a step being deleted is still
  listed meanwhile);
* a name found not committed (a save in flight, a dead save a live claim
  protects, a foreign store named like a step) is probed again only where
  the answer can change a decision: from the step being saved up, for the
  step-order check (a save in flight there may have committed since), and
  above the latest committed step, for :meth:`CheckpointManager.latest_step`;
  :meth:`CheckpointManager.all_steps` probes them all again. Retention
  deletes only steps known committed, so a step stays (it is never deleted
  unseen) until a probe finds it committed.

A save therefore costs one listing (on an object store one request per
1,000 children: the listing's pages), a probe of each name the listing shows
for the first time, and a probe of each name found not committed at or above
the new step: none of either in a run going forward, whether 10 or 10,000
steps are kept. A retention pass adds the deletion of what it retires, in
bulk requests. The one pass over every step is at open.

A distributed job has one manager per rank (``coordinator=``). Every rank
calls the same methods in the same order (they are collectives, as a
distributed save is); rank 0 alone lists, probes and deletes, and what it
finds (the committed steps, or its error) reaches every rank in one
broadcast, so every rank sees the same steps, takes the same decisions and
raises the same errors. Each step is one distributed checkpoint (see
:func:`gpuckpt.save`), saved in the background on a duplicate of the
coordinator kept for saves, while the manager's own queries use another:
neither mixes its messages with the caller's use of ``coordinator``.
"""

from __future__ import annotations

import functools
import os
import re
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import gpuckpt.api as api
from gpuckpt.background import SaveFuture, async_save_with_options
from gpuckpt.device.sharded import shard_dtensors
from gpuckpt.distributed.coordinator import Coordinator, SingleProcessCoordinator, describe_error
from gpuckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DistributedError,
    GpuckptError,
    InvalidOptionError,
    StepOrderError,
)
from gpuckpt.format.metadata import STATE_DICT_TYPE
from gpuckpt.options import SaveOptions
from gpuckpt.runtime.runner import run_all
from gpuckpt.runtime.workers import Workers
from gpuckpt.storage.stores import open_root, scheme_of
from gpuckpt.tiers import LocalTier, PartSource, RestoreReport, copy_values_back

__all__ = ["CheckpointManager", "step_of"]

_STEP_RE = re.compile(r"^(?:step_)?([0-9]{1,19})$")
#: the options of gpuckpt.async_save a manager passes on to each save
_SAVE_OPTIONS = frozenset(
    (
        "chunk_bytes",
        "compression",
        "allow_pickle",
        "sync",
        "threads",
        "progress",
        "staging",
        "staging_bytes",
        "portable",
        "storage_options",
    )
)
#: options of gpuckpt.save that a manager cannot take, and why
_REFUSED = {"overwrite": "the manager never overwrites a step"}
#: probes of root documents sent at once (each is a small request on an object store)
_PROBE_THREADS = 16

_T = TypeVar("_T")


def step_of(name: str) -> int | None:
    """The step a directory name stands for (``step_00000042`` or ``42``), else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def _failures(error: BaseException, rank: int) -> dict[int, str]:
    """Rank -> what failed, for an error of background work on ``rank`` (a collective's
    :class:`~gpuckpt.errors.DistributedError` names the ranks where it began)."""
    if isinstance(error, DistributedError):
        return dict(error.failures)
    return {rank: describe_error(error)}


def _check_count(name: str, value: int | None, minimum: int) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} or None, got {value!r}")


class CheckpointManager:
    """Saves a training state every few steps under ``root`` and restores the latest.

    Parameters
    ----------
    root
        Directory holding one sub-directory per saved step (created if needed),
        or an object-store prefix (``s3://bucket/run1``) holding one prefix per
        step; ``storage_options`` (endpoint, credentials) go with it.
    max_to_keep
        Keep at most this many of the newest steps (``None``: keep all).
        Steps kept by ``keep_period`` do not count against it.
    save_interval_steps
        :meth:`save` saves steps that are multiples of this (others need ``force``).
    keep_period
        Keep every step that is a multiple of this for good.
    async_save
        Save in the background (default): :meth:`save` returns once the state
        is snapshotted. At most one save is in flight; the next one waits for it.
    incremental
        Each save is an incremental save (see ``base`` of :func:`gpuckpt.save`)
        against the latest committed step: chunks that did not change since
        are shared with it (hard links), not written again. Every step stays a
        complete checkpoint: retention deletes names, and a chunk shared with a
        kept step lives on in it. The first save records the content hashes
        the next one compares with.
    coordinator
        A distributed job: every rank makes its manager with its own
        :class:`~gpuckpt.distributed.Coordinator` and calls every method in the
        same order (each is a collective). Each step is then one distributed
        checkpoint of every rank's state (``ShardedArray`` boxes, replicated
        arrays, plain values; see :func:`gpuckpt.save`); :meth:`restore` loads
        one step on every rank. The manager makes two duplicates of the
        coordinator (:meth:`~gpuckpt.distributed.Coordinator.duplicate`): one
        for its background saves, one for its queries; ``coordinator`` itself
        stays the caller's. ``root`` must be the same place for every rank (a
        shared file system, or an object store).
    **save_options
        Options of every save, as for :func:`gpuckpt.async_save`:
        ``chunk_bytes``, ``compression``, ``allow_pickle``, ``sync``, ``threads``, ``progress``,
        ``staging``, ``staging_bytes``, ``portable``, ``storage_options``; checked here
        (:class:`~gpuckpt.errors.InvalidOptionError` for a bad value).

    Notes
    -----
    An error of a background save is raised by the next :meth:`save`,
    :meth:`wait` or :meth:`close` (once). Each step is saved once: saving a
    step that already exists raises :class:`~gpuckpt.CheckpointExistsError`.
    A manager is meant for one thread.

    Steps only move forward: saving a step older than a committed one raises
    :class:`~gpuckpt.StepOrderError` before anything is written. Otherwise the
    newer step would stay :meth:`latest_step` (a restarted job would resume
    from the line it rolled back from) and retention, which keeps the newest
    ``max_to_keep`` steps, would delete each step saved after a roll-back
    right after its commit. To roll back, restore the earlier step, delete
    the newer ones, and go on saving::

        mgr.restore(state, step=100)
        for s in [s for s in mgr.all_steps() if s > 100]:
            mgr.delete(s)
        mgr.save(110, state)

    Retention never deletes the step just saved.

    Examples
    --------
    >>> import numpy as np, gpuckpt, tempfile
    >>> state = {"w": np.zeros(3), "step": 0}
    >>> with gpuckpt.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2, save_interval_steps=10) as mgr:
    ...     for step in range(1, 31):
    ...         state["w"] += 1
    ...         state["step"] = step
    ...         _ = mgr.save(step, state)
    ...     mgr.wait()
    ...     print(mgr.all_steps(), mgr.latest_step())
    [20, 30] 30
    >>> mgr.restore_state_dict()["step"]
    30
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        keep_period: int | None = None,
        async_save: bool = True,
        incremental: bool = False,
        coordinator: Coordinator | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        persist_interval_steps: int | None = None,
        replicas: int = 1,
        local_max_to_keep: int = 2,
        node: str | None = None,
        **save_options: Any,
    ) -> None:
        _check_count("max_to_keep", max_to_keep, 1)
        _check_count("save_interval_steps", save_interval_steps, 1)
        _check_count("keep_period", keep_period, 1)
        if not isinstance(incremental, bool):
            raise InvalidOptionError(f"incremental must be True or False, got {incremental!r}")
        unknown = sorted(set(save_options) - _SAVE_OPTIONS)
        if unknown:
            hints = "".join(f"; {k}: {_REFUSED[k]}" for k in unknown if k in _REFUSED)
            raise TypeError(
                f"CheckpointManager got unknown save option(s) {', '.join(unknown)}; "
                f"expected some of {', '.join(sorted(_SAVE_OPTIONS))}{hints}"
            )
        if save_options.get("storage_options") and scheme_of(root) == "file":
            raise TypeError(
                f"CheckpointManager got storage_options for {os.fspath(root)!r}, a local directory; "
                "storage_options are for URL roots (s3://bucket/prefix): drop them"
            )
        if coordinator is not None and not isinstance(coordinator, Coordinator):
            raise TypeError(
                f"coordinator must be a gpuckpt.distributed.Coordinator, got {type(coordinator).__name__}"
            )
        # bad values fail here, not at some later save (which could have taken staging memory)
        self.options = SaveOptions(**save_options)
        self.incremental = incremental
        _check_count("persist_interval_steps", persist_interval_steps, 1)
        if local_dir is not None and incremental:
            raise InvalidOptionError(
                "incremental saves do not go through a local tier: pass one or the other"
            )
        if local_dir is not None and coordinator is None:
            coordinator = SingleProcessCoordinator()
        #: the manager's own channels: queries (this thread) and saves (the writer thread, or
        #: with a local tier the drain thread)
        self._queries = None if coordinator is None else coordinator.duplicate()
        self._saves = None if coordinator is None else coordinator.duplicate()
        self._store = open_root(root, storage_options=self.options.store_options())
        self.root: Any = getattr(self._store, "path", root)
        #: child name -> whether it is committed, for the names of the last listing this manager
        #: probed or committed itself (see the module docstring); rank 0's alone in a distributed job
        self._known: dict[str, bool] = {}
        self._agreed(self._open_root)
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.keep_period = keep_period
        self.async_save = async_save
        self._pending: tuple[int, SaveFuture] | None = None
        self._error: BaseException | None = None
        self._closed = False
        #: what the last restore read, where each rank's part came from
        self.last_restore: RestoreReport | None = None
        self._tier: LocalTier | None = None
        if local_dir is not None:
            assert coordinator is not None and self._queries is not None
            self._tier = LocalTier(
                local_dir,
                queries=self._queries,
                background=coordinator.duplicate(),
                node=node,
                replicas=replicas,
                keep=local_max_to_keep,
                options=self.options,
            )
        self.persist_interval_steps = persist_interval_steps
        self._drains = Workers(1, "gpuckpt-drain", nice=19)
        self._drain: tuple[int, Any] | None = None
        #: background work whose failure every rank has raised already: ("tier" | "drain", step)
        self._reported: set[tuple[str, int]] = set()
        self._tier_last: int | None = None

    # the steps in the store --------------------------------------------------

    @property
    def coordinator(self) -> Coordinator | None:
        """The duplicate of the job's coordinator the manager's queries use (None: one process)."""
        return self._queries

    def _agreed(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` run on rank 0 alone, its result on every rank (in one process: ``fn()``).

        An error there is raised on every rank as one :class:`~gpuckpt.errors.DistributedError`
        naming it (its cause, on rank 0, the error itself): every rank then raises, or none does."""
        c = self._queries
        if c is None:
            return fn()
        outcome, error = self._run_on_rank0(fn)
        outcome = c.broadcast(outcome if c.rank == 0 else None)
        value: _T = self._outcome_of_rank0(outcome, error)
        return value

    def _run_on_rank0(self, fn: Callable[[], _T]) -> tuple[tuple[bool, Any] | None, Exception | None]:
        """On rank 0, ``fn()``'s outcome as sent to every rank, ``(True, value)`` or ``(False,
        what failed)``, and the error itself; elsewhere ``(None, None)``."""
        assert self._queries is not None
        if self._queries.rank != 0:
            return None, None
        try:
            return (True, fn()), None
        except Exception as exc:
            return (False, describe_error(exc)), exc

    def _outcome_of_rank0(self, outcome: tuple[bool, Any], error: Exception | None) -> Any:
        """The value of rank 0's outcome, or its failure raised (on every rank alike)."""
        assert self._queries is not None
        ok, value = outcome
        if not ok:
            raise DistributedError({0: value}, self._queries.world_size) from error
        return value

    def _open_root(self) -> None:
        """Probe every child named like a step once (in parallel), then clean what dead saves and
        interrupted deletions left among the children that are not committed (only claims whose
        holder is gone). What was found committed is remembered: cleanup never touches a
        committed checkpoint; the rest is probed again at the first listing (cleanup may have
        removed it, or put a set-aside copy back)."""
        names = self._store.children()
        found = self._probe([n for n in names if step_of(n) is not None])
        self._store.cleanup([n for n in names if not found.get(n, False)])
        self._known = {n: True for n, committed in found.items() if committed}

    def _probe(self, names: Sequence[str]) -> dict[str, bool]:
        """Whether each of ``names`` is committed: one probe each, in parallel."""
        jobs = [functools.partial(self._store.is_committed, n) for n in names]
        found = run_all(jobs, threads=_PROBE_THREADS, name="gpuckpt-probe")
        return dict(zip(names, found, strict=True))

    def _candidates(self) -> dict[int, str]:
        """Step -> name of every entry named like a step (committed or not), the first name
        in sorted order where two names stand for one step: one listing of the root."""
        found: dict[int, str] = {}
        for name in self._store.children():
            step = step_of(name)
            if step is not None and step not in found:
                found[step] = name
        return found

    def _view(self, recheck_from: int | None) -> dict[int, str]:
        """Step -> name of every committed step: one listing, and probes of what it does not know.

        Names not seen before are probed; names found not committed before are probed again
        when their step is ``recheck_from`` or later (None: later than the latest committed
        step); a name known committed is not probed (see the module docstring). Names gone
        from the listing are forgotten.
        """
        candidates = self._candidates()
        listed = set(candidates.values())
        self._known = {n: c for n, c in self._known.items() if n in listed}
        if recheck_from is None:
            recheck_from = 1 + max((s for s, n in candidates.items() if self._known.get(n)), default=-1)
        todo = [
            n
            for s, n in sorted(candidates.items())
            if n not in self._known or (not self._known[n] and s >= recheck_from)
        ]
        self._known.update(self._probe(todo))
        return {s: n for s, n in candidates.items() if self._known[n]}

    def _steps(self, recheck_from: int | None, *, block: bool, raise_error: bool = False) -> dict[int, str]:
        """:meth:`_view`, after taking note of the save in flight once it has ended (waiting for
        it when ``block``) and applying retention on that same listing. With ``raise_error``,
        the error of a failed background save is raised before the root is listed."""
        saved = self._collect(block=block)
        if raise_error:
            self._raise_error()

        def listed() -> dict[int, str]:
            steps = self._view(recheck_from)
            if saved is not None:
                self._apply_retention(saved, steps)
            return steps

        return self._agreed(listed)

    def step_path(self, step: int) -> Any:
        """Where ``step`` is (a directory, or a URL for an object store): the existing one,
        else where a save would put it."""
        return self._store.child(self._agreed(lambda: self._view(step)).get(step, f"step_{step:08d}"))

    def all_steps(self) -> list[int]:
        """Committed steps, in increasing order."""
        return sorted(self._steps(0, block=False))

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none."""
        steps = self._steps(None, block=False)
        return max(steps) if steps else None

    # saving ------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would save ``step`` without ``force``."""
        return step % self.save_interval_steps == 0

    def save(self, step: int, state_dict: STATE_DICT_TYPE, force: bool = False) -> bool:
        """Save ``state_dict`` as ``step`` if the interval says so (or ``force``); True if saved.

        In async mode this returns once the state is snapshotted (the caller
        may change its arrays right away), after waiting for the previous
        save. Raises the error of a failed earlier background save, if any,
        before saving anything.
        """
        if self._closed:
            raise GpuckptError(f"CheckpointManager for {self.root} is closed; create a new one to save")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if not force and not self.should_save(step):
            return False
        state_dict = shard_dtensors(state_dict)  # a DCP state dict: its DTensors' local shards
        if self._tier is not None:
            self._save_tiered(step, state_dict)
            return True
        # one listing serves the retention of the save that just ended and this save's checks
        steps = self._steps(step, block=True, raise_error=True)
        existing = steps.get(step)
        if existing is not None:
            raise CheckpointExistsError(
                f"step {step} is already saved at {self._store.child(existing)}; each step is saved once: "
                "save under another step number or delete that directory first"
            )
        newer = sorted(s for s in steps if s > step)
        if newer:
            shown = f"{newer[:10]}{' ...' if len(newer) > 10 else ''}"
            raise StepOrderError(
                f"step {step} is older than the committed step(s) {shown} under {self.root}; "
                f"saved, it would not be the latest: latest_step() and restore() would still give "
                f"step {newer[-1]}, and retention would count the newer steps and delete the new ones. "
                "To continue from an earlier step (a roll-back), delete the newer steps first "
                "(for s in [s for s in mgr.all_steps() if s > "
                f"{step}]: mgr.delete(s)), or save the new line under another root"
            )
        name = f"step_{step:08d}"
        path = self._store.child(name)
        options = self.options
        if self.incremental:
            # the latest committed step: retention never deletes it while this save runs
            # (retention runs only after a save's commit, and the next save waits for it)
            latest = self._store.child(steps[max(steps)]) if steps else None
            options = options.replace(content_hash=True, base=None if latest is None else os.fspath(latest))
        if self.async_save:
            self._pending = (step, async_save_with_options(state_dict, path, options, self._saves))
        else:
            api.save_with_options(state_dict, path, options, self._saves)
            self._known[name] = True
            # retention on the listing made before the save: a step that appeared meanwhile is
            # not counted (it is kept), one deleted meanwhile is deleted again (nothing happens)
            steps[step] = name
            self._agreed(lambda: self._apply_retention(step, steps))
        return True

    # the local tier ----------------------------------------------------------------------

    def _save_tiered(self, step: int, state_dict: STATE_DICT_TYPE) -> None:
        """A save through the local tier: one report of every rank's background work, the step
        checks on the agreed view, the part's snapshot; the drain of a persist step."""
        tier = self._tier
        assert tier is not None and self._queries is not None
        if self._tier_last is not None:
            # one step in flight, as for saves to the root: its snapshot memory is reused, and
            # its outcome is known on every rank before the next one starts
            tier.wait_for(self._tier_last)
        persist = step % (self.persist_interval_steps or 1) == 0
        # the save blocks for one collective: every rank's report of its background work, with
        # rank 0's view of the root and the save's id (the view may hold old steps that the
        # retention of a drain joined here deletes: the checks below look at this step and
        # newer ones only)
        idle, (steps, save_id) = self._gather_background(
            wait_tier=False, wait_drain=False, agreed=lambda: (self._view(step), uuid.uuid4().hex)
        )
        if not idle and persist:
            # the previous drain still runs somewhere: a persist step waits for it (the root
            # keeps up with the persist steps, or the saves slow down; none is skipped)
            self._gather_background(wait_tier=False, wait_drain=True)
        existing = steps.get(step)
        if existing is not None or (self._tier_last is not None and step == self._tier_last):
            where = f"under {self.root}" if existing else "in the local tier"
            raise CheckpointExistsError(
                f"step {step} is already saved ({where}); each step is saved once: "
                "save under another step number"
            )
        newer = sorted(s for s in steps if s > step)
        if self._tier_last is not None and self._tier_last > step:
            newer.append(self._tier_last)
        if newer:
            raise StepOrderError(
                f"step {step} is older than step(s) {sorted(newer)[:10]} already saved (under {self.root} "
                "or in the local tier); steps only move forward: to roll back, restore the earlier "
                "step and delete the newer ones under the root"
            )
        tier.begin(step, state_dict, save_id)
        self._tier_last = step
        if persist:
            self._start_drain(step)

    def _gather_background(
        self, *, wait_tier: bool = True, wait_drain: bool = True, agreed: Callable[[], Any] | None = None
    ) -> tuple[bool, Any]:
        """Collective: every rank's failed background work (tier steps, drains) raised on every
        rank, once; a drain that ended on every rank joins the root (its retention applied).
        Waits for the tier's work and the drain first where asked. Returns whether no drain
        is running on any rank, and ``agreed()`` as run on rank 0 (see :meth:`_agreed`), which
        travels in the same collective (None without it)."""
        tier = self._tier
        assert tier is not None and self._queries is not None
        if wait_tier:
            tier.wait_all()
        if wait_drain and self._drain is not None:
            self._drain[1].exception()
        failed: dict[tuple[str, int], BaseException] = {("tier", s): e for s, e in tier.settled().items()}
        running = False
        if self._drain is not None:
            step, fut = self._drain
            if fut.done():
                exc = fut.exception()
                if exc is not None:
                    failed[("drain", step)] = exc
            else:
                running = True
        # what failed where: a collective's error names the ranks that failed it
        mine = {k: _failures(e, self._queries.rank) for k, e in failed.items() if k not in self._reported}
        outcome, error = self._run_on_rank0(agreed) if agreed is not None else (None, None)
        reports = self._queries.all_gather((mine, running, outcome))
        failures: dict[int, str] = {}
        for errs, _, _ in reports:
            for (kind, s), by_rank in sorted(errs.items()):
                self._reported.add((kind, s))
                what = "writing the local tier" if kind == "tier" else "persisting"
                for rank, message in by_rank.items():
                    failures.setdefault(rank, f"{what} step {s}: {message}")
        idle = not any(r[1] for r in reports)
        if idle and self._drain is not None:
            step, fut = self._drain
            self._drain = None
            tier.pinned.discard(step)
            ok = fut.exception() is None and fut.result()

            def joined() -> None:
                if ok:  # committed at root: it counts for retention from now on
                    self._known[f"step_{step:08d}"] = True
                    self._apply_retention(step, self._view(None))

            self._agreed(joined)
        if failures:
            raise DistributedError(failures, self._queries.world_size)
        return idle, None if agreed is None else self._outcome_of_rank0(reports[0][2], error)

    def _wait_background(self) -> None:
        """Block until the tier's work and the drain in flight are done (errors kept, not raised)."""
        assert self._tier is not None
        self._tier.wait_all()
        if self._drain is not None:
            self._drain[1].exception()

    def _start_drain(self, step: int) -> None:
        """Persist ``step`` to the root in the background, from the parts in the local tier."""
        tier = self._tier
        assert tier is not None and self._saves is not None
        tier.pinned.add(step)
        job = tier.job(step)
        path = self._store.child(f"step_{step:08d}")
        options, coord = self.options, self._saves

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
            coord.idle_barrier()
            coord.all_reduce_errors(error)
            api.save_with_options(state, path, options, coord)
            return True

        self._drain = (step, self._drains.submit(drain))

    def local_steps(self) -> list[int]:
        """The steps this rank's node holds in its local tier (own parts or replicas; not a
        collective, so not an agreed view)."""
        return [] if self._tier is None else self._tier.steps()

    def _collect(self, *, block: bool) -> int | None:
        """Take note of the save in flight once it has ended (waiting for it when ``block``): the
        step it committed, or None (none ended; a failure is kept for the next save, wait or close)."""
        if self._pending is None or not (block or self._pending[1].done()):
            return None
        step, fut = self._pending
        self._pending = None
        err = fut.exception()  # blocks until done
        if err is not None:
            self._error = err
            return None
        self._known[f"step_{step:08d}"] = True
        return step

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _settle(self) -> None:
        """Wait for the save in flight, apply retention (listing the root only then), raise a
        stored error."""
        if self._tier is not None:
            self._gather_background()
            return
        saved = self._collect(block=True)
        if self.max_to_keep is not None:  # a collective in a distributed job: whatever this rank saw

            def retire() -> None:
                if saved is not None:
                    self._apply_retention(saved, self._view(None))

            self._agreed(retire)
        self._raise_error()

    def wait(self) -> None:
        """Block until the save in flight is committed; raises its error if it failed."""
        self._settle()

    def close(self) -> None:
        """Wait for the save in flight (raising its error) and refuse further saves."""
        if self._closed:
            return
        self._closed = True
        try:
            self._settle()
        finally:
            self._stop_threads()

    def _stop_threads(self) -> None:
        """End the tier's and the drain's threads (their work is done or failed by now)."""
        if self._tier is not None:
            self._tier.close()
            self._drains.shutdown(wait=False)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            if self._queries is None:
                self.close()
            else:
                # the other ranks may not be leaving: no collective, only this rank's save waited for
                self._closed = True
                self._collect(block=True)
                if self._tier is not None:
                    self._wait_background()
                    self._stop_threads()
                self._raise_error()
        except Exception as err:  # do not mask the exception that ends the block
            exc.add_note(f"also, a background checkpoint save failed: {err}")

    # retention ---------------------------------------------------------------

    def _apply_retention(self, saved: int, steps: dict[int, str]) -> None:
        """Keep the newest ``max_to_keep`` steps (and ``keep_period`` ones) after ``saved`` committed.

        ``steps`` are the committed steps of a listing made after that commit
        (:meth:`_view`); the deleted ones are taken out of it. ``saved`` itself
        is never deleted, whatever else the directory holds (a newer step
        written behind the manager's back, for one).
        """
        if self.max_to_keep is None or len(steps) <= self.max_to_keep:
            return
        doomed = [
            (step, name)
            for step, name in sorted(steps.items())[: -self.max_to_keep]
            if step != saved and not (self.keep_period is not None and step % self.keep_period == 0)
        ]
        for step, name in doomed:
            # forgotten first: a deletion that fails halfway leaves names to probe again
            del steps[step]
            self._known.pop(name, None)
        self._store.delete([name for _, name in doomed])  # together: batched requests on an object store

    def delete(self, step: int) -> None:
        """Delete the committed checkpoint of ``step``, e.g. the steps after one rolled back to.

        A save in flight is waited for first (its error, if any, is raised by
        the next :meth:`save` or :meth:`wait`). The step disappears at once
        (one rename, made durable; on an object store, the deletion of its root
        document) before its other files are removed.

        Raises
        ------
        CheckpointNotFoundError
            When ``step`` has no committed checkpoint.
        """
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {step!r}")
        step, name = self._resolve(step)

        def delete() -> None:
            self._known.pop(name, None)
            self._store.delete([name])

        self._agreed(delete)

    # restoring ---------------------------------------------------------------

    def _resolve(self, step: int | None) -> tuple[int, str]:
        """``step`` (None: the latest) and its name, of a committed step."""
        steps = self._steps(step, block=True)
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}; save one first")
        if step is None:
            step = max(steps)
        elif step not in steps:
            shown = sorted(steps)
            raise CheckpointNotFoundError(
                f"step {step} has no committed checkpoint under {self.root}; "
                f"available steps: {shown[:20]}{' ...' if len(shown) > 20 else ''}"
            )
        return step, steps[step]

    def restore(self, state_dict: STATE_DICT_TYPE, step: int | None = None, **options: Any) -> int:
        """Load ``step`` (default: the latest) into ``state_dict`` in place; returns the step.

        ``options`` go to :func:`gpuckpt.load` (``strict``, ``allow_pickle``,
        ``threads``, ``progress``). A save in flight is waited for first.
        Restoring an earlier step changes nothing on disk; to go on saving
        from it, delete the newer steps (:meth:`delete`): a save of a step
        older than a committed one is refused (see the class notes).
        """
        view = shard_dtensors(state_dict)  # DTensors are filled in place through views of their shards
        if self._tier is not None:
            step = self._restore_tiered(view, step, options)
        else:
            step, name = self._resolve(step)
            options.setdefault("storage_options", self.options.store_options() or None)
            api.load(view, self._store.child(name), coordinator=self._queries, **options)
        if view is not state_dict:
            copy_values_back(state_dict, view)
        return step

    def _restore_tiered(self, state_dict: STATE_DICT_TYPE, step: int | None, options: dict[str, Any]) -> int:
        """The newest step complete in the tiers (or ``step``), else the root's (see LocalTier)."""
        tier = self._tier
        assert tier is not None and self._queries is not None
        self._wait_background()  # failures stay for the next save or wait to raise

        def root_latest() -> int | None:
            steps = self._agreed(lambda: self._view(None))
            if step is not None:
                return step if step in steps else None
            return max(steps, default=None)

        choice, report = tier.restore(state_dict, root_latest, dict(options), only=step)
        if choice.step is not None:  # the line goes on from here: newer tier steps were deleted
            self._tier_last = choice.step
        if report is not None:
            self.last_restore = report
            assert choice.step is not None
            return choice.step
        if choice.source == "none":
            where = f"step {step}" if step is not None else "any step"
            raise CheckpointNotFoundError(
                f"{where}: no step is complete in the local tiers nor committed under {self.root}"
            )
        assert choice.step is not None
        _, name = self._resolve(choice.step)
        options.setdefault("storage_options", self.options.store_options() or None)
        api.load(state_dict, self._store.child(name), coordinator=self._queries, **options)
        world = self._queries.world_size
        self.last_restore = RestoreReport(
            choice.step, "root", None, {r: PartSource(r, "root") for r in range(world)}, ()
        )
        return choice.step

    def restore_state_dict(self, step: int | None = None, **options: Any) -> dict[str, Any]:
        """Load ``step`` (default: the latest) into a new dict (see :func:`gpuckpt.load_state_dict`)."""
        _step, name = self._resolve(step)
        options.setdefault("storage_options", self.options.store_options() or None)
        if self._queries is None:
            return api.load_state_dict(self._store.child(name), **options)
        error, loaded = None, {}
        try:  # every rank reads the whole step
            loaded = api.load_state_dict(self._store.child(name), **options)
        except Exception as exc:
            error = exc
        self._queries.all_reduce_errors(error)
        return loaded

    def __repr__(self) -> str:
        pending = f", step {self._pending[0]} in flight" if self._pending else ""
        return f"<CheckpointManager {self.root}{pending}>"
