"""Values, key selection, format detection and retention: regressions from an outside review.

Real checkpoints on ``tmp_path``, real safetensors files, the real command
(in process, and once as a subprocess), real manager directories.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.cli import main as cli_main
from gpuckpt.convert import convert, detect_format, read_safetensors, write_safetensors
from gpuckpt.errors import MetadataError, StepOrderError, UnsupportedValueError
from gpuckpt.format.values import MAX_INT_BITS, decode_object, encode_object
from gpuckpt.manager import CheckpointManager


def bits(x: float) -> int:
    return int.from_bytes(struct.pack(">d", x), "big")


def from_bits(b: int) -> float:
    f: float = struct.unpack(">d", b.to_bytes(8, "big"))[0]
    return f


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# 12. safetensors detection and the reserved __metadata__ key -----------------------------


def safetensors_starting_with_0x80(path: Path) -> dict[str, np.ndarray]:
    """A valid safetensors file whose header length is 128 mod 256 (its first byte is 0x80)."""
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    for pad in range(300):
        write_safetensors(tensors, path, metadata={"note": "x" * pad}, overwrite=True)
        if path.read_bytes()[0] == 0x80:
            return tensors
    raise AssertionError("no padding gave a header length of 128 mod 256")


def test_safetensors_whose_first_byte_is_0x80_is_detected_and_converts(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    tensors = safetensors_starting_with_0x80(src)
    assert src.read_bytes()[0] == 0x80 and int.from_bytes(src.read_bytes()[:8], "little") % 256 == 128
    assert detect_format(src) == "safetensors"
    res = convert(src, tmp_path / "ckpt")
    assert res.source_format == "safetensors"
    back = gpuckpt.load_state_dict(tmp_path / "ckpt")
    assert back["w"].tobytes() == tensors["w"].tobytes()


def test_torch_files_and_junk_are_still_told_apart(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.pt"  # legacy torch.save: a pickle (protocol 2) first
    legacy.write_bytes(pickle.dumps(119547037146038801333356, protocol=2) + b"\x00" * 64)
    assert legacy.read_bytes()[0] == 0x80
    assert detect_format(legacy) == "torch"
    zipped = tmp_path / "new.pt"
    zipped.write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    assert detect_format(zipped) == "torch"
    # a plausible header length and a '{' that is not followed by JSON: not safetensors
    junk = tmp_path / "junk.bin"
    junk.write_bytes((16).to_bytes(8, "little") + b"{not json at all" + b"\x01" * 8)
    with pytest.raises(UnsupportedValueError, match="cannot tell the format"):
        detect_format(junk)
    # a header length past the end of the file: not safetensors either
    short = tmp_path / "short.bin"
    short.write_bytes((1000).to_bytes(8, "little") + b'{"a": 1}')
    with pytest.raises(UnsupportedValueError, match="cannot tell the format"):
        detect_format(short)
    # 0x80 without a protocol torch.save writes next: no torch file (and no "needs torch")
    for head in (b"\x80", b"\x80\x00", b"\x80\x06", b"\x80\xff"):
        odd = tmp_path / "odd.bin"
        odd.write_bytes(head + b"\x00" * 64)
        with pytest.raises(UnsupportedValueError, match="cannot tell the format"):
            detect_format(odd)


def test_tensor_named_metadata_is_refused_before_writing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnsupportedValueError, match=r"'__metadata__'.*rename") as info:
        write_safetensors({"__metadata__": np.ones(2, np.float32)}, out / "m.safetensors")
    assert "reserves" in str(info.value)
    assert listing(out) == []  # not even a temporary
    gpuckpt.save({"__metadata__": np.ones(2, np.float32), "b": np.zeros(1)}, tmp_path / "ckpt")
    with pytest.raises(UnsupportedValueError, match=r"'__metadata__'.*rename"):
        convert(tmp_path / "ckpt", out / "m.safetensors")
    assert listing(out) == []
    # nested, the name is "x.__metadata__": allowed, and it comes back
    gpuckpt.save({"x": {"__metadata__": np.ones(2, np.float32)}}, tmp_path / "nested")
    convert(tmp_path / "nested", out / "n.safetensors")
    assert list(read_safetensors(out / "n.safetensors")[0]) == ["x.__metadata__"]


# 13. key selection inside lists, and empty containers --------------------------------------


@pytest.fixture
def layered(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    rng = np.random.default_rng(3)
    state = {
        "layers": [{"w": rng.random(3), "b": rng.random(1)} for _ in range(3)],
        "pair": (rng.random(2), rng.random(2)),
        "step": 7,
    }
    gpuckpt.save(state, tmp_path / "ckpt")
    return tmp_path / "ckpt", state


def test_key_inside_a_list_returns_that_entry_by_position(layered: tuple[Path, dict[str, Any]]) -> None:
    path, state = layered
    part = gpuckpt.load_state_dict(path, keys=["layers.1"])
    assert list(part) == ["layers"] and list(part["layers"]) == [1]
    assert part["layers"][1]["w"].tobytes() == state["layers"][1]["w"].tobytes()
    assert part["layers"][1]["b"].tobytes() == state["layers"][1]["b"].tobytes()
    part = gpuckpt.load_state_dict(path, keys=["layers.2.w", "layers.0"])
    assert sorted(part["layers"]) == [0, 2] and list(part["layers"][2]) == ["w"]
    assert part["layers"][0]["b"].tobytes() == state["layers"][0]["b"].tobytes()
    part = gpuckpt.load_state_dict(path, keys=["pair.1"])
    assert list(part["pair"]) == [1] and part["pair"][1].tobytes() == state["pair"][1].tobytes()
    # every position selected: the list (tuple) itself
    part = gpuckpt.load_state_dict(path, keys=["layers.0.w", "layers.1.w", "layers.2.w", "pair"])
    assert isinstance(part["layers"], list) and [list(d) for d in part["layers"]] == [["w"]] * 3
    assert isinstance(part["pair"], tuple) and len(part["pair"]) == 2


def test_unknown_position_is_refused(layered: tuple[Path, dict[str, Any]]) -> None:
    path, _ = layered
    with pytest.raises(gpuckpt.MissingKeyError, match="'layers.5' is not in the checkpoint"):
        gpuckpt.load_state_dict(path, keys=["layers.5"])


def test_empty_containers_come_back(tmp_path: Path) -> None:
    state: dict[str, Any] = {"a": {}, "l": [{}, {"w": np.ones(2)}], "t": (np.zeros(1), {}), "w": np.ones(1)}
    gpuckpt.save(state, tmp_path / "ckpt")
    back = gpuckpt.load_state_dict(tmp_path / "ckpt")
    assert back["a"] == {} and len(back["l"]) == 2 and back["l"][0] == {}
    assert back["l"][1]["w"].tobytes() == state["l"][1]["w"].tobytes()
    assert isinstance(back["t"], tuple) and back["t"][1] == {}
    # selected by a prefix that covers them; left out otherwise
    assert gpuckpt.load_state_dict(tmp_path / "ckpt", keys=["l"])["l"][0] == {}
    assert list(gpuckpt.load_state_dict(tmp_path / "ckpt", keys=["w"])) == ["w"]
    # through safetensors and back: the same nesting
    convert(tmp_path / "ckpt", tmp_path / "m.safetensors")
    convert(tmp_path / "m.safetensors", tmp_path / "again")
    again = gpuckpt.load_state_dict(tmp_path / "again")
    assert again["a"] == {} and again["l"][0] == {} and again["t"][1] == {}


# 14. floats exact to the bit ------------------------------------------------------------

NAN_BITS = [
    0x7FF8000000000000,  # the default quiet NaN
    0xFFF8000000000000,  # negative
    0x7FF0000000000001,  # signalling
    0xFFF8000000000123,  # negative, with a payload
    0x7FFFFFFFFFFFFFFF,
]
NUMBERS = [-0.0, 0.0, math.inf, -math.inf, 5e-324, -1.7976931348623157e308, 0.1]


def test_plain_floats_keep_nan_sign_payload_and_zero_sign(tmp_path: Path) -> None:
    nans = [from_bits(b) for b in NAN_BITS]
    state: dict[str, Any] = {
        "floats": nans + NUMBERS,
        "pairs": tuple(nans),
        "complex": [complex(nans[3], nans[1]), complex(-0.0, -math.inf), complex(nans[2], -0.0)],
        "nested": {"x": {"y": nans[3]}},
        "w": np.ones(1),
    }
    gpuckpt.save(state, tmp_path / "ckpt")
    for back in (
        gpuckpt.load_state_dict(tmp_path / "ckpt"),
        _via_safetensors(tmp_path),
    ):
        assert [bits(x) for x in back["floats"]] == [bits(x) for x in state["floats"]]
        assert [bits(x) for x in back["pairs"]] == NAN_BITS
        assert [(bits(c.real), bits(c.imag)) for c in back["complex"]] == [
            (bits(c.real), bits(c.imag)) for c in state["complex"]
        ]
        assert bits(back["nested"]["x"]["y"]) == NAN_BITS[3]


def _via_safetensors(tmp_path: Path) -> dict[str, Any]:
    convert(tmp_path / "ckpt", tmp_path / "m.safetensors", overwrite=True)
    convert(tmp_path / "m.safetensors", tmp_path / "again", overwrite=True)
    return gpuckpt.load_state_dict(tmp_path / "again")


def test_float_text_of_format_v1_still_reads_and_bad_nan_text_is_refused() -> None:
    # what format v1 wrote: float.hex, "nan" without its bits
    assert bits(decode_object({"float": "-0x0.0p+0"})) == bits(-0.0)
    assert decode_object({"float": "-inf"}) == -math.inf
    assert math.isnan(decode_object({"float": "nan"}))
    assert decode_object({"complex": ["0x1.8p+1", "nan"]}).real == 3.0
    # the new encoding is plain float.hex for everything but a NaN
    assert encode_object(0.5) == {"float": "0x1.0000000000000p-1"}
    assert encode_object(from_bits(0xFFF8000000000123)) == {"float": "nan:fff8000000000123"}
    for bad in (
        "nan:7ff0000000000000",
        "nan:fff8",
        "nan:FFF8000000000123",
        "nan: fff800000000012",
        "0x1p+0" * 20,
    ):
        with pytest.raises(MetadataError, match="malformed"):
            decode_object({"float": bad}, fqn="lr")


# 17c. ints past Python's int/str conversion limit ---------------------------------------


def test_huge_ints_round_trip_exactly(tmp_path: Path) -> None:
    big = 7**20_000  # 16,902 digits, far past the default limit of 4,300
    edge = 2**2048  # the first int written in hex
    state = {"big": big, "neg": -big, "list": [big, edge, edge - 1, -(edge - 1)], "np": np.int64(5)}
    gpuckpt.save(state, tmp_path / "ckpt")
    back = gpuckpt.load_state_dict(tmp_path / "ckpt")
    assert back["big"] == big and back["neg"] == -big
    assert back["list"] == [big, edge, edge - 1, -(edge - 1)]
    assert type(back["np"]) is np.int64
    # and inspect shows such a checkpoint instead of failing on the digit limit
    assert cli_main(["inspect", "-q", str(tmp_path / "ckpt")]) == 0


def test_int_too_large_or_unnamable_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedValueError, match=r"'opt.huge' is an int of \d+ bits"):
        gpuckpt.save({"opt": {"huge": 1 << (MAX_INT_BITS + 1)}}, tmp_path / "a")
    with pytest.raises(UnsupportedValueError, match=r"int key under 'opt' has \d+ bits"):
        gpuckpt.save({"opt": {10**5000: np.ones(1)}}, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_stored_int_text_is_bounded_on_read() -> None:
    too_long_hex = "0x" + "f" * (MAX_INT_BITS // 4 + 1)
    assert decode_object({"int": too_long_hex[:-1]}) == 2**MAX_INT_BITS - 1
    for body in (too_long_hex, "-" + too_long_hex, "9" * 10_001, "1_000", " 12", "0X1F", "+5"):
        with pytest.raises(MetadataError, match="'n'.*malformed"):
            decode_object({"int": body}, fqn="n")
    assert decode_object({"int": "-" + "9" * 9_999}) == -(10**9_999 - 1)
    assert decode_object({"int": hex(-(2**5000))}) == -(2**5000)


# 17b. --chunk-mb -----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "-1", "0", "1e308", "1e-9", "lots"])
def test_bad_chunk_mb_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    gpuckpt.save({"w": np.ones(4)}, tmp_path / "src")
    assert (
        cli_main(["convert", "-q", str(tmp_path / "src"), str(tmp_path / "dst"), f"--chunk-mb={value}"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpuckpt: error: argument --chunk-mb") and value in err[0]
    assert not (tmp_path / "dst").exists()


def test_chunk_mb_inf_as_a_command(tmp_path: Path) -> None:
    gpuckpt.save({"w": np.ones(4)}, tmp_path / "src")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuckpt.cli",
            "convert",
            str(tmp_path / "src"),
            str(tmp_path / "d"),
            "--chunk-mb",
            "inf",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GPUCKPT_DEBUG": ""},
    )
    assert r.returncode == 2, r.stderr
    assert "unexpected" not in r.stderr and "Traceback" not in r.stderr and "--chunk-mb" in r.stderr
    assert cli_main(["convert", "-q", str(tmp_path / "src"), str(tmp_path / "d"), "--chunk-mb", "0.5"]) == 0


# 16. retention after a roll-back --------------------------------------------------------


def state_at(step: int) -> dict[str, Any]:
    return {"w": np.full(8, step, np.float32), "step": step}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_rollback_save_is_refused_until_newer_steps_are_deleted(tmp_path: Path, async_save: bool) -> None:
    with CheckpointManager(tmp_path, async_save=async_save, sync="none") as mgr:
        for s in (100, 200, 300):
            mgr.save(s, state_at(s))
    mgr = CheckpointManager(tmp_path, max_to_keep=2, async_save=async_save, sync="none")
    target = state_at(0)
    assert mgr.restore(target, step=100) == 100 and target["step"] == 100
    before = listing(tmp_path)
    with pytest.raises(
        StepOrderError, match=r"step 110 is older than the committed step\(s\) \[200, 300\]"
    ) as info:
        mgr.save(110, state_at(110))
    assert "mgr.delete(s)" in str(info.value) and "latest_step()" in str(info.value)
    mgr.wait()
    assert listing(tmp_path) == before  # nothing written, nothing deleted
    for s in [s for s in mgr.all_steps() if s > 100]:
        mgr.delete(s)
    assert mgr.all_steps() == [100]
    for s in (110, 120, 130):
        assert mgr.save(s, state_at(s))
        mgr.wait()
        assert mgr.latest_step() == s and s in mgr.all_steps()
        assert mgr.restore_state_dict()["step"] == s
    mgr.close()
    assert mgr.all_steps() == [120, 130]
    assert not [n for n in listing(tmp_path) if n.startswith(".")]


def test_retention_never_deletes_the_step_just_saved(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, max_to_keep=1, sync="none")  # async saves
    mgr.save(10, state_at(10))
    mgr.wait()
    mgr.save(20, state_at(20))
    # a newer step appears behind the manager's back before it takes note of step 20's commit
    gpuckpt.save(state_at(500), tmp_path / "step_00000500", sync="none")
    mgr.wait()
    assert 20 in mgr.all_steps() and 10 not in mgr.all_steps()
    assert mgr.restore_state_dict(step=20)["step"] == 20
    mgr.close()


def test_delete_of_a_missing_step_is_an_error(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False, sync="none") as mgr:
        mgr.save(1, state_at(1))
        with pytest.raises(gpuckpt.CheckpointNotFoundError, match=r"step 2 has no committed checkpoint"):
            mgr.delete(2)
        with pytest.raises(TypeError, match="step must be an int"):
            mgr.delete(None)  # type: ignore[arg-type]
        assert mgr.all_steps() == [1]


def test_json_of_a_nan_entry_is_plain_text(tmp_path: Path) -> None:
    """The NaN encoding is a JSON string: the metadata stays standard JSON (no NaN literals)."""
    gpuckpt.save({"x": from_bits(0xFFF8000000000123)}, tmp_path / "ckpt")
    raw = (tmp_path / "ckpt" / "zarr.json").read_text()
    assert "nan:fff8000000000123" in raw
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
