"""Cooperative loads as pure data: which rank reads each stored chunk that several ranks need.

A distributed load in which several ranks need the same stored chunk (the
replicas of a data-parallel job, replicated tensors) reads that chunk once for
the whole job: one rank, its *reader*, reads and checks it, then sends its bytes
to the other ranks that need it (its *receivers*). :func:`plan_cooperative` makes
that plan from what every rank needs (the same inputs on every rank give the
same plan, so the ranks agree without a second round of messages):

- a chunk that one rank needs is read by that rank, as in any load, and so is a
  chunk of which each rank that needs it needs other rows (``alone``: where the
  store reads ranges, each reads only its rows, and no byte is read twice);
- a chunk that several ranks need is read by one of them: the chunks are taken
  largest first and each goes to the rank (of those that need it) that has been
  given the fewest bytes to read so far, ties to the least loaded node, then to
  the lowest rank, so that every rank, and every node, reads about the same bytes;
- the shared chunks travel in *rounds*: a rank holds, in one round, the bytes of
  every shared chunk it reads or receives in that round, at most ``budget`` bytes
  (first fit, largest chunks first). A chunk larger than the budget travels in a
  round of its own: the reader checks a chunk whole before sending any of it. A
  rank that reads or receives a chunk straight into its own targets (``free``)
  holds no memory for it: a replicated state whose targets take whole chunks
  travels in one round.

No arrays and no I/O: a chunk is named by ``(fqn, grid coordinates)`` and
described by its stored size.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ChunkId", "CooperativePlan", "SharedChunk", "plan_cooperative"]

#: a stored chunk: its tensor's FQN and its coordinates in the tensor's chunk grid
ChunkId = tuple[str, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class SharedChunk:
    """A stored chunk that several ranks need: ``reader`` reads it, ``receivers`` get its bytes.

    ``nbytes`` is its stored size (what the reader reads and sends); ``round`` the
    round in which it travels.
    """

    fqn: str
    coords: tuple[int, ...]
    nbytes: int
    reader: int
    receivers: tuple[int, ...]
    round: int

    @property
    def id(self) -> ChunkId:
        return (self.fqn, self.coords)


@dataclass(frozen=True, slots=True)
class CooperativePlan:
    """Who reads what in a cooperative load.

    ``shared``: the chunks several ranks need, ordered by round, then by FQN and
    coordinates; ``read_bytes[r]``: the stored bytes rank ``r`` reads (its own
    chunks and the shared chunks it reads); ``needed_bytes``: the stored bytes the
    job needs, each chunk counted once (what all readers together read);
    ``requested_bytes``: what the ranks would read each on its own (every chunk
    counted once per rank that needs it); ``round_bytes[k][r]``: the bytes rank
    ``r`` holds in round ``k`` (see ``held`` and ``free`` of :func:`plan_cooperative`).
    Chunks each of whose needers reads only its own rows (``alone``) count in full
    for each in ``read_bytes``.
    """

    world_size: int
    budget: int
    shared: tuple[SharedChunk, ...]
    nrounds: int
    read_bytes: tuple[int, ...]
    needed_bytes: int
    requested_bytes: int
    round_bytes: tuple[tuple[int, ...], ...]

    def in_round(self, k: int) -> list[SharedChunk]:
        """The shared chunks of round ``k``, in order."""
        return [s for s in self.shared if s.round == k]

    @property
    def saves_reads(self) -> bool:
        """Whether the plan reads fewer bytes than the ranks would each on their own."""
        return bool(self.shared)


def plan_cooperative(
    wants: Sequence[Iterable[ChunkId]],
    nbytes: Mapping[ChunkId, int],
    *,
    budget: int,
    nodes: Sequence[str] | None = None,
    alone: Collection[ChunkId] = (),
    held: Mapping[ChunkId, int] | None = None,
    free: Sequence[Collection[ChunkId]] | None = None,
) -> CooperativePlan:
    """The plan of a load in which rank ``r`` needs the chunks ``wants[r]``.

    ``nbytes`` gives the stored size of every chunk named in ``wants``;
    ``budget`` the bytes of shared chunks one rank may hold in one round
    (positive); ``nodes[r]`` names the machine of rank ``r`` (default: every rank
    on a machine of its own). ``alone``: chunks that every rank needing them reads
    itself even when several do (each needs other rows of it, and reads only those:
    ranged reads read each byte once without an exchange); each counts in full for
    each of its readers in ``read_bytes``, an upper bound. ``held``: the bytes a rank
    holds for a chunk in its round (default its stored size; the caller's memory per
    chunk may be less, its checksum trailer not kept); ``free[r]``: the chunks rank
    ``r`` reads or receives straight into its targets: they take none of ``r``'s
    budget.

    Examples
    --------
    >>> a, b = ("w", (0,)), ("w", (1,))
    >>> p = plan_cooperative([[a, b], [a, b]], {a: 10, b: 10}, budget=100)
    >>> [(s.coords, s.reader, s.receivers) for s in p.shared], p.read_bytes, p.needed_bytes
    ([((0,), 0, (1,)), ((1,), 1, (0,))], (10, 10), 20)
    """
    world = len(wants)
    if budget < 1:
        raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
    if nodes is not None and len(nodes) != world:
        raise ValueError(f"nodes names {len(nodes)} ranks, wants {world}")
    if free is not None and len(free) != world:
        raise ValueError(f"free names {len(free)} ranks, wants {world}")
    cost = nbytes if held is None else held
    free_of = [set(f) for f in free] if free is not None else [set() for _ in range(world)]
    node_of = list(nodes) if nodes is not None else [str(r) for r in range(world)]
    needers: dict[ChunkId, list[int]] = {}
    for rank, ids in enumerate(wants):
        for cid in dict.fromkeys(ids):  # a rank naming a chunk twice needs it once
            needers.setdefault(cid, []).append(rank)
    load = [0] * world
    node_load: dict[str, int] = dict.fromkeys(node_of, 0)
    requested = 0
    shared_ids: list[tuple[int, ChunkId]] = []
    alone = set(alone)
    for cid, ranks in needers.items():
        size = nbytes[cid]
        requested += size * len(ranks)
        if len(ranks) == 1 or cid in alone:
            for r in ranks:
                load[r] += size
                node_load[node_of[r]] += size
        else:
            shared_ids.append((size, cid))
    # largest first: each goes to the least loaded of the ranks that need it
    shared_ids.sort(key=lambda item: (-item[0], item[1]))
    placed: list[tuple[ChunkId, int, int, tuple[int, ...]]] = []
    for size, cid in shared_ids:
        ranks = needers[cid]
        reader = min(ranks, key=lambda r: (load[r], node_load[node_of[r]], r))
        load[reader] += size
        node_load[node_of[reader]] += size
        placed.append((cid, size, reader, tuple(r for r in ranks if r != reader)))
    # rounds: first fit, largest first, within the budget of every rank involved
    rounds: list[list[int]] = []
    shared: list[SharedChunk] = []
    for cid, size, reader, receivers in placed:
        kept = cost[cid]
        holds = [(r, kept) for r in (reader, *receivers) if cid not in free_of[r]]
        k = next(
            (i for i, taken in enumerate(rounds) if all(taken[r] + n <= budget for r, n in holds)),
            None,
        )
        if k is None:
            k = len(rounds)
            rounds.append([0] * world)
        for r, n in holds:
            rounds[k][r] += n
        shared.append(SharedChunk(cid[0], cid[1], size, reader, receivers, k))
    shared.sort(key=lambda s: (s.round, s.fqn, s.coords))
    return CooperativePlan(
        world_size=world,
        budget=budget,
        shared=tuple(shared),
        nrounds=len(rounds),
        read_bytes=tuple(load),
        needed_bytes=sum(nbytes[cid] for cid in needers),
        requested_bytes=requested,
        round_bytes=tuple(tuple(held) for held in rounds),
    )
