"""Local tiers as pure data: where replicas go, which step a restore takes, what retention drops.

Every rank computes these from the same gathered inputs, so every rank decides the same.

Nodes are ordered by their lowest rank; rank ``r`` has local index ``j`` on node ``k`` of
``N``. Replica ``i`` (1 to ``replicas``) of its part goes to the rank of local index
``j mod size`` on node ``(k + i) mod N``: never its own node, and spread over the ranks
of the other node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpuckpt.errors import InvalidOptionError

__all__ = ["Choice", "CopySeen", "choose", "nodes_of", "replica_holders", "tier_retention"]


def nodes_of(node_names: Sequence[str]) -> list[list[int]]:
    """The ranks of each node (``node_names[r]`` is rank r's), nodes ordered by their lowest rank."""
    order: dict[str, list[int]] = {}
    for rank, name in enumerate(node_names):
        order.setdefault(name, []).append(rank)
    return list(order.values())


def replica_holders(rank: int, node_names: Sequence[str], replicas: int) -> list[int]:
    """The ranks that hold the replicas of ``rank``'s part, replica 1 first.

    Raises
    ------
    InvalidOptionError
        When the job has fewer than ``replicas + 1`` nodes.
    """
    nodes = nodes_of(node_names)
    if replicas + 1 > len(nodes):
        raise InvalidOptionError(
            f"replicas={replicas} needs {replicas + 1} nodes; this job has {len(nodes)} "
            f"({', '.join(sorted(set(node_names)))}): pass replicas={len(nodes) - 1}, or node= to name "
            "the nodes of a job simulated on one machine"
        )
    k = next(i for i, ranks in enumerate(nodes) if rank in ranks)
    j = nodes[k].index(rank)
    out = []
    for i in range(1, replicas + 1):
        other = nodes[(k + i) % len(nodes)]
        out.append(other[j % len(other)])
    return out


@dataclass(frozen=True)
class CopySeen:
    """A committed part in a local tier, as the rank ``holder`` (on its node) lists it."""

    step: int
    save_id: str
    rank: int
    world_size: int
    layout: str
    holder: int


@dataclass(frozen=True)
class Choice:
    """What a restore reads: ``source`` is ``"tiers"`` (``senders[r]`` holds rank r's part;
    ``senders[r] == r``: its own node's copy), ``"root"`` (the root's ``step``) or ``"none"``."""

    source: str
    step: int | None = None
    save_id: str | None = None
    senders: dict[int, int] = field(default_factory=dict)
    #: steps complete under two save ids (two lines of one run): never taken
    ambiguous: tuple[int, ...] = ()
    #: steps every rank's part of which is in the tiers, saved from a state of another layout
    #: (arrays, shapes, dtypes or boxes) than some ranks' present one: step -> those ranks
    other_layout: dict[int, tuple[int, ...]] = field(default_factory=dict)
    #: steps every rank's part of which is in the tiers for a job of another number of ranks:
    #: step -> those numbers of ranks (a restart with as many ranks restores them)
    other_ranks: dict[int, tuple[int, ...]] = field(default_factory=dict)


def choose(
    copies: Iterable[CopySeen],
    layouts: Sequence[str],
    node_names: Sequence[str],
    root_latest: int | None,
    fits: Iterable[tuple[int, str, int]] = (),
) -> Choice:
    """The newest step whose every rank's part has a usable copy, else the root's latest.

    A copy is usable for rank r when it is r's part, of a save of this many ranks, with
    r's present layout, or one that holds it: ``fits`` names the ``(step, save_id, rank)``
    whose part holds every array of rank r's present state, of the same shape, dtype and
    boxes (a subset of what was saved, as a load of the root's step takes it). Step T (of
    one ``save_id``) is complete when every rank has a usable copy; the newest complete T is
    taken when it is at least ``root_latest``. Every rank reads a part of the same
    ``(T, save_id)``: never a mix. Steps whose every part is there for a job of another number
    of ranks are named in ``other_ranks``.
    """
    n = len(layouts)
    nodes = nodes_of(node_names)
    local_index = {r: ranks.index(r) for ranks in nodes for r in ranks}
    holders: dict[tuple[int, str], dict[int, set[int]]] = {}
    saved_as: dict[tuple[int, str], dict[int, set[str]]] = {}  # whatever their layout
    fitting = set(fits)
    elsewhere: dict[tuple[int, str, int], set[int]] = {}  # saves of another number of ranks
    for c in copies:
        if c.world_size != n or not 0 <= c.rank < n:
            if 0 <= c.rank < c.world_size:
                elsewhere.setdefault((c.step, c.save_id, c.world_size), set()).add(c.rank)
            continue
        saved_as.setdefault((c.step, c.save_id), {}).setdefault(c.rank, set()).add(c.layout)
        if c.layout == layouts[c.rank] or (c.step, c.save_id, c.rank) in fitting:
            holders.setdefault((c.step, c.save_id), {}).setdefault(c.rank, set()).add(c.holder)
    complete: dict[int, list[str]] = {}
    for (step, save_id), by_rank in holders.items():
        if len(by_rank) == n:
            complete.setdefault(step, []).append(save_id)
    other: dict[int, set[int]] = {}
    for (step, save_id), seen in saved_as.items():
        if len(seen) == n and len(holders.get((step, save_id), {})) < n:
            other.setdefault(step, set()).update(
                r for r, lays in seen.items() if layouts[r] not in lays and (step, save_id, r) not in fitting
            )
    other_layout = {s: tuple(sorted(rs)) for s, rs in sorted(other.items())}
    sizes: dict[int, set[int]] = {}
    for (step, _, size), ranks in elsewhere.items():
        if len(ranks) == size:
            sizes.setdefault(step, set()).add(size)
    other_ranks = {s: tuple(sorted(z)) for s, z in sorted(sizes.items())}
    ambiguous = tuple(sorted(s for s, ids in complete.items() if len(ids) > 1))
    steps = [s for s, ids in complete.items() if len(ids) == 1]
    best = max(steps, default=None)
    if best is None or (root_latest is not None and root_latest > best):
        if root_latest is None:
            return Choice("none", ambiguous=ambiguous, other_layout=other_layout, other_ranks=other_ranks)
        return Choice(
            "root", root_latest, ambiguous=ambiguous, other_layout=other_layout, other_ranks=other_ranks
        )
    (save_id,) = complete[best]
    senders = {}
    for r, found in holders[(best, save_id)].items():
        if r in found:
            senders[r] = r
        else:
            ordered = sorted(found)
            senders[r] = ordered[local_index[r] % len(ordered)]
    return Choice("tiers", best, save_id, senders, ambiguous, other_layout, other_ranks)


def tier_retention(steps: Iterable[int], keep: int, newest: int, pinned: Iterable[int] = ()) -> list[int]:
    """The steps a tier deletes once ``newest`` is written, to hold ``keep`` steps up to it
    besides the pinned ones (being drained: held in addition, never deleted, never counted, so
    that a drain slower than the steps does not take the place of the newest complete step);
    never one after ``newest`` (parts of later steps may be committed before this step's
    replication ends: they are the next steps' to count). ``newest`` counts, pinned or not."""
    held = set(pinned) - {newest}
    counted = sorted(s for s in set(steps) if s <= newest and s not in held)
    excess = len(counted) - keep
    return [s for s in counted if s != newest][: max(0, excess)]
