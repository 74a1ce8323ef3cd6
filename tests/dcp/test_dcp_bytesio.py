"""DCP's ``io.BytesIO`` values (data loader, RNG and train state blobs) load through ``Reader()``
without ``allow_pickle``, and without running anything in the checkpoint.

Written as DCP's own tests are: a temporary directory from ``tempfile``, the
state saved by ``dcp.save``, the values compared with what DCP's own
``FileSystemWriter``/``FileSystemReader`` give back.
"""

from __future__ import annotations

import io
import os
import struct
import tempfile
import tracemalloc
import zipfile
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402 - after the skip
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import gpuckpt.dcp  # noqa: E402
from gpuckpt.dcp.saved_bytesio import saved_bytesio  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]

#: every call a pickle in a checkpoint makes of a function in this module
CALLS: list[str] = []


def _ran(what: str) -> str:
    CALLS.append(what)
    return what


class Boom:
    """Unpickling it calls :func:`_ran`: proof that a pickle in the checkpoint was run."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_ran, ("Boom was unpickled",))


def bytesio(raw: bytes, pos: int = 0) -> io.BytesIO:
    out = io.BytesIO(raw)
    out.seek(pos)
    return out


def state() -> dict[str, Any]:
    rng = torch.get_rng_state().numpy().tobytes()
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3)},
        "dataloader": bytesio(b"\x80\x04{'epoch': 3, 'index': 1234}\x00\xff" * 50),
        "rng": bytesio(rng, pos=len(rng) // 2),  # read half-way: the position comes back too
        "train": {"blob": bytesio(b""), "step": 7},
    }


def empty() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(2, 3)},
        "dataloader": io.BytesIO(),
        "rng": io.BytesIO(),
        "train": {"blob": io.BytesIO(), "step": 0},
    }


def blobs(sd: dict[str, Any]) -> dict[str, tuple[bytes, int]]:
    return {
        "dataloader": (sd["dataloader"].getvalue(), sd["dataloader"].tell()),
        "rng": (sd["rng"].getvalue(), sd["rng"].tell()),
        "train.blob": (sd["train"]["blob"].getvalue(), sd["train"]["blob"].tell()),
    }


def test_bytesio_values_load_as_with_filesystem_reader_without_allow_pickle() -> None:
    sd = state()
    with tempfile.TemporaryDirectory() as d:
        dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(os.path.join(d, "gpuckpt")))
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(d, "fs")))
        ours, theirs = empty(), empty()
        dcp.load(ours, storage_reader=gpuckpt.dcp.Reader(os.path.join(d, "gpuckpt")))
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(os.path.join(d, "fs")))
    for got in (ours, theirs):
        assert all(isinstance(v, io.BytesIO) for v in (got["dataloader"], got["rng"], got["train"]["blob"]))
        assert blobs(got) == blobs(sd)
        assert got["train"]["step"] == 7 and torch.equal(got["model"]["w"], sd["model"]["w"])
    # the bytes are usable as the state they are
    torch.set_rng_state(torch.frombuffer(bytearray(ours["rng"].getvalue()), dtype=torch.uint8))


def test_bytesio_values_through_dcp_checkpoint_id() -> None:
    """DCP's other call pattern: the path as checkpoint_id, the Reader made without it."""
    sd = {"w": torch.ones(3), "state": bytesio(b"opaque\x00bytes", pos=3)}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt")
        dcp.save(sd, checkpoint_id=path, storage_writer=gpuckpt.dcp.Writer(os.path.join(d, "unused")))
        got: dict[str, Any] = {"w": torch.zeros(3), "state": io.BytesIO()}
        dcp.load(got, checkpoint_id=path, storage_reader=gpuckpt.dcp.Reader(os.path.join(d, "unused")))
        assert sorted(os.listdir(d)) == ["ckpt"]
    assert got["state"].getvalue() == b"opaque\x00bytes" and got["state"].tell() == 3


def test_other_pickled_values_still_need_allow_pickle_and_nothing_runs() -> None:
    """A BytesIO with attributes, one inside a list, or any other object: refused as before,
    with nothing in the checkpoint unpickled; allow_pickle=True still loads them."""
    with_attrs = bytesio(b"x")
    with_attrs.hook = Boom()  # type: ignore[attr-defined]
    cases = {"with_attrs": with_attrs, "in_list": [bytesio(b"y"), Boom()], "boom": Boom()}
    with tempfile.TemporaryDirectory() as d:
        for key, value in cases.items():
            path = os.path.join(d, key)
            dcp.save({"w": torch.ones(1), key: value}, storage_writer=gpuckpt.dcp.Writer(path))
            CALLS.clear()
            with pytest.raises(CheckpointException) as info:
                dcp.load({"w": torch.zeros(1), key: None}, storage_reader=gpuckpt.dcp.Reader(path))
            assert CALLS == [], key
            assert "UnsafeCheckpointError" in str(info.value) and f"'{key}'" in str(info.value)
            assert "allow_pickle=True" in str(info.value)
            got: dict[str, Any] = {"w": torch.zeros(1), key: None}
            dcp.load(got, storage_reader=gpuckpt.dcp.Reader(path, allow_pickle=True))
            assert "Boom was unpickled" in CALLS, key


def _torch_save(value: Any) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def _with_pickle(blob: bytes, pickle: bytes) -> bytes:
    """``blob`` (a torch.save archive) with its data.pkl replaced by ``pickle``."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, pickle if info.filename.endswith("/data.pkl") else src.read(info))
    return out.getvalue()


def test_only_the_program_of_a_lone_bytesio_is_recognised() -> None:
    good = _torch_save(bytesio(b"abc", pos=1))
    got = saved_bytesio(good)
    assert got is not None and got.getvalue() == b"abc" and got.tell() == 1
    for proto in (2, 3, 4, 5):
        out = io.BytesIO()
        torch.save(bytesio(b"\x00\xff" * 9, pos=4), out, pickle_protocol=proto)
        got = saved_bytesio(out.getvalue())
        assert got is not None and got.getvalue() == b"\x00\xff" * 9 and got.tell() == 4, proto
    program = zipfile.ZipFile(io.BytesIO(good)).read("archive/data.pkl")
    assert program.count(b"c_io\nBytesIO\n") == 1
    forged = {
        # the same program calling something else
        "os.system": program.replace(b"c_codecs\nencode\n", b"cposix\nsystem\n"),
        "class": program.replace(b"c_io\nBytesIO\n", b"cposix\nsystem\n"),
        # a state that is not (bytes, position, None)
        "no-stop": program[:-1],
        "trailing": program[:-1] + b"N.",
    }
    for name, pickle in forged.items():
        assert saved_bytesio(_with_pickle(good, pickle)) is None, name
    assert saved_bytesio(_torch_save(3)) is None
    assert saved_bytesio(_torch_save({"a": torch.ones(1)})) is None
    assert saved_bytesio(b"not a zip archive") is None


def test_a_program_that_calls_more_than_once_is_refused_before_it_grows() -> None:
    # one memoized string encoded again and again (5 bytes of opcodes a call): followed as
    # written, memory would grow by the string's size per call
    size, calls = 1 << 20, 1000
    program = (
        b"\x80\x02c_codecs\nencode\nq\x00X" + struct.pack("<I", size) + b"a" * size
        + b"X\x06\x00\x00\x00latin1\x86q\x01" + b"h\x00h\x01R" * calls + b"."
    )  # fmt: skip
    blob = _with_pickle(_torch_save(bytesio(b"abc")), program)
    tracemalloc.start()
    try:
        assert saved_bytesio(blob) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak  # followed as written: 1 GiB


def test_an_archive_zipfile_cannot_read_is_no_saved_bytesio() -> None:
    """An entry marked encrypted (zipfile: RuntimeError) or needing an unknown zip version
    (NotImplementedError) is not what torch.save writes: not recognised, nothing raised (the
    Reader then refuses the value as a pickle it does not run, a typed error)."""
    good = bytearray(_torch_save(io.BytesIO(b"payload")))
    assert saved_bytesio(bytes(good)) is not None

    def encrypted(raw: bytearray) -> bytearray:
        for sig, at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
            i = 0
            while (j := raw.find(sig, i)) >= 0:
                raw[j + at] |= 1  # general purpose flag: encrypted
                i = j + 4
        return raw

    def unknown_version(raw: bytearray) -> bytearray:
        for sig in (b"PK\x03\x04", b"PK\x01\x02"):
            i = 0
            while (j := raw.find(sig, i)) >= 0:
                raw[j + (4 if sig == b"PK\x03\x04" else 6)] = 127  # version needed to extract: 12.7
                i = j + 4
        return raw

    for damage in (encrypted, unknown_version):
        assert saved_bytesio(bytes(damage(bytearray(good)))) is None, damage.__name__
