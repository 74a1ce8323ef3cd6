"""verify_checkpoint reads everything and lists every damaged part."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuckpt
from gpuckpt.format.documents import expected_array_document
from gpuckpt.loading.open import open_checkpoint
from gpuckpt.verify import verify_checkpoint


def make(path: Path, **kw: object) -> Path:
    rng = np.random.default_rng(0)
    sd = {
        "layer": {"weight": rng.standard_normal((64, 16)).astype(np.float32)},
        "bias": np.ones(5),
        "conv": np.zeros((2, 5, 6, 3), np.float32).transpose(0, 3, 1, 2),
        "step": 3,
        **kw,
    }
    gpuckpt.save(sd, path, chunk_bytes=1024, sync="none", allow_pickle=True)
    return path


def flip(p: Path, at: int = 10) -> None:
    raw = bytearray(p.read_bytes())
    raw[at] ^= 0x10
    p.write_bytes(raw)


def test_good_checkpoint(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []
    r = verify_checkpoint(make(tmp_path / "c"), progress=lambda d, t: seen.append((d, t)))
    assert r.ok and r.tensors == 3 and r.objects == 1 and r.chunks == 6
    assert r.bytes_checked == 64 * 16 * 4 + 5 * 8 + 180 * 4
    assert seen[-1] == (r.bytes_checked, r.bytes_checked)
    assert "OK" in r.format() and json.loads(json.dumps(r.to_json()))["ok"] is True


def test_every_damaged_chunk_is_listed(tmp_path: Path) -> None:
    c = make(tmp_path / "c")
    flip(c / "layer.weight" / "c.0.0")
    flip(c / "layer.weight" / "c.3.0", at=-1)  # the stored checksum itself
    os.remove(c / "layer.weight" / "c.2.0")
    p = c / "bias" / "c.0"
    p.write_bytes(p.read_bytes()[:-3])
    r = verify_checkpoint(c, group_bytes=1)
    assert not r.ok
    assert sorted(d.where for d in r.damage) == [
        "bias/c.0",
        "layer.weight/c.0.0",
        "layer.weight/c.2.0",
        "layer.weight/c.3.0",
    ]
    by = {d.where: d.problem for d in r.damage}
    assert "checksum mismatch" in by["layer.weight/c.0.0"]
    assert by["layer.weight/c.2.0"] == "missing"
    assert "truncated" in by["bias/c.0"]
    assert r.damaged_tensors() == ["bias", "layer.weight"]
    assert "layer.weight/c.2.0: missing" in r.format()
    # checked bytes are those found whole: one chunk of layer.weight and the third tensor
    assert r.bytes_checked == 16 * 16 * 4 + 180 * 4


def test_swapped_valid_chunks(tmp_path: Path) -> None:
    c = make(tmp_path / "c")
    a, b = c / "layer.weight" / "c.0.0", c / "layer.weight" / "c.1.0"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    r = verify_checkpoint(c)
    assert {d.where for d in r.damage} == {"layer.weight/c.0.0", "layer.weight/c.1.0"}
    assert all("not the one the metadata lists" in d.problem for d in r.damage)


def test_array_document_checked_against_metadata(tmp_path: Path) -> None:
    c = make(tmp_path / "c")
    doc_path = c / "conv" / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["shape"] = [2, 3, 5, 7]
    doc_path.write_text(json.dumps(doc))
    os.remove(c / "bias" / "zarr.json")
    r = verify_checkpoint(c)
    by = {d.where: d.problem for d in r.damage}
    assert "shape is [2, 3, 5, 7]" in by["conv/zarr.json"]
    assert by["bias/zarr.json"] == "missing"


def test_an_array_document_whose_numbers_changed_json_type_is_damage(tmp_path: Path) -> None:
    """``true`` for 1, ``4.0`` for 4, ``0`` for false: equal in Python, but not the document
    gpuckpt wrote (TensorStore refuses a chunk shape of ``[true, 10]``)."""
    edits = {
        "chunk_grid": lambda d: d["chunk_grid"]["configuration"]["chunk_shape"].__setitem__(0, True),
        "shape": lambda d: d["shape"].__setitem__(0, float(d["shape"][0])),
        "codecs": lambda d: d["codecs"][1]["configuration"].__setitem__("checksum", 0),
    }
    for key, edit in edits.items():
        c = tmp_path / key
        if key == "codecs":
            gpuckpt.save({"w": np.zeros(100, np.float32)}, c, compression={"codec": "zstd"})
        else:
            gpuckpt.save({"w": np.arange(40, dtype=np.int32).reshape(4, 10)}, c, chunk_bytes=40)
        doc = json.loads((c / "w" / "zarr.json").read_text())
        edit(doc)
        (c / "w" / "zarr.json").write_text(json.dumps(doc))
        (bad,) = verify_checkpoint(c).damage
        assert bad.where == "w/zarr.json" and bad.problem.startswith(f"{key} is "), (key, bad)


def test_array_documents_are_what_layout_defines(tmp_path: Path) -> None:
    """The writer writes expected_array_document, and verify holds every field of it to that."""
    c = make(tmp_path / "c")
    tensors = open_checkpoint(c, shared=False).index.tensors
    assert len(tensors) == 3
    for t in tensors.values():
        want = expected_array_document(
            shape=t.shape,
            dtype=t.dtype,
            grid=t.grid,
            fqn=t.fqn,
            memory_format=t.metadata.properties.memory_format.name,
        )
        assert json.loads((c / t.name / "zarr.json").read_bytes()) == want, t.fqn
    doc_path = c / "layer.weight" / "zarr.json"
    doc = json.loads(doc_path.read_text())
    doc["fill_value"] = 1.5  # what zarr reads in the padding of edge chunks
    doc["attributes"]["other tool"] = {"note": "kept"}  # attributes of others are allowed
    doc_path.write_text(json.dumps(doc))
    (bad,) = verify_checkpoint(c).damage
    assert (bad.where, bad.problem) == ("layer.weight/zarr.json", "fill_value is 1.5, the metadata says 0.0")
    doc["fill_value"] = 0.0
    doc["attributes"]["gpuckpt"]["memory_format"] = "channels_last"
    doc_path.write_text(json.dumps(doc))
    (bad,) = verify_checkpoint(c).damage
    assert bad.where == "layer.weight/zarr.json" and bad.problem.startswith("attributes.gpuckpt is ")


def test_damaged_root_metadata_and_not_a_checkpoint(tmp_path: Path) -> None:
    c = make(tmp_path / "c")
    root = c / "zarr.json"
    root.write_text(root.read_text().replace('"step"', '"stop"'))
    r = verify_checkpoint(c)
    assert [d.where for d in r.damage] == ["zarr.json"] and "checksum mismatch" in r.damage[0].problem
    with pytest.raises(gpuckpt.CheckpointNotFoundError):
        verify_checkpoint(tmp_path / "nothing")


def test_pickled_values_are_decoded_only_when_allowed(tmp_path: Path) -> None:
    c = make(tmp_path / "c", obj=complex_object())
    r = verify_checkpoint(c)
    assert r.ok and len(r.skipped) == 1 and "allow_pickle" in r.skipped[0]
    assert verify_checkpoint(c, allow_pickle=True).skipped == []


class Thing:
    pass


def complex_object() -> Thing:
    return Thing()


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_any_flipped_byte_is_found_in_its_chunk(data: st.DataObject) -> None:
    base = Path(tempfile.mkdtemp())
    try:
        c = make(base / "c")
        chunks = sorted(p for p in c.rglob("c*") if p.is_file() and p.parent != c)
        victim = data.draw(st.sampled_from(chunks))
        at = data.draw(st.integers(0, victim.stat().st_size - 1))
        flip(victim, at)
        r = verify_checkpoint(c)
        assert [d.where for d in r.damage] == [f"{victim.parent.name}/{victim.name}"]
    finally:
        shutil.rmtree(base)


def test_bad_options_are_invalid_option_errors_and_a_truthy_string_never_unpickles(tmp_path: Path) -> None:
    """verify takes its options as a load does: a string such as "no" is not allow_pickle=True
    (it would have run the checkpoint's pickles)."""
    from gpuckpt.errors import InvalidOptionError

    gpuckpt.save({"w": np.arange(4.0), "obj": _Pickled()}, tmp_path / "c", allow_pickle=True)
    for bad, match in (
        ({"allow_pickle": "no"}, "allow_pickle must be True or False"),
        ({"threads": -1}, "threads"),
        ({"progress": 0}, "progress"),
        ({"group_bytes": "x"}, "group_bytes"),
        ({"group_bytes": 0}, "group_bytes"),
        ({"storage_options": "x"}, "storage_options"),
    ):
        with pytest.raises(InvalidOptionError, match=match):
            verify_checkpoint(tmp_path / "c", **bad)
    assert _Pickled.loads == 0
    report = verify_checkpoint(tmp_path / "c")
    assert report.ok and report.skipped and _Pickled.loads == 0


def _count_load() -> _Pickled:
    _Pickled.loads += 1
    return _Pickled()


class _Pickled:
    """A pickled value that counts how often it is unpickled."""

    loads = 0

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_count_load, ())
