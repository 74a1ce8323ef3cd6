"""Distributed save and resharded load under mpiexec: save with N ranks, load with M != N ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt

# run_mpi skips the tests when mpiexec or mpi4py is missing
pytestmark = pytest.mark.skipif(not hasattr(gpuckpt, "ShardedArray"), reason="distributed save not available")

SCRIPT = "sharded_save_load.py"


def _check_single_process_view(module: Any, path: Path) -> None:
    """load_state_dict in one process returns the full global tensors and the plain values."""
    sd = gpuckpt.load_state_dict(path)
    for key, full in module.global_tensors().items():
        node: Any = sd
        for part in key.split("."):
            node = node[part]
        assert isinstance(node, np.ndarray), (key, type(node))
        assert node.dtype == full.dtype and np.array_equal(node, full), key
    for key, value in module.PLAIN.items():
        assert sd[key] == value, key


@pytest.mark.parametrize(("n_save", "n_load"), [(2, 3), (3, 4), (4, 2)])
def test_save_with_n_ranks_load_with_m(
    run_mpi: Any, load_script: Any, tmp_path: Path, n_save: int, n_load: int
) -> None:
    module = load_script("sharded_save_load")
    path = tmp_path / "ckpt"
    saved = run_mpi(n_save, SCRIPT, "save", path, timeout=60).check(n_save)
    assert all(r == {"saved": True} for r in saved.values())
    loaded = run_mpi(n_load, SCRIPT, "load", path, timeout=60).check(n_load)
    for rank in range(n_load):
        assert loaded[rank] == module.expected_loaded(), f"rank {rank} of {n_load}"
    _check_single_process_view(module, path)


def test_compressed_save_with_3_ranks_loads_with_2(run_mpi: Any, load_script: Any, tmp_path: Path) -> None:
    module = load_script("sharded_save_load")
    path = tmp_path / "ckpt"
    run_mpi(3, SCRIPT, "save_compressed", path, timeout=60).check(3)
    md = gpuckpt.read_metadata(path)
    assert md.version == "4" and all("codec" in e for e in md.storage_data["tensors"].values())
    loaded = run_mpi(2, SCRIPT, "load", path, timeout=60).check(2)
    assert all(r == module.expected_loaded() for r in loaded.values())
    _check_single_process_view(module, path)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_async_save_with_n_ranks(run_mpi: Any, load_script: Any, tmp_path: Path, n: int) -> None:
    module = load_script("sharded_save_load")
    path = tmp_path / "ckpt"
    run_mpi(n, SCRIPT, "async_save", path, timeout=60).check(n)
    loaded = run_mpi(1 + n % 4, SCRIPT, "load", path, timeout=60).check(1 + n % 4)
    assert all(r == module.expected_loaded() for r in loaded.values())
    _check_single_process_view(module, path)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_rank_failing_during_save_fails_every_rank_and_publishes_nothing(
    run_mpi: Any, tmp_path: Path, n: int
) -> None:
    path = tmp_path / "ckpt"
    results = run_mpi(n, SCRIPT, "save_fail", path, timeout=60).check(n)
    for rank in range(n):
        assert results[rank] == {
            "raised": "DistributedError",
            "failing_ranks": [1],
            "rank_1_reports": "UnsupportedValueError",
            "message_names_rank_1": True,
            "published": False,
        }, f"rank {rank} of {n}"
    assert not path.exists()
    with pytest.raises(gpuckpt.CheckpointNotFoundError):
        gpuckpt.load_state_dict(path)
