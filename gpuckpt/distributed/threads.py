"""N threads acting as N ranks of one process: fast, in-process distributed tests.

A :class:`ThreadGroup` holds the state its :class:`ThreadCoordinator` ranks
share. Its collectives have the semantics of the MPI ones: objects are
pickled by the sender and unpickled by each receiver (no rank ever shares an
object with another, and an object MPI could not send fails here too), and
every rank must call the same collective in the same order with the same
``root``. Where MPI would hang or pair up the wrong messages, the group
raises :class:`~gpuckpt.distributed.coordinator.CoordinatorError` on every
rank: a rank calling another collective, a rank that left (returned or
raised) while others wait for it, or a rank not arriving within ``timeout``.

Point-to-point exchanges go through the same rounds: each rank deposits what
it sends to each rank, then picks what was sent to it (``exchange_buffers``
copies straight from the sender's buffer into the receiver's, and a second
round keeps the senders' buffers alive until every copy is made). A
duplicate is a child group of the same size, with its own lock and rounds,
shared by the ranks: the ``k``-th ``duplicate()`` of each rank joins the
``k``-th child.
"""

from __future__ import annotations

import pickle
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from gpuckpt.distributed.coordinator import Coordinator, CoordinatorError
from gpuckpt.distributed.exchange import copy_buffers, dumps, pick_mail, raise_problems

__all__ = ["ThreadCoordinator", "ThreadGroup", "run_ranks"]

_Entry = tuple[str, int | None, Any]  # (collective, root, pickled payload or None)

# A module-level TypeVar, not PEP 695 syntax (`def run_ranks[T]`): that needs Python 3.12.
_T = TypeVar("_T")


def _loads(data: bytes | None) -> Any:
    return None if data is None else pickle.loads(data)


class ThreadGroup:
    """Shared state of ``world_size`` in-process ranks, one :class:`ThreadCoordinator` each.

    Each collective is one rendezvous of all ranks: a rank deposits its entry
    and waits until the last rank arrives; the entries of that round are then
    read by every rank. Rounds are numbered, so a fast rank can start the next
    collective while slow ones still read the previous one.

    Parameters
    ----------
    world_size
        Number of ranks (threads), at least 1.
    timeout
        Seconds a rank waits in one collective for the others before the
        group is broken and every waiting rank raises; ``None`` waits forever.

    Examples
    --------
    >>> import threading
    >>> group = ThreadGroup(2)
    >>> out = [None, None]
    >>> def rank_main(c):
    ...     out[c.rank] = c.all_gather(c.rank * 10)
    >>> ts = [threading.Thread(target=rank_main, args=(c,)) for c in group.coordinators]
    >>> for t in ts: t.start()
    >>> for t in ts: t.join()
    >>> out
    [[0, 10], [0, 10]]
    """

    def __init__(self, world_size: int, *, timeout: float | None = 60.0) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        self.world_size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._round = 0
        self._pending: list[_Entry | None] = [None] * world_size
        self._arrived = 0
        self._done: dict[int, list[_Entry]] = {}  # finished rounds not yet read by every rank
        self._readers: dict[int, int] = {}
        self._departed: dict[int, str] = {}  # rank -> how it left
        self._broken: str | None = None
        self._children: list[ThreadGroup] = []  # the duplicates, in the order the ranks made them
        self._duplicated = [0] * world_size  # rank -> how many duplicates it made
        self.coordinators = [ThreadCoordinator(self, rank) for rank in range(world_size)]

    def depart(self, rank: int, error: BaseException | None = None) -> None:
        """Record that ``rank`` left (returned, or raised ``error``): it will call no more collectives.

        Ranks waiting for it, and later collectives, raise instead of waiting;
        in the group's duplicates too.
        """
        how = "returned" if error is None else f"raised {type(error).__name__}: {error}"
        with self._cond:
            self._departed[rank] = how
            self._cond.notify_all()
            children = list(self._children)
        for child in children:
            child.depart(rank, error)

    def abort(self, reason: str = "the group was aborted") -> None:
        """Break the group and its duplicates: waiting and later collectives raise CoordinatorError."""
        with self._cond:
            if self._broken is None:
                self._broken = reason
            self._cond.notify_all()
            children = list(self._children)
        for child in children:
            child.abort(reason)

    def duplicate(self, rank: int) -> ThreadGroup:
        """The group of ``rank``'s next duplicate: the ``k``-th call of each rank returns the ``k``-th child.

        A child is created by the first rank that asks for it, with this
        group's size and timeout, and with the departures and the break this
        group has seen so far.
        """
        with self._cond:
            k = self._duplicated[rank]
            self._duplicated[rank] += 1
            if k == len(self._children):
                child = ThreadGroup(self.world_size, timeout=self.timeout)
                child._departed = dict(self._departed)
                child._broken = self._broken
                self._children.append(child)
            return self._children[k]

    def _failure(self, rank: int, op: str) -> CoordinatorError | None:
        """Why ``rank`` cannot complete ``op`` now, or None (the lock is held)."""
        if self._broken is not None:
            return CoordinatorError(f"rank {rank} in {op}: {self._broken}")
        if self._departed:
            left = ", ".join(f"rank {r} {how}" for r, how in sorted(self._departed.items()))
            return CoordinatorError(
                f"rank {rank} in {op}: {left} without calling it; every rank must call the same "
                "collectives in the same order (catch errors and pass them to all_reduce_errors)"
            )
        return None

    def exchange(self, rank: int, op: str, root: int | None, payload: Any) -> list[_Entry]:
        """One collective round: deposit ``(op, root, payload)``, return every rank's entry."""
        with self._cond:
            failure = self._failure(rank, op)
            if failure is not None:
                raise failure
            this_round = self._round
            self._pending[rank] = (op, root, payload)
            self._arrived += 1
            if self._arrived == self.world_size:
                self._done[this_round] = [e for e in self._pending if e is not None]
                self._readers[this_round] = self.world_size
                self._pending = [None] * self.world_size
                self._arrived = 0
                self._round += 1
                self._cond.notify_all()
            else:
                released = self._cond.wait_for(
                    lambda: self._round != this_round or self._broken is not None or bool(self._departed),
                    self.timeout,
                )
                if self._round == this_round:  # not released: broken, a rank left, or timed out
                    if not released:
                        missing = [r for r, e in enumerate(self._pending) if e is None]
                        self._broken = (
                            f"ranks {missing} did not reach {op} within {self.timeout} s "
                            "(a rank hangs, or the ranks call different collectives)"
                        )
                        self._cond.notify_all()
                    failure = self._failure(rank, op)
                    assert failure is not None
                    raise failure
            entries = self._done[this_round]
            self._readers[this_round] -= 1
            if self._readers[this_round] == 0:
                del self._done[this_round], self._readers[this_round]
        calls = {(e[0], e[1]) for e in entries}
        if len(calls) > 1:
            seen = ", ".join(
                f"rank {r}: {op_}" + ("" if root_ is None else f"(root={root_})")
                for r, (op_, root_, _) in enumerate(entries)
            )
            raise CoordinatorError(
                f"rank {rank}: the ranks called different collectives in one round ({seen}); every rank "
                "must call the same collectives in the same order with the same root"
            )
        return entries


class ThreadCoordinator(Coordinator):
    """Rank ``rank`` of a :class:`ThreadGroup`; used from that rank's thread.

    Obtain them from :attr:`ThreadGroup.coordinators` or through
    :func:`run_ranks`.
    """

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        if not 0 <= rank < group.world_size:
            raise ValueError(f"rank {rank} is not in a group of {group.world_size}")
        self._group = group
        self._rank = rank

    @property
    def group(self) -> ThreadGroup:
        """The shared state of the ranks."""
        return self._group

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._group.world_size

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        self._check_root(root)
        entries = self._group.exchange(self._rank, "gather", root, dumps(obj))
        return [_loads(e[2]) for e in entries] if self._rank == root else None

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        self._check_root(root)
        payload = [dumps(o) for o in self._scatter_payload(objs)] if self._rank == root else None
        entries = self._group.exchange(self._rank, "scatter", root, payload)
        return self._scatter_result(_loads(entries[root][2][self._rank]))

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        self._check_root(root)
        payload = dumps(obj) if self._rank == root else None
        entries = self._group.exchange(self._rank, "broadcast", root, payload)
        return _loads(entries[root][2])

    def all_gather(self, obj: Any) -> list[Any]:
        entries = self._group.exchange(self._rank, "all_gather", None, dumps(obj))
        return [_loads(e[2]) for e in entries]

    def barrier(self) -> None:
        self._group.exchange(self._rank, "barrier", None, None)

    def duplicate(self) -> ThreadCoordinator:
        """This rank of the group's next child :class:`ThreadGroup` (see :meth:`Coordinator.duplicate`).

        One round of the group (so that a rank calling another collective
        fails as usual), then the ``k``-th call of each rank returns its
        coordinator of the ``k``-th child group: same size and timeout, its own
        lock and rounds.

        Raises
        ------
        CoordinatorError
            As every collective of the group: a rank that left, a rank that
            called another collective, a rank not arriving within the timeout.
        """
        self._group.exchange(self._rank, "duplicate", None, None)
        return self._group.duplicate(self._rank).coordinators[self._rank]

    def exchange_objects(self, sends: Mapping[int, Any], sources: Iterable[int]) -> dict[int, Any]:
        """One round: each rank deposits its pickled sends, then unpickles those sent to it.

        See :meth:`Coordinator.exchange_objects`. Raises :class:`CoordinatorError`
        as every collective of the group does, and on a rank whose sources do
        not match what was sent to it.
        """
        sent, srcs = self._check_exchange(sends, sources)
        payload = {dest: dumps(obj) for dest, obj in sent.items()}
        entries = self._group.exchange(self._rank, "exchange_objects", None, payload)
        received, problems = pick_mail(self._rank, srcs, [e[2] for e in entries])
        raise_problems("exchange_objects", problems)
        return {src: _loads(data) for src, data in received.items()}

    def exchange_buffers(
        self, sends: Mapping[int, Sequence[Any]], recvs: Mapping[int, Sequence[Any]]
    ) -> None:
        """Two rounds: each rank deposits views of its buffers, copies what was sent to it, then all wait.

        Each byte is copied once, from the sender's buffer into the
        receiver's; the second round keeps each sender in the call (its
        buffers in use) until every receiver has copied. See
        :meth:`Coordinator.exchange_buffers`; raises :class:`CoordinatorError`
        as every collective of the group does, and on a rank whose receive
        buffers do not match what was sent to it (after both rounds).
        """
        send_views, recv_views = self._buffer_views(sends, recvs)
        entries = self._group.exchange(self._rank, "exchange_buffers", None, send_views)
        problems: list[str] = []
        error: BaseException | None = None
        try:
            problems = _copy_mail(self._rank, entries, recv_views)
        except BaseException as exc:  # the senders wait in the second round: reach it, then raise
            error = exc
            traceback.clear_frames(exc.__traceback__)
        # no reference to another rank's buffers may outlive the call (a sender may close its mmap then)
        del entries
        self._group.exchange(self._rank, "exchange_buffers (copied)", None, None)
        if error is not None:
            raise error
        raise_problems("exchange_buffers", problems)

    def __repr__(self) -> str:
        return f"ThreadCoordinator(rank={self._rank}, world_size={self.world_size})"


def _copy_mail(rank: int, entries: list[_Entry], recv_views: dict[int, list[memoryview]]) -> list[str]:
    """Copy into ``rank``'s receive buffers what each rank deposited for it; return the mismatches."""
    received, problems = pick_mail(rank, list(recv_views), [e[2] for e in entries])
    for src, sent in received.items():
        problems += copy_buffers(sent, recv_views[src], src, rank)
    return problems


def run_ranks(n: int, fn: Callable[[ThreadCoordinator], _T], *, timeout: float | None = 60.0) -> list[_T]:
    """Run ``fn(coordinator)`` as ranks ``0..n-1`` of a new :class:`ThreadGroup`, one thread each.

    Parameters
    ----------
    n
        Number of ranks.
    fn
        Called once per rank with that rank's :class:`ThreadCoordinator`.
    timeout
        Per-collective wait limit of the group (see :class:`ThreadGroup`).

    Returns
    -------
    list
        ``fn``'s results, indexed by rank.

    Raises
    ------
    BaseException
        If any rank raised: the exception of the rank that raised first,
        re-raised with a note naming its rank and the other ranks' errors.

    Examples
    --------
    >>> run_ranks(3, lambda c: c.all_gather(c.rank ** 2))
    [[0, 1, 4], [0, 1, 4], [0, 1, 4]]
    """
    group = ThreadGroup(n, timeout=timeout)
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def target(coordinator: ThreadCoordinator) -> None:
        try:
            results[coordinator.rank] = fn(coordinator)
        except BaseException as exc:
            with lock:
                errors.append((coordinator.rank, exc))
            group.depart(coordinator.rank, exc)
        else:
            group.depart(coordinator.rank)

    threads = [
        threading.Thread(target=target, args=(c,), name=f"gpuckpt-rank-{c.rank}", daemon=True)
        for c in group.coordinators
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        rank, first = errors[0]
        first.add_note(f"raised on rank {rank} of {n} (run_ranks)")
        others = [f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors[1:], key=lambda x: x[0])]
        if others:
            first.add_note("other ranks also raised: " + "; ".join(others))
        raise first
    return results
