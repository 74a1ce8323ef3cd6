"""A checkpoint path of the wrong type, an empty one or one of an unknown scheme is a typed
error naming what was given and what to give instead, raised before anything is written
or read; an earlier checkpoint stays loadable."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt import CheckpointManager, InvalidPathError
from gpuckpt.verify import verify_checkpoint

BAD_PATHS: list[tuple[Any, str]] = [
    ({"w": np.zeros(2)}, "the state dict comes first"),
    (None, "found NoneType"),
    (7, "found int"),
    (b"/tmp/ckpt", "os.fsdecode"),
    ("", "is empty"),
    ("file://", "is empty"),
    ("gs://bucket/run", "no storage back end for gs://"),
    # a URL with a slash missing would be a local directory named "s3:"
    ("s3:/bucket/run", r"looks like a URL with a slash missing .*: write 's3://bucket/run'"),
    ("S3:/bucket/run", r"looks like a URL with a slash missing .*: write 'S3://bucket/run'"),
    ("s3:", r"looks like a URL with a slash missing .*: write 's3://BUCKET/PREFIX'"),
    ("file:/ckpt/run", r"looks like a URL with a slash missing .*: write 'file:///ckpt/run'"),
]


@pytest.fixture
def earlier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # the working directory is where a path read as "" or "file://" would land
    monkeypatch.chdir(tmp_path)
    gpuckpt.save({"w": np.arange(4.0)}, tmp_path / "earlier")
    return tmp_path / "earlier"


def _unchanged(tmp_path: Path, earlier: Path) -> None:
    assert sorted(os.listdir(tmp_path)) == ["earlier"]
    sd = {"w": np.zeros(4)}
    gpuckpt.load(sd, earlier)
    np.testing.assert_array_equal(sd["w"], np.arange(4.0))


@pytest.mark.parametrize(("path", "says"), BAD_PATHS, ids=[repr(p)[:20] for p, _ in BAD_PATHS])
def test_save_and_async_save_refuse_bad_paths(tmp_path: Path, earlier: Path, path: Any, says: str) -> None:
    state = {"w": np.ones(3)}
    with pytest.raises(InvalidPathError, match=says) as info:
        gpuckpt.save(state, path)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    with pytest.raises(InvalidPathError, match=says):
        gpuckpt.async_save(state, path).result(timeout=60)
    _unchanged(tmp_path, earlier)


@pytest.mark.parametrize(("path", "says"), BAD_PATHS, ids=[repr(p)[:20] for p, _ in BAD_PATHS])
def test_load_read_metadata_and_verify_refuse_bad_paths(
    tmp_path: Path, earlier: Path, path: Any, says: str
) -> None:
    sd = {"w": np.full(4, 9.0)}
    with pytest.raises(InvalidPathError, match=says):
        gpuckpt.load(sd, path)
    np.testing.assert_array_equal(sd["w"], np.full(4, 9.0))
    with pytest.raises(InvalidPathError, match=says):
        gpuckpt.read_metadata(path)
    with pytest.raises(InvalidPathError, match=says):
        verify_checkpoint(path)
    _unchanged(tmp_path, earlier)


def test_swapped_load_arguments_name_the_order(tmp_path: Path, earlier: Path) -> None:
    sd = {"w": np.zeros(4)}
    with pytest.raises(InvalidPathError, match=r"load\(state_dict, path\)"):
        gpuckpt.load(str(earlier), sd)  # type: ignore[arg-type]
    np.testing.assert_array_equal(sd["w"], np.zeros(4))


@pytest.mark.parametrize("root", [None, 3, b"runs", "", "gs://bucket/runs", "s3:/bucket/runs"])
def test_manager_refuses_a_bad_root_at_construction(tmp_path: Path, earlier: Path, root: Any) -> None:
    with pytest.raises(InvalidPathError):
        CheckpointManager(root)
    _unchanged(tmp_path, earlier)


def test_a_local_directory_named_like_a_scheme_is_written_as_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "s3:" / "bucket" / "run"
    with pytest.raises(
        InvalidPathError, match=re.escape(f"or the absolute path '{local}' to mean that local directory")
    ):
        gpuckpt.save({"w": np.ones(2)}, Path("s3:/bucket/run"))
    assert os.listdir(tmp_path) == []
    gpuckpt.save({"w": np.ones(2)}, local)
    np.testing.assert_array_equal(gpuckpt.load_state_dict(local)["w"], np.ones(2))
    assert verify_checkpoint(local).ok
    # a path written relative with ./ reaches save and load as written
    gpuckpt.save({"w": np.ones(2)}, "./s3:/bucket/run", overwrite=True)
    np.testing.assert_array_equal(gpuckpt.load_state_dict("./s3:/bucket/run")["w"], np.ones(2))


# names that are legal but long, and errors whose remedy depends on what failed -------------------


@pytest.mark.parametrize("length", [140, 200, 230, 255])
def test_a_legal_long_name_saves_loads_and_overwrites(tmp_path: Path, length: int) -> None:
    path = tmp_path / ("n" * (length - 4) + "é" * 2)  # 2-byte characters at the end: bytes count
    assert len(os.fsencode(path.name)) == length
    gpuckpt.save({"w": np.arange(3.0)}, path)
    gpuckpt.save({"w": np.arange(4.0)}, path, overwrite=True)
    np.testing.assert_array_equal(gpuckpt.load_state_dict(path)["w"], np.arange(4.0))
    assert verify_checkpoint(path).ok
    assert sorted(os.listdir(tmp_path)) == [path.name]


def test_a_dead_save_to_a_long_name_is_cleaned_up_by_the_next(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / ("x" * 230)
    code = (
        "import os, sys, numpy as np, gpuckpt\n"
        "from gpuckpt.storage.local import writer as local\n"
        "def die(self, *a, **k): os._exit(9)\n"
        "local.LocalWriter.commit = die\n"
        "gpuckpt.save({'w': np.zeros(4)}, sys.argv[1])\n"
    )
    assert subprocess.run([sys.executable, "-c", code, str(path)], check=False).returncode == 9
    (left,) = os.listdir(tmp_path)  # the dead save's temporary, its name within the limit
    assert left.startswith(".xxx") and ".gpuckpt-tmp-" in left and len(os.fsencode(left)) <= 255
    gpuckpt.save({"w": np.ones(4)}, path)
    assert sorted(os.listdir(tmp_path)) == [path.name]


def test_a_name_longer_than_the_file_system_allows_says_which_and_by_how_much(tmp_path: Path) -> None:
    name = "b" * 300
    with pytest.raises(gpuckpt.CheckpointWriteError) as info:
        gpuckpt.save({"w": np.zeros(2)}, tmp_path / name)
    assert f"the name '{name}' is 300 bytes, 45 more than the 255 this file system allows" in str(info.value)
    assert "free space" not in str(info.value)
    assert os.listdir(tmp_path) == []


def test_a_parent_that_is_a_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("mine")
    for path in (tmp_path / "notes" / "ckpt", tmp_path / "notes" / "sub" / "ckpt"):
        with pytest.raises(gpuckpt.CheckpointWriteError) as info:
            gpuckpt.save({"w": np.zeros(2)}, path)
        assert f"{tmp_path / 'notes'} is a file, not a directory" in str(info.value), info.value
        assert "free space" not in str(info.value)
        # the errno open() and mkdir() give (os.makedirs says EEXIST), as torch's writer raises
        assert info.value.errno == errno.ENOTDIR and "Not a directory" in str(info.value)
    assert (tmp_path / "notes").read_text() == "mine"


def test_too_many_open_files_names_the_limit_not_the_disk(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import resource, sys, numpy as np, gpuckpt\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))\n"
        "try:\n"
        "    gpuckpt.save({f'w{i}': np.zeros(8) for i in range(300)}, sys.argv[1], sync='file', threads=4)\n"
        "except gpuckpt.CheckpointWriteError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], capture_output=True, text=True)
    assert "Too many open files" in out.stdout and "ulimit -n" in out.stdout, out.stdout + out.stderr
    assert "free space" not in out.stdout


def test_a_directory_torchs_dcp_wrote_is_named_as_one_by_every_reader(tmp_path: Path) -> None:
    # (a .metadata file and no zarr.json is what DCP's FileSystemWriter leaves)
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"\x80\x04N.")
    (tmp_path / "dcp" / "__0_0.distcp").write_bytes(b"\0" * 8)
    for read in (gpuckpt.load_state_dict, gpuckpt.read_metadata, lambda p: gpuckpt.load({}, p)):
        with pytest.raises(gpuckpt.CheckpointNotFoundError) as info:
            read(tmp_path / "dcp")
        assert f"{tmp_path / 'dcp'} is a torch.distributed.checkpoint directory" in str(info.value)
        assert f"gpuckpt convert {tmp_path / 'dcp'} CKPT --trust-pickle-metadata" in str(info.value)


def test_a_load_from_no_checkpoint_says_what_is_there(tmp_path: Path) -> None:
    with pytest.raises(gpuckpt.CheckpointNotFoundError, match=r"no checkpoint at .*nope: nothing is there"):
        gpuckpt.load_state_dict(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(gpuckpt.CheckpointNotFoundError, match=r"has no zarr.json \(the directory is empty\)"):
        gpuckpt.read_metadata(tmp_path / "empty")
    with CheckpointManager(tmp_path / "run", max_to_keep=5) as mgr:
        for step in range(5):
            mgr.save(step, {"w": np.ones(3)})
    newest = re.escape(str(tmp_path / "run" / "step_00000004"))
    with pytest.raises(
        gpuckpt.CheckpointNotFoundError,
        match=rf"CheckpointManager's steps \(\.\.\., step_00000002, step_00000003, step_00000004\): "
        rf"load one of them \({newest}\), or restore with CheckpointManager",
    ):
        gpuckpt.load_state_dict(tmp_path / "run")
