"""The drain of a single-process manager with a local tier: it reads each persist step's part
into the arrays of the drain before, where the layout is the same, and what reaches the root
is each step's own values; a part that does not read fails its drain and leaves the root's
earlier steps as they were."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.format.parts import part_name


def _manager(tmp_path: Path) -> gpuckpt.CheckpointManager:
    return gpuckpt.CheckpointManager(
        tmp_path / "root", local_dir=tmp_path / "tier", replicas=0, persist_interval_steps=1, max_to_keep=5
    )


def _state(step: int, n: int = 1000) -> dict[str, object]:
    return {
        "w": np.arange(n, dtype=np.float32) * step,
        "b": {"m": np.full((3, 5), step, np.int64), "t": (f"s{step}", np.full(2, step, np.int8))},
        "step": step,
    }


def _kept(mgr: gpuckpt.CheckpointManager) -> dict[str, object]:
    kept = mgr._tiered.tier._drain_buffers  # type: ignore[union-attr]
    assert kept is not None
    return kept[1]


def test_drains_of_one_layout_read_into_the_same_arrays_and_persist_each_steps_values(tmp_path: Path) -> None:
    mgr = _manager(tmp_path)
    arrays = []
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
        mgr.wait()
        arrays.append(_kept(mgr)["w"])
    assert arrays[0] is arrays[1] is arrays[2]  # one set of buffers for the three drains
    mgr.save(4, _state(4, n=7))  # another layout: new arrays
    mgr.wait()
    assert _kept(mgr)["w"] is not arrays[0] and _kept(mgr)["w"].shape == (7,)
    # the same arrays, a plain value more: new dicts (the last drain's would not take it)
    mgr.save(5, {**_state(5, n=7), "lr": 0.5})
    mgr.wait()
    assert _kept(mgr)["lr"] == 0.5
    mgr.close()
    assert mgr._tiered.tier._drain_buffers is None  # type: ignore[union-attr]
    for step in (1, 2, 3, 4, 5):
        got = gpuckpt.load_state_dict(tmp_path / "root" / f"step_{step:08d}")
        want = _state(step, n=7 if step >= 4 else 1000)
        np.testing.assert_array_equal(got["w"], want["w"])
        np.testing.assert_array_equal(got["b"]["m"], want["b"]["m"])  # type: ignore[index]
        assert isinstance(got["b"]["t"], tuple) and got["b"]["t"][0] == f"s{step}"  # type: ignore[index]
        np.testing.assert_array_equal(got["b"]["t"][1], want["b"]["t"][1])  # type: ignore[index]
        assert got["step"] == step
        assert ("lr" in got) == (step == 5)


def test_a_damaged_part_fails_its_drain_and_the_next_drain_reads_anew(tmp_path: Path) -> None:
    mgr = gpuckpt.CheckpointManager(
        tmp_path / "root",
        local_dir=tmp_path / "tier",
        replicas=0,
        persist_interval_steps=2,
        save_interval_steps=1,
        max_to_keep=5,
    )
    mgr.save(2, _state(2))
    mgr.wait()
    first = _kept(mgr)["w"]
    before = first.copy()
    mgr.save(3, _state(3))  # to the tier only
    mgr.wait()
    # step 4's part is damaged after its write, before its drain reads it: hold the drain back
    drains = mgr._tiered._drains  # type: ignore[union-attr]
    held = drains.submit(lambda: __import__("time").sleep(0.5))
    mgr.save(4, _state(4))
    mgr._tiered.tier.wait_for(4)  # type: ignore[union-attr]
    part = tmp_path / "tier" / part_name(4, 0)
    chunk = next(p for p in sorted((part / "w").rglob("*")) if p.is_file() and p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[10] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    held.result()
    with pytest.raises(gpuckpt.ChecksumError, match="chunk c.0 of tensor 'w'") as info:
        mgr.wait()
    assert any("persisting step 4" in n for n in getattr(info.value, "__notes__", []))
    assert mgr.all_steps() == [2]  # the root's earlier step stays, whole
    got = gpuckpt.load_state_dict(tmp_path / "root" / "step_00000002")
    np.testing.assert_array_equal(got["w"], before)
    mgr.save(5, _state(5))
    mgr.save(6, _state(6))  # the next drain reads anew and persists its own values
    mgr.wait()
    assert mgr.all_steps() == [2, 6]
    assert _kept(mgr)["w"] is not first  # the failed drain let its arrays go
    np.testing.assert_array_equal(
        gpuckpt.load_state_dict(tmp_path / "root" / "step_00000006")["w"], _state(6)["w"]
    )
    mgr.close()


def test_a_part_is_written_into_the_files_of_the_part_it_retires(tmp_path: Path) -> None:
    """local_max_to_keep=2: step s's part takes the files of step s-2's part (on tmpfs, pages
    already allocated); every step restores bit-exactly and the tier holds two steps."""
    mgr = gpuckpt.CheckpointManager(
        tmp_path / "root", local_dir=tmp_path / "tier", replicas=0, persist_interval_steps=100
    )
    inode = {}
    for step in (1, 2, 3, 4):
        mgr.save(step, {"w": np.full(1 << 21, step, np.float32), "step": step})  # one 8 MiB chunk
        mgr.wait()
        chunk = tmp_path / "tier" / part_name(step, 0) / "w" / "c.0"
        inode[step] = chunk.stat().st_ino
    assert inode[3] == inode[1] and inode[4] == inode[2] and inode[1] != inode[2], inode
    assert mgr.local_steps() == [3, 4]
    mgr.close()
    target = {"w": np.zeros(1 << 21, np.float32), "step": 0}
    again = gpuckpt.CheckpointManager(
        tmp_path / "root", local_dir=tmp_path / "tier", replicas=0, persist_interval_steps=100
    )
    assert again.restore(target) == 4 and (target["w"] == 4).all() and target["step"] == 4
    again.close()
    for step in (3, 4):  # each part whole, its chunks cut to their sizes
        got = gpuckpt.load_state_dict(tmp_path / "tier" / part_name(step, 0))
        assert (got["w"] == step).all()


def test_a_part_is_written_into_new_files_while_the_step_before_is_in_flight(tmp_path: Path) -> None:
    """The retired part's files are taken only while a newer step stays whose tier work ended
    without error: a step still in flight may yet fail (on another rank) and be deleted, and
    the rank would then hold no complete step until this one commits; a failed step whose
    parts are still there (their deletion failed) never counts, also once reported."""
    from concurrent.futures import Future

    mgr = gpuckpt.CheckpointManager(
        tmp_path / "root", local_dir=tmp_path / "tier", replicas=0, persist_interval_steps=100
    )
    for step in (1, 2):
        mgr.save(step, {"w": np.full(1 << 10, step, np.float32)})
        mgr.wait()
    tier = mgr._tiered.tier  # type: ignore[union-attr]
    assert tier._retired_part(3) == tmp_path / "tier" / part_name(1, 0)
    pending: Future[None] = Future()
    tier._jobs[2] = pending  # step 2's collectives not over yet
    assert tier._retired_part(3) is None
    pending.set_result(None)
    assert tier._retired_part(3) == tmp_path / "tier" / part_name(1, 0)
    failed: Future[None] = Future()
    failed.set_exception(OSError("its parts could not be deleted"))  # and are still there
    tier._jobs[2] = failed
    assert set(tier.settled()) == {2}  # taken and reported: still not a step to rely on
    assert tier._retired_part(3) is None
    tier._failed.clear()
    assert tier._retired_part(3) == tmp_path / "tier" / part_name(1, 0)
    # step 2 held only as another rank's part (a replica), not this rank's own: nothing to rely on
    (tmp_path / "tier" / part_name(2, 0)).rename(tmp_path / "tier" / part_name(2, 1))
    assert tier._retired_part(3) is None
    mgr.close()


def test_a_save_that_raises_an_earlier_steps_failure_says_its_own_step_was_not_saved(tmp_path: Path) -> None:
    mgr = gpuckpt.CheckpointManager(
        tmp_path / "root", local_dir=tmp_path / "tier", replicas=0, persist_interval_steps=2, max_to_keep=5
    )
    # a non-checkpoint directory where step 2's drain goes: the drain fails in the background
    (tmp_path / "root" / "step_00000002").mkdir(parents=True)
    (tmp_path / "root" / "step_00000002" / "junk").write_text("x")
    mgr.save(2, _state(2))
    mgr._tiered._drain[1].exception()  # type: ignore[union-attr]  # (the drain has failed)
    with pytest.raises(gpuckpt.GpuckptError) as info:
        mgr.save(3, _state(3))
    assert any("step 3 was not saved" in n for n in getattr(info.value, "__notes__", [])), info.value
    assert 3 not in mgr.local_steps()
    mgr.save(3, _state(3))  # saved again: it goes on
    mgr.wait()
    assert 3 in mgr.local_steps()
    mgr.close()
