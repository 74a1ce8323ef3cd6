"""A directory of step checkpoints: periodic saves, retention, restore of the latest, and in
a distributed job the local tiers (see :class:`CheckpointManager`)."""

from __future__ import annotations

from gpuckpt.manager.core import CheckpointManager
from gpuckpt.manager.steps import step_of

__all__ = ["CheckpointManager", "step_of"]
