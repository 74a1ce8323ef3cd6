"""Workers(nice=): background threads at a lower CPU priority, the caller's thread unchanged."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from gpuckpt.runtime.workers import Workers, lower_priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_threads_of_nice_workers_take_the_nice_value_and_the_caller_keeps_its_own() -> None:
    before = _nice()
    with Workers(2, "test-nice", nice=19) as pool:
        seen = [pool.submit(_nice).result() for _ in range(3)]

        def started_here() -> int:  # threads a worker starts (a save's I/O threads) inherit it
            out: list[int] = []
            t = threading.Thread(target=lambda: out.append(_nice()))
            t.start()
            t.join()
            return out[0]

        inherited = pool.submit(started_here).result()
    assert seen == [19, 19, 19] and inherited == 19
    assert _nice() == before


def test_workers_without_nice_run_at_the_callers_priority() -> None:
    with Workers(1, "test-plain") as pool:
        assert pool.submit(_nice).result() == _nice()


def test_lower_priority_changes_the_calling_thread_only() -> None:
    before = _nice()
    out: list[int] = []

    def lowered() -> None:
        lower_priority(7)
        out.append(_nice())

    t = threading.Thread(target=lowered)
    t.start()
    t.join()
    assert out == [max(7, before)] and _nice() == before
