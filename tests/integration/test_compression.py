"""Compressed checkpoints: every Zarr reader decodes them bit-exactly, damage and hostile chunks
are typed errors, verify and the records work as for uncompressed ones."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr

import gpuckpt
from gpuckpt.format.checksum import crc32c
from gpuckpt.format.codecs import MAX_BLOSC_BLOCKSIZE, Codec, encode
from gpuckpt.format.reader import metadata_from_json
from gpuckpt.testing.faults import copy_checkpoint
from gpuckpt.verify import verify_checkpoint

CHOICES: list[Any] = ["zstd", "lz4", {"codec": "zstd", "level": 3}, {"shuffle": "bitshuffle", "level": 2}]


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    w = rng.standard_normal((96, 200), dtype=np.float32) * 0.02
    conv = rng.standard_normal((4, 6, 5, 3), dtype=np.float32)
    return {
        "bf16": w.astype(ml_dtypes.bfloat16),
        "fp8": w.astype(ml_dtypes.float8_e4m3fn),
        "fp16": w.astype(np.float16),
        "fp32": np.abs(w) * 1e-3,
        "int": rng.integers(-1000, 1000, (333,), dtype=np.int32),
        "u8": rng.integers(0, 4, (1000,), dtype=np.uint8),
        "bool": rng.integers(0, 2, (77,)).astype(bool),
        "channels_last": conv.transpose(0, 2, 3, 1),  # a (4, 5, 3, 6) view in NHWC order
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.float64(2.5),
        "step": 11,
    }


def _same(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("choice", CHOICES, ids=["zstd", "lz4", "zstd-core", "bitshuffle"])
def test_zarr_python_and_tensorstore_read_every_compressed_tensor(tmp_path: Path, choice: Any) -> None:
    state = _state()
    # small chunks: several per tensor, edge chunks padded
    md = gpuckpt.save(state, tmp_path / "c", compression=choice, chunk_bytes=16 << 10)
    assert md.version == "4"
    codec_name = choice["codec"] if isinstance(choice, dict) and "codec" in choice else "blosc"
    back = gpuckpt.load_state_dict(tmp_path / "c")
    for fqn, value in state.items():
        if not isinstance(value, np.ndarray):
            assert back[fqn] == value
            continue
        assert _same(back[fqn], value), fqn
        doc = json.loads((tmp_path / "c" / fqn / "zarr.json").read_text())
        assert [c["name"] for c in doc["codecs"]] == ["bytes", codec_name, "crc32c"]
        if value.size == 0:
            continue
        z = zarr.open_array(str(tmp_path / "c" / fqn), mode="r")[...]
        assert np.ascontiguousarray(value).tobytes() == np.asarray(z).tobytes(), fqn
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "c" / fqn)}}
        t = ts.open(spec).result().read().result()
        assert np.ascontiguousarray(value).tobytes() == t.tobytes(), fqn
    report = verify_checkpoint(tmp_path / "c")
    assert report.ok and report.chunks > len(state)
    # the channels-last array comes back in its memory format too
    out = {"channels_last": np.zeros((4, 6, 5, 3), np.float32).transpose(0, 2, 3, 1)}
    gpuckpt.load(out, tmp_path / "c", strict=False)
    assert _same(out["channels_last"], state["channels_last"])


def test_compressed_chunks_are_smaller_and_uncompressed_saves_unchanged(tmp_path: Path) -> None:
    state = _state()
    gpuckpt.save(state, tmp_path / "plain")
    gpuckpt.save(state, tmp_path / "zstd", compression="zstd")
    plain = (tmp_path / "plain" / "bf16" / "c.0.0").stat().st_size
    packed = (tmp_path / "zstd" / "bf16" / "c.0.0").stat().st_size
    assert packed < plain / 1.2
    md = gpuckpt.read_metadata(tmp_path / "plain")
    assert md.version == "1" and "codec" not in md.storage_data["tensors"]["bf16"]
    assert "codec" in gpuckpt.read_metadata(tmp_path / "zstd").storage_data["tensors"]["bf16"]
    assert not (tmp_path / "plain" / "bf16" / "zarr.json").read_text().count("blosc")


def test_compression_none_is_no_compression_on_every_path(tmp_path: Path) -> None:
    """ "none", the command line's word, means what None means on each entry point of the
    Python API: save, async_save, a sharded save, the manager and convert."""
    state = _state()
    gpuckpt.save(state, tmp_path / "default")
    gpuckpt.save(state, tmp_path / "save", compression="none")
    gpuckpt.async_save(state, tmp_path / "async", compression="none").result()
    w = np.arange(32, dtype=np.float32).reshape(4, 8)
    sharded = {"w": gpuckpt.ShardedArray(w, (0, 0), (4, 8))}
    gpuckpt.save(sharded, tmp_path / "sharded", compression="none")
    with gpuckpt.CheckpointManager(tmp_path / "root", compression="none") as manager:
        manager.save(1, state)
    from gpuckpt.convert import convert

    convert(tmp_path / "default", tmp_path / "converted", compression="none")
    steps = [p for p in (tmp_path / "root").iterdir() if (p / "zarr.json").is_file()]
    assert len(steps) == 1
    for ckpt in [tmp_path / n for n in ("save", "async", "sharded", "converted")] + steps:
        md = gpuckpt.read_metadata(ckpt)
        assert md.version == "1", ckpt  # what a save without compression writes
        assert all("codec" not in e for e in md.storage_data["tensors"].values()), ckpt
    plain = (tmp_path / "default" / "bf16" / "c.0.0").read_bytes()
    assert (tmp_path / "save" / "bf16" / "c.0.0").read_bytes() == plain
    # other spellings are refused, naming "none" among the choices
    with pytest.raises(gpuckpt.InvalidOptionError, match="'none'"):
        gpuckpt.save(state, tmp_path / "bad", compression="None")
    assert not (tmp_path / "bad").exists()


def test_a_chunk_table_records_the_stored_sizes(tmp_path: Path) -> None:
    # more than 4,096 chunks: records in the chunk table, with its nbytes column
    rng = np.random.default_rng(1)
    state = {"w": (rng.standard_normal((4200, 64), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)}
    md = gpuckpt.save(state, tmp_path / "c", compression="lz4", chunk_bytes=128)
    assert md.version == "4" and "nbytes" in md.storage_data["chunk_table"]["columns"]
    assert _same(gpuckpt.load_state_dict(tmp_path / "c")["w"], state["w"])
    assert verify_checkpoint(tmp_path / "c").ok


def test_a_flipped_byte_in_a_compressed_chunk_names_tensor_and_chunk(tmp_path: Path) -> None:
    gpuckpt.save(_state(), tmp_path / "c", compression="zstd", chunk_bytes=16 << 10)
    chunk = tmp_path / "c" / "bf16" / "c.1.0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    chunk.write_bytes(raw)
    with pytest.raises(gpuckpt.ChecksumError, match=r"chunk c\.1\.0 of tensor 'bf16'") as info:
        gpuckpt.load_state_dict(tmp_path / "c")
    assert (info.value.fqn, info.value.key) == ("bf16", "c.1.0")
    damage = verify_checkpoint(tmp_path / "c").damage
    assert [d.where for d in damage] == ["bf16/c.1.0"] and "checksum" in damage[0].problem


def _replace_chunk(ckpt: Path, fqn: str, key: str, payload: bytes) -> None:
    """Store ``payload`` as chunk ``key`` of ``fqn`` with a valid trailer, and record its size and
    CRC32C in the root document (a hostile checkpoint consistent with itself)."""
    crc = crc32c(payload)
    (ckpt / fqn / key).write_bytes(payload + crc.to_bytes(4, "little"))
    root = json.loads((ckpt / "zarr.json").read_text())
    md = root["attributes"]["gpuckpt"]["metadata"]
    for rec in md["storage_data"]["tensors"][fqn]["chunks"]:
        if rec["key"] == key:
            rec["nbytes"], rec["crc32c"] = len(payload) + 4, crc
    canonical = json.dumps(md, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    root["attributes"]["gpuckpt"]["metadata_crc32c"] = crc32c(canonical)
    (ckpt / "zarr.json").write_text(json.dumps(root))


#: loads each checkpoint of argv[1:] into a 256 x 256 float32 target with memory traced from
#: before the first load (tracing starts while no other thread runs and is never stopped:
#: stopping it while another thread allocates crashes CPython before 3.12.9,
#: python/cpython#128679, and the load's I/O threads live on), and prints per load the error
#: it raised and the most memory traced during it
_TRACED_LOADS = """
import json, sys, threading, tracemalloc
import numpy as np, gpuckpt
assert threading.active_count() == 1
tracemalloc.start()
out = []
for path in sys.argv[1:]:
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    try:
        gpuckpt.load({"w": np.empty((256, 256), np.float32)}, path)
        out.append({"raised": None})
    except gpuckpt.GpuckptError as e:
        peak = tracemalloc.get_traced_memory()[1] - before
        out.append({"raised": type(e).__name__, "message": str(e), "fqn": e.fqn, "key": e.key,
                    "corrupted": isinstance(e, gpuckpt.CheckpointCorruptedError), "peak": peak})
print(json.dumps(out))
"""


@pytest.mark.parametrize("codec", ["zstd", {"codec": "zstd"}])
def test_hostile_compressed_chunks_are_typed_errors_within_bounded_memory(tmp_path: Path, codec: Any) -> None:
    state = {"w": np.zeros((256, 256), np.float32)}  # one chunk of 256 KiB
    md = gpuckpt.save(state, tmp_path / "c", compression=codec)
    info = md.storage_data["tensors"]["w"]["codec"]
    c = Codec("zstd", 1) if info["name"] == "zstd" else Codec("blosc", 1, "zstd", "shuffle", 4, 1 << 20)
    bomb = encode(c, np.zeros(1 << 30, np.uint8), 0).tobytes()  # 1 GiB of zeros in a few KiB
    wrong = encode(c, np.zeros(100, np.uint8), 0).tobytes()
    garbage = bytes(wrong[:16]) + b"\xff" * 64
    cases = [
        (bomb, "announces 1073741824 bytes"),
        (wrong, "announces 100 bytes"),
        (garbage, "decompress|announces"),
    ]
    paths = []
    for i, (payload, _) in enumerate(cases):
        paths.append(copy_checkpoint(tmp_path / "c", tmp_path / f"hostile{i}"))
        _replace_chunk(paths[-1], "w", "c.0.0", payload)
    proc = subprocess.run(
        [sys.executable, "-c", _TRACED_LOADS, *map(str, paths)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for path, (_, match), r in zip(paths, cases, json.loads(proc.stdout), strict=True):
        assert r["raised"] == "ChunkDecodeError" and re.search(match, r["message"]), r
        assert r["peak"] < 8 << 20, r  # nothing sized by the frame's claim
        assert (r["fqn"], r["key"], r["corrupted"]) == ("w", "c.0.0", True)
        assert [d.where for d in verify_checkpoint(path).damage] == ["w/c.0.0"]


_TRACED_VERIFY = """
import json, sys, threading, tracemalloc
from gpuckpt.verify import verify_checkpoint
tracemalloc.start()
out = []
for group_bytes in (1 << 20, 1 << 30):
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    report = verify_checkpoint(sys.argv[1], threads=4, group_bytes=group_bytes)
    out.append({"ok": report.ok, "peak": tracemalloc.get_traced_memory()[1] - before})
print(json.dumps(out))
"""


def test_verify_decompresses_within_group_bytes_or_one_chunk_at_a_time(tmp_path: Path) -> None:
    """Compressed chunks are decompressed whole (their codecs do not stream): 8 chunks of 8 MiB of
    zeros, a few KiB each on disk, verified by 4 threads, hold one chunk at a time within a
    budget of 1 MiB, and at most one chunk per thread within 1 GiB."""
    gpuckpt.save(
        {"w": np.zeros((8, 2 << 20), np.float32)}, tmp_path / "c", chunk_bytes=8 << 20, compression="zstd"
    )
    assert gpuckpt.read_metadata(tmp_path / "c").storage_data["tensors"]["w"]["codec"]["name"] == "blosc"
    proc = subprocess.run(
        [sys.executable, "-c", _TRACED_VERIFY, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tight, loose = json.loads(proc.stdout)
    assert tight["ok"] and loose["ok"]
    chunk = 8 << 20
    assert tight["peak"] < chunk + (2 << 20), tight  # one chunk (and its few KiB of frame)
    assert loose["peak"] < 4 * chunk + (4 << 20), loose  # at most one chunk per thread


def test_a_record_claiming_more_than_the_codec_stores_is_refused(tmp_path: Path) -> None:
    gpuckpt.save({"w": np.zeros(1000, np.float32)}, tmp_path / "c", compression="zstd")
    root = json.loads((tmp_path / "c" / "zarr.json").read_text())
    md = root["attributes"]["gpuckpt"]["metadata"]
    md["storage_data"]["tensors"]["w"]["chunks"][0]["nbytes"] = 1 << 40
    canonical = json.dumps(md, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    root["attributes"]["gpuckpt"]["metadata_crc32c"] = crc32c(canonical)
    (tmp_path / "c" / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(gpuckpt.MetadataError, match="its codec stores 5 to"):
        gpuckpt.read_metadata(tmp_path / "c")


@pytest.mark.parametrize(
    "field", ["name", "configuration", "cname", "clevel", "shuffle", "typesize", "blocksize"]
)
def test_a_codec_field_of_any_wrong_type_is_a_metadata_error(tmp_path: Path, field: str) -> None:
    # a list as blosc's shuffle once escaped as a bare TypeError (unhashable)
    gpuckpt.save({"w": np.zeros(1000, np.float32)}, tmp_path / "c", compression="zstd")
    path = tmp_path / "c" / "zarr.json"
    good = json.loads(path.read_text())
    for value in (None, True, -1, 1.5, "x", [], {}, ["shuffle"], {"a": 1}):
        root = json.loads(json.dumps(good))
        md = root["attributes"]["gpuckpt"]["metadata"]
        codec = md["storage_data"]["tensors"]["w"]["codec"]
        assert codec["name"] == "blosc"
        (codec if field in ("name", "configuration") else codec["configuration"])[field] = value
        canonical = json.dumps(md, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        root["attributes"]["gpuckpt"]["metadata_crc32c"] = crc32c(canonical)
        path.write_text(json.dumps(root))
        with pytest.raises(gpuckpt.MetadataError, match="'w'.*its codec is not one gpuckpt reads"):
            gpuckpt.read_metadata(tmp_path / "c")


def test_a_codec_in_an_older_format_version_is_refused(tmp_path: Path) -> None:
    gpuckpt.save({"w": np.zeros(1000, np.float32)}, tmp_path / "c", compression="zstd")
    root = json.loads((tmp_path / "c" / "zarr.json").read_text())
    md = root["attributes"]["gpuckpt"]["metadata"]
    md["version"] = "1"
    with pytest.raises(gpuckpt.MetadataError, match="names a codec, which format version 1 does not have"):
        metadata_from_json(md)


@pytest.mark.parametrize(
    "bad",
    [
        "gzip",
        {"codec": "lz77"},
        {"level": 99},
        {"shuffle": "twice"},
        3,
        # the core zstd codec has no shuffle: asked for, it would be dropped without a word
        {"codec": "zstd", "shuffle": "bitshuffle"},
        {"codec": "zstd", "cname": "lz4"},
        {"codec": "zstd", "blocksize": -5},
        {"blocksize": MAX_BLOSC_BLOCKSIZE + 1},  # a block TensorStore would refuse to read
    ],
)
def test_a_bad_compression_option_is_refused_before_anything_is_written(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(gpuckpt.InvalidOptionError, match="compression"):
        gpuckpt.save({"w": np.zeros(4)}, tmp_path / "c", compression=bad)
    assert not (tmp_path / "c").exists()


def test_the_largest_blosc_block_size_accepted_is_read_by_tensorstore(tmp_path: Path) -> None:
    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    gpuckpt.save({"w": w}, tmp_path / "c", compression={"blocksize": MAX_BLOSC_BLOCKSIZE})
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "c" / "w")}}
    assert np.array_equal(ts.open(spec).result().read().result(), w)


def test_inspect_shows_stored_and_logical_bytes(tmp_path: Path) -> None:
    from gpuckpt.cli.inspect_cmd import describe_checkpoint, format_description

    state = {"w": (np.random.default_rng(0).standard_normal(1 << 18) * 0.02).astype(ml_dtypes.bfloat16)}
    gpuckpt.save(state, tmp_path / "c", compression="zstd")
    d = describe_checkpoint(tmp_path / "c")
    (row,) = d["tensors"]
    assert row["codec"] == "blosc zstd-1 shuffle" and row["stored_bytes"] == row["file_bytes"] < row["bytes"]
    text = format_description(d)
    assert "stored" in text and "x smaller" in text and "warning" not in text


def test_a_release_that_reads_version_3_refuses_a_compressed_checkpoint_cleanly(tmp_path: Path) -> None:
    from unittest import mock

    import gpuckpt.format.metadata as fmt

    gpuckpt.save({"w": np.zeros(1000, np.float32)}, tmp_path / "c", compression="zstd")
    gpuckpt.save({"w": np.zeros(1000, np.float32)}, tmp_path / "plain")
    # what the previous release's version check says of each (its versions: 1 to 3)
    with mock.patch.multiple(fmt, FORMAT_VERSION="3", READABLE_VERSIONS=("1", "2", "3")):
        with pytest.raises(gpuckpt.UnsupportedVersionError, match="version 4 is newer .* upgrade gpuckpt"):
            gpuckpt.load_state_dict(tmp_path / "c")
        assert gpuckpt.load_state_dict(tmp_path / "plain")["w"].shape == (1000,)
