"""gpuckpt.runtime.interrupts: Ctrl-C held while a step that must not stop half way runs."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from gpuckpt.runtime.interrupts import (
    after_interrupt,
    after_interrupt_for,
    held_interrupts,
    interrupt_held_for,
)


@pytest.fixture(autouse=True)
def _python_default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, as in a program (a pytest-xdist worker ignores SIGINT)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _seen_from_another_thread(ask: Callable[[], float | None] = interrupt_held_for) -> float | None:
    seen: list[float | None] = []
    t = threading.Thread(target=lambda: seen.append(ask()))
    t.start()
    t.join()
    return seen[0]


def test_an_interrupt_is_held_until_the_outermost_block_ends_and_only_the_main_thread_waits_on_it() -> None:
    # (what is seen inside is asserted outside: a failed assertion inside would end in the
    # held KeyboardInterrupt that pytest.raises expects)
    seen: dict[str, float | None] = {}
    with pytest.raises(KeyboardInterrupt), held_interrupts():
        with held_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # (the handler runs: held, not raised)
            seen["main"] = interrupt_held_for()
            seen["other"] = _seen_from_another_thread()
        seen["after inner"] = interrupt_held_for()
    assert seen["main"] is not None and seen["main"] >= 0, seen
    # a background thread's wait never gives up for the main thread's interrupt
    assert seen["other"] is None, seen
    assert seen["after inner"] is not None, seen  # the inner block ended: still held
    assert interrupt_held_for() is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_without_an_interrupt_nothing_is_raised() -> None:
    with held_interrupts():
        assert interrupt_held_for() is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_after_an_interrupt_waits_count_from_the_outermost_block_in_the_main_thread_only() -> None:
    assert after_interrupt_for() is None
    with after_interrupt():
        time.sleep(0.02)
        with after_interrupt():
            inner = after_interrupt_for()
        other = _seen_from_another_thread(after_interrupt_for)
        assert interrupt_held_for() is None  # (no interrupt is held for it)
    assert inner is not None and inner >= 0.02, inner  # the outer block's start
    assert other is None  # a background thread's wait never gives up for it
    assert after_interrupt_for() is None


def test_a_collective_after_an_interrupt_gives_up_at_the_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpuckpt.distributed.mpi as mpi

    monkeypatch.setattr(mpi, "INTERRUPT_GRACE_S", 0.01)
    assert not mpi._stranded_after_interrupt()
    with after_interrupt():
        assert not mpi._stranded_after_interrupt()
        time.sleep(0.02)
        assert mpi._stranded_after_interrupt()
