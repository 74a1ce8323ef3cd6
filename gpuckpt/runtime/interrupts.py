"""Ctrl-C (``SIGINT``) held while a step that must not stop half way runs.

A collective of several messages, or a manager's call that gathers the ranks' reports and
then acts on them, left half done by ``KeyboardInterrupt`` leaves the ranks out of step: the
next collective pairs one call's messages with another's. :func:`held_interrupts` holds
``SIGINT`` in the main thread (the only one Python delivers it to) and runs the handler it
replaced once the step is over; a waiting loop inside may ask how long one has been held
(:func:`interrupt_held_for`) and give up after a grace. Re-entrant: the outermost holder
delivers it. Elsewhere (another thread; ``SIGINT`` ignored or left to its default action)
nothing is held.

An interrupt that ended an operation on one rank may have ended the others' elsewhere, or not
at all: the next collective this rank joins may be one that the others never join. Such a
step runs in :func:`after_interrupt`, where the same waiting loops give up after the same grace
counted from the block's start (:func:`after_interrupt_for`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["after_interrupt", "after_interrupt_for", "held_interrupts", "interrupt_held_for"]


class _Held:
    def __init__(self) -> None:
        self.depth = 0
        self.previous: Any = None
        self.caught: tuple[int, Any] | None = None
        self.at: float | None = None  # when the held interrupt came
        self.since: float | None = None  # when the outermost after_interrupt block began

    def hold(self, signum: int, frame: Any) -> None:
        if self.caught is None:
            self.caught, self.at = (signum, frame), time.monotonic()


_HELD = _Held()


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Hold ``SIGINT`` for the ``with`` block (see the module docstring). An interrupt that
    came meanwhile is delivered when the outermost block ends, also when it ends in an
    exception (the interrupt's ``KeyboardInterrupt`` then carries it as its context), unless
    that exception is itself a ``KeyboardInterrupt``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _HELD.depth == 0:
        previous = signal.getsignal(signal.SIGINT)
        if not callable(previous):  # ignored, or the default action: nothing to hold
            yield
            return
        _HELD.previous, _HELD.caught, _HELD.at = previous, None, None
        signal.signal(signal.SIGINT, _HELD.hold)
    _HELD.depth += 1
    interrupted = False
    try:
        yield
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        _HELD.depth -= 1
        if _HELD.depth == 0:
            signal.signal(signal.SIGINT, _HELD.previous)
            caught, _HELD.caught, _HELD.at = _HELD.caught, None, None
            if caught is not None and not interrupted:
                _HELD.previous(*caught)  # Python's default handler raises KeyboardInterrupt


def interrupt_held_for() -> float | None:
    """Seconds since an interrupt came that :func:`held_interrupts` holds, or None (none held;
    always None in a thread other than the main one, which is never the holder: a background
    thread's wait must not give up for the main thread's interrupt)."""
    at = _HELD.at
    if at is None or threading.current_thread() is not threading.main_thread():
        return None
    return time.monotonic() - at


@contextlib.contextmanager
def after_interrupt() -> Iterator[None]:
    """Mark the ``with`` block as a step taken after an interrupt ended an earlier one on this
    rank (the other ranks may never join its collectives): a waiting loop inside gives up
    after the grace counted from the block's start (:func:`after_interrupt_for`). Main thread
    only; re-entrant (the outermost block's start counts)."""
    if threading.current_thread() is not threading.main_thread() or _HELD.since is not None:
        yield
        return
    _HELD.since = time.monotonic()
    try:
        yield
    finally:
        _HELD.since = None


def after_interrupt_for() -> float | None:
    """Seconds since the running :func:`after_interrupt` block began, or None (none runs;
    always None in a thread other than the main one)."""
    since = _HELD.since
    if since is None or threading.current_thread() is not threading.main_thread():
        return None
    return time.monotonic() - since
