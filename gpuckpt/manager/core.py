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

The steps form one line: a save of a step older than a committed step is
refused (:class:`~gpuckpt.StepOrderError`), so the step last saved is always
the latest. To continue training from an earlier step (a roll-back), delete
the newer steps with :meth:`CheckpointManager.delete` first.

Which steps are committed, and what retention deletes, is :mod:`gpuckpt.manager.steps`'s:
one listing per save, probes only of what it does not know, whatever the steps kept.
Saves through a local tier are :mod:`gpuckpt.manager.tiered`'s.

A distributed job has one manager per rank (``coordinator=``). Every rank
calls the same methods in the same order (they are collectives, as a
distributed save is; :meth:`~CheckpointManager.all_steps` and
:meth:`~CheckpointManager.latest_step` aside, which each rank answers from its
own listing); rank 0 alone lists, probes and deletes, and what it
finds (the committed steps, or its error) reaches every rank in one
broadcast, so every rank sees the same steps, takes the same decisions and
raises the same errors. Each step is one distributed checkpoint (see
:func:`gpuckpt.save`), saved in the background on a duplicate of the
coordinator kept for saves, while the manager's own queries use another:
neither mixes its messages with the caller's use of ``coordinator``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import gpuckpt.api as api
from gpuckpt.background import SaveFuture, async_save_with_options
from gpuckpt.device.sharded import shard_dtensors
from gpuckpt.distributed.coordinator import (
    Coordinator,
    SingleProcessCoordinator,
    check_coordinator,
    describe_error,
    disagreement,
)
from gpuckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DistributedError,
    GpuckptError,
    InvalidOptionError,
    StepOrderError,
)
from gpuckpt.format.metadata import STATE_DICT_TYPE
from gpuckpt.manager.steps import StepRoot, check_step, step_name
from gpuckpt.manager.tiered import TieredSaves
from gpuckpt.options import SaveOptions
from gpuckpt.storage.stores import open_root, refuse_inside_a_checkpoint, scheme_of
from gpuckpt.tiers import LocalTier, RestoreReport, copy_values_back

__all__ = ["CheckpointManager"]

_T = TypeVar("_T")

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


def _check_count(name: str, value: int | None, minimum: int, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        also = " or None" if optional else ""
        raise InvalidOptionError(f"{name} must be an integer >= {minimum}{also}, got {value!r}")


def _agree_arguments(coordinator: Coordinator, refused: Exception | None, settings: dict[str, Any]) -> None:
    """Collective, on the job's coordinator: a rank that refused its arguments raises its own
    error (the caller does), every other rank a :class:`DistributedError` naming the ranks that
    refused theirs; settings that differ between ranks are refused on every rank."""
    gathered = coordinator.all_gather(
        (None if refused is None else describe_error(refused), {k: repr(v) for k, v in settings.items()})
    )
    failures = {r: g[0] for r, g in enumerate(gathered) if g[0] is not None}
    if failures:
        if refused is None:
            raise DistributedError(failures, coordinator.world_size)
        return
    names = sorted({k for _, s in gathered for k in s})
    differ = [
        f"{name}: {found}"
        for name in names
        if (found := disagreement([s.get(name, "(not given)") for _, s in gathered], str)) is not None
    ]
    if differ:
        raise InvalidOptionError(
            f"the ranks passed CheckpointManager different settings ({'; '.join(differ)}); every rank "
            "must pass the same (node= aside)"
        )


def _root_name(root: Any) -> str:
    """The canonical name of a root: its resolved absolute path, or its URL (``s3://...``)
    without a trailing slash. The ranks of a job compare it, and a local tier records it."""
    if scheme_of(root) == "file":
        return os.fspath(Path(os.fspath(root)).resolve())
    return str(os.fspath(root)).rstrip("/")


def _check_apart(root: Any, local_dir: str | os.PathLike[str]) -> None:
    """Refuse a local tier that is the root, inside it or around it (a directory of each's own:
    each would list the other's entries as its own)."""
    if scheme_of(root) != "file":
        return
    r, t = Path(os.fspath(root)).resolve(), Path(local_dir).resolve()
    if r == t or r in t.parents or t in r.parents:
        raise InvalidOptionError(
            f"local_dir {t} and the root {r} overlap: give the local tier a directory of its own, "
            "outside the root (a node-local tmpfs such as /dev/shm/RUN, or local NVMe)"
        )


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
        shared file system, or an object store): the ranks compare its
        canonical name (resolved absolute path, or URL), and a difference is an
        :class:`~gpuckpt.errors.InvalidOptionError` on every rank.
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
        check_coordinator(coordinator)
        # what one rank refuses is raised on every rank, and every rank must pass the same
        # settings: a rank that raised alone, or one that replicated or persisted other steps,
        # would leave the others waiting in a collective
        refused: Exception | None = None
        try:
            _check_count("max_to_keep", max_to_keep, 1)
            _check_count("save_interval_steps", save_interval_steps, 1, optional=False)
            _check_count("keep_period", keep_period, 1)
            if not isinstance(async_save, bool):
                raise InvalidOptionError(f"async_save must be True or False, got {async_save!r}")
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
            # bad values fail here, not at some later save (which could have taken staging memory)
            self.options = SaveOptions(**save_options)
            self.incremental = incremental
            _check_count("persist_interval_steps", persist_interval_steps, 1)
            if local_dir is not None and not isinstance(local_dir, (str, os.PathLike)):
                raise TypeError(
                    "local_dir must be a directory path (str or os.PathLike) or None, "
                    f"got {type(local_dir).__name__}"
                )
            if local_dir is not None and incremental:
                raise InvalidOptionError(
                    "incremental saves do not go through a local tier: pass one or the other"
                )
            if local_dir is None:
                given = [
                    name
                    for name, value, default in (
                        ("persist_interval_steps", persist_interval_steps, None),
                        ("replicas", replicas, 1),
                        ("local_max_to_keep", local_max_to_keep, 2),
                        ("node", node, None),
                    )
                    if value != default
                ]
                if given:
                    raise InvalidOptionError(
                        f"{', '.join(given)} configure(s) the local tier, and there is none: pass "
                        "local_dir= too (or drop them: without a tier every saved step goes to the root)"
                    )
            else:
                LocalTier.check_arguments(local_dir, replicas, local_max_to_keep, node)
                if coordinator is None:  # (a job's ranks raise what any of them finds, together)
                    problem = LocalTier.path_problem(local_dir)
                    if problem is not None:
                        raise InvalidOptionError(problem)
                _check_apart(root, local_dir)
                refuse_inside_a_checkpoint(local_dir)
            refuse_inside_a_checkpoint(root)  # (its steps would go with that checkpoint)
            root_name = _root_name(root)
        except Exception as exc:
            refused = exc
            root_name = None
        if coordinator is not None and coordinator.world_size > 1:
            settings = {
                "max_to_keep": max_to_keep,
                "save_interval_steps": save_interval_steps,
                "keep_period": keep_period,
                "async_save": async_save,
                "incremental": incremental,
                "local_dir given": local_dir is not None,
                "persist_interval_steps": persist_interval_steps,
                "replicas": replicas,
                "local_max_to_keep": local_max_to_keep,
                **{k: v for k, v in save_options.items() if k != "storage_options"},
                # one root for the job: a rank of another root would restore another run's
                # step beside the others', and write its part of each step elsewhere
                "root": root_name,
            }
            _agree_arguments(coordinator, refused, settings)
        if refused is not None:
            raise refused
        if local_dir is not None and coordinator is None:
            coordinator = SingleProcessCoordinator()
        #: the manager's own channels: queries (this thread) and saves (the writer thread, or
        #: with a local tier the drain thread)
        self._queries = None if coordinator is None else coordinator.duplicate()
        self._saves = None if coordinator is None else coordinator.duplicate()
        self._store = open_root(root, storage_options=self.options.store_options())
        self.root: Any = getattr(self._store, "path", root)
        self._steps_root = StepRoot(
            self._store, self._queries, max_to_keep=max_to_keep, keep_period=keep_period
        )
        self._agreed(self._steps_root.open)
        self.save_interval_steps = save_interval_steps
        self.async_save = async_save
        self._pending: tuple[int, SaveFuture] | None = None
        self._error: BaseException | None = None
        self._closed = False
        #: what the last restore read, where each rank's part came from
        self.last_restore: RestoreReport | None = None
        self.persist_interval_steps = persist_interval_steps
        self._tiered: TieredSaves | None = None
        if local_dir is not None:
            assert coordinator is not None and self._queries is not None and self._saves is not None
            tier = LocalTier(
                local_dir,
                queries=self._queries,
                background=coordinator.duplicate(),
                node=node,
                replicas=replicas,
                keep=local_max_to_keep,
                options=self.options,
                # the root's canonical name: a tier holds one root's steps (never read for it)
                root=_root_name(self.root),
            )
            self._tiered = TieredSaves(
                self._steps_root,
                tier,
                saves=self._saves,
                options=self.options,
                persist_interval_steps=persist_interval_steps,
                root=self.root,
            )

    # the steps in the store --------------------------------------------------

    @property
    def max_to_keep(self) -> int | None:
        """Retention keeps at most this many of the newest steps (None: all); may be changed."""
        return self._steps_root.max_to_keep

    @max_to_keep.setter
    def max_to_keep(self, value: int | None) -> None:
        _check_count("max_to_keep", value, 1)
        self._steps_root.max_to_keep = value

    @property
    def keep_period(self) -> int | None:
        """Retention keeps every step that is a multiple of this for good (None: none)."""
        return self._steps_root.keep_period

    @keep_period.setter
    def keep_period(self, value: int | None) -> None:
        _check_count("keep_period", value, 1)
        self._steps_root.keep_period = value

    @property
    def coordinator(self) -> Coordinator | None:
        """The duplicate of the job's coordinator the manager's queries use (None: one process)."""
        return self._queries

    def _agreed(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` on rank 0 alone, its result (or its failure) on every rank: see
        :meth:`StepRoot.agreed <gpuckpt.manager.steps.StepRoot.agreed>`."""
        return self._steps_root.agreed(fn)

    def _view(self, recheck_from: int | None) -> dict[int, str]:
        return self._steps_root.view(recheck_from)

    def _steps(
        self, recheck_from: int | None, *, block: bool, raise_error: bool = False, saving: int | None = None
    ) -> dict[int, str]:
        """:meth:`_view`, after taking note of the save in flight once it has ended (waiting for
        it when ``block``) and applying retention on that same listing. With ``raise_error``,
        the error of a failed background save is raised before the root is listed. ``saving``:
        the step this call saves, the same on every rank (see :meth:`StepRoot.agreed`)."""
        saved = self._collect(block=block)
        if raise_error:
            try:
                self._raise_error()
            except GpuckptError as exc:  # (an earlier save's failure, raised by this call)
                if saving is not None:
                    exc.add_note(
                        f"step {saving} was not saved: this call raised the failure above; save it again"
                    )
                raise

        def listed() -> dict[int, str]:
            steps = self._view(recheck_from)
            if saved is not None:
                self._steps_root.retire(saved, steps)
            return steps

        return self._steps_root.agreed(listed, step=saving)

    def step_path(self, step: int) -> Any:
        """Where ``step`` is (a directory, or a URL for an object store): the existing one,
        else where a save would put it."""
        check_step(step)
        return self._store.child(self._agreed(lambda: self._view(step)).get(step, step_name(step)))

    def all_steps(self) -> list[int]:
        """Committed steps, in increasing order.

        In a distributed job this is no collective: each rank lists the root itself, so one
        rank alone may ask (for logging, say). While a save, a drain or retention runs, ranks
        may see different steps; :meth:`restore` and :meth:`save` decide on rank 0's view."""
        return sorted(self._listed(0))

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none (no collective: see
        :meth:`all_steps`)."""
        steps = self._listed(None)
        return max(steps) if steps else None

    def _listed(self, recheck_from: int | None) -> dict[int, str]:
        """:meth:`_steps` in one process; in a distributed job this rank's own listing of the
        root (the save in flight is taken note of by the next collective call)."""
        if self._queries is None:
            return self._steps(recheck_from, block=False)
        return StepRoot(self._store, None, max_to_keep=None, keep_period=None).view(recheck_from)

    # saving ------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would save ``step`` without ``force``."""
        check_step(step)
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
        check_step(step)
        if not force and not self.should_save(step):
            return False
        state_dict = shard_dtensors(state_dict)  # a DCP state dict: its DTensors' local shards
        if self._tiered is not None:
            self._tiered.save(step, state_dict)
            return True
        # one listing serves the retention of the save that just ended and this save's checks
        steps = self._steps(step, block=True, raise_error=True, saving=step)
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
        name = step_name(step)
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
            self._steps_root.committed(step)
            # retention on the listing made before the save: a step that appeared meanwhile is
            # not counted (it is kept), one deleted meanwhile is deleted again (nothing happens)
            steps[step] = name
            self._agreed(lambda: self._steps_root.retire(step, steps))
        return True

    def local_steps(self) -> list[int]:
        """The steps this rank's node holds in its local tier (own parts or replicas; not a
        collective, so not an agreed view)."""
        return [] if self._tiered is None else self._tiered.local_steps()

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
        self._steps_root.committed(step)
        return step

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _settle(self) -> None:
        """Wait for the save in flight, apply retention (listing the root only then), raise a
        stored error."""
        if self._tiered is not None:
            self._tiered.gather()
            return
        saved = self._collect(block=True)
        if self.max_to_keep is not None:  # a collective in a distributed job: whatever this rank saw

            def retire() -> None:
                if saved is not None:
                    self._steps_root.retire(saved, self._view(None))

            self._agreed(retire)
        self._raise_error()

    def wait(self) -> None:
        """Block until the save in flight is committed; raises its error if it failed."""
        self._settle()

    def close(self) -> None:
        """Wait for the save in flight (raising its error) and refuse further saves.

        Called while an interrupt (Ctrl-C, ``SystemExit``) is being handled, in a distributed
        job, or once the ranks were found out of step (in different calls of the manager, or a
        collective left unfinished at an interrupt): the ranks may be in other calls by then, so
        this rank takes part in no collective (as when a ``with`` block ends in an exception):
        it waits for its own background work only, and raises its error."""
        if self._closed:
            return
        handled = sys.exc_info()[1]
        interrupted = handled is not None and not isinstance(handled, Exception)
        if self._queries is not None and (interrupted or self._out_of_step()):
            self._close_alone()
            return
        self._closed = True
        try:
            self._settle()
        finally:
            self._stop_threads()

    def _out_of_step(self) -> bool:
        """Whether the ranks can no longer meet in a collective: found in different calls of
        the manager, or this rank's coordinator left a collective unfinished at an interrupt."""
        tiered_off = self._tiered is not None and self._tiered.out_of_step is not None
        return tiered_off or (self._queries is not None and self._queries.out_of_step is not None)

    def _close_alone(self) -> None:
        """Close without a collective: the other ranks may not be closing (see :meth:`close`)."""
        self._closed = True
        self._collect(block=True)
        if self._tiered is not None:
            self._tiered.wait()
            self._stop_threads()
        self._raise_error()

    def _stop_threads(self) -> None:
        """End the tier's and the drain's threads (their work is done or failed by now)."""
        if self._tiered is not None:
            self._tiered.close()

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
            else:  # the other ranks may not be leaving: no collective, only this rank's save waited for
                self._close_alone()
        except Exception as err:  # do not mask the exception that ends the block
            exc.add_note(f"also, a background checkpoint save failed: {err}")

    # deleting ---------------------------------------------------------------

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
        check_step(step)
        if self._tiered is not None:  # (ranks in another call raise CoordinatorError, not hang)
            self._tiered.meet("delete", step)
        _step, name = self._resolve(step)
        self._agreed(lambda: self._steps_root.delete(name))

    # restoring ---------------------------------------------------------------

    def _resolve(self, step: int | None) -> tuple[int, str]:
        """``step`` (None: the latest) and its name, of a committed step."""
        check_step(step, latest=True)
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
        check_step(step, latest=True)
        view = shard_dtensors(state_dict)  # DTensors are filled in place through views of their shards
        if self._tiered is not None:
            step, self.last_restore = self._tiered.restore(view, step, options, lambda s: self._resolve(s)[1])
        else:
            step, name = self._resolve(step)
            options.setdefault("storage_options", self.options.store_options() or None)
            api.load(view, self._store.child(name), coordinator=self._queries, **options)
        if view is not state_dict:
            copy_values_back(state_dict, view)
        return step

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
