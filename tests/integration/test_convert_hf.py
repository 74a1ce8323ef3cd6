"""``gpuckpt convert --to hf`` and back, with NumPy alone (transformers checks the output in
tests/frameworks/test_hf.py): small groups and chunks, a distributed source, loads from a file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gpuckpt
import gpuckpt.convert.hf_layout as layout
from gpuckpt.convert import convert
from gpuckpt.distributed import run_ranks
from gpuckpt.errors import MissingKeyError


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "emb": rng.standard_normal((300, 16)).astype(np.float32),
        "w": rng.standard_normal((7, 5, 3)).astype(ml_dtypes.bfloat16),
        "ids": np.arange(11, dtype=np.int64),
        "scale": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize(("group", "shard"), [(4096, 5000), (3 * 4096 + 100, 15_000)])
def test_small_groups_and_chunks_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: int, shard: int
) -> None:
    state = _state()
    gpuckpt.save({"model": state, "step": 3}, tmp_path / "ck", chunk_bytes=2048)
    # many groups per shard, rows cut at chunk edges, groups that end inside an aligned block
    monkeypatch.setattr(layout.plan_groups, "__defaults__", (group,))
    res = convert(
        tmp_path / "ck",
        tmp_path / "hf",
        target_format="hf",
        keys="model",
        strip_prefix="model.",
        max_shard_size=shard,
    )
    assert res.tensors == len(state)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state) and len(set(index["weight_map"].values())) > 1
    back = gpuckpt.load_state_dict(tmp_path / "hf")
    assert all(_same(back[k], v) for k, v in state.items())
    convert(tmp_path / "hf", tmp_path / "ck2")
    again = gpuckpt.load_state_dict(tmp_path / "ck2")
    assert all(_same(again[k], v) for k, v in state.items())
    with pytest.raises(MissingKeyError):
        gpuckpt.load_state_dict(tmp_path / "hf", keys=["nope"])


def test_distributed_source_and_cli(tmp_path: Path) -> None:
    full = np.random.default_rng(2).standard_normal((50, 6)).astype(np.float32)

    def rank(c: gpuckpt.distributed.Coordinator) -> None:
        edges = [0, 7, 20, 41, 50]
        lo, hi = edges[c.rank], edges[c.rank + 1]
        gpuckpt.save(
            {"w": gpuckpt.ShardedArray(full[lo:hi].copy(), (lo, 0), full.shape)},
            tmp_path / "d",
            coordinator=c,
        )

    run_ranks(4, rank)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "gpuckpt.cli", "convert", str(tmp_path / "d"), str(tmp_path / "hf")]
    p = subprocess.run(
        [*cmd, "--to", "hf", "--dtype", "float16", "--single-file"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path / "hf")) == ["model.safetensors"]
    one = gpuckpt.load_state_dict(tmp_path / "hf" / "model.safetensors")
    assert _same(one["w"], full.astype(np.float16))
    target = {"w": np.zeros((50, 6), np.float16)}
    gpuckpt.load(target, tmp_path / "hf")
    assert _same(target["w"], full.astype(np.float16))


@pytest.mark.parametrize("ranks", [1, 4])
def test_a_source_with_a_chunk_table_exports(tmp_path: Path, ranks: int) -> None:
    """More chunks than a root document lists (a chunk table; in blocks from 4 ranks): the
    export places its rows from the grid and reads the records with the chunks."""
    full = np.arange(4400 * 4, dtype=np.float32).reshape(4400, 4)
    per = len(full) // ranks

    def rank(c: gpuckpt.distributed.Coordinator) -> None:
        box = full[c.rank * per : (c.rank + 1) * per].copy()
        gpuckpt.save(
            {"w": gpuckpt.ShardedArray(box, (c.rank * per, 0), full.shape), "b": np.ones(3)},
            tmp_path / "ck",
            coordinator=c,
            chunk_bytes=16,
        )

    run_ranks(ranks, rank)
    md = gpuckpt.read_metadata(tmp_path / "ck")
    assert md.storage_data["chunk_table"]["rows"] > 4096 and md.version == ("5" if ranks > 1 else "2")
    convert(tmp_path / "ck", tmp_path / "hf", target_format="hf")
    back = gpuckpt.load_state_dict(tmp_path / "hf")
    assert _same(back["w"], full) and _same(back["b"], np.ones(3))


def test_overwrite_replaces_the_directory_whole(tmp_path: Path) -> None:
    gpuckpt.save({"a": np.ones(10, np.float32), "b": np.ones(3, np.int8)}, tmp_path / "ck")
    convert(tmp_path / "ck", tmp_path / "hf", target_format="hf")
    gpuckpt.save({"a": np.zeros(10, np.float32)}, tmp_path / "ck2")
    convert(tmp_path / "ck2", tmp_path / "hf", target_format="hf", overwrite=True)
    assert list(gpuckpt.load_state_dict(tmp_path / "hf")) == ["a"]
    assert not gpuckpt.load_state_dict(tmp_path / "hf")["a"].any()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck2", "hf"]  # nothing set aside remains


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs a tmpfs at /dev/shm (refuses O_DIRECT)")
def test_export_where_o_direct_is_refused(tmp_path: Path) -> None:
    import tempfile

    state = _state()
    gpuckpt.save(state, tmp_path / "ck")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        convert(tmp_path / "ck", Path(shm) / "hf", target_format="hf", max_shard_size=5000)
        back = gpuckpt.load_state_dict(Path(shm) / "hf")
        assert all(_same(back[k], v) for k, v in state.items())


def test_bad_options_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    from gpuckpt.errors import InvalidOptionError, UnsupportedValueError

    gpuckpt.save({"a": np.ones(4, np.float32), "m.a": np.ones(4, np.float32), "n": 3}, tmp_path / "ck")
    for kw in ({"dtype": "int8"}, {"dtype": "nope"}, {"max_shard_size": "5XB"}):
        with pytest.raises(InvalidOptionError):
            convert(tmp_path / "ck", tmp_path / "hf", target_format="hf", **kw)
    with pytest.raises(UnsupportedValueError, match="nothing to export"):
        convert(tmp_path / "ck", tmp_path / "hf", target_format="hf", keys=["n"])
    with pytest.raises(UnsupportedValueError, match="no name left"):
        convert(tmp_path / "ck", tmp_path / "hf", target_format="hf", strip_prefix="a")
    with pytest.raises(UnsupportedValueError, match="both become 'a'"):
        convert(tmp_path / "ck", tmp_path / "hf", target_format="hf", strip_prefix="m.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
