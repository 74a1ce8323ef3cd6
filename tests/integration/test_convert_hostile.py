"""``convert`` given what it must refuse: files that are not regular files, configs without end,
destinations around or inside the source, names and metadata a safetensors file cannot hold or that
another tool changed; typed errors, nothing deleted, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.convert import convert
from gpuckpt.convert.core import STATE_KEY
from gpuckpt.convert.safetensors_io import read_safetensors_header
from gpuckpt.errors import CheckpointExistsError, InvalidOptionError, MetadataError, UnsupportedValueError

REPO = Path(__file__).resolve().parents[2]


def _ckpt(tmp_path: Path, state: dict | None = None) -> Path:
    path = tmp_path / "ck"
    gpuckpt.save(state or {"model": {"w": np.arange(12.0).reshape(3, 4)}, "step": 3}, path, sync="none")
    return path


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


_FIFO = """
import os, sys
from gpuckpt.convert import convert
try:
    convert(sys.argv[1], sys.argv[2], source_format=sys.argv[3])
except Exception as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("fmt", ["auto", "safetensors"])
def test_a_fifo_source_is_refused_not_waited_on(tmp_path: Path, fmt: str) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", _FIFO, str(fifo), str(tmp_path / "out"), fmt],
        capture_output=True,
        text=True,
        timeout=60,  # (a blocking open would wait here for a writer that never comes)
        env=env,
    )
    assert out.stdout.startswith("UnsupportedValueError") and "not a regular file (a FIFO)" in out.stdout, out
    assert not (tmp_path / "out").exists()


def test_a_config_that_is_not_a_small_regular_file_is_refused(tmp_path: Path) -> None:
    ck = _ckpt(tmp_path)
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.json")
    with open(tmp_path / "huge.json", "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB of zeros
    (tmp_path / "list.json").write_text("[1, 2]")
    for name, error, match in (
        ("zero.json", UnsupportedValueError, "not a regular file"),
        ("fifo.json", UnsupportedValueError, "not a regular file"),
        ("huge.json", InvalidOptionError, "larger than"),
        ("list.json", InvalidOptionError, "not a JSON object"),
    ):
        with pytest.raises(error, match=match):
            convert(ck, tmp_path / "hf", target_format="hf", config=tmp_path / name)
        assert not (tmp_path / "hf").exists(), name


def test_an_export_never_replaces_its_source_its_parent_or_other_things(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    ck = _ckpt(project)
    (project / "notes.txt").write_text("keep me")
    before = _tree(project)
    for dst in (ck / "model.w", project, ck):
        with pytest.raises(InvalidOptionError):
            convert(ck, dst, target_format="hf", overwrite=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointExistsError, match=r"tokenizer\.json.*nothing was deleted"):
        convert(ck, other, target_format="hf", overwrite=True)
    assert _tree(project) == before and (other / "tokenizer.json").exists()
    # an export replaces an export
    convert(ck, tmp_path / "hf", target_format="hf")
    convert(ck, tmp_path / "hf", target_format="hf", overwrite=True, dtype="float16")
    (shard,) = (tmp_path / "hf").glob("*.safetensors")
    header, _, _ = read_safetensors_header(shard)
    assert header["model.w"]["dtype"] == "F16"


def test_a_tensor_named_like_the_metadata_key_is_not_exported(tmp_path: Path) -> None:
    ck = _ckpt(tmp_path, {"__metadata__": np.ones(2), "w": np.ones(3)})
    with pytest.raises(UnsupportedValueError, match="reserves the header key"):
        convert(ck, tmp_path / "hf", target_format="hf")
    with pytest.raises(UnsupportedValueError, match="reserves the header key"):
        convert(
            _ckpt(tmp_path / "b", {"x": {"__metadata__": np.ones(2)}}),
            tmp_path / "hf",
            target_format="hf",
            strip_prefix="x.",
        )
    assert not (tmp_path / "hf").exists()


def _rewrite_header(path: Path, change) -> None:  # type: ignore[no-untyped-def]
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    change(header)
    new = json.dumps(header).encode()
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def test_a_stored_state_description_that_is_damaged_or_out_of_date_is_a_metadata_error(
    tmp_path: Path,
) -> None:
    ck = _ckpt(tmp_path)
    st = tmp_path / "m.safetensors"
    convert(ck, st)

    def bad_formats(h: dict) -> None:
        extra = json.loads(h["__metadata__"][STATE_KEY])
        extra["memory_formats"] = 5
        h["__metadata__"][STATE_KEY] = json.dumps(extra)

    def another_tool(h: dict) -> None:  # a tensor added by a tool that kept the metadata
        end = max(e["data_offsets"][1] for k, e in h.items() if k != "__metadata__")
        h["model.new"] = {"dtype": "F64", "shape": [0], "data_offsets": [end, end]}

    for change, match in ((bad_formats, "not a gpuckpt state description"), (another_tool, "model.new")):
        target = tmp_path / f"{change.__name__}.safetensors"
        target.write_bytes(st.read_bytes())
        _rewrite_header(target, change)
        with pytest.raises(MetadataError, match=match):
            convert(target, tmp_path / f"out-{change.__name__}")
        assert not (tmp_path / f"out-{change.__name__}").exists()


def test_sizes_and_destinations_give_typed_errors(tmp_path: Path) -> None:
    ck = _ckpt(tmp_path)
    for size in ("inf", "1e400"):
        with pytest.raises(InvalidOptionError, match="is not a size"):
            convert(ck, tmp_path / "hf", target_format="hf", max_shard_size=size)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(CheckpointExistsError, match="destination exists"):
        convert(ck, tmp_path / "taken")
    assert (tmp_path / "taken" / "x").read_text() == "x"


def test_every_option_of_convert_is_checked_before_anything_is_read(tmp_path: Path) -> None:
    """Options of the wrong type or value are InvalidOptionErrors naming them (a truthy string is
    not True), and options of the Hugging Face layout given for another target are refused, not
    ignored; nothing is written."""
    ck = _ckpt(tmp_path)
    hf = {"target_format": "hf"}
    for kw, match in (
        ({"overwrite": "x", **hf}, "overwrite must be True or False"),
        ({"single_file": "x", **hf}, "single_file must be True or False"),
        ({"trust_pickle_metadata": "no"}, "trust_pickle_metadata must be True or False"),
        ({"allow_pickle": "no"}, "allow_pickle must be True or False"),
        ({"keys": [None], **hf}, "keys must name entries"),
        ({"strip_prefix": 5, **hf}, "strip_prefix must be a str"),
        ({"config": 5, **hf}, "config must be a config.json path"),
        ({"config": {"a": {1}}, **hf}, "config must hold JSON values only"),
        ({"storage_options": "x"}, "storage_options must be"),
        ({"threads": 0}, "threads"),
        ({"chunk_bytes": "64MB"}, "chunk_bytes"),
        ({"target_format": "bogus"}, "unknown target format 'bogus'"),
        ({"source_format": "bogus"}, "unknown source format 'bogus'"),
        ({"target_format": 5}, "target_format must be a format name"),
        ({"keys": ["w"]}, "keys is an option of a Hugging Face target"),
        (
            {"strip_prefix": "m.", "single_file": True},
            "strip_prefix, single_file are options of a Hugging Face",
        ),
        (
            {"max_shard_size": 10**6, "target_format": "safetensors"},
            "max_shard_size is an option of a Hugging Face",
        ),
        (
            {"source_format": "safetensors"},
            r"source format 'safetensors' \(--from\) was given, but .* is a gpuckpt",
        ),
        ({"source_format": "dcp"}, r"is a gpuckpt directory: leave the format out"),
    ):
        with pytest.raises(InvalidOptionError, match=match):
            convert(ck, tmp_path / "out", **kw)
        assert not (tmp_path / "out").exists()
    r = subprocess.run(
        [sys.executable, "-m", "gpuckpt.cli", "convert", str(ck), str(tmp_path / "out"), "--keys", "w", "-q"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "keys is an option of a Hugging Face target" in r.stderr, r.stderr
    # a tensor named '' (a key gpuckpt stores) is refused for the Hugging Face layout by what it is
    gpuckpt.save({"": np.ones(1)}, tmp_path / "blank")
    with pytest.raises(UnsupportedValueError, match="has an empty name"):
        convert(tmp_path / "blank", tmp_path / "hf", target_format="hf")


def _bool_file(path: Path, raw: bytes) -> None:
    """A safetensors file of one BOOL tensor ``mask`` with the bytes ``raw`` and a float tensor."""
    header = {
        "mask": {"dtype": "BOOL", "shape": [len(raw)], "data_offsets": [0, len(raw)]},
        "w": {"dtype": "F32", "shape": [2], "data_offsets": [len(raw), len(raw) + 8]},
    }
    head = json.dumps(header).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + raw + np.ones(2, np.float32).tobytes())


def test_a_bool_tensor_whose_bytes_are_not_0_or_1_is_refused_by_every_reader(tmp_path: Path) -> None:
    """A safetensors BOOL holding byte 2 makes a NumPy/torch bool that is True and unequal to
    True; every path that reads safetensors refuses it, naming the tensor and the element, and a
    target is left as it was."""
    hf = tmp_path / "hf"
    hf.mkdir()
    _bool_file(hf / "model.safetensors", bytes([0, 1, 2, 1, 7]))
    with pytest.raises(MetadataError, match=r"tensor 'mask'.*element 2 is the byte 0x02 \(2 elements"):
        gpuckpt.load_state_dict(hf)
    target = {"mask": np.zeros(5, bool), "w": np.zeros(2, np.float32)}
    with pytest.raises(MetadataError, match="'mask'"):
        gpuckpt.load(target, hf)
    assert not target["mask"].any()  # read aside, never into the target
    with pytest.raises(MetadataError, match="'mask'"):
        convert(hf, tmp_path / "ck")  # a directory import (mapped shards)
    assert not (tmp_path / "ck").exists()
    with pytest.raises(MetadataError, match="'mask'"):
        convert(hf / "model.safetensors", tmp_path / "ck2", source_format="safetensors")
    assert not (tmp_path / "ck2").exists()
    # 0 and 1 alone load as they are
    _bool_file(hf / "model.safetensors", bytes([0, 1, 1, 0, 1]))
    assert gpuckpt.load_state_dict(hf)["mask"].tolist() == [False, True, True, False, True]
    convert(hf, tmp_path / "ck")
    assert gpuckpt.load_state_dict(tmp_path / "ck")["mask"].tolist() == [False, True, True, False, True]


def test_a_killed_conversions_temporary_is_removed_by_the_next_one_to_its_path(tmp_path: Path) -> None:
    """A conversion killed half-way leaves its temporary (a file for safetensors, a directory for
    a Hugging Face export); the next conversion to that path removes it once its writer is dead,
    as a save does, and never a live writer's."""
    import secrets

    from gpuckpt.storage.local import fsutil

    ck = _ckpt(tmp_path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    host = fsutil.tmp_owner().rpartition("-")[0]
    owners = {
        "dead": f"{host}-{int(dead.stdout)}-{secrets.token_hex(4)}",
        "live": f"{fsutil.tmp_owner()}-{secrets.token_hex(4)}",
    }
    for dst, make in (("out.safetensors", Path.write_bytes), ("hf", None)):
        left = {}
        for who, owner in owners.items():
            p = tmp_path / f"{fsutil.side_prefix(dst, '.gpuckpt-tmp-')}{owner}"
            if make is None:
                p.mkdir()
                (p / "model-00001-of-00002.safetensors").write_bytes(b"x" * 1000)
            else:
                make(p, b"x" * 1000)
            left[who] = p
        convert(ck, tmp_path / dst, **({"target_format": "hf"} if make is None else {}))
        assert not left["dead"].exists() and left["live"].exists(), dst
        assert gpuckpt.load_state_dict(tmp_path / dst)


def test_an_empty_directory_takes_a_conversion_without_overwrite(tmp_path: Path) -> None:
    """As a save: an empty directory holds no output, so convert (gpuckpt and hf targets) writes
    into its place without overwrite; one holding anything is still refused."""
    ck = _ckpt(tmp_path)
    for target in ("gpuckpt", "hf"):
        (tmp_path / target).mkdir()
        convert(ck, tmp_path / target, target_format=target)
        assert gpuckpt.load_state_dict(tmp_path / target)
        (tmp_path / f"full-{target}").mkdir()
        (tmp_path / f"full-{target}" / "x").write_text("x")
        with pytest.raises(CheckpointExistsError):
            convert(ck, tmp_path / f"full-{target}", target_format=target)
        assert [p.name for p in (tmp_path / f"full-{target}").iterdir()] == ["x"]
