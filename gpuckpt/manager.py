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
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import gpuckpt.api as api
from gpuckpt.background import SaveFuture, async_save_with_options
from gpuckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    GpuckptError,
    InvalidOptionError,
    StepOrderError,
)
from gpuckpt.format.metadata import STATE_DICT_TYPE
from gpuckpt.options import SaveOptions
from gpuckpt.runtime.runner import run_all
from gpuckpt.storage.stores import open_root, scheme_of

__all__ = ["CheckpointManager", "step_of"]

_STEP_RE = re.compile(r"^(?:step_)?([0-9]{1,19})$")
#: the options of gpuckpt.async_save a manager passes on to each save
_SAVE_OPTIONS = frozenset(
    (
        "chunk_bytes",
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
_REFUSED = {
    "overwrite": "the manager never overwrites a step",
    "coordinator": "a manager saves from one process",
}
#: probes of root documents sent at once (each is a small request on an object store)
_PROBE_THREADS = 16


def step_of(name: str) -> int | None:
    """The step a directory name stands for (``step_00000042`` or ``42``), else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


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
    **save_options
        Options of every save, as for :func:`gpuckpt.async_save`:
        ``chunk_bytes``, ``allow_pickle``, ``sync``, ``threads``, ``progress``,
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
        # bad values fail here, not at some later save (which could have taken staging memory)
        self.options = SaveOptions(**save_options)
        self.incremental = incremental
        self._store = open_root(root, storage_options=self.options.store_options())
        self.root: Any = getattr(self._store, "path", root)
        #: child name -> whether it is committed, for the names of the last listing this manager
        #: probed or committed itself (see the module docstring)
        self._known: dict[str, bool] = {}
        self._open_root()
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.keep_period = keep_period
        self.async_save = async_save
        self._pending: tuple[int, SaveFuture] | None = None
        self._error: BaseException | None = None
        self._closed = False

    # the steps in the store --------------------------------------------------

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
        steps = self._view(recheck_from)
        if saved is not None:
            self._apply_retention(saved, steps)
        return steps

    def step_path(self, step: int) -> Any:
        """Where ``step`` is (a directory, or a URL for an object store): the existing one,
        else where a save would put it."""
        return self._store.child(self._view(step).get(step, f"step_{step:08d}"))

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
            self._pending = (step, async_save_with_options(state_dict, path, options))
        else:
            api.save_with_options(state_dict, path, options)
            self._known[name] = True
            # retention on the listing made before the save: a step that appeared meanwhile is
            # not counted (it is kept), one deleted meanwhile is deleted again (nothing happens)
            steps[step] = name
            self._apply_retention(step, steps)
        return True

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
        saved = self._collect(block=True)
        if saved is not None and self.max_to_keep is not None:
            self._apply_retention(saved, self._view(None))
        self._raise_error()

    def wait(self) -> None:
        """Block until the save in flight is committed; raises its error if it failed."""
        self._settle()

    def close(self) -> None:
        """Wait for the save in flight (raising its error) and refuse further saves."""
        if self._closed:
            return
        self._closed = True
        self._settle()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
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
        self._known.pop(name, None)
        self._store.delete([name])

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
        step, name = self._resolve(step)
        options.setdefault("storage_options", self.options.store_options() or None)
        api.load(state_dict, self._store.child(name), **options)
        return step

    def restore_state_dict(self, step: int | None = None, **options: Any) -> dict[str, Any]:
        """Load ``step`` (default: the latest) into a new dict (see :func:`gpuckpt.load_state_dict`)."""
        _step, name = self._resolve(step)
        options.setdefault("storage_options", self.options.store_options() or None)
        return api.load_state_dict(self._store.child(name), **options)

    def __repr__(self) -> str:
        pending = f", step {self._pending[0]} in flight" if self._pending else ""
        return f"<CheckpointManager {self.root}{pending}>"
