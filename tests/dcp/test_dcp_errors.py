"""gpuckpt.dcp on bad input: clear errors through DCP's error path, nothing published or damaged."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402 - after the skip
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402

import gpuckpt  # noqa: E402
import gpuckpt.dcp  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning")]


def digest(path: Path) -> dict[str, str]:
    """Every file under ``path`` with the hash of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def temporaries(path: Path) -> list[str]:
    return [p.name for p in path.parent.iterdir() if ".gpuckpt-tmp-" in p.name]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    dcp.save(
        {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(3), "step": 4},
        storage_writer=gpuckpt.dcp.Writer(path),
    )
    return path


def test_path_that_is_not_a_gpuckpt_checkpoint(tmp_path: Path) -> None:
    import zarr

    (tmp_path / "empty").mkdir()
    zarr.open_group(tmp_path / "zarr-group", mode="w")
    (tmp_path / "file").write_text("not a checkpoint")
    cases = {
        "missing": "no checkpoint at",
        "empty": "not a committed checkpoint",
        "zarr-group": "not a gpuckpt checkpoint",
        "file": "is a file, not a checkpoint",
    }
    for name, expected in cases.items():
        path = tmp_path / name
        before = digest(path) if path.is_dir() else None
        with pytest.raises(CheckpointException) as info:
            dcp.load({"w": torch.zeros(2)}, storage_reader=gpuckpt.dcp.Reader(path))
        assert expected in str(info.value), (name, str(info.value)[:500])
        assert (digest(path) if path.is_dir() else None) == before
        assert not gpuckpt.dcp.Reader.validate_checkpoint_id(path)


def test_a_directory_dcp_wrote_is_named_as_one_with_what_to_do(tmp_path: Path) -> None:
    """A FileSystemWriter directory (a .metadata file, no zarr.json) is said to be one, with the
    reader that reads it and the command that converts it; nothing in it is read or changed."""
    from gpuckpt.errors import CheckpointNotFoundError

    path = tmp_path / "dcp-native"
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(path))
    before = digest(path)
    with pytest.raises(CheckpointNotFoundError) as info:
        gpuckpt.dcp.Reader(path).read_metadata()
    text = str(info.value)
    assert f"{path} is a torch.distributed.checkpoint directory" in text, text
    assert "FileSystemReader" in text and f"gpuckpt convert {path} CKPT --trust-pickle-metadata" in text
    with pytest.raises(CheckpointException, match="is a torch.distributed.checkpoint directory"):
        dcp.load({"w": torch.zeros(2)}, storage_reader=gpuckpt.dcp.Reader(path))
    assert digest(path) == before
    assert not gpuckpt.dcp.Reader.validate_checkpoint_id(path)


def test_a_value_torch_will_not_unpickle_is_refused_in_our_words(tmp_path: Path) -> None:
    """The UnsafeCheckpointError names the entry and the global torch refused, says how to allow
    it and when; none of torch's advice to call torch.load(weights_only=False), no escape codes."""
    from gpuckpt.errors import UnsafeCheckpointError

    dcp.save({"s": slice(1, 2), "f": frozenset({1})}, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c"))
    for key, name in (("s", "slice"), ("f", "frozenset")):
        with pytest.raises(CheckpointException) as info:
            dcp.load({key: None}, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
        (failure,) = info.value.failures.values()
        exc = failure[0] if isinstance(failure, tuple) else failure
        assert isinstance(exc, UnsafeCheckpointError)
        text = str(exc)
        assert f"entry {key!r}" in text and f"GLOBAL {name} " in text, text
        assert "allow_pickle=True to gpuckpt.dcp.Reader" in text and "trust" in text
        assert "\x1b" not in text and "weights_only=False" not in text and "add_safe_globals" not in text
        assert "\n" not in text and len(text) < 500, text
    got: dict[str, Any] = {"s": None, "f": None}
    dcp.load(got, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c", allow_pickle=True))
    assert got == {"s": slice(1, 2), "f": frozenset({1})}


def test_corrupted_chunk_names_the_tensor(saved: Path) -> None:
    chunk = saved / "w" / "c.0.0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x40
    chunk.write_bytes(bytes(data))
    before = digest(saved)
    target = {"w": torch.zeros(4, 3), "b": torch.zeros(3), "step": 0}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=gpuckpt.dcp.Reader(saved))
    failures = info.value.failures  # rank -> (exception, traceback)
    error = failures[0][0] if isinstance(failures[0], tuple) else failures[0]
    assert isinstance(error, gpuckpt.ChecksumError)
    assert "'w'" in str(error) and "c.0.0" in str(error)
    assert digest(saved) == before  # a load never writes


def test_targets_that_cannot_take_the_values_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    """A target made by expand() (elements sharing memory) was filled with one value per address,
    silently; a lazily conjugated view failed with a bare BufferError. Both are now the
    ReadOnlyTargetError gpuckpt.load gives, naming the tensor, before anything is read."""
    import re

    z = torch.complex(torch.arange(4.0), torch.ones(4))
    dcp.save(
        {"w": torch.arange(12.0).reshape(4, 3), "z": z}, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c")
    )
    for key, target, match in (
        ("w", torch.zeros(1, 3).expand(4, 3), r"tensor 'w'.*share memory"),
        ("z", torch.zeros(4, dtype=torch.complex64).conj(), r"tensor 'z'.*read-only"),
    ):
        other = "z" if key == "w" else "w"
        state = {key: target, other: torch.zeros_like(z if other == "z" else torch.zeros(4, 3))}
        with pytest.raises(CheckpointException) as info:
            dcp.load(state, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
        failures = info.value.failures
        error = failures[0][0] if isinstance(failures[0], tuple) else failures[0]
        assert isinstance(error, gpuckpt.ReadOnlyTargetError), error
        assert re.search(match, str(error)), str(error)
        assert not state[other].any()  # checked before anything was read


def test_requested_key_not_in_checkpoint(saved: Path) -> None:
    before = digest(saved)
    target: dict[str, Any] = {"w": torch.zeros(4, 3), "missing": torch.zeros(2)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=gpuckpt.dcp.Reader(saved))
    assert "Missing key in checkpoint state_dict: missing" in str(info.value)
    assert digest(saved) == before
    from torch.distributed.checkpoint import DefaultLoadPlanner

    dcp.load(
        target, storage_reader=gpuckpt.dcp.Reader(saved), planner=DefaultLoadPlanner(allow_partial_load=True)
    )
    assert torch.equal(target["w"], torch.arange(12.0).reshape(4, 3))


def test_existing_checkpoint_needs_overwrite(saved: Path) -> None:
    before = digest(saved)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.zeros(1)}, storage_writer=gpuckpt.dcp.Writer(saved, overwrite=False))
    assert "CheckpointExistsError" in str(info.value) and "overwrite=True" in str(info.value)
    assert digest(saved) == before and temporaries(saved) == []
    dcp.save({"w": torch.zeros(1)}, storage_writer=gpuckpt.dcp.Writer(saved))  # overwrite=True by default
    assert list(gpuckpt.read_metadata(saved).state_dict_metadata) == ["w"]


def test_existing_checkpoint_is_refused_in_dcps_words() -> None:
    """DCP's tests match ``Checkpoint already exists`` (as FileSystemWriter and FsspecWriter say it)."""
    t1, t2 = torch.randn(10), torch.randn(10)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt")
        dcp.save({"random": t1}, storage_writer=gpuckpt.dcp.Writer(path, overwrite=False))
        dcp.save({"random": t2}, storage_writer=gpuckpt.dcp.Writer(path, overwrite=True))
        sd = {"random": torch.zeros(10)}
        dcp.load(sd, storage_reader=gpuckpt.dcp.Reader(path))
        torch.testing.assert_close(sd["random"], t2)
        with pytest.raises(CheckpointException, match=".*Checkpoint already exists.*") as info:
            dcp.save({"random": t1}, storage_writer=gpuckpt.dcp.Writer(path, overwrite=False))
        error = info.value.failures[0]
        error = error[0] if isinstance(error, tuple) else error
        assert isinstance(error, gpuckpt.CheckpointExistsError)
        assert str(error).startswith(f"Checkpoint already exists at {path}; ")
        assert path in str(error) and "pass overwrite=True" in str(error)  # the remedy is kept
        dcp.load(sd, storage_reader=gpuckpt.dcp.Reader(path))
        torch.testing.assert_close(sd["random"], t2)


def test_dcp_saves_into_a_temporary_directory_and_beside_other_files_by_default(tmp_path: Path) -> None:
    """What DCP programs (and DCP's own tests) do: save into a directory they made (empty, or
    holding a ``torch.save`` file), with the writer built from the path alone."""
    sd = {"w": torch.arange(4.0), "nested": {"b": torch.ones(2, 3)}}
    with tempfile.TemporaryDirectory() as d:
        dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(d))
        got = {"w": torch.zeros(4), "nested": {"b": torch.zeros(2, 3)}}
        dcp.load(got, storage_reader=gpuckpt.dcp.Reader(d))
        torch.testing.assert_close(got, sd)
    run = tmp_path / "run"
    run.mkdir()
    torch.save(sd, run / "model.pt")  # DCP's test_torch_save_to_dcp saves next to it
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(run))
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(run))  # and again: the checkpoint is replaced
    torch.testing.assert_close(torch.load(run / "model.pt", weights_only=True), sd)
    got = {"w": torch.zeros(4), "nested": {"b": torch.zeros(2, 3)}}
    dcp.load(got, storage_reader=gpuckpt.dcp.Reader(run))
    torch.testing.assert_close(got, sd)
    assert temporaries(run) == []


def test_other_refusals_of_a_path_are_not_called_an_existing_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("someone's files")
    (tmp_path / "clash").mkdir()
    (tmp_path / "clash" / "w").write_text("a file named like the tensor")
    cases = (
        ("foreign", False, "pass overwrite=True to publish the checkpoint's own names into it"),
        ("clash", True, "refusing to touch them"),
    )
    for name, overwrite, expected in cases:
        writer = gpuckpt.dcp.Writer(tmp_path / name, overwrite=overwrite)
        with pytest.raises(CheckpointException) as info:
            dcp.save({"w": torch.ones(2)}, storage_writer=writer)
        assert expected in str(info.value) and "Checkpoint already exists" not in str(info.value), name
    assert (tmp_path / "clash" / "w").read_text() == "a file named like the tensor"


class PublishingPlanner(DefaultSavePlanner):
    """Publishes another checkpoint at the save's path while the save writes (a concurrent save)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def resolve_data(self, write_item: Any) -> Any:
        if not self.path.exists():
            gpuckpt.save({"other": np.arange(3)}, self.path)
        return super().resolve_data(write_item)


def test_checkpoint_published_by_another_save_meanwhile_is_refused_in_dcps_words(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with pytest.raises(CheckpointException, match="Checkpoint already exists") as info:
        dcp.save(
            {"w": torch.ones(2)},
            storage_writer=gpuckpt.dcp.Writer(path, overwrite=False),
            planner=PublishingPlanner(path),
        )
    assert "another save" in str(info.value)
    assert list(gpuckpt.load_state_dict(path)) == ["other"] and temporaries(path) == []


class FailingPlanner(DefaultSavePlanner):
    """Fails while the Writer asks it for the data of a tensor (inside write_data)."""

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.index.fqn == "b":
            raise OSError(5, "Input/output error (injected)")
        return super().resolve_data(write_item)


def test_failed_save_publishes_nothing_and_its_temporary_goes(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    writer = gpuckpt.dcp.Writer(path)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(3), "b": torch.ones(2)}, storage_writer=writer, planner=FailingPlanner())
    assert "injected" in str(info.value)
    assert not path.exists()
    assert len(temporaries(path)) == 1  # unpublished: DCP calls no hook on failure...
    # ... so the Writer removes it when it starts its next save (or is garbage-collected)
    dcp.save({"w": torch.ones(3)}, storage_writer=writer)
    assert temporaries(path) == [] and gpuckpt.load_state_dict(path)["w"].tolist() == [1.0, 1.0, 1.0]
    other = gpuckpt.dcp.Writer(tmp_path / "other")
    with pytest.raises(CheckpointException):
        dcp.save({"b": torch.ones(2)}, storage_writer=other, planner=FailingPlanner())
    assert len(temporaries(tmp_path / "other")) == 1
    del other, info
    import gc

    gc.collect()
    assert temporaries(tmp_path / "other") == [] and not (tmp_path / "other").exists()


def test_unsupported_dtype_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as info:
        dcp.save(
            {"ok": torch.ones(2), "c32": torch.ones(2, dtype=torch.complex32)},
            storage_writer=gpuckpt.dcp.Writer(tmp_path / "c"),
        )
    assert "UnsupportedValueError" in str(info.value) and "'c32'" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_writer_needs_collectives(tmp_path: Path) -> None:
    with pytest.raises(gpuckpt.UnsupportedValueError, match="use_collectives"):
        dcp.save(
            {"w": torch.ones(2)}, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c"), use_collectives=False
        )
    assert list(tmp_path.iterdir()) == []


def test_hostile_planner_data_is_a_metadata_error(saved: Path) -> None:
    """A checkpoint whose DCP marker names a value it does not hold: a clear error, no crash."""
    from gpuckpt.format.checksum import crc32c

    root = saved / "zarr.json"
    doc = json.loads(root.read_text())
    md = doc["attributes"]["gpuckpt"]["metadata"]
    md["planner_data"]["structure"]["d"].append(["s", "ghost", {"v": "ghost"}])
    canonical = json.dumps(md, sort_keys=True, separators=(",", ":")).encode()
    doc["attributes"]["gpuckpt"]["metadata_crc32c"] = crc32c(canonical)
    root.write_text(json.dumps(doc))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(4, 3)}, storage_reader=gpuckpt.dcp.Reader(saved))
    # DCP reports a failed read_metadata as "metadata is None", with gpuckpt's message
    assert "planner_data names 'ghost', which the checkpoint does not hold" in str(info.value)


@pytest.mark.parametrize("listed", [0, None, {}, "ghost", "w"])
def test_a_serialised_values_list_naming_no_value_is_a_metadata_error(tmp_path: Path, listed: object) -> None:
    """An entry of the DCP marker's list of serialised values that is not the FQN of a plain
    value (not a string, a name the checkpoint lacks, a tensor's) was dropped, and the value it
    should name reached DCP as its raw bytes: refused, in gpuckpt's words."""
    from gpuckpt.testing.faults import rewrite_root_metadata

    dcp.save({"w": torch.arange(4.0), "lr": 0.1}, storage_writer=gpuckpt.dcp.Writer(tmp_path / "c"))
    rewrite_root_metadata(
        tmp_path / "c", lambda md: md["planner_data"]["torch_dcp"]["torch_save"].append(listed)
    )
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(4), "lr": 0.0}, storage_reader=gpuckpt.dcp.Reader(tmp_path / "c"))
    assert f"torch_save lists {listed!r}, which names no plain value" in str(info.value)


def test_a_table_claiming_millions_of_chunks_costs_the_reader_what_was_written(tmp_path: Path) -> None:
    """DCP's metadata lists every chunk: a chunk table claiming 33.5 million rows over sparse
    files (5,000 chunk files written) is refused before a record per claimed chunk is made."""
    import subprocess
    import sys

    from gpuckpt.testing.faults import sparse_table_claim

    path = tmp_path / "claim"
    sparse_table_claim(path, 1 << 25)
    code = (
        "import sys, torch, torch.distributed.checkpoint as dcp, gpuckpt, gpuckpt.dcp\n"
        "try:\n"
        "    gpuckpt.dcp.Reader(sys.argv[1]).read_metadata()\n"
        "except gpuckpt.MissingChunkError as e:\n"
        "    print('typed:', e)\n"
    )
    # a record per claimed chunk takes minutes and gigabytes: the timeout is the failure
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "typed: tensor 'w' claims 33554432 chunks but its array w holds 5000 chunk files" in done.stdout
    with pytest.raises(CheckpointException, match="33549432 are missing"):
        dcp.load({"w": torch.zeros(16)}, storage_reader=gpuckpt.dcp.Reader(path))


def test_cached_save_plans_are_refused_clearly(tmp_path: Path) -> None:
    """DCP's plan caching would hand the ranks the temporary of an earlier save: refused, nothing written."""
    planner = DefaultSavePlanner(enable_plan_caching=True)
    sd = {"w": torch.ones(3)}
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(tmp_path / "first"), planner=planner)
    assert gpuckpt.load_state_dict(tmp_path / "first")["w"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(CheckpointException) as info:
        dcp.save(
            sd,
            storage_writer=gpuckpt.dcp.Writer(tmp_path / "second"),
            planner=DefaultSavePlanner(enable_plan_caching=True),
        )
    assert "enable_plan_caching" in str(info.value)
    assert not (tmp_path / "second").exists() and temporaries(tmp_path / "second") == []


def test_writers_of_one_job_with_different_paths_or_options_are_refused(tmp_path: Path) -> None:
    """Each rank's Writer sends its path and options with its local plan; the coordinator refuses
    a job whose Writers differ (rank 1's compression and path were ignored, its chunks written to
    rank 0's path), naming each setting and its ranks; nothing is written."""
    from torch.distributed.checkpoint.planner import SavePlan

    writers = [
        gpuckpt.dcp.Writer(tmp_path / "c", compression="zstd"),
        gpuckpt.dcp.Writer(tmp_path / "d"),
    ]
    plans = [w.prepare_local_plan(SavePlan([])) for w in writers]
    with pytest.raises(
        gpuckpt.InvalidOptionError, match=r"path: '.*/c' on rank 0, '.*/d' on rank 1; compression"
    ):
        writers[0].prepare_global_plan(plans)
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
    same = [gpuckpt.dcp.Writer(tmp_path / "c", threads=t) for t in (1, 2)]  # threads are each rank's own
    assert len(same[0].prepare_global_plan([w.prepare_local_plan(SavePlan([])) for w in same])) == 2
    same[0]._discard()
