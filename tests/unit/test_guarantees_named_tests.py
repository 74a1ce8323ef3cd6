"""Every test that docs/GUARANTEES.md names exists: a guarantee backed by a missing test is not backed."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"`((?:[\w./-]+/)?(test_\w+\.py))::(\w+)(?:\[[^\]`]*\])?`")


def _references() -> list[tuple[str, str, str]]:
    text = (REPO / "docs" / "GUARANTEES.md").read_text()
    return [(m.group(1), m.group(2), m.group(3)) for m in REFERENCE.finditer(text)]


def _candidates(path: str, basename: str) -> list[Path]:
    if "/" in path:
        return [REPO / path]
    return sorted((REPO / "tests").rglob(basename))


def test_the_guarantees_name_tests() -> None:
    assert len(_references()) > 100


def test_every_named_test_exists() -> None:
    missing = []
    for path, basename, name in _references():
        files = _candidates(path, basename)
        pattern = re.compile(rf"^\s*(?:async\s+)?def {re.escape(name)}\(", re.M)
        if not any(f.is_file() and pattern.search(f.read_text()) for f in files):
            missing.append(f"{path}::{name}")
    assert not missing, "GUARANTEES.md names tests that do not exist:\n" + "\n".join(missing)
