"""A coordinator over an MPI communicator (mpi4py, imported when one is created).

Collectives of objects use mpi4py's pickle-based calls; ``exchange_objects``
uses its point-to-point ones (``isend``, ``recv``), ``exchange_buffers`` the
buffer ones (``Isend``, ``Irecv``, then a wait) straight on the caller's
buffers, and ``duplicate`` the communicator's ``Dup``, which needs an MPI
initialised with ``MPI_THREAD_MULTIPLE``.

MPICH's blocking waits spin. Where a node runs more ranks than a rank may use
CPUs (:func:`shares_cores`), a rank that spins takes a core from the ranks it
waits for, so there every wait tests its requests (or probes for the messages) with
sleeps in between (with single-copy transfers, the receiver copies a whole message in one
test): the collectives of objects become two non-blocking collectives of bytes (the pickles'
sizes, then the pickles: :class:`_IdleObjects`), the barrier an ``Ibarrier``.

A collective of those two steps must not be left half done: Ctrl-C (``SIGINT``) arriving
between them left this rank's first step pending while its next collective began, so that
the ranks paired the wrong messages (a hang, an abort inside MPICH, or one collective's
pickle read as another's). In the main thread, ``SIGINT`` is therefore held while such a
collective runs, and its handler runs (``KeyboardInterrupt``) once the collective is over;
if the other ranks do not finish it within :data:`INTERRUPT_GRACE_S` of the interrupt, the
interrupt is raised anyway and the coordinator refuses every later collective
(:class:`CoordinatorError`): its ranks are out of step, and the job has to end. A collective
run after an interrupt ended an earlier operation on this rank
(:func:`~gpuckpt.runtime.interrupts.after_interrupt`: the other ranks may never join it) gives
up after the same grace, with a :class:`CoordinatorError`, and the coordinator refuses every
later one as well.
"""

from __future__ import annotations

import functools
import os
import pickle
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gpuckpt.distributed.coordinator import (
    Coordinator,
    CoordinatorError,
    MissingDependencyError,
    check_error_argument,
)
from gpuckpt.runtime.interrupts import after_interrupt_for, held_interrupts, interrupt_held_for

__all__ = ["MPICoordinator"]

# Tags of the point-to-point messages; the coordinator's communicator carries nothing else (a duplicate
# of the job's communicator, ideally: see MPICoordinator.duplicate).
_OBJECT_TAG = 0x6770
_BUFFER_TAG = 0x6771
#: the longest sleep between two tests of an idle wait (:func:`_poll_idle`)
IDLE_POLL_MAX_S = 0.002
#: the shortest sleep of such a wait: its first, and the first after a test that completed something
IDLE_POLL_MIN_S = 50e-6
#: a sleep is at most this fraction of the time waited since the last progress
IDLE_POLL_FRACTION = 0.02


#: how long a collective that Ctrl-C came into goes on waiting for the other ranks (see the
#: module docstring)
INTERRUPT_GRACE_S = 5.0


class _Stranded(Exception):
    """The other ranks did not finish a collective within the grace after an interrupt."""


def _stranded_after_interrupt() -> bool:
    """Whether an interrupt held while the running collective waits came more than the grace
    ago, or the collective runs after an interrupt (see the module docstring) and began more
    than the grace ago."""
    return any(
        waited is not None and waited > INTERRUPT_GRACE_S
        for waited in (interrupt_held_for(), after_interrupt_for())
    )


def _whole(method: Callable[..., Any]) -> Callable[..., Any]:
    """A collective of :class:`MPICoordinator` that is never left half done (see the module
    docstring): where its waits are idle (two steps, a wait Python can interrupt) and in the
    main thread, ``SIGINT`` is held until it is over."""

    @functools.wraps(method)
    def run(self: MPICoordinator, *args: Any, **kwargs: Any) -> Any:
        if self._stranded is not None:
            raise CoordinatorError(self._stranded)
        if self._idle is None:
            return method(self, *args, **kwargs)
        with held_interrupts():
            try:
                return method(self, *args, **kwargs)
            except _Stranded:
                held = interrupt_held_for() is not None
                when = "was interrupted (Ctrl-C) in" if held else "joined, after an interrupt (Ctrl-C),"
                self._stranded = (
                    f"rank {self._rank} {when} a collective that the other ranks did not finish within "
                    f"{INTERRUPT_GRACE_S:g} s: the job's ranks are out of step, and this coordinator "
                    "takes part in no further collective; end the job and start it again"
                )
                if held:
                    raise KeyboardInterrupt from None
                raise CoordinatorError(self._stranded) from None

    return run


#: the launchers' variables that give the number of ranks on this rank's node (MPICH's Hydra,
#: Open MPI, Slurm's srun with one task per rank)
LOCAL_RANKS_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def shares_cores(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this node runs more ranks than this process may use CPUs.

    The number of ranks on the node comes from the launcher's environment
    (:data:`LOCAL_RANKS_VARIABLES`, the first one set to a number), the CPUs
    from ``os.sched_getaffinity``. Unknown: False (each rank is taken to have a
    core of its own, and waits spin, as MPI's own do).

    >>> shares_cores({"MPI_LOCALNRANKS": "100000"})
    True
    >>> shares_cores({"MPI_LOCALNRANKS": "1"}), shares_cores({})
    (False, False)
    """
    env = os.environ if environ is None else environ
    for name in LOCAL_RANKS_VARIABLES:
        text = env.get(name, "").strip()
        if text.isdigit():
            return int(text) > len(os.sched_getaffinity(0))
    return False


def _poll_idle(pending: list[Any], finish: Callable[[list[Any]], list[Any]]) -> None:
    """Call ``finish(pending)`` (it completes what it can and returns what is still pending)
    until nothing is, sleeping between calls that completed nothing: a sleep is
    :data:`IDLE_POLL_FRACTION` of the time waited since the wait began or last completed
    something, from :data:`IDLE_POLL_MIN_S` to :data:`IDLE_POLL_MAX_S`.

    What a sleep adds to a wait is then at most 2% of it (plus the shortest sleep), while a
    long wait still tests only every 2 ms. A round of many messages completes them one
    handshake after another, each needing a test on both ends, and a non-blocking collective
    moves on one step per test of each rank taking part, without completing anything the
    test sees: sleeps that grew with each test regardless (50 us doubling to 2 ms) added up
    to 10-25 ms over the three collectives that close a replaced node's restore (4 ranks of
    256 MiB on a 2-vCPU VM: the ranks that had waited longest slept longest). The restore
    took 0.18, 0.18 and 0.20 s that way, and 0.15, 0.16 and 0.13 s with this schedule
    (medians of 6 rounds, three pairs of interleaved runs). Sleeping anew from the shortest
    after progress, 256 MiB in the 55 messages of a part's 37 files moved one way in
    0.06-0.12 s where sleeps that only grew took 0.15-0.18 s."""
    since = time.perf_counter()
    while pending:
        left = finish(pending)
        now = time.perf_counter()
        if len(left) < len(pending):
            since = now
        else:
            time.sleep(min(IDLE_POLL_MAX_S, max(IDLE_POLL_MIN_S, IDLE_POLL_FRACTION * (now - since))))
        pending = left
        if pending and _stranded_after_interrupt():
            raise _Stranded


def _wait_idle(requests: Sequence[Any]) -> None:
    """Test ``requests`` until all are done, sleeping between tests (:func:`_poll_idle`)."""
    from mpi4py import MPI

    def finish(pending: list[Any]) -> list[Any]:
        done = MPI.Request.Testsome(pending)
        if done is None:  # (no active request left)
            return []
        finished = set(done)
        return [r for i, r in enumerate(pending) if i not in finished]

    _poll_idle(list(requests), finish)


def _receive_idle(comm: Any, sources: Sequence[int], tag: int) -> dict[int, Any]:
    """``comm.recv`` of one message of ``tag`` from each of ``sources``, in the order they
    arrive: probed for with sleeps between the probes (:func:`_poll_idle`; a blocking receive
    probes by spinning)."""
    received: dict[int, Any] = {}

    def finish(pending: list[int]) -> list[int]:
        for src in pending:
            if comm.iprobe(source=src, tag=tag):
                received[src] = comm.recv(source=src, tag=tag)
        return [src for src in pending if src not in received]

    _poll_idle(list(sources), finish)
    return received


class _IdleObjects:
    """mpi4py's pickle-based collectives as non-blocking collectives of bytes, waited for
    with sleeps (:func:`_wait_idle`): first the pickles' sizes, then the pickles.

    mpi4py's own (``comm.allgather`` and the others) also move the sizes first, then the
    bytes, in blocking calls whose waits spin. A rank that waits there for a late one takes
    a core from it where ranks share cores: after a restore of a replaced node (4 ranks on a
    2-vCPU VM), the ranks that had finished spun in its closing ``allgather`` for 2-14 ms
    while the last rank, woken from a sleep, waited for a core to finish its own part."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())

    @staticmethod
    def _dumps(obj: Any) -> np.ndarray:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)

    @staticmethod
    def _layout(sizes: np.ndarray) -> tuple[list[int], list[int]]:
        counts = [int(n) for n in sizes]
        return counts, [int(d) for d in np.concatenate(([0], np.cumsum(sizes[:-1])))]

    @staticmethod
    def _loads(data: np.ndarray, counts: list[int], displs: list[int]) -> list[Any]:
        view = memoryview(data)
        return [pickle.loads(view[d : d + n]) for n, d in zip(counts, displs, strict=True)]

    def all_gather(self, obj: Any) -> list[Any]:
        from mpi4py import MPI

        mine = self._dumps(obj)
        size, sizes = np.array([mine.size], np.int64), np.empty(self.size, np.int64)
        _wait_idle([self.comm.Iallgather(size, sizes)])
        counts, displs = self._layout(sizes)
        data = np.empty(sum(counts), np.uint8)
        _wait_idle([self.comm.Iallgatherv(mine, [data, counts, displs, MPI.BYTE])])
        return self._loads(data, counts, displs)

    def gather(self, obj: Any, root: int) -> list[Any] | None:
        from mpi4py import MPI

        mine = self._dumps(obj)
        at_root = self.rank == root
        size, sizes = np.array([mine.size], np.int64), np.empty(self.size, np.int64) if at_root else None
        _wait_idle([self.comm.Igather(size, sizes, root=root)])
        if not at_root:
            _wait_idle([self.comm.Igatherv(mine, None, root=root)])
            return None
        assert sizes is not None
        counts, displs = self._layout(sizes)
        data = np.empty(sum(counts), np.uint8)
        _wait_idle([self.comm.Igatherv(mine, [data, counts, displs, MPI.BYTE], root=root)])
        return self._loads(data, counts, displs)

    def broadcast(self, obj: Any, root: int) -> Any:
        data = self._dumps(obj) if self.rank == root else np.empty(0, np.uint8)
        size = np.array([data.size], np.int64)
        _wait_idle([self.comm.Ibcast(size, root=root)])
        if self.rank != root:
            data = np.empty(int(size[0]), np.uint8)
        _wait_idle([self.comm.Ibcast(data, root=root)])
        return obj if self.rank == root else pickle.loads(memoryview(data))

    def scatter(self, objs: list[Any] | None, root: int) -> Any:
        from mpi4py import MPI

        parts = [self._dumps(o) for o in objs] if objs is not None else None  # (at the root)
        sizes = None if parts is None else np.array([p.size for p in parts], np.int64)
        size = np.empty(1, np.int64)
        _wait_idle([self.comm.Iscatter(sizes, size, root=root)])
        send = None
        if parts is not None and sizes is not None:
            counts, displs = self._layout(sizes)
            send = [np.concatenate(parts), counts, displs, MPI.BYTE]
        data = np.empty(int(size[0]), np.uint8)
        _wait_idle([self.comm.Iscatterv(send, data, root=root)])
        return pickle.loads(memoryview(data))


def _comm_world() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise MissingDependencyError(
            f"MPICoordinator needs mpi4py, which cannot be imported ({exc}); install it with an MPI "
            "library, e.g. `pip install mpich mpi4py`, and start the job with that MPI's mpiexec"
        ) from exc
    return MPI.COMM_WORLD


class MPICoordinator(Coordinator):
    """The ranks of an MPI communicator.

    Uses mpi4py's pickle-based collectives (``comm.gather``, ``comm.bcast``,
    ...), which suit the small objects a coordinator exchanges; where the node's
    ranks share cores (:func:`shares_cores`), the same as non-blocking collectives
    of bytes waited for with sleeps (:class:`_IdleObjects`). The objects
    travel between the trusted ranks of one job and are never stored. Bulk
    bytes (:meth:`exchange_buffers`) travel as MPI messages of bytes, in
    pieces of at most :data:`~gpuckpt.distributed.coordinator.PIECE_BYTES`.

    Parameters
    ----------
    comm
        An ``mpi4py.MPI.Comm`` (or an object with the same collectives,
        blocking and non-blocking). Default: ``MPI.COMM_WORLD``; mpi4py is imported, and
        MPI initialised, only then.

    Examples
    --------
    Run with ``mpiexec -n 4 python train.py``::

        from gpuckpt.distributed import MPICoordinator
        coordinator = MPICoordinator()
        gpuckpt.save(state, "ckpt", coordinator=coordinator)
    """

    def __init__(self, comm: Any = None) -> None:
        self._comm = _comm_world() if comm is None else comm
        self._rank = int(self._comm.Get_rank())
        self._size = int(self._comm.Get_size())
        #: the collectives' idle waits, where the node's ranks share cores (else None: MPI's own)
        self._idle = _IdleObjects(self._comm) if shares_cores() else None
        #: why this coordinator refuses collectives (an interrupt left one unfinished), or None
        self._stranded: str | None = None

    @property
    def _waits_idle(self) -> bool:
        return self._idle is not None

    @_waits_idle.setter
    def _waits_idle(self, idle: bool) -> None:  # (tests run both kinds of waits in one job)
        self._idle = _IdleObjects(self._comm) if idle else None

    @property
    def out_of_step(self) -> str | None:
        return self._stranded

    @property
    def comm(self) -> Any:
        """The underlying communicator."""
        return self._comm

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    @_whole
    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        self._check_root(root)
        if self._idle is not None:
            return self._idle.gather(obj, root)
        out = self._comm.gather(obj, root=root)
        return list(out) if self._rank == root else None

    @_whole
    def scatter(self, objs: list[Any] | None, root: int = 0) -> Any:
        self._check_root(root)
        payload = self._scatter_payload(objs) if self._rank == root else None
        if self._idle is not None:
            return self._scatter_result(self._idle.scatter(payload, root))
        return self._scatter_result(self._comm.scatter(payload, root=root))

    @_whole
    def broadcast(self, obj: Any, root: int = 0) -> Any:
        self._check_root(root)
        if self._idle is not None:
            return self._idle.broadcast(obj if self._rank == root else None, root)
        return self._comm.bcast(obj if self._rank == root else None, root=root)

    @_whole
    def all_gather(self, obj: Any) -> list[Any]:
        if self._idle is not None:
            return self._idle.all_gather(obj)
        return list(self._comm.allgather(obj))

    @_whole
    def all_reduce_xor(self, values: np.ndarray) -> np.ndarray:
        from mpi4py import MPI

        send = np.ascontiguousarray(values, np.uint64)
        out = np.empty_like(send)
        if self._idle is not None:
            _wait_idle([self.comm.Iallreduce(send, out, op=MPI.BXOR)])
        else:
            self.comm.Allreduce(send, out, op=MPI.BXOR)
        return out

    @_whole
    def barrier(self) -> None:
        if self._idle is not None:
            _wait_idle([self._comm.Ibarrier()])
        else:
            self._comm.Barrier()

    @_whole
    def all_reduce_errors(self, error: BaseException | None) -> None:
        """See :meth:`Coordinator.all_reduce_errors`. Where the node's ranks share cores
        (:func:`shares_cores`): first a non-blocking sum of the ranks' failure flags, tested with
        sleeps in between (as :meth:`idle_barrier` waits: the ranks of background work arrive
        far apart), and the errors gathered only where some rank failed; one collective of a
        few bytes when none did."""
        if not self._waits_idle:
            super().all_reduce_errors(error)
            return
        check_error_argument(error)
        from mpi4py import MPI

        flag = np.array([0 if error is None else 1], dtype=np.int64)
        failed = np.zeros(1, dtype=np.int64)
        _wait_idle([self._comm.Iallreduce(flag, failed, op=MPI.SUM)])
        if failed[0]:
            super().all_reduce_errors(error)

    @_whole
    def idle_barrier(self) -> None:
        """``comm.Ibarrier()`` tested with sleeps in between (growing to
        :data:`IDLE_POLL_MAX_S`): MPICH's blocking waits spin, and a rank that
        spins takes a core from the ranks it waits for where ranks share cores.

        See :meth:`Coordinator.idle_barrier`.
        """
        _wait_idle([self._comm.Ibarrier()])

    def duplicate(self) -> MPICoordinator:
        """A coordinator over ``comm.Dup()``: the same ranks, a communicator of its own.

        See :meth:`Coordinator.duplicate`. Two threads then call MPI at the
        same time, which MPI allows only when initialised with
        ``MPI_THREAD_MULTIPLE``. Every rank first gathers every rank's thread
        level, so that all of them refuse, or none does.

        Raises
        ------
        CoordinatorError
            On every rank, if any rank's MPI provides less than
            ``MPI_THREAD_MULTIPLE`` (``MPI.Query_thread()``).
        """
        from mpi4py import MPI

        levels = self._comm.allgather(int(MPI.Query_thread()))
        lacking = [rank for rank, level in enumerate(levels) if level != MPI.THREAD_MULTIPLE]
        if lacking:
            names = {
                int(MPI.THREAD_SINGLE): "MPI_THREAD_SINGLE",
                int(MPI.THREAD_FUNNELED): "MPI_THREAD_FUNNELED",
                int(MPI.THREAD_SERIALIZED): "MPI_THREAD_SERIALIZED",
            }
            found = ", ".join(f"rank {r}: {names.get(levels[r], levels[r])}" for r in lacking)
            raise CoordinatorError(
                "MPICoordinator.duplicate: a duplicate is used from another thread while this coordinator "
                "is used, so two threads call MPI at once, which needs MPI_THREAD_MULTIPLE; MPI was "
                f'initialised with less ({found}). Set mpi4py.rc.thread_level = "multiple" (mpi4py\'s '
                "default) before the first `from mpi4py import MPI`, with an MPI build that provides it "
                "(MPICH and Open MPI do)"
            )
        return MPICoordinator(self._comm.Dup())

    def exchange_objects(self, sends: Mapping[int, Any], sources: Iterable[int]) -> dict[int, Any]:
        """``comm.isend`` of each object, ``comm.recv`` from each source (pickled, of any size).

        See :meth:`Coordinator.exchange_objects`. A copy goes to this rank
        itself without MPI. A source that sends nothing leaves this rank
        waiting (the pairs are the caller's contract). Where the node's ranks
        share cores (:func:`shares_cores`), each message is probed for with
        sleeps in between, and received as it comes.
        """
        from mpi4py import MPI

        sent, srcs = self._check_exchange(sends, sources)
        me = self._rank
        requests = [
            self._comm.isend(obj, dest=dest, tag=_OBJECT_TAG) for dest, obj in sent.items() if dest != me
        ]
        received: dict[int, Any] = {}
        if me in srcs:
            received[me] = pickle.loads(pickle.dumps(sent[me], protocol=pickle.HIGHEST_PROTOCOL))
        # a receive probes for the size first (irecv would need a buffer as large as any message)
        others = [src for src in srcs if src != me]
        if self._waits_idle:
            received.update(_receive_idle(self._comm, others, _OBJECT_TAG))
            _wait_idle(requests)
        else:
            for src in others:
                received[src] = self._comm.recv(source=src, tag=_OBJECT_TAG)
            MPI.Request.waitall(requests)
        return {src: received[src] for src in srcs}

    def exchange_buffers(
        self, sends: Mapping[int, Sequence[Any]], recvs: Mapping[int, Sequence[Any]]
    ) -> None:
        """``comm.Isend``/``comm.Irecv`` of bytes straight from and into the buffers, then a wait.

        See :meth:`Coordinator.exchange_buffers`. The sizes go first (one
        :meth:`exchange_objects` round), so that each receiver posts exactly
        the messages its senders send; copies to this rank itself are made
        without MPI. The wait is ``Waitall``, or, where the node's ranks share
        cores (:func:`shares_cores`), tests with sleeps in between.
        """
        from mpi4py import MPI

        plan = self._plan_buffer_round(sends, recvs)
        requests = [
            self._comm.Isend([piece, MPI.BYTE], dest=dest, tag=_BUFFER_TAG) for dest, piece in plan.sends
        ]
        requests += [
            self._comm.Irecv([piece, MPI.BYTE], source=src, tag=_BUFFER_TAG) for src, piece in plan.recvs
        ]
        if self._waits_idle:
            _wait_idle(requests)
        else:
            MPI.Request.Waitall(requests)
        plan.finish()

    def __repr__(self) -> str:
        return f"MPICoordinator(rank={self._rank}, world_size={self._size})"
