"""The transfer rules of object-store saves: part sizes and the budget of requests and bytes."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuckpt.storage.s3.client import RequestBudget, plan_parts, pop_transfer_options


@given(st.integers(1, 1 << 40), st.integers(5 << 20, 1 << 30))
def test_parts_are_between_one_and_two_part_sizes_and_cover_the_object(nbytes: int, part: int) -> None:
    n, size = plan_parts(nbytes, part)
    assert n >= 1 and size * n >= nbytes and size * (n - 1) < nbytes  # every part holds bytes
    if n > 1:
        assert part <= size < 2 * part + 1  # never a tiny last part
    else:
        assert nbytes < 2 * part


def test_the_budget_never_holds_more_than_its_requests_and_bytes() -> None:
    budget = RequestBudget(3, byte_limit=100)
    held, peak, lock = [0, 0], [0, 0], threading.Lock()

    def worker(n: int, nbytes: int) -> None:
        for _ in range(20):
            with budget.take(n, nbytes) as slots:
                with lock:
                    held[0] += slots
                    held[1] += min(nbytes, 100)
                    peak[0], peak[1] = max(peak[0], held[0]), max(peak[1], held[1])
                time.sleep(0.0005)
                with lock:
                    held[0] -= slots
                    held[1] -= min(nbytes, 100)

    threads = [
        threading.Thread(target=worker, args=(n, b)) for n, b in [(1, 40), (2, 30), (5, 250), (1, 0)] * 2
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert peak[0] <= 3 and peak[1] <= 100, peak
    assert budget.in_use == (0, 0)


@pytest.mark.parametrize(
    ("key", "value"),
    [("max_requests", 0), ("part_bytes", 1 << 20), ("max_parts_in_flight", "4"), ("upload_buffer_bytes", -1)],
)
def test_bad_transfer_options_are_refused_with_their_name(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=key):
        pop_transfer_options({key: value})
