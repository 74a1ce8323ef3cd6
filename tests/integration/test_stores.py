"""The storage layer's one door (gpuckpt.storage.stores): opening, joining and tidying stores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import UnsupportedValueError
from gpuckpt.storage.local import fsutil
from gpuckpt.storage.stores import attach_writer, cleanup_leftovers, is_committed, open_reader, open_writer


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_second_process_joins_a_local_save_through_its_token(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    owner = open_writer(path, sync="none")
    owner.begin()
    assert owner.token is not None
    owner.write_array_document("w", b"{}")
    joined = attach_writer(path, owner.token)
    joined.write_chunk("w", "c.0", [b"abc", b"de"])
    assert (Path(owner.token) / "w" / "c.0").read_bytes() == b"abcde"  # in the owner's temporary
    with pytest.raises(ValueError, match="is not a temporary of a save to"):
        attach_writer(tmp_path / "other", owner.token)
    owner.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_save_is_joined_only_with_its_token(tmp_path: Path) -> None:
    # s3:// saves are joined too (tests/distributed/test_s3_distributed.py), never without a token
    for path in ("s3://bucket/ck", tmp_path / "ck"):
        with pytest.raises(UnsupportedValueError, match=r"no save to join.*got None"):
            attach_writer(path, None)


def test_readers_and_writers_for_file_urls(tmp_path: Path) -> None:
    gpuckpt.save({"w": np.arange(4.0)}, tmp_path / "ck", sync="none")
    reader = open_reader(f"file://{tmp_path / 'ck'}")
    assert reader.chunk_nbytes("w", "c.0") == 4 * 8 + 4
    with pytest.raises(ValueError, match=r"no storage back end for gs:// URLs"):
        open_reader("gs://bucket/ck")


def test_cleanup_leftovers_tidies_a_directory_of_checkpoints(tmp_path: Path) -> None:
    me, dead = fsutil.tmp_owner(), fsutil.tmp_owner().rsplit("-", 1)[0] + f"-{_dead_pid()}"
    for name in ("a", "c"):
        gpuckpt.save({"w": np.full(3, ord(name), np.float32)}, tmp_path / name, sync="none")
    dead_tmp = tmp_path / f".a.gpuckpt-tmp-{dead}-deadbeef"
    live_tmp = tmp_path / f".b.gpuckpt-tmp-{me}-cafef00d"
    aside = tmp_path / f".c.gpuckpt-old-{dead}-01234567"
    for d in (dead_tmp, live_tmp):
        d.mkdir()
        (d / "partial").write_bytes(b"x")
    os.rename(tmp_path / "c", aside)  # an overwrite of c died between its two renames
    assert not is_committed(tmp_path / "c") and is_committed(aside)

    assert cleanup_leftovers(tmp_path) == [dead_tmp]
    assert sorted(p.name for p in tmp_path.iterdir()) == [live_tmp.name, "a", "c"]
    assert is_committed(tmp_path / "c")  # put back, not deleted: the last complete copy
    assert gpuckpt.load_state_dict(tmp_path / "c")["w"][0] == ord("c")
    assert cleanup_leftovers(tmp_path / "nowhere") == []


def test_is_committed(tmp_path: Path) -> None:
    gpuckpt.save({"w": np.zeros(2)}, tmp_path / "ck", sync="none")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ck")
    (tmp_path / "zarr-store").mkdir()
    (tmp_path / "zarr-store" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    assert is_committed(tmp_path / "ck") and is_committed(f"file://{tmp_path / 'ck'}")
    assert not any(is_committed(tmp_path / n) for n in ("empty", "link", "zarr-store", "missing"))


def test_a_back_end_registered_like_the_others_serves_saves_and_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Back ends are entries of one registry, the file system included: a scheme added there
    (here ``mirror://``, the local back end under another name) is saved to, joined, loaded
    from and listed as a root with no other change."""
    from gpuckpt.storage import stores
    from gpuckpt.storage.base import Backend

    assert all(isinstance(b, Backend) for b in stores.BACKENDS.values())
    assert {"file", "s3"} <= set(stores.BACKENDS)
    local = stores.BACKENDS["file"]
    mirror = Backend(local.writer, local.reader, local.attach, local.root, lambda t: t[len("mirror://") :])
    monkeypatch.setitem(stores.BACKENDS, "mirror", mirror)
    url = f"mirror://{tmp_path}/ck"
    state = {"w": np.arange(12.0).reshape(3, 4), "step": 3}
    gpuckpt.save(state, url)
    assert is_committed(tmp_path / "ck")
    back = gpuckpt.load_state_dict(url)
    assert np.array_equal(back["w"], state["w"]) and back["step"] == 3
    assert type(open_reader(url)) is type(open_reader(tmp_path / "ck"))
    writer = open_writer(f"mirror://{tmp_path}/joined")
    writer.begin()
    assert attach_writer(f"mirror://{tmp_path}/joined", writer.token) is not None
    writer.abort()
    assert stores.open_root(f"mirror://{tmp_path}").is_committed("ck")


def test_an_unknown_scheme_names_the_registered_ones(tmp_path: Path) -> None:
    from gpuckpt.errors import InvalidPathError

    with pytest.raises(InvalidPathError, match=r"no storage back end for gs:// URLs .*one of s3"):
        open_reader("gs://bucket/ck")
