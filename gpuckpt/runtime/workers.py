"""Worker threads that gpuckpt owns: the thread pool behind saves, usable until the process ends.

:class:`concurrent.futures.ThreadPoolExecutor` is unusable for work that must
finish while the interpreter exits: once its exit hook has run it refuses new
work ("cannot schedule new futures after interpreter shutdown"), and since
Python 3.12 no thread at all can be started once shutdown has begun. Its pools
also lose their threads in a child created by ``fork()`` while still believing
they have some, so work submitted in the child never runs.

:class:`Workers` keeps the same ``submit`` / ``shutdown`` / ``with`` interface
with these differences:

* it never refuses work because the interpreter is exiting; a call that cannot
  get a thread (none can be started any more and none is left) runs in the
  calling thread instead, so work submitted during exit still completes;
* its threads are daemon threads, and end after a few idle seconds: exit
  does not wait for idle workers, and a pool no longer used is collected. Work
  that must finish at exit is waited for explicitly (:meth:`Workers.drain`,
  see :mod:`gpuckpt.pending`);
* in a child created by ``fork()`` every pool starts empty (no threads, no
  queued work: the parent's queued calls run in the parent only) with fresh
  locks, and starts threads again on demand;
* ``nice``: its threads lower their own CPU priority (:func:`lower_priority`), so that
  background work (a local tier's writes and replication, a drain) yields the cores to
  the training threads, whose priority stays as it was (on Linux the nice value is per
  thread); threads they start inherit it;
* its threads say ``defers_library_loads``: a library whose first use would hold
  the GIL for long (awscrt's load, 40-60 ms, see :mod:`gpuckpt.format.checksum`)
  is not loaded on them while a library already loaded can do the work, since
  every other thread of the run would wait for it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

__all__ = ["Workers", "lower_priority"]

_P = ParamSpec("_P")
_T = TypeVar("_T")

_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]

_all_pools: weakref.WeakSet[Workers] = weakref.WeakSet()
#: an idle thread ends after this long (the next call starts one again), so that a pool
#: nobody uses any more holds no thread and can be collected
_IDLE_SECONDS = 5.0


class _WorkerThread(threading.Thread):
    """A thread of a :class:`Workers` pool."""

    #: asked (duck-typed) by code that would load a slow library on first use
    defers_library_loads = True


def lower_priority(nice: int = 19) -> None:
    """Set the calling thread's nice value to ``nice`` (19: the least CPU priority).

    On Linux the nice value belongs to the thread (``sched(7)``): the process's other
    threads keep theirs, and threads started from this one inherit it. Elsewhere, or where
    the system refuses, nothing happens.
    """
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def _run(item: _Item) -> None:
    future, fn, args, kwargs = item
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


class Workers:
    """Up to ``max_workers`` threads (started on demand) running submitted calls in order.

    Call order: :meth:`submit` any number of times (from any thread), then
    :meth:`shutdown` once (or leave a ``with`` block); a pool that lives as
    long as the process is never shut down, and :meth:`drain` waits until its
    queued work is done.
    """

    def __init__(self, max_workers: int, name: str, *, nice: int | None = None) -> None:
        if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
            raise ValueError(f"max_workers must be an integer >= 1, got {max_workers!r}")
        self.max_workers = max_workers
        self.name = name
        #: the nice value each thread takes when it starts (None: the starting thread's)
        self.nice = nice
        self._reset()
        _all_pools.add(self)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        # idle workers wait on one condition, callers of drain/shutdown on the other:
        # a finished call wakes no idle worker
        self._ready = threading.Condition(self._lock)
        self._changed = threading.Condition(self._lock)
        self._queue: deque[_Item] = deque()
        self._threads: set[threading.Thread] = set()
        self._idle = 0
        self._running = 0
        self._closed = False

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        """Queue ``fn(*args, **kwargs)``; returns its future."""
        future: Future[_T] = Future()
        item: _Item = (future, fn, args, kwargs)
        thread = None
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.name} workers are shut down; no new work is accepted")
            self._queue.append(item)
            if len(self._queue) > self._idle and len(self._threads) < self.max_workers:
                thread = _WorkerThread(
                    target=self._work, name=f"{self.name}_{len(self._threads)}", daemon=True
                )
                self._threads.add(thread)
            self._ready.notify()
        if thread is not None and not self._start(thread):
            # no thread could be started (interpreter exit, or the system's thread limit):
            # with no thread left to take the queued calls, they run here
            while True:
                with self._lock:
                    if self._threads or not self._queue:
                        break
                    queued = self._queue.popleft()
                    self._running += 1
                try:
                    _run(queued)
                finally:
                    del queued
                    with self._lock:
                        self._running -= 1
                        self._changed.notify_all()
        return future

    def _start(self, thread: threading.Thread) -> bool:
        try:
            thread.start()
        except RuntimeError:
            with self._lock:
                self._threads.discard(thread)
                self._changed.notify_all()
            return False
        return True

    def _work(self) -> None:
        me = threading.current_thread()
        if self.nice is not None:
            lower_priority(self.nice)
        while True:
            with self._lock:
                idle_out = False
                while not self._queue and not self._closed and not idle_out:
                    self._idle += 1
                    try:
                        idle_out = not self._ready.wait(_IDLE_SECONDS)
                    finally:
                        self._idle -= 1
                if not self._queue:
                    self._threads.discard(me)
                    self._changed.notify_all()
                    return
                item = self._queue.popleft()
                self._running += 1
            try:
                _run(item)
            finally:
                del item
                with self._lock:
                    self._running -= 1
                    self._changed.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no work is queued or running (including work submitted meanwhile).

        Returns False if ``timeout`` seconds passed first.
        """
        with self._lock:
            return self._changed.wait_for(lambda: not self._queue and not self._running, timeout)

    def pending(self) -> int:
        """Calls queued or running."""
        with self._lock:
            return len(self._queue) + self._running

    def shutdown(self, wait: bool = True) -> None:
        """Accept no more work; with ``wait``, return once the queued work is done and the threads ended."""
        with self._lock:
            self._closed = True
            self._ready.notify_all()
            if wait:
                self._changed.wait_for(lambda: not self._threads and not self._running)

    def __enter__(self) -> Workers:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown(wait=True)


def _after_fork_in_child() -> None:
    # only the forking thread exists in the child: threads, locks (possibly held
    # by a thread that is gone) and the parent's queued work are all dropped
    for pool in list(_all_pools):
        pool._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
