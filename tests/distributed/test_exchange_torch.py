"""TorchCoordinator's exchanges and duplicates over gloo (4 processes; the checks of ``scripts/exchange_checks.py``).

The ``run_torch`` fixture skips a test when torch.distributed is not importable;
the tests carry the ``torch`` marker (run in the Python 3.11 venv, where a skip is a failure).
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.torch


def test_exchanges_over_gloo(run_torch: Any, load_script: Any) -> None:
    """The checks on the world group, then a duplicate of a group that lists the ranks in reverse."""
    checks = load_script("exchange_checks")
    results = run_torch(4, "exchange_checks.py", "torch", timeout=120).check(4)
    for rank in range(4):
        assert results[rank].pop("reversed") == checks.expected_reversed(rank, 4)
        assert results[rank] == checks.expected(rank, 4)


def test_exchanges_over_a_subgroup(run_torch: Any, load_script: Any) -> None:
    """Ranks are those of the given group (torch's src/dst are global ranks); its duplicates hold only its members."""
    expected = load_script("exchange_checks").expected
    results = run_torch(4, "exchange_checks.py", "torch-split", timeout=120).check(4)
    for rank in range(4):
        assert results[rank] == expected(rank // 2, 2)
