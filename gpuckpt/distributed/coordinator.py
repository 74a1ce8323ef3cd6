"""The coordinator interface: collectives of small objects between the ranks of one job.

A distributed save or load runs the same code on every rank; the ranks agree
on a plan (who writes which box, which metadata is published) by exchanging
small Python objects through a :class:`Coordinator`. Bulk tensor data never
goes through it: each rank reads and writes its own chunks in the store.

Implementations: :class:`SingleProcessCoordinator` (the default, one rank),
:class:`~gpuckpt.distributed.threads.ThreadCoordinator` (N threads acting as N
ranks, for tests), :class:`~gpuckpt.distributed.mpi.MPICoordinator` (mpi4py)
and :class:`~gpuckpt.distributed.torch_dist.TorchCoordinator`
(``torch.distributed``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from gpuckpt.errors import CoordinatorError, DistributedError, MissingDependencyError

__all__ = [
    "Coordinator",
    "CoordinatorError",
    "DistributedError",
    "MissingDependencyError",
    "SingleProcessCoordinator",
    "describe_error",
]


def describe_error(error: BaseException) -> str:
    """``"TypeName: message"`` for ``error``, as reported in :attr:`DistributedError.failures`."""
    message = str(error)
    name = type(error).__name__
    return f"{name}: {message}" if message else name


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

    A subclass implements :attr:`rank`, :attr:`world_size`, :meth:`gather`,
    :meth:`scatter`, :meth:`broadcast`, :meth:`all_gather` and
    :meth:`barrier`; :meth:`all_reduce_errors` is built on :meth:`all_gather`, and so is
    :meth:`all_reduce_xor` unless the subclass reduces in its transport (MPI and gloo do:
    what each rank receives then does not grow with the number of ranks).

    Examples
    --------
    >>> from gpuckpt.distributed import SingleProcessCoordinator
    >>> c = SingleProcessCoordinator()
    >>> c.gather({"rank": c.rank})
    [{'rank': 0}]
    >>> c.all_reduce_errors(None)  # no rank failed: returns
    """

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
        pass ``None`` it returns on every rank. Otherwise every rank raises
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
        if error is not None and not isinstance(error, BaseException):
            raise TypeError(f"all_reduce_errors expects an exception or None, got {type(error).__name__}")
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

    def __repr__(self) -> str:
        return "SingleProcessCoordinator()"
