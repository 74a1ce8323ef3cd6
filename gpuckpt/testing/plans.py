"""The plans of cooperative loads, kept for tests: who read each shared chunk, who was to receive it.

:func:`record_plans` keeps the :class:`~gpuckpt.planning.cooperative.CooperativePlan`
of every cooperative load the calling thread makes inside a block (each rank of a
job in threads keeps its own). :func:`received_boxes` names the boxes of a tensor's
chunks that a rank was to receive from other ranks under a plan: where nothing of a
failed round may have arrived.

Examples
--------
>>> with record_plans() as plans:  # doctest: +SKIP
...     gpuckpt.load(state, path, coordinator=c, cooperative=True)
>>> plans[0].nrounds  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from gpuckpt.planning.boxes import Box
from gpuckpt.planning.cooperative import CooperativePlan

__all__ = ["received_boxes", "record_plans"]

_local = threading.local()
_install = threading.Lock()
_PLANNER = "plan_cooperative"  # the name the cooperative loads call their planner by


def _wrap() -> None:
    """Route the cooperative loads' planning through a recorder (once per process)."""
    from gpuckpt.distributed import cooperative

    with _install:
        real = getattr(cooperative, _PLANNER)
        if getattr(real, "records", False):
            return

        @functools.wraps(real)
        def recording(*args: Any, **kwargs: Any) -> CooperativePlan:
            plan: CooperativePlan = real(*args, **kwargs)
            kept = getattr(_local, "plans", None)
            if kept is not None:
                kept.append(plan)
            return plan

        recording.records = True  # type: ignore[attr-defined]
        setattr(cooperative, _PLANNER, recording)


@contextlib.contextmanager
def record_plans() -> Iterator[list[CooperativePlan]]:
    """A list that gets the plan of each cooperative load this thread makes inside the block."""
    _wrap()
    outer = getattr(_local, "plans", None)
    plans: list[CooperativePlan] = []
    _local.plans = plans
    try:
        yield plans
    finally:
        _local.plans = outer


def received_boxes(plan: CooperativePlan, rank: int, tensors: Mapping[str, Any]) -> dict[str, list[Box]]:
    """For each tensor, the boxes (offsets, sizes in the whole tensor) of the shared chunks of
    ``plan`` that rank ``rank`` was to receive from their readers. ``tensors``: the checkpoint's
    tensor entries by FQN (``open_checkpoint(path).index.tensors``)."""
    out: dict[str, list[Box]] = {}
    for s in plan.shared:
        if rank in s.receivers:
            spec = tensors[s.fqn].chunk(s.coords).spec
            out.setdefault(s.fqn, []).append((tuple(spec.offsets), tuple(spec.sizes)))
    return out
