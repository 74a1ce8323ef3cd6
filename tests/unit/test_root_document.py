"""The root zarr.json: the metadata as written is checked on its stored bytes, anything else re-encoded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import MetadataError
from gpuckpt.format.documents import _as_written, root_document
from gpuckpt.format.reader import metadata_of_root


@pytest.fixture
def raw(tmp_path: Path) -> bytes:
    gpuckpt.save({"w": np.arange(12.0).reshape(3, 4), "opt": {"lr": 0.1, "step": 7}}, tmp_path / "c")
    return (tmp_path / "c" / "zarr.json").read_bytes()


def test_a_document_as_written_is_read_from_its_stored_bytes(raw: bytes) -> None:
    assert _as_written(raw) is not None
    md = metadata_of_root(raw, "zarr.json")
    assert root_document(md) == raw  # the same canonical bytes round-trip


def test_a_reserialized_document_takes_the_general_path(raw: bytes) -> None:
    pretty = json.dumps(json.loads(raw), indent=2).encode()
    assert _as_written(pretty) is None
    assert metadata_of_root(pretty, "zarr.json") == metadata_of_root(raw, "zarr.json")
    assert _as_written(raw + b"\n") is None
    assert metadata_of_root(raw + b"\n", "zarr.json") == metadata_of_root(raw, "zarr.json")


def test_a_changed_byte_in_the_metadata_is_a_checksum_mismatch(raw: bytes) -> None:
    i = raw.index(b'"step"')  # the name of a stored value: still valid JSON when changed
    damaged = raw[:i] + b'"stAp"' + raw[i + 6 :]
    json.loads(damaged)
    assert _as_written(damaged) is None
    with pytest.raises(MetadataError, match="metadata checksum mismatch"):
        metadata_of_root(damaged, "zarr.json")


@pytest.mark.parametrize("crc", [b"4294967296", b"01", b"-1", b"1.0"])
def test_an_impossible_checksum_is_refused(raw: bytes, crc: bytes) -> None:
    head, _, _ = raw.rpartition(b',"metadata_crc32c":')
    damaged = head + b',"metadata_crc32c":' + crc + b"}}}"
    assert _as_written(damaged) is None
    with pytest.raises(MetadataError):
        metadata_of_root(damaged, "zarr.json")
