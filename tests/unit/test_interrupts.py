"""gpuckpt.runtime.interrupts: Ctrl-C held while a step that must not stop half way runs."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from gpuckpt.runtime.interrupts import held_interrupts, interrupt_held_for


@pytest.fixture(autouse=True)
def _python_default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, as in a program (a pytest-xdist worker ignores SIGINT)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _seen_from_another_thread() -> float | None:
    seen: list[float | None] = []
    t = threading.Thread(target=lambda: seen.append(interrupt_held_for()))
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
