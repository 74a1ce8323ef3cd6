"""gpuckpt's environment switches: one parser for every on/off switch, and a bad value refused
as an option error before a save or a load takes anything."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import InvalidOptionError
from gpuckpt.options import LoadOptions, SaveOptions, switch_from_env

SWITCHES = ("GPUCKPT_DIRECT_IO", "GPUCKPT_BATCHIO", "GPUCKPT_CRCCOPY")


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize(
    ("value", "meaning"),
    [("", "auto"), ("auto", "auto"), ("1", "on"), ("On", "on"), ("true", "on"), ("0", "off"), ("no", "off")],
)
def test_every_switch_reads_the_same_words(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, meaning: str
) -> None:
    monkeypatch.setenv(name, value)
    assert switch_from_env(name) == meaning


@pytest.mark.parametrize("name", [*SWITCHES, "GPUCKPT_CRC32C"])
def test_a_bad_value_is_refused_before_a_save_or_load_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    gpuckpt.save({"a": np.arange(1 << 16, dtype=np.float64)}, tmp_path / "ok")
    monkeypatch.setenv(name, "sometimes")
    for make in (SaveOptions, LoadOptions):
        with pytest.raises(InvalidOptionError, match=f"{name}='sometimes'"):
            make()
    with pytest.raises(InvalidOptionError, match=name):
        gpuckpt.save({"a": np.zeros(4)}, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    with pytest.raises(InvalidOptionError, match=name):
        gpuckpt.load_state_dict(tmp_path / "ok")
