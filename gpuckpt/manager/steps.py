"""The steps under a manager's root: which are committed, what retention deletes, agreed by
every rank.

Step directories are named ``step_<step>`` (zero-padded to 8 digits) and
are ordered by their number, never by name; plain integer names (``42``)
are read too. A step counts only once it is committed, so an interrupted or
failed save is never taken for a step.

What a save costs does not grow with the steps kept. Telling a committed
step from a save in flight, a dead save or another program's Zarr store
takes a probe of its root document (on an object store a request: a ranged
GET of its first bytes, which also tells a gpuckpt root document from another
program's ``zarr.json``), and a root may hold thousands of steps
(``max_to_keep=None``, or ``keep_period`` over a long run). A listing cannot
replace the probe: it shows a child's name, never what its root document
says. So :class:`StepRoot` probes every child named like a step once, when it
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
  above the latest committed step, for ``latest_step``; ``all_steps`` probes
  them all again. Retention deletes only steps known committed, so a step
  stays (it is never deleted unseen) until a probe finds it committed.

A save therefore costs one listing (on an object store one request per
1,000 children: the listing's pages), a probe of each name the listing shows
for the first time, and a probe of each name found not committed at or above
the new step: none of either in a run going forward, whether 10 or 10,000
steps are kept. A retention pass adds the deletion of what it retires, in
bulk requests. The one pass over every step is at open.

In a distributed job rank 0 alone lists, probes and deletes (:meth:`StepRoot.agreed`),
and what it finds (the committed steps, or its error) reaches every rank in one
broadcast, so every rank sees the same steps, takes the same decisions and
raises the same errors.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from gpuckpt.distributed.coordinator import Coordinator, describe_error, disagreement
from gpuckpt.errors import DistributedError, InvalidOptionError, StepOrderError
from gpuckpt.runtime.runner import run_all

__all__ = ["MAX_STEP", "StepRoot", "check_step", "step_name", "step_of"]

_STEP_RE = re.compile(r"^(?:step_)?([0-9]{1,19})$")
#: probes of root documents sent at once (each is a small request on an object store)
_PROBE_THREADS = 16

_T = TypeVar("_T")


def step_of(name: str) -> int | None:
    """The step a directory name stands for (``step_00000042`` or ``42``), else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


#: the largest step a manager saves: :func:`step_of` reads names of at most 19 digits back
MAX_STEP = 10**19 - 1


def check_step(step: Any, *, latest: bool = False) -> None:
    """Refuse what is not a step (an int from 0 to :data:`MAX_STEP`; None too where ``latest``:
    the latest step) with an :class:`~gpuckpt.errors.InvalidOptionError` naming it."""
    if step is None and latest:
        return
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        also = " or None (the latest)" if latest else ""
        raise InvalidOptionError(f"step must be an integer from 0 to {MAX_STEP}{also}, got {step!r}")


def step_name(step: int) -> str:
    """The name a save gives ``step``: ``step_00000042``."""
    return f"step_{step:08d}"


def different_steps(steps: Sequence[int]) -> StepOrderError | None:
    """The error every rank raises when the ranks saved different steps in one call (``steps[r]``:
    rank ``r``'s), or None."""
    differ = disagreement(steps)
    if differ is None:
        return None
    return StepOrderError(
        f"the ranks saved different steps in one call ({differ}): every rank saves the same step "
        "number in the same call of save"
    )


class StepRoot:
    """The steps of one root (a store from :func:`gpuckpt.storage.stores.open_root`) as one
    manager knows them, with its retention policy; ``queries`` carries the agreement of a
    distributed job's ranks (None: one process). See the module docstring."""

    def __init__(
        self, store: Any, queries: Coordinator | None, *, max_to_keep: int | None, keep_period: int | None
    ) -> None:
        self.store = store
        self.queries = queries
        self.max_to_keep = max_to_keep
        self.keep_period = keep_period
        #: child name -> whether it is committed, for the names of the last listing this manager
        #: probed or committed itself (see the module docstring); rank 0's alone in a distributed job
        self.known: dict[str, bool] = {}

    # agreement ---------------------------------------------------------------------

    def agreed(self, fn: Callable[[], _T], *, step: int | None = None) -> _T:
        """``fn()`` run on rank 0 alone, its result on every rank (in one process: ``fn()``).

        An error there is raised on every rank as one :class:`~gpuckpt.errors.DistributedError`
        naming it (its cause, on rank 0, the error itself): every rank then raises, or none does.
        ``step``: the step every rank saves in this call, compared (a
        :class:`~gpuckpt.errors.StepOrderError` on every rank where they differ)."""
        c = self.queries
        if c is None:
            return fn()
        outcome, error = self.run_on_rank0(fn)
        if step is None:
            outcome = c.broadcast(outcome if c.rank == 0 else None)
        else:
            gathered = c.all_gather((outcome, step))
            outcome = gathered[0][0]
            different = different_steps([g[1] for g in gathered])
            if different is not None:
                raise different
        value: _T = self.outcome_of_rank0(outcome, error)
        return value

    def run_on_rank0(self, fn: Callable[[], _T]) -> tuple[tuple[bool, Any] | None, Exception | None]:
        """On rank 0, ``fn()``'s outcome as sent to every rank, ``(True, value)`` or ``(False,
        what failed)``, and the error itself; elsewhere ``(None, None)``."""
        assert self.queries is not None
        if self.queries.rank != 0:
            return None, None
        try:
            return (True, fn()), None
        except Exception as exc:
            return (False, describe_error(exc)), exc

    def outcome_of_rank0(self, outcome: tuple[bool, Any], error: Exception | None) -> Any:
        """The value of rank 0's outcome, or its failure raised (on every rank alike)."""
        assert self.queries is not None
        ok, value = outcome
        if not ok:
            raise DistributedError({0: value}, self.queries.world_size) from error
        return value

    # what is committed ---------------------------------------------------------------

    def open(self) -> None:
        """Probe every child named like a step once (in parallel), then clean what dead saves and
        interrupted deletions left among the children that are not committed (only claims whose
        holder is gone). What was found committed is remembered: cleanup never touches a
        committed checkpoint; the rest is probed again at the first listing (cleanup may have
        removed it, or put a set-aside copy back). A root inside a checkpoint is refused first."""
        self.store.refuse_inside_a_checkpoint()
        names = self.store.children()
        found = self.probe([n for n in names if step_of(n) is not None])
        self.store.cleanup([n for n in names if not found.get(n, False)])
        self.known = {n: True for n, committed in found.items() if committed}

    def probe(self, names: Sequence[str]) -> dict[str, bool]:
        """Whether each of ``names`` is committed: one probe each, in parallel."""
        jobs = [functools.partial(self.store.is_committed, n) for n in names]
        found = run_all(jobs, threads=_PROBE_THREADS, name="gpuckpt-probe")
        return dict(zip(names, found, strict=True))

    def candidates(self) -> dict[int, str]:
        """Step -> name of every entry named like a step (committed or not), the first name
        in sorted order where two names stand for one step: one listing of the root."""
        found: dict[int, str] = {}
        for name in self.store.children():
            step = step_of(name)
            if step is not None and step not in found:
                found[step] = name
        return found

    def view(self, recheck_from: int | None) -> dict[int, str]:
        """Step -> name of every committed step: one listing, and probes of what it does not know.

        Names not seen before are probed; names found not committed before are probed again
        when their step is ``recheck_from`` or later (None: later than the latest committed
        step); a name known committed is not probed (see the module docstring). Names gone
        from the listing are forgotten.
        """
        candidates = self.candidates()
        listed = set(candidates.values())
        self.known = {n: c for n, c in self.known.items() if n in listed}
        if recheck_from is None:
            recheck_from = 1 + max((s for s, n in candidates.items() if self.known.get(n)), default=-1)
        todo = [
            n
            for s, n in sorted(candidates.items())
            if n not in self.known or (not self.known[n] and s >= recheck_from)
        ]
        self.known.update(self.probe(todo))
        return {s: n for s, n in candidates.items() if self.known[n]}

    def committed(self, step: int) -> None:
        """Take note that this manager committed ``step`` (under :func:`step_name`)."""
        self.known[step_name(step)] = True

    # retention and deletion ------------------------------------------------------------

    def retire(self, saved: int, steps: dict[int, str]) -> None:
        """Keep the newest ``max_to_keep`` steps (and ``keep_period`` ones) after ``saved`` committed.

        ``steps`` are the committed steps of a listing made after that commit
        (:meth:`view`); the deleted ones are taken out of it. ``saved`` itself
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
            self.known.pop(name, None)
        self.store.delete([name for _, name in doomed])  # together: batched requests on an object store

    def delete(self, name: str) -> None:
        """Delete the committed step ``name`` (forgotten first)."""
        self.known.pop(name, None)
        self.store.delete([name])
