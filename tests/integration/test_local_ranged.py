"""Ranged reads of local checkpoints: a load of some rows of a tensor reads only the segments holding them.

The tensor is 12 MiB in chunks of 4 MiB (1,024 rows of 4 KiB): 4 segments of 1 MiB per chunk.
Which bytes were read shows in which damage is found: a segment that is read is checked, one that
is not needed is not read at all.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import ChecksumError
from gpuckpt.format.documents import ROOT_KEY, root_document
from gpuckpt.format.reader import metadata_of_root
from gpuckpt.format.segments import SEGMENT_BYTES, SEGMENTS_KEY
from gpuckpt.verify import verify_checkpoint

STATE = np.arange(3 << 20, dtype=np.float32).reshape(3072, 1024)


def _rows(path: Path, start: int, stop: int) -> np.ndarray:
    box = gpuckpt.ShardedArray(np.empty((stop - start, 1024), np.float32), (start, 0), STATE.shape)
    gpuckpt.load({"w": box}, path)
    out: np.ndarray = box.local
    return out


def _flip(path: Path, at: int) -> None:
    with open(path / "w" / "c.1.0", "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


def test_a_partial_local_load_reads_and_checks_only_the_segments_holding_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    gpuckpt.save({"w": STATE}, path, chunk_bytes=4 << 20)
    _flip(path, 100)  # segment 0 of chunk 1 (its rows 0..256): not needed by rows 1500..1600
    assert np.array_equal(_rows(path, 1500, 1600), STATE[1500:1600])
    _flip(path, SEGMENT_BYTES + 100)  # segment 1 (rows 256..512): read for rows 1500..1600
    with pytest.raises(ChecksumError, match=r"c\.1\.0.*segment 1"):
        _rows(path, 1500, 1600)
    with pytest.raises(ChecksumError, match=r"c\.1\.0"):  # the whole tensor: the whole chunk, checked
        gpuckpt.load({"w": np.empty_like(STATE)}, path)


def _rewrite_root(path: Path, change: Any) -> None:
    """Re-publish the root document with ``change(storage_data)`` applied (valid and checksummed)."""
    root = path / ROOT_KEY
    md = metadata_of_root(root.read_bytes(), str(root))
    change(md.storage_data)
    root.write_bytes(root_document(md))


def test_verify_reports_segment_records_that_do_not_add_up_and_loads_stay_correct(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    gpuckpt.save({"w": STATE}, path, chunk_bytes=4 << 20)
    assert verify_checkpoint(path).ok

    def swap(sd: dict[str, Any]) -> None:
        entry = sd["tensors"]["w"][SEGMENTS_KEY]
        crcs = np.frombuffer(base64.b64decode(entry["crc32c"]), "<u4").copy()
        crcs[[5, 6]] = crcs[[6, 5]]  # two segments of chunk 1 swapped: they no longer combine
        entry["crc32c"] = base64.b64encode(crcs.tobytes()).decode()

    _rewrite_root(path, swap)
    report = verify_checkpoint(path)
    assert [(d.fqn, d.where) for d in report.damage] == [("w", "zarr.json (segment records of w)")]
    assert "chunk 1 in C order" in report.damage[0].problem
    assert np.array_equal(_rows(path, 1500, 1600), STATE[1500:1600])  # read whole, checked whole

    _rewrite_root(path, lambda sd: sd["tensors"]["w"].__setitem__(SEGMENTS_KEY, {"bytes": 3, "crc32c": "?"}))
    report = verify_checkpoint(path)
    assert [d.problem.split(":")[0] for d in report.damage] == ["malformed"]
    assert np.array_equal(_rows(path, 1500, 1600), STATE[1500:1600])
