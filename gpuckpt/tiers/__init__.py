"""The local tier of a distributed :class:`~gpuckpt.CheckpointManager`: parts, replicas, recovery.

Each saved step is written by every rank to its node's ``local_dir`` (tmpfs or node-local
NVMe) as a *part*: an ordinary single-process gpuckpt checkpoint of what the rank holds
(each ``ShardedArray`` box as an array of the box's shape), with a record of what it is a
part of (:mod:`gpuckpt.format.parts`), named ``step_00000120.rank_00002``. gpuckpt,
zarr-python and TensorStore read a part as any checkpoint.

After a rank's part is committed, a background thread sends its files to the rank that
holds its replica on another node (:func:`gpuckpt.planning.tiers.replica_holders`), over
the coordinator's own transport (MPI, gloo through torch.distributed, or threads in tests);
gpuckpt opens no socket of its own. A failure of any rank's write or replication fails the
step on every rank: each deletes what it wrote of it.

A restore (:meth:`LocalTier.restore`) lists the parts every node
holds, takes the newest step whose every rank's part has a copy somewhere (never a mix of
steps), fetches the parts a rank's node lacks (a replaced node) from the ranks that hold
them, and loads each part with every chunk checked; a copy that fails its checks is deleted
and the choice made again without it.

Retention: the lowest rank of each node deletes the oldest steps of its ``local_dir``
(own parts and replicas) beyond ``local_max_to_keep``, never a step being drained to root.
A rank receiving a replica first takes the copy of the same rank's part that this step
retires out of the tier and writes the received files over its files (pages the file system
already holds).

A tier holds the steps of one root: its ``.root`` file names the manager's root (resolved
path or URL), and a manager of another root, or one finding steps whose root is unknown, is
refused on every rank before anything is read (see :meth:`LocalTier._claim`). Its background
work is kept by :mod:`gpuckpt.pending` until it is done: a manager never closed still writes
its last step, replicas and drain at exit, or exit reports what was not written.
"""

from __future__ import annotations

from gpuckpt.tiers.files import tree_bytes
from gpuckpt.tiers.local import LocalTier
from gpuckpt.tiers.parts import copy_values_back, layout_of, part_bytes, part_view, sharded_from_part
from gpuckpt.tiers.report import PartSource, RestoreReport

__all__ = [
    "LocalTier",
    "PartSource",
    "RestoreReport",
    "copy_values_back",
    "layout_of",
    "part_bytes",
    "part_view",
    "sharded_from_part",
    "tree_bytes",
]
