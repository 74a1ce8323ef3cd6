"""The metadata of a checkpoint is parsed and validated once per root document and process:
later loads of the same bytes reuse it; other bytes (an overwrite, damage, a hostile edit)
are validated again; what callers receive is never shared with the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.loading import open as opening
from gpuckpt.testing.faults import rewrite_root_metadata


def _count_validations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = opening.read_index

    def counted(data: Any) -> Any:
        calls.append(1)
        return real(data)

    monkeypatch.setattr(opening, "read_index", counted)
    return calls


def _state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "t": {
            f"w{i}": rng.standard_normal(int(n)).astype(np.float32)
            for i, n in enumerate(rng.integers(1, 500, 60))
        },
        "step": seed,
    }


def test_later_loads_of_the_same_checkpoint_skip_validation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = _state(1)
    gpuckpt.save(sd, tmp_path / "c")
    calls = _count_validations(monkeypatch)
    first = gpuckpt.load_state_dict(tmp_path / "c")
    second = gpuckpt.load_state_dict(tmp_path / "c")
    targets = {"t": {k: np.zeros_like(v) for k, v in sd["t"].items()}, "step": None}
    gpuckpt.load(targets, tmp_path / "c")
    assert len(calls) == 1
    for k, v in sd["t"].items():
        np.testing.assert_array_equal(first["t"][k], v)
        np.testing.assert_array_equal(second["t"][k], v)
        np.testing.assert_array_equal(targets["t"][k], v)
    assert first["step"] == second["step"] == targets["step"] == 1
    # results are the caller's own: changing one changes nothing else
    first["t"]["w0"][:] = -1
    first["t"].clear()
    assert gpuckpt.load_state_dict(tmp_path / "c")["t"]["w0"][0] == sd["t"]["w0"][0]


def test_an_overwritten_checkpoint_is_validated_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpuckpt.save(_state(1), tmp_path / "c")
    calls = _count_validations(monkeypatch)
    gpuckpt.load_state_dict(tmp_path / "c")
    new = _state(2)
    gpuckpt.save(new, tmp_path / "c", overwrite=True)
    got = gpuckpt.load_state_dict(tmp_path / "c")
    assert len(calls) == 2 and got["step"] == 2
    np.testing.assert_array_equal(got["t"]["w5"], new["t"]["w5"])


def test_a_hostile_edit_of_a_loaded_checkpoint_is_caught(tmp_path: Path) -> None:
    gpuckpt.save(_state(1), tmp_path / "c")
    gpuckpt.load_state_dict(tmp_path / "c")  # validated and kept

    def edit(md: dict[str, Any]) -> None:
        md["state_dict_metadata"]["t.w3"]["size"] = [10**15]

    rewrite_root_metadata(tmp_path / "c", edit)
    for _ in range(2):  # never kept: refused every time
        with pytest.raises(gpuckpt.MetadataError, match="t.w3"):
            gpuckpt.load_state_dict(tmp_path / "c")


def test_read_metadata_hands_out_its_own_metadata(tmp_path: Path) -> None:
    gpuckpt.save(_state(1), tmp_path / "c")
    gpuckpt.load_state_dict(tmp_path / "c")
    md = gpuckpt.read_metadata(tmp_path / "c")
    md.state_dict_metadata.clear()
    md.planner_data.clear()
    assert gpuckpt.load_state_dict(tmp_path / "c")["step"] == 1
