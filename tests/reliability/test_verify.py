"""``gpuckpt verify`` reports every damaged part of a checkpoint, by path, and exits non-zero."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import gpuckpt
from gpuckpt.testing.faults import copy_checkpoint, damage
from gpuckpt.verify import verify_checkpoint

from .conftest import STRESS_TRIALS
from .test_corruption import CHUNK_KINDS, KINDS, make_state


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("verify") / "ckpt"
    gpuckpt.save(make_state(), path, chunk_bytes=1024)
    return path


def wheres(path: Path) -> set[str]:
    return {d.where for d in verify_checkpoint(path).damage}


def test_undamaged_checkpoint_verifies_ok(template: Path) -> None:
    report = verify_checkpoint(template)
    assert report.ok, report.format()
    proc = subprocess.run(
        [sys.executable, "-m", "gpuckpt.cli", "verify", str(template)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("trial", range(STRESS_TRIALS))
def test_verify_reports_every_damaged_chunk_and_array_document(
    template: Path, tmp_path: Path, trial: int
) -> None:
    rng = random.Random(f"verify-{trial}")
    ckpt = copy_checkpoint(template, tmp_path / "c")
    chunks = sorted(p for p in ckpt.glob("*/c*") if p.is_file())
    docs = sorted(ckpt.glob("*/zarr.json"))
    expected: set[str] = set()
    for victim in rng.sample(chunks, 3):
        damage(victim, rng.choice(CHUNK_KINDS), rng)
        expected.add(f"{victim.parent.name}/{victim.name}")
    for doc in rng.sample(docs, 2):
        before = json.loads(doc.read_bytes())
        damage(doc, rng.choice(KINDS), rng)
        try:
            if json.loads(doc.read_bytes()) == before:
                continue  # the change does not alter what the document says
        except (ValueError, OSError):
            pass
        expected.add(f"{doc.parent.name}/zarr.json")
    found = wheres(ckpt)
    assert expected <= found, (expected - found, found)
    proc = subprocess.run(
        [sys.executable, "-m", "gpuckpt.cli", "verify", str(ckpt)], capture_output=True, text=True
    )
    assert proc.returncode == 1 and "damaged" in proc.stderr, proc.stderr
    for where in expected:
        assert where in proc.stdout, (where, proc.stdout)


@pytest.mark.parametrize("kind", KINDS[:-2])  # delete/empty of the root: not a checkpoint any more
def test_verify_reports_damaged_root_metadata(template: Path, tmp_path: Path, kind: str) -> None:
    ckpt = copy_checkpoint(template, tmp_path / "c")
    raw = (ckpt / "zarr.json").read_bytes()
    damage(ckpt / "zarr.json", kind, random.Random(kind))
    try:
        if json.loads((ckpt / "zarr.json").read_bytes()) == json.loads(raw):
            pytest.skip("this change does not alter what the root document says")
    except ValueError:
        pass
    assert "zarr.json" in wheres(ckpt)


def test_verify_of_deleted_root_is_a_typed_error(template: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(template, tmp_path / "c")
    (ckpt / "zarr.json").unlink()
    with pytest.raises(gpuckpt.CheckpointNotFoundError):
        verify_checkpoint(ckpt)
    proc = subprocess.run(
        [sys.executable, "-m", "gpuckpt.cli", "verify", str(ckpt)], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
