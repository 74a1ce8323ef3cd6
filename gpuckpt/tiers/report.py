"""What a restore of the local tiers reports: where each rank's part came from."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["PartSource", "RestoreReport"]


@dataclass(frozen=True)
class PartSource:
    """Where one rank's part of a restored step came from."""

    rank: int
    where: str  # "local", "peer" or "root"
    holder: int | None = None  # the rank that sent it ("peer")
    node: str | None = None
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class RestoreReport:
    """What :meth:`~gpuckpt.CheckpointManager.restore` read, identical on every rank."""

    step: int
    source: str  # "tiers" or "root"
    save_id: str | None = None
    parts: dict[int, PartSource] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()
