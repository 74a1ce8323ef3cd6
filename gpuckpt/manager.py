"""A directory of step checkpoints: periodic saves, retention, restore of the latest.

Layout::

    ROOT/
      step_00000040/      a committed checkpoint (its zarr.json exists)
      step_00000080/
      .step_00000120.gpuckpt-tmp-...   a save in flight or interrupted: ignored

The root may also be an object-store prefix (``s3://bucket/run1``): the
steps are the prefixes under it (``s3://bucket/run1/step_00000040``), each a
checkpoint published by its root document (see
:mod:`gpuckpt.storage.s3_root`).

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
"""

from __future__ import annotations

import os
import re
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
from gpuckpt.metadata import STATE_DICT_TYPE
from gpuckpt.options import SaveOptions
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
        # cleans what dead saves and interrupted deletions left (only claims whose holder is gone)
        self._store = open_root(root, storage_options=self.options.store_options())
        self.root: Any = getattr(self._store, "path", root)
        self._store.cleanup()
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.keep_period = keep_period
        self.async_save = async_save
        self._pending: tuple[int, SaveFuture] | None = None
        self._error: BaseException | None = None
        self._closed = False

    # the steps in the store --------------------------------------------------

    def _candidates(self) -> dict[int, str]:
        """Step -> name of every entry named like a step (committed or not), the first name
        in sorted order where two names stand for one step."""
        found: dict[int, str] = {}
        for name in self._store.children():
            step = step_of(name)
            if step is not None and step not in found:
                found[step] = name
        return found

    def _scan(self) -> dict[int, str]:
        """Step -> name of every committed step."""
        return {s: n for s, n in self._candidates().items() if self._store.is_committed(n)}

    def _latest(self) -> tuple[int, str] | None:
        """The highest committed step: the candidates from the newest down until one is committed
        (one listing of the root and, usually, one probe)."""
        for step, name in sorted(self._candidates().items(), reverse=True):
            if self._store.is_committed(name):
                return step, name
        return None

    def step_path(self, step: int) -> Any:
        """Where ``step`` is (a directory, or a URL for an object store): the existing one,
        else where a save would put it."""
        return self._store.child(self._scan().get(step, f"step_{step:08d}"))

    def all_steps(self) -> list[int]:
        """Committed steps, in increasing order."""
        self._poll()
        return sorted(self._scan())

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none."""
        self._poll()
        latest = self._latest()
        return None if latest is None else latest[0]

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
        self._settle()
        steps = self._scan()
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
        path = self._store.child(f"step_{step:08d}")
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
            self._apply_retention(step)
        return True

    def _poll(self) -> None:
        """Take note of a finished background save without blocking."""
        if self._pending is not None and self._pending[1].done():
            self._finish_pending()

    def _finish_pending(self) -> None:
        assert self._pending is not None
        step, fut = self._pending
        self._pending = None
        err = fut.exception()
        if err is not None:
            self._error = err
            return
        self._apply_retention(step)

    def _settle(self, *, raise_error: bool = True) -> None:
        """Wait for the save in flight, apply retention, raise a stored error."""
        if self._pending is not None:
            self._pending[1].exception()  # blocks until done
            self._finish_pending()
        if raise_error and self._error is not None:
            err, self._error = self._error, None
            raise err

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

    def _apply_retention(self, saved: int) -> None:
        """Keep the newest ``max_to_keep`` steps (and ``keep_period`` ones) after ``saved`` committed.

        ``saved`` itself is never deleted, whatever else the directory holds
        (a newer step written behind the manager's back, for one).
        """
        if self.max_to_keep is None:
            return
        steps = sorted(self._scan().items())
        if len(steps) <= self.max_to_keep:
            return
        doomed = [
            name
            for step, name in steps[: -self.max_to_keep]
            if step != saved and not (self.keep_period is not None and step % self.keep_period == 0)
        ]
        self._store.delete(doomed)  # together: batched requests on an object store

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
        self._store.delete([name])

    # restoring ---------------------------------------------------------------

    def _resolve(self, step: int | None) -> tuple[int, str]:
        """``step`` (None: the latest) and its name, of a committed step."""
        self._settle(raise_error=False)
        if step is None:
            latest = self._latest()
            if latest is None:
                raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}; save one first")
            return latest
        steps = self._scan()
        if not steps:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}; save one first")
        if step not in steps:
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
