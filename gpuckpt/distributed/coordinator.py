"""The coordinator interface: collectives of small objects between the ranks of one job.

A distributed save or load runs the same code on every rank; the ranks agree
on a plan (who writes which box, which metadata is published) by exchanging
small Python objects through a :class:`Coordinator`. A save or a load moves no
tensor data through it: each rank reads and writes its own chunks in the store.

Three collectives reach further: :meth:`Coordinator.duplicate` makes a new
coordinator over the same ranks, usable from another thread at the same time
(a background writer keeps one of its own); :meth:`Coordinator.exchange_objects`
and :meth:`Coordinator.exchange_buffers` move objects and bulk bytes between
chosen pairs of ranks (copies of checkpoint files from one rank to another),
in pieces of at most :data:`PIECE_BYTES`.

Implementations: :class:`SingleProcessCoordinator` (the default, one rank),
:class:`~gpuckpt.distributed.threads.ThreadCoordinator` (N threads acting as N
ranks, for tests), :class:`~gpuckpt.distributed.mpi.MPICoordinator` (mpi4py)
and :class:`~gpuckpt.distributed.torch_dist.TorchCoordinator`
(``torch.distributed``).
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gpuckpt.distributed.exchange import (
    BufferRound,
    byte_view,
    copy_buffers,
    count_mismatch,
    dumps,
    pick_mail,
    raise_problems,
    size_mismatch,
)
from gpuckpt.errors import CoordinatorError, DistributedError, MissingDependencyError

__all__ = [
    "PIECE_BYTES",
    "Coordinator",
    "CoordinatorError",
    "DistributedError",
    "MissingDependencyError",
    "SingleProcessCoordinator",
    "check_coordinator",
    "check_error_argument",
    "collectively",
    "describe_error",
    "disagreement",
]

#: The largest message :meth:`Coordinator.exchange_buffers` sends: larger buffers go in pieces of
#: this size (256 MiB), so that no count overflows a C ``int`` (MPI's counts are ``int``). Read at
#: each call: tests set it small to exercise the pieces.
PIECE_BYTES = 256 << 20


def describe_error(error: BaseException) -> str:
    """``"TypeName: message"`` for ``error``, as reported in :attr:`DistributedError.failures`."""
    message = str(error)
    name = type(error).__name__
    return f"{name}: {message}" if message else name


def collectively(coordinator: Coordinator, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on this rank, then :meth:`Coordinator.all_reduce_errors`: every rank raises
    if it failed on any. An interrupt (``KeyboardInterrupt``, ``SystemExit``) takes part in the
    check too, so that the other ranks fail instead of waiting for this one in their next
    collective, and goes on as itself on this rank. In a group of one rank (a one-process
    save of ShardedArray boxes) the rank's own error is raised as it is: "rank 0 of 1" adds
    nothing to it."""
    result, error = None, None
    try:
        result = fn(*args)
    except BaseException as exc:  # every failure, interrupts included, must reach the check
        error = exc
    if error is not None and coordinator.world_size == 1:
        raise error
    try:
        coordinator.all_reduce_errors(error)
    except DistributedError:
        if error is not None and not isinstance(error, Exception):
            raise error from None
        raise
    return result


def disagreement(values: Sequence[Any], show: Callable[[Any], str] = repr) -> str | None:
    """None when every rank gave the same value (``values[r]``: rank ``r``'s, compared as
    ``show`` writes them); else each value and the ranks that gave it.

    >>> disagreement([1, 1, 0, 1]) is None, disagreement([1, 1, 1, 0])
    (False, '1 on ranks [0, 1, 2], 0 on rank 3')
    """
    by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(show(value), []).append(rank)
    if len(by_value) <= 1:
        return None
    return ", ".join(
        f"{value} on {'rank ' + str(ranks[0]) if len(ranks) == 1 else f'ranks {ranks}'}"
        for value, ranks in by_value.items()
    )


class Coordinator(ABC):
    """Collectives of small, picklable objects between the ranks of one job.

    Call discipline: every method except the :attr:`rank` and
    :attr:`world_size` properties is a collective. Every rank of the group
    calls the same collectives, in the same order, with the same ``root``;
    a rank that skips one, or calls them in another order, deadlocks the job
    or pairs up the wrong messages. Code that may fail on some ranks only
    therefore does not skip the next collective: it catches the error and
    passes it to :meth:`all_reduce_errors`, which every rank calls, so that
    either every rank continues or every rank raises.

    Objects that reach another rank are copies (pickled by every
    multi-rank implementation): a receiver never shares one with its sender.
    They are meant to be small (plans, box lists, metadata), not tensor data.

    A coordinator is used by one thread at a time. Work that runs in another
    thread at the same time (a background save) uses a :meth:`duplicate`: a
    coordinator over the same ranks whose messages never mix with this one's.

    A subclass implements :attr:`rank`, :attr:`world_size`, :meth:`gather`,
    :meth:`scatter`, :meth:`broadcast`, :meth:`all_gather` and
    :meth:`barrier`; :meth:`all_reduce_errors` is built on :meth:`all_gather`, and so is
    :meth:`all_reduce_xor` unless the subclass reduces in its transport (MPI and gloo do:
    what each rank receives then does not grow with the number of ranks).
    :meth:`exchange_objects` is built on :meth:`all_gather` too (correct, but every
    rank receives every rank's sends), and :meth:`exchange_buffers` on
    :meth:`exchange_objects` (the bytes are pickled and copied): a subclass
    overrides both with its transport's point-to-point messages, as gpuckpt's
    coordinators do. :meth:`duplicate` has no generic form: a subclass that
    supports it implements it (the default raises :class:`CoordinatorError`).

    Examples
    --------
    >>> from gpuckpt.distributed import SingleProcessCoordinator
    >>> c = SingleProcessCoordinator()
    >>> c.gather({"rank": c.rank})
    [{'rank': 0}]
    >>> c.all_reduce_errors(None)  # no rank failed: returns
    """

    @property
    def out_of_step(self) -> str | None:
        """Why this coordinator takes part in no further collective (an interrupt left one
        unfinished on this rank: its ranks are out of step), or None. Not a collective."""
        return None

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the group, ``0 <= rank < world_size``."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """The number of ranks in the group."""

    @abstractmethod
    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Collect ``obj`` of every rank on ``root``.

        Returns
        -------
        list or None
            On ``root``, the objects indexed by rank; ``None`` on other ranks.
        """

    @abstractmethod
    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        """Send ``objs[r]`` from ``root`` to rank ``r``; return this rank's object.

        ``root`` passes a list of exactly :attr:`world_size` objects; other
        ranks pass ``None`` (their argument is ignored). A list of the wrong
        length raises :class:`CoordinatorError` on every rank.
        """

    @abstractmethod
    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """Return ``root``'s ``obj`` on every rank (other ranks' ``obj`` is ignored)."""

    @abstractmethod
    def all_gather(self, obj: Any) -> list[Any]:
        """Return the ``obj`` of every rank, indexed by rank, on every rank."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    def idle_barrier(self) -> None:
        """:meth:`barrier` for ranks that may arrive far apart: a rank waiting here leaves the
        CPU to the ranks still working.

        A transport whose waits spin (MPICH's) polls instead, sleeping between polls; the
        others block in :meth:`barrier` (the default). Background work calls it before the
        collective that ends a step of uneven length (each rank's write, load or fetch).
        """
        self.barrier()

    def duplicate(self) -> Coordinator:
        """A new coordinator over the same ranks, for use from another thread at the same time.

        A collective: every rank calls it, in the same order relative to the
        other collectives. The ``k``-th duplicate of each rank is a member of the
        same new group, with the same :attr:`rank` and :attr:`world_size` as
        this coordinator. Messages of the duplicate never mix with this
        coordinator's (nor with another duplicate's), so that one thread may
        run collectives on this coordinator while another runs them on the
        duplicate; each coordinator is still used by one thread at a time.

        Returns
        -------
        Coordinator
            The duplicate (of the same class as this coordinator).

        Raises
        ------
        CoordinatorError
            If the transport cannot carry two threads' messages at once (MPI
            without ``MPI_THREAD_MULTIPLE``; raised on every rank), or, in this
            default, always: a subclass that supports duplicates implements
            this method.

        Examples
        --------
        >>> from gpuckpt.distributed import SingleProcessCoordinator
        >>> SingleProcessCoordinator().duplicate()
        SingleProcessCoordinator()
        """
        raise CoordinatorError(
            f"{type(self).__name__} cannot duplicate itself: Coordinator.duplicate has no generic form; "
            "implement duplicate() in the subclass (a new channel over the same ranks, usable from "
            "another thread), or use a coordinator of gpuckpt.distributed"
        )

    def host_transport(self) -> Coordinator:
        """This coordinator, or one over the same ranks whose :meth:`exchange_buffers` carries
        host memory where this one's transport does not (torch's NCCL groups: a gloo
        :meth:`duplicate`, made on the first call and kept). A collective on that first call:
        every rank calls it at the same point. Here, where every transport carries host
        memory: this coordinator."""
        return self

    def exchange_objects(self, sends: Mapping[int, Any], sources: Iterable[int]) -> dict[int, Any]:
        """Send ``sends[dest]`` to each rank ``dest``; receive one object from each rank of ``sources``.

        A collective: every rank calls it, in the same order relative to the
        other collectives, with its own ``sends`` and ``sources`` (either may be
        empty). The pairs must match, which is the caller's contract: rank
        ``s`` has ``d`` among the keys of its ``sends`` exactly when rank ``d``
        has ``s`` among its ``sources``. A rank that expects an object nobody
        sends waits for it (MPI and torch hang until their own timeouts; the
        in-process coordinators raise :class:`CoordinatorError`). A rank may
        send to itself (it receives a copy).

        The objects travel pickled, as with the other collectives: every
        object received is a copy. They are meant to be small (manifests,
        lists of sizes); bulk bytes go through :meth:`exchange_buffers`.

        Parameters
        ----------
        sends
            Rank -> the object this rank sends it.
        sources
            The ranks this rank receives one object from, each at most once.

        Returns
        -------
        dict
            Source rank -> the object it sent to this rank, for each rank of ``sources``.

        Raises
        ------
        CoordinatorError
            If a rank of ``sends`` or ``sources`` is not an ``int`` in
            ``[0, world_size)``, a source is named twice, or this rank sends to
            itself without receiving from itself (or the reverse): raised on
            this rank before anything is sent. The in-process coordinators also
            raise it when the ranks' sends and sources do not match.

        Examples
        --------
        >>> from gpuckpt.distributed import run_ranks
        >>> def ring(c):
        ...     got = c.exchange_objects({(c.rank + 1) % c.world_size: f"from {c.rank}"},
        ...                              [(c.rank - 1) % c.world_size])
        ...     return got
        >>> run_ranks(3, ring)
        [{2: 'from 2'}, {0: 'from 0'}, {1: 'from 1'}]
        """
        sent, srcs = self._check_exchange(sends, sources)
        everyone = self.all_gather({dest: dumps(obj) for dest, obj in sent.items()})
        received, problems = pick_mail(self.rank, srcs, everyone)
        raise_problems("exchange_objects", problems)
        return {src: pickle.loads(data) for src, data in received.items()}

    def exchange_buffers(
        self, sends: Mapping[int, Sequence[Any]], recvs: Mapping[int, Sequence[Any]]
    ) -> None:
        """Send the buffers of ``sends[dest]`` to each rank ``dest``; receive into those of ``recvs[source]``.

        A collective: every rank calls it, in the same order relative to the
        other collectives, with its own ``sends`` and ``recvs`` (either may be
        empty). The pairs must match, as for :meth:`exchange_objects` (the
        caller's contract): rank ``s`` has ``d`` among the keys of its
        ``sends`` exactly when rank ``d`` has ``s`` among the keys of its
        ``recvs``, empty lists included. The buffers of one pair are matched in
        order: the ``i``-th buffer rank ``s`` sends to ``d`` lands in the
        ``i``-th receive buffer ``d`` gives for ``s``, which must have the same
        size (the receiver knows the sizes in advance, e.g. from an
        :meth:`exchange_objects` round). A rank may send to itself (a copy).

        Sent buffers are bytes-like and C-contiguous, of any size, and may be
        read-only (``bytes``, a ``memoryview`` of a read-only ``mmap``); they
        are only read, and must not change until the call returns. Receive
        buffers are writable, C-contiguous bytes-like objects. Buffers larger
        than :data:`PIECE_BYTES` travel in pieces. This default pickles the
        bytes through :meth:`exchange_objects`; gpuckpt's coordinators send
        them with their transport's own point-to-point messages, without a copy
        on either side beyond what the transport makes.

        Parameters
        ----------
        sends
            Rank -> the buffers this rank sends it, in order.
        recvs
            Rank -> the buffers this rank receives from it, in order.

        Raises
        ------
        CoordinatorError
            If a rank is not an ``int`` in ``[0, world_size)``, a buffer is not
            C-contiguous, a receive buffer is read-only, or this rank sends to
            itself without receiving from itself (or the reverse): raised on
            this rank before anything is sent. If a buffer received has another
            size than its receive buffer, or a pair's sender sends another
            number of buffers than the receiver gives: raised on the receiving
            rank, once every message has arrived (no memory past a receive
            buffer is written, and the group stays usable); the other ranks
            return. Callers pass such errors to :meth:`all_reduce_errors`.

        Examples
        --------
        >>> from gpuckpt.distributed import run_ranks
        >>> def ring(c):
        ...     out = bytearray(5)
        ...     c.exchange_buffers({(c.rank + 1) % c.world_size: [b"rank%d" % c.rank]},
        ...                        {(c.rank - 1) % c.world_size: [out]})
        ...     return bytes(out)
        >>> run_ranks(3, ring)
        [b'rank2', b'rank0', b'rank1']
        """
        send_views, recv_views = self._buffer_views(sends, recvs)
        received = self.exchange_objects(
            {dest: [bytes(v) for v in views] for dest, views in send_views.items()}, recv_views
        )
        problems: list[str] = []
        for src, targets in recv_views.items():
            problems += copy_buffers(received[src], targets, src, self.rank)
        raise_problems("exchange_buffers", problems)

    def all_reduce_xor(self, values: np.ndarray) -> np.ndarray:
        """The bitwise XOR over every rank of ``values``, on every rank.

        Every rank passes an array of the same shape (taken as ``uint64``) and
        gets a new ``uint64`` array. This default gathers every rank's array on
        every rank (its cost grows with the number of ranks); the MPI and gloo
        coordinators reduce in the transport instead, so that what each rank
        receives does not grow with the ranks. Raises ValueError when the ranks'
        shapes differ (the default; a transport may fail or hang instead: pass
        equal shapes).

        Examples
        --------
        >>> import numpy as np
        >>> from gpuckpt.distributed import SingleProcessCoordinator
        >>> SingleProcessCoordinator().all_reduce_xor(np.array([5, 3], np.uint64)).tolist()
        [5, 3]
        """
        mine = np.ascontiguousarray(values, np.uint64)
        out = mine.copy()
        for rank, other in enumerate(self.all_gather(mine)):
            if rank == self.rank:
                continue
            if other.shape != out.shape:
                raise ValueError(
                    f"all_reduce_xor: rank {rank} passed shape {other.shape}, rank {self.rank} {out.shape}; "
                    "every rank must pass an array of the same shape"
                )
            np.bitwise_xor(out, other, out=out)
        return out

    def all_reduce_errors(self, error: BaseException | None) -> None:
        """Raise :class:`DistributedError` on every rank if any rank passed an error.

        Every rank calls it, with the exception it caught or ``None``. If all
        pass ``None`` it returns on every rank. Ranks may arrive far apart: it
        waits as :meth:`idle_barrier` does (MPI's coordinator, where ranks share
        cores, polls a sum of the ranks' failure flags, and gathers the errors
        only when one is set). Otherwise every rank raises
        :class:`DistributedError` whose :attr:`~DistributedError.failures`
        names each failing rank and its ``"TypeName: message"``; on a failing
        rank the error's ``__cause__`` is that rank's own exception.

        Examples
        --------
        >>> from gpuckpt.distributed import SingleProcessCoordinator
        >>> try:
        ...     SingleProcessCoordinator().all_reduce_errors(ValueError("bad value"))
        ... except Exception as e:
        ...     print(e.failures)
        {0: 'ValueError: bad value'}
        """
        check_error_argument(error)
        reports = self.all_gather(None if error is None else describe_error(error))
        failures = {rank: report for rank, report in enumerate(reports) if report is not None}
        if not failures:
            return
        raise DistributedError(failures, self.world_size) from error

    def _check_root(self, root: int) -> int:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world_size:
            raise CoordinatorError(
                f"root={root!r} is not a rank of this group; expected an int in [0, {self.world_size})"
            )
        return root

    def _check_peer(self, rank: Any, what: str) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise CoordinatorError(
                f"{what}: rank {rank!r} is not a rank of this group; "
                f"expected an int in [0, {self.world_size})"
            )
        return rank

    def _check_exchange(
        self, sends: Mapping[int, Any], sources: Iterable[int]
    ) -> tuple[dict[int, Any], list[int]]:
        """``sends`` and ``sources`` of :meth:`exchange_objects`, checked before anything is sent."""
        if not isinstance(sends, Mapping):
            raise CoordinatorError(
                f"exchange_objects: sends must be a mapping of rank -> object, got {type(sends).__name__}"
            )
        sent = {self._check_peer(dest, "exchange_objects sends"): obj for dest, obj in sends.items()}
        srcs = [self._check_peer(src, "exchange_objects sources") for src in sources]
        if len(set(srcs)) != len(srcs):
            twice = sorted({src for src in srcs if srcs.count(src) > 1})
            raise CoordinatorError(f"exchange_objects: sources name ranks {twice} more than once")
        self._check_self_pair("exchange_objects", self.rank in sent, self.rank in srcs)
        return sent, srcs

    def _buffer_views(
        self, sends: Mapping[int, Sequence[Any]], recvs: Mapping[int, Sequence[Any]]
    ) -> tuple[dict[int, list[memoryview]], dict[int, list[memoryview]]]:
        """The buffers of :meth:`exchange_buffers` as flat byte views, checked before anything is sent."""
        send_views = self._views("sends", sends, writable=False)
        recv_views = self._views("recvs", recvs, writable=True)
        self._check_self_pair("exchange_buffers", self.rank in send_views, self.rank in recv_views)
        return send_views, recv_views

    def _views(
        self, what: str, buffers: Mapping[int, Sequence[Any]], *, writable: bool
    ) -> dict[int, list[memoryview]]:
        if not isinstance(buffers, Mapping):
            raise CoordinatorError(
                f"exchange_buffers: {what} must be a mapping of rank -> list of buffers, "
                f"got {type(buffers).__name__}"
            )
        views: dict[int, list[memoryview]] = {}
        for peer, bufs in buffers.items():
            self._check_peer(peer, f"exchange_buffers {what}")
            if isinstance(bufs, bytes | bytearray | memoryview) or not isinstance(bufs, Sequence):
                raise CoordinatorError(
                    f"exchange_buffers: {what}[{peer}] must be a list of buffers, got {type(bufs).__name__} "
                    "(wrap a single buffer in a list)"
                )
            views[peer] = [
                byte_view(buf, writable=writable, name=f"exchange_buffers: {what}[{peer}][{i}]")
                for i, buf in enumerate(bufs)
            ]
        return views

    def _plan_buffer_round(
        self, sends: Mapping[int, Sequence[Any]], recvs: Mapping[int, Sequence[Any]]
    ) -> BufferRound:
        """The messages of one :meth:`exchange_buffers` over point-to-point messages, copies to self done.

        Checks the buffers, copies this rank's buffers to itself, then sends
        each receiver the sizes of its buffers (one :meth:`exchange_objects`
        round), so that a receiver posts exactly the messages its senders
        send, whatever the sizes it expected: a buffer whose size differs is
        received into a scratch buffer of its own size and reported by
        :meth:`BufferRound.finish`, never written past a receive buffer.
        """
        send_views, recv_views = self._buffer_views(sends, recvs)
        me = self.rank
        problems = copy_buffers(send_views[me], recv_views[me], me, me) if me in send_views else []
        sizes = self.exchange_objects(
            {dest: [v.nbytes for v in views] for dest, views in send_views.items() if dest != me},
            [src for src in recv_views if src != me],
        )
        piece = PIECE_BYTES
        round_ = BufferRound(problems=problems)
        for src, sent_sizes in sizes.items():
            targets = recv_views[src]
            if len(sent_sizes) != len(targets):
                round_.problems.append(count_mismatch(src, me, len(sent_sizes), len(targets)))
            for i, nbytes in enumerate(sent_sizes):
                target = targets[i] if i < len(targets) else None
                if target is None or target.nbytes != nbytes:
                    if target is not None:
                        round_.problems.append(size_mismatch(src, me, i, nbytes, target.nbytes))
                    target = memoryview(bytearray(nbytes))  # drains the message; discarded
                round_.recvs += [(src, target[off : off + piece]) for off in range(0, nbytes, piece)]
        for dest, views in send_views.items():
            if dest != me:
                round_.sends += [
                    (dest, v[off : off + piece]) for v in views for off in range(0, v.nbytes, piece)
                ]
        return round_

    def _check_self_pair(self, op: str, sends: bool, receives: bool) -> None:
        if sends != receives:
            did, did_not = ("sends to", "receive from") if sends else ("receives from", "send to")
            raise CoordinatorError(
                f"{op}: rank {self.rank} {did} itself but does not {did_not} itself; "
                "a rank's send to itself and its receive from itself come in pairs"
            )

    def _scatter_payload(self, objs: list[Any] | None) -> list[Any]:
        """What ``root`` sends: ``objs``, or a misuse marker per rank so that no rank hangs."""
        if isinstance(objs, list | tuple) and len(objs) == self.world_size:
            return list(objs)
        found = f"a list of {len(objs)}" if isinstance(objs, list | tuple) else type(objs).__name__
        marker = _ScatterMisuse(
            f"scatter: root {self.rank} must pass a list of world_size={self.world_size} objects, got {found}"
        )
        return [marker] * self.world_size

    @staticmethod
    def _scatter_result(received: Any) -> Any:
        if isinstance(received, _ScatterMisuse):
            raise CoordinatorError(received.message)
        return received


class _ScatterMisuse:
    """Sent in place of the objects when ``root`` passed a malformed list to scatter."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ScatterMisuse, (self.message,))


class SingleProcessCoordinator(Coordinator):
    """The one-rank group: rank 0 of 1. Every collective returns at once.

    Examples
    --------
    >>> c = SingleProcessCoordinator()
    >>> (c.rank, c.world_size, c.broadcast("x"), c.scatter(["only"]))
    (0, 1, 'x', 'only')
    """

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        self._check_root(root)
        return [obj]

    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        self._check_root(root)
        return self._scatter_result(self._scatter_payload(objs)[0])

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        self._check_root(root)
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None

    def duplicate(self) -> SingleProcessCoordinator:
        """A new :class:`SingleProcessCoordinator` (one rank has no messages to mix)."""
        return SingleProcessCoordinator()

    def exchange_objects(self, sends: Mapping[int, Any], sources: Iterable[int]) -> dict[int, Any]:
        """Rank 0 sends to itself only: a pickled copy of ``sends[0]`` if ``0`` is among ``sources``.

        See :meth:`Coordinator.exchange_objects` (and what it raises).
        """
        sent, srcs = self._check_exchange(sends, sources)
        return {0: pickle.loads(dumps(sent[0]))} if srcs else {}

    def exchange_buffers(
        self, sends: Mapping[int, Sequence[Any]], recvs: Mapping[int, Sequence[Any]]
    ) -> None:
        """Rank 0 sends to itself only: a copy of each buffer of ``sends[0]`` into ``recvs[0]``.

        See :meth:`Coordinator.exchange_buffers` (and what it raises).
        """
        send_views, recv_views = self._buffer_views(sends, recvs)
        if send_views:
            raise_problems("exchange_buffers", copy_buffers(send_views[0], recv_views[0], 0, 0))

    def __repr__(self) -> str:
        return "SingleProcessCoordinator()"


def check_error_argument(error: Any) -> None:
    """The ``TypeError`` of :meth:`Coordinator.all_reduce_errors` given neither an exception
    nor None, raised before any collective."""
    if error is not None and not isinstance(error, BaseException):
        raise TypeError(f"all_reduce_errors expects an exception or None, got {type(error).__name__}")


def check_coordinator(coordinator: Any) -> None:
    """A ``TypeError`` that names what was passed unless ``coordinator`` is None or a
    :class:`Coordinator` (raised before any rank starts work it could not finish)."""
    if coordinator is not None and not isinstance(coordinator, Coordinator):
        raise TypeError(
            f"coordinator must be a gpuckpt.distributed.Coordinator (MPICoordinator, TorchCoordinator, "
            f"ThreadCoordinator) or None, got {type(coordinator).__name__}"
        )
