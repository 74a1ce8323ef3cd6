"""Random damage to a checkpoint's files is always detected, with a typed error naming what is damaged.

Chunk files and the root ``zarr.json`` are what a load reads; every change
to them must raise a :class:`gpuckpt.GpuckptError`. An array's own
``zarr.json`` is not read by a load (the root metadata is authoritative), so
damage there must never change loaded data.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import gpuckpt
from gpuckpt.testing.faults import copy_checkpoint, damage

from .conftest import STRESS_TRIALS

KINDS = ["flip-bit", "flip-byte", "flip-many", "truncate", "extend", "zero-tail", "delete", "empty"]
CHUNK_KINDS = [*KINDS, "to-dir"]


def make_state() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "model": {
            "emb": rng.standard_normal((40, 33)).astype(np.float32),  # several chunks, padded last one
            "bf": rng.standard_normal((17, 5)).astype(ml_dtypes.bfloat16),
            "scalar": np.full((), 3.5, np.float64),
            "mask": rng.integers(0, 2, size=(9,)).astype(bool),
        },
        "opt": {"step": 12, "betas": (0.9, 0.99), "name": "adam"},
    }


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "ckpt"
    gpuckpt.save(make_state(), path, chunk_bytes=1024)
    return path


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want["model"].items():
        g = got["model"][k]
        assert g.dtype == v.dtype and g.shape == v.shape and g.tobytes() == v.tobytes()
    assert got["opt"] == want["opt"]


def chunk_files(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("*/c*") if p.is_file())


def load_into_prefilled(path: Path) -> dict[str, Any]:
    target = make_state()
    for v in target["model"].values():
        v[...] = 0
    gpuckpt.load(target, path)
    return target


@pytest.mark.parametrize("kind", CHUNK_KINDS)
@pytest.mark.parametrize("trial", range(STRESS_TRIALS))
def test_damaged_chunk_file_raises_typed_error_naming_chunk(
    template: Path, tmp_path: Path, kind: str, trial: int
) -> None:
    rng = random.Random(f"chunk-{kind}-{trial}")
    ckpt = copy_checkpoint(template, tmp_path / "c")
    victim = rng.choice(chunk_files(ckpt))
    what = damage(victim, kind, rng)
    fqn = f"model.{victim.parent.name.split('.', 1)[1]}"
    for reader in (gpuckpt.load_state_dict, load_into_prefilled):
        with pytest.raises(gpuckpt.CheckpointCorruptedError) as info:
            reader(ckpt)
        msg = str(info.value)
        assert victim.name in msg and repr(fqn) in msg, f"{what}: {msg}"
    # what is undamaged still loads on its own
    others = [k for k in gpuckpt.read_metadata(ckpt).state_dict_metadata if k != fqn]
    assert set(gpuckpt.load_state_dict(ckpt, keys=others)["model"]) >= {
        k.split(".", 1)[1] for k in others if k.startswith("model.")
    }


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("trial", range(STRESS_TRIALS))
def test_damaged_root_metadata_raises_typed_error_naming_it(
    template: Path, tmp_path: Path, kind: str, trial: int
) -> None:
    rng = random.Random(f"root-{kind}-{trial}")
    ckpt = copy_checkpoint(template, tmp_path / "c")
    what = damage(ckpt / "zarr.json", kind, rng)
    for call in (gpuckpt.read_metadata, gpuckpt.load_state_dict, load_into_prefilled):
        try:
            got = call(ckpt)
        except gpuckpt.GpuckptError as exc:
            assert "zarr.json" in str(exc) or str(ckpt) in str(exc), f"{what}: {exc}"
            continue
        # the only acceptable success: a change that does not alter what the JSON means
        # (e.g. a hex digit's case in a \\u escape); then the data must be exactly right
        if call is not gpuckpt.read_metadata:
            assert_same(got, make_state())


@pytest.mark.parametrize("trial", range(STRESS_TRIALS))
def test_damaged_array_document_never_changes_loaded_data(template: Path, tmp_path: Path, trial: int) -> None:
    rng = random.Random(f"array-doc-{trial}")
    ckpt = copy_checkpoint(template, tmp_path / "c")
    docs = sorted(p for p in ckpt.glob("*/zarr.json"))
    for doc in rng.sample(docs, 2):
        damage(doc, rng.choice(KINDS), rng)
    assert_same(gpuckpt.load_state_dict(ckpt), make_state())


def test_deleted_array_directory_is_a_missing_chunk_error(template: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(template, tmp_path / "c")
    shutil.rmtree(ckpt / "model.emb")
    with pytest.raises(gpuckpt.MissingChunkError, match=r"'model\.emb'"):
        gpuckpt.load_state_dict(ckpt)


def test_deleted_root_metadata_is_not_a_checkpoint(template: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(template, tmp_path / "c")
    (ckpt / "zarr.json").unlink()
    with pytest.raises(gpuckpt.CheckpointNotFoundError, match="not a committed checkpoint"):
        gpuckpt.load_state_dict(ckpt)


def test_root_metadata_replaced_by_directory_is_a_typed_error(template: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(template, tmp_path / "c")
    damage(ckpt / "zarr.json", "to-dir", random.Random(0))
    with pytest.raises(gpuckpt.GpuckptError, match="zarr.json"):
        gpuckpt.read_metadata(ckpt)
