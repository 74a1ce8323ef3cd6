"""Planning: where every byte of a checkpoint goes, as pure data (no arrays, no I/O).

- :mod:`gpuckpt.format.grid`: chunk grids of one tensor (:class:`ChunkGrid`,
  :func:`plan_regular_grid`);
- :mod:`gpuckpt.planning.boxes`: the boxes processes hold, which process
  writes which chunk (:func:`plan_global`), and box overlaps for resharding loads;
- :mod:`gpuckpt.planning.plan`: the save plan (:class:`SavePlan`), made by
  :func:`plan_save` for every kind of save.
"""

from gpuckpt.format.grid import ChunkGrid, ChunkSpec, plan_regular_grid
from gpuckpt.planning.boxes import (
    Box,
    GlobalTensorPlan,
    LocalTensor,
    intersect,
    overlapping_chunks,
    plan_global,
)
from gpuckpt.planning.plan import ChunkAssignment, SavePlan, StateDescription, TensorPlan, plan_save

__all__ = [
    "Box",
    "ChunkAssignment",
    "ChunkGrid",
    "ChunkSpec",
    "GlobalTensorPlan",
    "LocalTensor",
    "SavePlan",
    "StateDescription",
    "TensorPlan",
    "intersect",
    "overlapping_chunks",
    "plan_global",
    "plan_regular_grid",
    "plan_save",
]
