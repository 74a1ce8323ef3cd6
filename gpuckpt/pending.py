"""Background saves in flight: their futures, their writer threads, and the promise kept at exit.

Each queued save runs on a writer thread (one per process, one per
coordinator for distributed saves) and is tracked here until it is done.

A returned future is a promise kept at exit: the interpreter's exit (the
main module ending, ``sys.exit``, an uncaught exception) first waits for
every queued save. A save that failed without anyone asking for its outcome
(``result()`` or ``exception()``) is reported on standard error, and the
process then exits with status 1. Other background work whose return made the same promise
(a :class:`~gpuckpt.CheckpointManager`'s local tier: a part's write and its replication
round, a drain to the root) is kept here too (:func:`keep_until_exit`) and waited for at
the same points; its owner takes charge of a failure by reporting it (:func:`taken`), and
one it never reported is reported at exit like a save's. The threads involved are gpuckpt's own
(:mod:`gpuckpt.runtime.workers`), so nothing refuses the work during exit, and after
``fork()`` the child starts with empty queues and fresh locks: its own saves
run, the parent's saves stay the parent's.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from gpuckpt.errors import ForkedSaveError, InvalidOptionError
from gpuckpt.format.metadata import Metadata
from gpuckpt.runtime.workers import Workers

__all__ = ["SaveFuture", "keep_until_exit", "submit", "taken", "wait_all", "writer_executor"]

_lock = threading.Lock()
_executors: dict[int, Workers] = {}
#: saves queued or running in this process, and saves that failed (kept until exit)
_inflight: set[SaveFuture] = set()
_failed: list[SaveFuture] = []
#: other background work that exit waits for (see keep_until_exit): its future -> what it
#: writes; and those that failed, until their owner takes charge of the failure
_kept: dict[Future[Any], str] = {}
_kept_failed: dict[Future[Any], str] = {}
#: exit progress: a drain began (a daemon thread's later saves run in that thread); the final
#: drain has run (every later save runs in its caller); a drain was interrupted; kept work
#: failed and its owner never reported it (see keep_until_exit)
_exit = {"draining": False, "final": False, "interrupted": False, "kept_failed": False}


def writer_executor(coordinator: Any = None) -> Workers:
    """The background writer: one per process, and one per coordinator (rank) for distributed saves,
    so that ranks simulated by threads of one process do not queue behind each other."""
    key = 0 if coordinator is None else id(coordinator)
    with _lock:
        ex = _executors.get(key)
        if ex is None:
            ex = _executors[key] = Workers(1, "gpuckpt-async")
        return ex


class SaveFuture:
    """The result of :func:`async_save`: ``done()``, ``result(timeout)``, ``exception(timeout)``.

    Asking for the outcome (``result()`` or ``exception()``) takes charge of
    a failure; a failed save whose outcome nobody asked for is reported at
    exit, and makes the process exit with status 1.
    """

    def __init__(self, future: Future[Metadata], path: str) -> None:
        self._future = future
        self.path = path
        self._pid = os.getpid()
        self._observed = False
        self._reported = False

    def _outcome(self, timeout: float | None) -> BaseException | None:
        if timeout is not None and (
            not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout >= 0
        ):
            raise InvalidOptionError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        if timeout is not None and timeout >= threading.TIMEOUT_MAX:
            timeout = None  # (inf, or longer than a wait can be: no limit, as None)
        if os.getpid() != self._pid and not self._future.done():
            raise ForkedSaveError(
                f"the async save to {self.path} was started by process {self._pid} before it forked; "
                "it completes in that process only: wait for it there (this process saves on its own)"
            )
        try:
            # raises TimeoutError only while the save is unfinished (its own error may be a TimeoutError)
            exc = self._future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(f"async save to {self.path} not finished after {timeout} s") from None
        self._observed = True
        return exc

    def done(self) -> bool:
        """True once the checkpoint is published (or the save failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Metadata:
        """Wait for the save; returns its metadata or raises its error.

        Raises ``TimeoutError`` if it is not finished within ``timeout`` seconds.
        """
        self._outcome(timeout)
        return self._future.result()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save; returns its error, or None if it succeeded."""
        return self._outcome(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<SaveFuture {self.path} {state}>"


def submit(
    ex: Workers,
    fn: Callable[[], Metadata],
    path: str,
    handover: Callable[[Future[Metadata]], None] | None = None,
) -> SaveFuture:
    """Queue ``fn`` on ``ex`` (run it here once the exit drain is over) and track its future."""
    if _exit["final"] or (_exit["draining"] and threading.current_thread().daemon):
        # the interpreter is past its last drain: a queued save would be lost, so it runs now;
        # a daemon thread's, once the drain began, too: one that saves back to back would keep
        # the drain waiting for ever (the interpreter abandons it, and a save cut short
        # publishes nothing)
        raw: Future[Metadata] = Future()
        raw.set_running_or_notify_cancel()
        try:
            raw.set_result(fn())
        except BaseException as exc:
            raw.set_exception(exc)
    else:
        raw = ex.submit(fn)
    fut = SaveFuture(raw, path)
    with _lock:
        _inflight.add(fut)
    if handover is not None:
        handover(raw)
    raw.add_done_callback(lambda _: _settled(fut))
    return fut


def _settled(fut: SaveFuture) -> None:
    """Runs once a save is done: it is no longer in flight; a failure is kept for the exit report."""
    failed = not fut._future.cancelled() and fut._future.exception() is not None
    with _lock:
        _inflight.discard(fut)
        if failed:
            _failed.append(fut)


def keep_until_exit(future: Future[Any], what: str) -> None:
    """Make exit wait for ``future`` too, as for a queued save: background work whose return
    promised that something would be written (``what``: what it writes, named in the report of
    its failure). A failure stays until :func:`taken`; one never taken is reported at exit, and
    the process then exits with status 1. In a distributed job every rank's exit waits for its
    own work, so the ranks' background collectives meet as they would have without the exit."""
    with _lock:
        _kept[future] = what
    future.add_done_callback(_kept_done)


def _kept_done(future: Future[Any]) -> None:
    with _lock:
        what = _kept.pop(future, None)
        if what is not None and not future.cancelled() and future.exception() is not None:
            _kept_failed[future] = what


def taken(*futures: Future[Any]) -> None:
    """The owner of these kept futures took charge of their outcome (it reported their failure,
    or waited for them on closing): exit neither waits for them nor reports them."""
    with _lock:
        for f in futures:
            _kept.pop(f, None)
            _kept_failed.pop(f, None)


def _wait_kept() -> None:
    """Block until no kept work is running (work kept meanwhile too)."""
    while True:
        with _lock:
            running = [f for f in _kept if not f.done()]
        if not running:
            return
        for f in running:
            f.exception()  # (waits; the outcome stays in the future)


def wait_all() -> None:
    """Block until every queued async save has finished (errors stay in their futures)."""
    _drain_all()


def _drain_all() -> None:
    # loop: a save may be queued (or a writer created) while others are waited for
    while True:
        with _lock:
            executors = list(_executors.values())
        if not any(ex.pending() for ex in executors):
            return
        for ex in executors:
            ex.drain()


def _report(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass  # no usable stderr: nothing else to tell


def _unhandled_failures() -> list[SaveFuture]:
    with _lock:
        return [f for f in _failed if not f._observed]


def _drain_at_exit(final: bool) -> None:
    """Wait for every queued save before the interpreter goes (a return from async_save
    promised that the state would be written); report what could not be written.

    Runs twice: before the interpreter joins its threads (this also runs in a
    ``multiprocessing`` child, which skips ``atexit``) and, ``final``, from
    ``atexit``, after the program's own exit handlers, which may have saved too.
    """
    _exit["draining"] = True
    if not _exit["interrupted"]:
        try:
            _drain_all()
            _wait_kept()  # (a tier's work saves nothing through the writers above)
        except KeyboardInterrupt:
            _exit["interrupted"] = True
            with _lock:
                paths = sorted(f.path for f in _inflight) + sorted(
                    w for f, w in _kept.items() if not f.done()
                )
            _report(
                "gpuckpt: interrupted while waiting for background saves at exit; not written: "
                f"{', '.join(paths) or '(none)'} (nothing was published for them; an earlier "
                "checkpoint at the same path is intact)\n"
            )
    if final:
        _exit["final"] = True
    failures = _unhandled_failures()
    for f in failures:
        if f._reported:
            continue
        f._reported = True
        exc = f._future.exception()
        assert exc is not None
        _report(
            f"gpuckpt: the background save to {f.path} failed and its result was never asked for; "
            "nothing was published there:\n" + "".join(traceback.format_exception(exc))
        )
    with _lock:
        kept_failures = list(_kept_failed.items())
        _kept_failed.clear()
        _exit["kept_failed"] = _exit["kept_failed"] or bool(kept_failures)
    for fut, what in kept_failures:
        exc = fut.exception()
        assert exc is not None
        _report(
            f"gpuckpt: background work failed and was never reported (its CheckpointManager was not "
            f"closed); not written: {what}:\n" + "".join(traceback.format_exception(exc))
        )
    if final and (failures or _exit["interrupted"] or _exit["kept_failed"]):
        _report(
            "gpuckpt: exiting with status 1 because a background save did not complete (see above); "
            "call result() on the future async_save returns, or close() the CheckpointManager, "
            "to handle its errors\n"
        )
        _exit_now(1)


def _exit_now(status: int) -> None:
    """End the process with ``status`` (Python's own exit status is fixed before exit handlers
    run): flush what would be flushed, then leave."""
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _after_fork_in_child() -> None:
    # the parent's saves (queued, running or failed) are the parent's to finish and report;
    # the worker pools and arena pools reset themselves
    global _lock
    _lock = threading.Lock()
    _inflight.clear()
    _failed.clear()
    _kept.clear()
    _kept_failed.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
# the final drain runs from atexit (registered now, at import: after handlers registered
# later, which may still save); the first, before the interpreter joins its threads
atexit.register(_drain_at_exit, True)
_register_before_thread_join = getattr(threading, "_register_atexit", None)
if _register_before_thread_join is not None:
    with contextlib.suppress(RuntimeError):  # imported while the interpreter is already exiting
        _register_before_thread_join(_drain_at_exit, False)
