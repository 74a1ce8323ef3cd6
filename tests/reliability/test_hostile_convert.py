"""Loads in place from safetensors files and conversions of hostile ones: typed errors before
anything is written, byte order kept, nothing amplified, links that lead nowhere named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.convert import convert
from gpuckpt.convert.safetensors_io import write_safetensors


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    write_safetensors({"w": np.arange(4, dtype=np.float32), "b": np.arange(3, dtype=np.int64)}, path)
    return path


def test_a_target_of_the_other_byte_order_gets_the_values_not_the_bytes(model: Path) -> None:
    target = {"w": np.zeros(4, ">f4"), "b": np.zeros(3, "<i8")}
    gpuckpt.load(target, model)
    assert target["w"].dtype == np.dtype(">f4") and target["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert target["b"].tolist() == [0, 1, 2]


def test_a_read_only_target_is_refused_before_any_target_is_written(model: Path) -> None:
    target = {"w": np.full(4, 9.0, np.float32), "b": np.zeros(3, np.int64)}
    target["b"].flags.writeable = False
    with pytest.raises(gpuckpt.ReadOnlyTargetError, match="tensor 'b'.*read-only.*nothing was loaded"):
        gpuckpt.load(target, model)
    assert target["w"].tolist() == [9.0] * 4


def test_a_target_whose_elements_share_memory_is_refused_before_any_target_is_written(model: Path) -> None:
    target = {
        "w": np.full(4, 9.0, np.float32),
        "b": np.lib.stride_tricks.as_strided(np.zeros(1, np.int64), (3,), (0,)),
    }
    with pytest.raises(gpuckpt.ReadOnlyTargetError, match="tensor 'b'.*share memory.*nothing was loaded"):
        gpuckpt.load(target, model)
    assert target["w"].tolist() == [9.0] * 4


def test_a_state_description_nested_too_deep_is_a_metadata_error(tmp_path: Path) -> None:
    header = json.dumps({"__metadata__": {"gpuckpt.state": "[" * 50_000 + "]" * 50_000}}).encode()
    (tmp_path / "deep.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(gpuckpt.MetadataError, match="is not a gpuckpt state description"):
        convert(tmp_path / "deep.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("source_format", ["auto", "safetensors", "hf"])
def test_a_source_that_is_a_link_loop_is_an_invalid_path(tmp_path: Path, source_format: str) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(gpuckpt.InvalidPathError, match="loop"):
        convert(tmp_path / "loop", tmp_path / "out", source_format=source_format)
    assert not (tmp_path / "out").exists()


def test_a_structure_that_names_an_entry_twice_is_refused_by_load_verify_and_convert(tmp_path: Path) -> None:
    """A save names each leaf once; a structure naming one 1 MiB tensor 100 times would load it
    100 times over (a conversion wrote 100 copies)."""
    from gpuckpt.testing.faults import rewrite_root_metadata
    from gpuckpt.verify import verify_checkpoint

    ckpt = tmp_path / "c"
    gpuckpt.save({"w": np.ones(1 << 18, np.float32)}, ckpt)

    def repeat(md: dict) -> None:
        md["planner_data"]["structure"]["d"] += [["s", f"dup{i}", {"v": "w"}] for i in range(100)]

    rewrite_root_metadata(ckpt, repeat)
    with pytest.raises(gpuckpt.MetadataError, match="names the entry 'w' twice"):
        gpuckpt.load_state_dict(ckpt)
    report = verify_checkpoint(ckpt)
    assert not report.ok and any("names the entry 'w' twice" in d.problem for d in report.damage)
    with pytest.raises(gpuckpt.MetadataError, match="twice"):
        convert(ckpt, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_a_directory_of_many_shards_is_matched_to_its_index_in_one_pass(tmp_path: Path) -> None:
    """Each shard's header is checked against the names the index puts in it: listed once for
    all shards (a pass over the index per shard made 16,000 one-tensor shards take 40 s)."""
    from gpuckpt.loading.hf import open_hf

    index = {}
    for i in range(50):
        write_safetensors({f"t{i}": np.full(1, i, np.uint8)}, tmp_path / f"s{i}.safetensors")
        index[f"t{i}"] = f"s{i}.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    src = open_hf(tmp_path)

    class Counted(dict):  # type: ignore[type-arg]
        passes = 0

        def items(self):  # type: ignore[no-untyped-def]
            Counted.passes += 1
            return super().items()

    src.weight_map = Counted(src.weight_map)
    for name in src.names:
        src.header(name)
    assert Counted.passes == 1
    assert gpuckpt.load_state_dict(tmp_path)["t49"].tolist() == [49]


def test_a_document_whose_parse_runs_out_of_memory_is_a_metadata_error(tmp_path: Path, model: Path) -> None:
    """Parsed JSON costs far more memory than its text; where a parse exhausts the process's
    memory, each reader raises its typed error naming the file (not a bare MemoryError)."""
    import json as json_module
    from unittest import mock

    ckpt = tmp_path / "c"
    gpuckpt.save({"w": np.ones(4)}, ckpt)
    real = json_module.loads

    def short_of_memory(raw: object, *a: object, **k: object) -> object:
        if isinstance(raw, (bytes, bytearray, str)) and len(raw) > 40:
            raise MemoryError
        return real(raw, *a, **k)

    with mock.patch("gpuckpt.format.jsontext.json.loads", short_of_memory):
        for read in (gpuckpt.read_metadata, gpuckpt.load_state_dict):
            with pytest.raises(gpuckpt.MetadataError, match="more values than this process has memory for"):
                read(ckpt)
        with pytest.raises(gpuckpt.MetadataError, match="more values than this process has memory for"):
            gpuckpt.load_state_dict(model)


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ({"__metadata__": []}, "__metadata__ must map strings to strings"),
        ({"__metadata__": False}, "__metadata__ must map strings to strings"),
        ({"__metadata__": 0}, "__metadata__ must map strings to strings"),
        ("utf-16", "not JSON in UTF-8"),
    ],
)
def test_a_safetensors_header_the_reference_reader_refuses_is_refused(
    tmp_path: Path, header: object, match: str
) -> None:
    entry = {"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    if header == "utf-16":
        raw = json.dumps(entry).encode("utf-16")
    else:
        raw = json.dumps({**entry, **header}).encode()  # type: ignore[dict-item]
    (tmp_path / "m.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + b"x")
    with pytest.raises(gpuckpt.MetadataError, match=match):
        gpuckpt.load_state_dict(tmp_path / "m.safetensors")


def test_an_index_that_puts_a_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    for i in range(2):
        write_safetensors({"w": np.full(2, i, np.float32)}, tmp_path / f"s{i}.safetensors")
    raw = '{"weight_map": {"w": "s0.safetensors", "w": "s1.safetensors"}}'
    (tmp_path / "model.safetensors.index.json").write_text(raw)
    with pytest.raises(gpuckpt.MetadataError, match="the key 'w' is given twice"):
        gpuckpt.load_state_dict(tmp_path)
