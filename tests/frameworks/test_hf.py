"""The Hugging Face layout both ways, against transformers itself.

A small Llama model built from a config (random weights, nothing downloaded) is
saved with gpuckpt by one process and as a 4-rank distributed checkpoint,
exported with several shards, and loaded by ``AutoModelForCausalLM.from_pretrained``
bit for bit; the directory converts back, loads straight through ``gpuckpt.load``,
and damaged directories give typed errors.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SHARD = "64KB"  # the model holds 361,728 bytes of float32: several shards


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import gpuckpt
    from gpuckpt.distributed import run_ranks

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    root = tmp_path_factory.mktemp("hf")
    gpuckpt.save({"model": sd, "step": 5, "optim": {"lr": 0.1}}, root / "single")
    full = {k: v.numpy() for k, v in sd.items()}

    def rank(c: Any) -> None:  # each rank holds a quarter of every tensor's rows
        part = {}
        for k, a in full.items():
            edges = np.linspace(0, a.shape[0], 5).astype(int)
            lo, hi = edges[c.rank], edges[c.rank + 1]
            offsets = (int(lo),) + (0,) * (a.ndim - 1)
            part[k] = gpuckpt.ShardedArray(np.ascontiguousarray(a[lo:hi]), offsets, a.shape)
        gpuckpt.save({"model": part, "step": 5}, root / "dist", coordinator=c)

    run_ranks(4, rank)
    model.config.save_pretrained(root / "cfgdir")
    return {"torch": torch, "transformers": transformers, "model": model, "sd": sd, "root": root}


def _same_bits(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (bfloat16 compared through its bytes)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    raw = [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in (a, b)]
    return raw[0] == raw[1]


def _from_pretrained(llama: dict[str, Any], path: Path) -> dict[str, Any]:
    auto = llama["transformers"].AutoModelForCausalLM
    return dict(auto.from_pretrained(path, local_files_only=True).state_dict())


@pytest.mark.parametrize("source", ["single", "dist"])
def test_export_loads_in_transformers_bit_exact(llama: dict[str, Any], tmp_path: Path, source: str) -> None:
    from gpuckpt.convert import convert

    out = tmp_path / "out"
    config: Any = llama["model"].config.to_dict() if source == "single" else llama["root"] / "cfgdir"
    res = convert(
        llama["root"] / source,
        out,
        target_format="hf",
        keys=["model"],
        strip_prefix="model.",
        max_shard_size=SHARD,
        config=config,
    )
    sd = llama["sd"]
    assert res.target_format == "hf" and res.tensors == len(sd)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 5 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in sd.values())
    assert set(index["weight_map"]) == set(sd) and set(index["weight_map"].values()) == set(shards)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    loaded = _from_pretrained(llama, out)
    assert set(loaded) == set(sd)
    for k, v in sd.items():
        assert _same_bits(loaded[k].contiguous(), v), k
    # the reference reader agrees on every header
    from safetensors import safe_open

    for shard in shards:
        with safe_open(out / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                assert index["weight_map"][k] == shard and _same_bits(f.get_tensor(k), sd[k])


def test_cast_single_file_and_existing_destination(llama: dict[str, Any], tmp_path: Path) -> None:
    torch = llama["torch"]
    from gpuckpt.convert import convert
    from gpuckpt.errors import CheckpointExistsError, InvalidOptionError

    out = tmp_path / "bf16"
    convert(
        llama["root"] / "dist",
        out,
        target_format="hf",
        keys="model",
        strip_prefix="model.",
        dtype="bfloat16",
        single_file=True,
        config=llama["root"] / "cfgdir" / "config.json",
    )
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = _from_pretrained(llama, out)
    for k, v in llama["sd"].items():
        assert _same_bits(loaded[k].contiguous(), v.to(torch.bfloat16)), k
    with pytest.raises(CheckpointExistsError):
        convert(llama["root"] / "dist", out, target_format="hf", single_file=True)
    with pytest.raises(InvalidOptionError, match="max_shard_size"):
        convert(
            llama["root"] / "dist", tmp_path / "x", target_format="hf", single_file=True, max_shard_size=SHARD
        )
    assert not (tmp_path / "x").exists()


def test_reverse_round_trip_and_direct_loads(llama: dict[str, Any], tmp_path: Path) -> None:
    import gpuckpt
    from gpuckpt.convert import convert
    from gpuckpt.errors import MissingChunkError

    torch, sd = llama["torch"], llama["sd"]
    hf = tmp_path / "hf"
    llama["model"].save_pretrained(hf, max_shard_size=SHARD)  # written by transformers itself
    res = convert(hf, tmp_path / "back")
    assert (res.source_format, res.tensors) == ("hf", len(sd))
    back = gpuckpt.load_state_dict(tmp_path / "back")
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert _same_bits(torch.from_numpy(back[k]), v), k
    # straight from the directory: new arrays by name, or in place into the model's own tensors
    direct = gpuckpt.load_state_dict(hf, keys=["lm_head"])
    assert list(direct) == ["lm_head.weight"] and _same_bits(
        torch.from_numpy(direct["lm_head.weight"]), sd["lm_head.weight"]
    )
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    gpuckpt.load(target, hf)
    assert all(_same_bits(target[k], v) for k, v in sd.items())
    # only the shards that hold the requested keys are read
    index = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    other = next(s for k, s in index.items() if s != index["lm_head.weight"])
    (hf / other).unlink()
    assert list(gpuckpt.load_state_dict(hf, keys=["lm_head.weight"])) == ["lm_head.weight"]
    with pytest.raises(MissingChunkError, match="missing"):
        gpuckpt.load_state_dict(hf)


def _damaged(llama: dict[str, Any], tmp_path: Path, name: str) -> Path:
    hf = tmp_path / name
    llama["model"].save_pretrained(hf, max_shard_size=SHARD)
    return hf


def test_damaged_directories_give_typed_errors(llama: dict[str, Any], tmp_path: Path) -> None:
    import gpuckpt
    from gpuckpt.convert import convert
    from gpuckpt.errors import GpuckptError, MetadataError, MissingChunkError

    base = _damaged(llama, tmp_path, "base")
    shards = sorted(base.glob("model-*.safetensors"))
    cases: dict[str, tuple[type[GpuckptError], str]] = {}

    truncated = tmp_path / "truncated"
    shutil.copytree(base, truncated)
    with open(truncated / shards[1].name, "r+b") as f:
        f.truncate(os.path.getsize(shards[1]) - 100)
    cases["truncated"] = (MetadataError, "truncated")

    bad_index = tmp_path / "bad_index"
    shutil.copytree(base, bad_index)
    (bad_index / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    cases["bad_index"] = (MetadataError, "not JSON")

    escaping = tmp_path / "escaping"
    shutil.copytree(base, escaping)
    doc = json.loads((escaping / "model.safetensors.index.json").read_text())
    doc["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    (escaping / "model.safetensors.index.json").write_text(json.dumps(doc))
    cases["escaping"] = (MetadataError, "not a file name")

    offsets = tmp_path / "offsets"
    shutil.copytree(base, offsets)
    raw = (offsets / shards[0].name).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 10**9, end + 10**9]  # past the end of the file
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (offsets / shards[0].name).write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    cases["offsets"] = (MetadataError, "expected|cover")

    missing = tmp_path / "missing"
    shutil.copytree(base, missing)
    (missing / shards[-1].name).unlink()
    cases["missing"] = (MissingChunkError, "missing")

    for case, (error, match) in cases.items():
        with pytest.raises(error, match=match):
            convert(tmp_path / case, tmp_path / f"{case}.ckpt")
        assert not (tmp_path / f"{case}.ckpt").exists(), case
        with pytest.raises(error, match=match):
            gpuckpt.load_state_dict(tmp_path / case)


def test_a_failed_export_publishes_nothing(llama: dict[str, Any], tmp_path: Path) -> None:
    from gpuckpt.convert import convert
    from gpuckpt.errors import CheckpointCorruptedError

    src = tmp_path / "src"
    shutil.copytree(llama["root"] / "single", src)
    chunk = max((p for p in src.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptedError):
        convert(src, tmp_path / "out", target_format="hf", max_shard_size=SHARD)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no temporary
