"""Whether MPICoordinator's waits sleep (from the launcher's count of ranks on the node and the CPUs
this process may use), and how long they sleep (no MPI needed)."""

from __future__ import annotations

import os

import pytest

from gpuckpt.distributed.mpi import LOCAL_RANKS_VARIABLES, shares_cores


def test_ranks_beyond_the_cpus_share_cores() -> None:
    cpus = len(os.sched_getaffinity(0))
    for name in LOCAL_RANKS_VARIABLES:
        assert shares_cores({name: str(cpus + 1)}) is True
        assert shares_cores({name: str(cpus)}) is False
        assert shares_cores({name: "1"}) is False


def test_the_first_launcher_variable_set_to_a_number_decides() -> None:
    cpus = len(os.sched_getaffinity(0))
    first, second = LOCAL_RANKS_VARIABLES[:2]
    assert shares_cores({first: "1", second: str(cpus + 1)}) is False
    assert shares_cores({first: "", second: str(cpus + 1)}) is True
    assert shares_cores({first: "four", second: str(cpus + 1)}) is True


def test_unknown_means_a_core_each() -> None:
    assert shares_cores({}) is False
    assert shares_cores({"UNRELATED": "99999"}) is False


class _Clock:
    """A virtual clock for ``_poll_idle``: ``sleep`` advances it and records the sleep."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[tuple[float, float]] = []  # (when, how long)

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append((self.now, seconds))
        self.now += seconds


def test_an_idle_wait_sleeps_a_fiftieth_of_its_wait_from_50_us_to_2_ms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sleeps grow with the time waited since the last progress (2% of it, from 50 us to 2 ms),
    and start from the shortest again once a test completes something: a wait of 1 s that
    completes one of its two requests at 0.5 s."""
    import gpuckpt.distributed.mpi as mpi

    clock = _Clock()
    monkeypatch.setattr(mpi, "time", clock)
    done_at = {"a": 0.5, "b": 1.0}

    def finish(pending: list[str]) -> list[str]:
        return [p for p in pending if clock.now < done_at[p]]

    mpi._poll_idle(["a", "b"], finish)
    assert clock.now >= 1.0
    # each test follows a sleep; the first test at 0.5 s or later completes "a"
    since = 0.0
    for when, seconds in clock.sleeps:
        if since == 0.0 and when >= 0.5:
            since = when
            assert seconds == mpi.IDLE_POLL_MIN_S
        waited = when - since
        assert seconds == pytest.approx(min(mpi.IDLE_POLL_MAX_S, max(mpi.IDLE_POLL_MIN_S, 0.02 * waited)))
    # per half second: 50 us sleeps to 2.5 ms, growing ones to 0.1 s (50 ln 40, about 184), then 2 ms
    assert 750 < len(clock.sleeps) < 950, len(clock.sleeps)
