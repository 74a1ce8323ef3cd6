"""Parallel jobs of one save, load, verify or resharding run.

Every pipeline splits its work into jobs (a chunk, or a batch of small
chunks) and runs them here, on :class:`gpuckpt.runtime.workers.Workers` threads:
work submitted while the interpreter exits still runs (in the calling thread
when no thread can be started any more), and a child created by ``fork()``
starts with fresh pools.

* :func:`default_threads`: how many threads a run uses unless told.
* :data:`compressing`: how many chunks the process compresses at once (:class:`CpuSlots`):
  one core fewer than it may use, at least one.
* :class:`Batcher` / :func:`batches`: small host jobs gathered into batches of
  about :data:`IO_BATCH_BYTES` or :data:`IO_BATCH_JOBS` (one task per few-KiB
  chunk would cost more than the chunk's I/O).
* :class:`Runner`: jobs submitted one by one, results in submission order;
  the first error stops the run: jobs not started yet are skipped (their
  ``cancel`` cleanup runs instead), running ones finish, and that error is
  raised. :func:`run_all` and :func:`run_ordered` run a list or a stream of
  jobs through one.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from types import TracebackType
from typing import Generic, TypeVar

from gpuckpt.runtime.workers import Workers

__all__ = [
    "IO_BATCH_BYTES",
    "IO_BATCH_JOBS",
    "Batcher",
    "Runner",
    "batches",
    "compressing",
    "CpuSlots",
    "default_threads",
    "run_all",
    "run_ordered",
]

T = TypeVar("T")
R = TypeVar("R")

#: small host chunks go to the I/O threads in batches of about this many bytes or chunks
IO_BATCH_BYTES = 1 << 20
IO_BATCH_JOBS = 64


def default_threads() -> int:
    """I/O threads: enough to overlap checksums, writes and fsyncs on small machines."""
    return max(2, min(8, (os.cpu_count() or 2) * 2))


class CpuSlots:
    """At most ``limit`` holders at once (a ``with`` block each), process-wide; by default one
    fewer than the CPUs this process may use (``os.sched_getaffinity``), at least one. A child
    created by ``fork()`` starts with every slot free (the parent's holders are not its own).

    Compression is the one step of a save that can take every core: with the I/O threads all
    compressing at once (4 on a 2-vCPU VM) a save's uploads, and the server they went to, waited
    for a core; with one compression at a time, a save of 1 GiB through a 200 MB/s link went
    from 7.1-8.0 s to 6.3-6.4 s, compressing as many bytes (bench/RESULTS.md)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit if limit is not None else max(1, len(os.sched_getaffinity(0)) - 1)
        self._reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._slots = threading.BoundedSemaphore(self.limit)

    def __enter__(self) -> None:
        self._slots.acquire()

    def __exit__(self, *exc: object) -> None:
        self._slots.release()


#: the chunks a process compresses at once (see :class:`CpuSlots`)
compressing = CpuSlots()


class Batcher(Generic[T]):
    """Gathers items into batches of at least ``max_bytes`` bytes or ``max_items`` items.

    :meth:`add` returns a batch as soon as it is full; :meth:`take` returns
    what is gathered so far (the last, partial batch).
    """

    def __init__(self, max_bytes: int = IO_BATCH_BYTES, max_items: int = IO_BATCH_JOBS) -> None:
        if max_bytes < 1 or max_items < 1:
            raise ValueError(f"batch limits must be positive, got {max_bytes} bytes and {max_items} items")
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._items: list[T] = []
        self._bytes = 0

    def add(self, item: T, nbytes: int) -> list[T] | None:
        """Add ``item`` (of ``nbytes`` bytes); the batch it completes, or None."""
        self._items.append(item)
        self._bytes += nbytes
        if self._bytes >= self.max_bytes or len(self._items) >= self.max_items:
            return self.take()
        return None

    def take(self) -> list[T]:
        """The items gathered so far (possibly none); the next batch starts empty."""
        items, self._items, self._bytes = self._items, [], 0
        return items


def batches(
    items: Iterable[tuple[T, int]], max_bytes: int = IO_BATCH_BYTES, max_items: int = IO_BATCH_JOBS
) -> Iterator[list[T]]:
    """The ``(item, nbytes)`` pairs of ``items`` gathered into batches, in order (see :class:`Batcher`)."""
    batcher: Batcher[T] = Batcher(max_bytes, max_items)
    for item, nbytes in items:
        full = batcher.add(item, nbytes)
        if full is not None:
            yield full
    rest = batcher.take()
    if rest:
        yield rest


class Runner(Generic[R]):
    """Jobs of one run on up to ``threads`` worker threads (:func:`default_threads` when None).

    Call order: use as a context manager; :meth:`submit` jobs (from one
    producer thread), taking results in submission order with :meth:`take`
    or :meth:`results` at any point; leaving the block waits for every job
    that started and ends the threads.

    The first error of a job (or of the producer, when it leaves the block
    with one) stops the run: :meth:`submit` raises it instead of queueing
    more, jobs not started yet are skipped and their ``cancel`` cleanup runs
    instead (every submitted job either runs or is cancelled), and
    :meth:`take` / :meth:`results` raise it.
    """

    def __init__(self, threads: int | None = None, *, name: str = "gpuckpt-run") -> None:
        self._workers = Workers(threads or default_threads(), name)
        self._futures: deque[Future[R]] = deque()
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def _fail(self, exc: BaseException) -> BaseException:
        """Record ``exc`` unless an error came first; returns the first error."""
        with self._lock:
            if self._error is None:
                self._error = exc
            return self._error

    def _call(self, job: Callable[[], R], cancel: Callable[[], None] | None) -> R:
        if self._error is not None:
            if cancel is not None:
                cancel()
            raise CancelledError()
        try:
            return job()
        except BaseException as exc:
            self._fail(exc)
            raise

    def check(self) -> None:
        """Raise the first error, if a job failed already (a producer stops making jobs)."""
        if self._error is not None:
            raise self._error

    def submit(self, job: Callable[[], R], *, cancel: Callable[[], None] | None = None) -> None:
        """Queue ``job``; ``cancel`` (if given) runs instead of it when the run stops first.

        Raises the first error of the run, after running ``cancel``, if a job failed already.
        """
        if self._error is not None:
            if cancel is not None:
                cancel()
            raise self._error
        self._futures.append(self._workers.submit(self._call, job, cancel))

    @property
    def pending(self) -> int:
        """Jobs submitted whose results were not taken yet."""
        return len(self._futures)

    def take(self) -> R:
        """The result of the oldest job not taken yet (waits for it); raises the run's first error."""
        future = self._futures.popleft()
        try:
            return future.result()
        except BaseException as exc:
            first = self._fail(exc)
            if first is exc:
                raise
        raise first  # an earlier error of another job (this one was skipped, or failed later)

    def results(self) -> list[R]:
        """The results of every job not taken yet, in submission order."""
        return [self.take() for _ in range(len(self._futures))]

    def __enter__(self) -> Runner[R]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._fail(exc)  # jobs not started are skipped
        self._workers.shutdown(wait=True)


def run_all(
    jobs: Sequence[Callable[[], R]], *, threads: int | None = None, name: str = "gpuckpt-run"
) -> list[R]:
    """Run ``jobs`` in parallel; their results in order. A single job runs in the calling thread."""
    if len(jobs) <= 1:
        return [job() for job in jobs]
    with Runner[R](threads, name=name) as run:
        for job in jobs:
            run.submit(job)
        return run.results()


def run_ordered(
    jobs: Iterable[Callable[[], R]],
    *,
    window: int,
    threads: int | None = None,
    name: str = "gpuckpt-run",
) -> Generator[R, None, None]:
    """Run ``jobs`` in parallel with at most ``window`` results not taken; yield results in order.

    ``jobs`` is consumed as results are taken, so a stream of a million jobs
    holds ``window`` of them at a time. Closing the iterator early skips the
    jobs not started.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    with Runner[R](threads, name=name) as run:
        for job in jobs:
            run.submit(job)
            if run.pending >= window:
                yield run.take()
        while run.pending:
            yield run.take()
