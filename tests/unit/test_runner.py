"""The runner of parallel jobs: result order, first-error cancellation, batching, threads."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from gpuckpt.runtime import runner
from gpuckpt.runtime.runner import (
    IO_BATCH_BYTES,
    IO_BATCH_JOBS,
    Batcher,
    Runner,
    batches,
    run_all,
    run_ordered,
)

WAIT = 10.0  # seconds a test waits for an event that must come at once (a bound, never reached)


def _raise(exc: BaseException) -> Callable[[], None]:
    def job() -> None:
        raise exc

    return job


def _threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def _assert_threads_end(prefix: str) -> None:
    for t in _threads_named(prefix):
        t.join(WAIT)
    assert _threads_named(prefix) == []


def test_results_come_in_submission_order_whatever_order_jobs_finish_in() -> None:
    n = 4
    go = [threading.Event() for _ in range(n)]
    finished: list[int] = []

    def job(i: int) -> Callable[[], int]:
        def run() -> int:
            assert go[i].wait(WAIT)
            finished.append(i)
            if i > 0:
                go[i - 1].set()  # the jobs finish last to first
            return i * 10

        return run

    go[n - 1].set()
    assert run_all([job(i) for i in range(n)], threads=n) == [0, 10, 20, 30]
    assert finished == [3, 2, 1, 0]


def test_a_single_job_runs_in_the_calling_thread_and_no_job_is_no_work() -> None:
    assert run_all([lambda: threading.current_thread()]) == [threading.current_thread()]
    assert run_all([]) == []


def test_first_error_skips_the_jobs_not_started_runs_their_cleanup_and_is_raised() -> None:
    ran: list[int] = []
    cancelled: list[int] = []
    all_queued = threading.Event()

    def job(i: int) -> Callable[[], int]:
        def run() -> int:
            ran.append(i)
            if i == 0:
                assert all_queued.wait(WAIT)
                raise ValueError("job 0 failed")
            return i

        return run

    # one thread: the others are queued behind job 0 when it fails
    with pytest.raises(ValueError, match="job 0 failed"), Runner[int](1, name="gpuckpt-test-cancel") as run:
        for i in range(10):
            run.submit(job(i), cancel=functools.partial(cancelled.append, i))
        all_queued.set()
        run.results()
    assert ran == [0]
    assert cancelled == list(range(1, 10))  # each skipped job's cleanup ran instead
    _assert_threads_end("gpuckpt-test-cancel")


def test_after_a_failure_submit_refuses_with_that_error_and_cleans_up() -> None:
    cleaned: list[str] = []
    with Runner[None](2) as run:
        run.submit(_raise(KeyError("disk gone")))
        with pytest.raises(KeyError, match="disk gone"):
            run.take()
        with pytest.raises(KeyError, match="disk gone"):
            run.check()
        with pytest.raises(KeyError, match="disk gone"):
            run.submit(lambda: cleaned.append("ran"), cancel=lambda: cleaned.append("cleaned"))
    assert cleaned == ["cleaned"]


def test_an_error_of_the_producer_stops_the_run_and_running_jobs_finish() -> None:
    ran: list[int] = []
    cancelled: list[int] = []

    def first() -> None:
        # runs until the run has stopped, so that the others are still queued then
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                run.check()
            except RuntimeError:
                break
            time.sleep(0.001)
        ran.append(0)

    with pytest.raises(RuntimeError, match="interrupted"), Runner[None](1, name="gpuckpt-test-stop") as run:
        run.submit(first, cancel=lambda: cancelled.append(0))
        for i in range(1, 4):
            run.submit(functools.partial(ran.append, i), cancel=functools.partial(cancelled.append, i))
        raise RuntimeError("interrupted")  # e.g. KeyboardInterrupt while staging the next chunk
    assert ran == [0]  # the running job finished before the block was left
    assert cancelled == [1, 2, 3]
    _assert_threads_end("gpuckpt-test-stop")


def test_run_ordered_keeps_at_most_a_window_of_jobs_in_flight() -> None:
    made = 0

    def jobs() -> Iterator[Callable[[], int]]:
        nonlocal made
        for i in range(50):
            made += 1
            yield functools.partial(pow, i, 2)

    taken = 0
    for value in run_ordered(jobs(), window=3, threads=2):
        assert value == taken * taken
        taken += 1
        assert made <= taken + 3
    assert taken == 50


def test_closing_run_ordered_early_skips_the_rest_and_ends_its_threads() -> None:
    ran: list[int] = []

    def job(i: int) -> int:
        ran.append(i)
        return i

    results = run_ordered(
        (functools.partial(job, i) for i in range(1000)), window=4, threads=2, name="gpuckpt-test-close"
    )
    assert [next(results) for _ in range(3)] == [0, 1, 2]
    results.close()
    assert len(ran) < 1000
    _assert_threads_end("gpuckpt-test-close")
    with pytest.raises(ValueError, match="window"):
        next(run_ordered([], window=0))


def test_batches_close_at_the_byte_or_the_count_limit_and_keep_order() -> None:
    # the count limit: many tiny items
    tiny = list(batches((i, 1) for i in range(2 * IO_BATCH_JOBS + 5)))
    assert [len(b) for b in tiny] == [IO_BATCH_JOBS, IO_BATCH_JOBS, 5]
    # the byte limit: a batch closes on the item that reaches it
    size = 300 << 10
    mid = list(batches((i, size) for i in range(10)))
    per = -(-IO_BATCH_BYTES // size)
    assert [len(b) for b in mid] == [per] * (10 // per) + ([10 % per] if 10 % per else [])
    # a large item closes the batch it joins; order is kept throughout
    mixed = [("a", 10), ("b", 10), ("big", IO_BATCH_BYTES), ("c", 10)]
    assert list(batches(mixed)) == [["a", "b", "big"], ["c"]]
    assert [x for b in tiny for x in b] == list(range(2 * IO_BATCH_JOBS + 5))
    assert list(batches([])) == []


def test_batcher_returns_full_batches_and_the_rest() -> None:
    b: Batcher[str] = Batcher(max_bytes=100, max_items=3)
    assert b.add("x", 10) is None and b.add("y", 10) is None
    assert b.add("z", 10) == ["x", "y", "z"]
    assert b.add("big", 100) == ["big"]
    assert b.take() == [] and b.add("w", 1) is None and b.take() == ["w"]
    with pytest.raises(ValueError, match="positive"):
        Batcher(max_bytes=0)


def test_runs_leave_no_threads_behind() -> None:
    before = threading.active_count()
    for _ in range(20):
        jobs = [functools.partial(int, i) for i in range(16)]
        assert run_all(jobs, threads=4, name="gpuckpt-test-leak") == list(range(16))
        with pytest.raises(OSError), Runner[None](4, name="gpuckpt-test-leak") as run:
            for _ in range(8):
                run.submit(_raise(OSError("no space")))
            run.results()
    _assert_threads_end("gpuckpt-test-leak")
    assert threading.active_count() <= before


def test_default_threads_is_bounded() -> None:
    assert 2 <= runner.default_threads() <= 8
