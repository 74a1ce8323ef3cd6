"""The local tier with 4 thread ranks as 2 simulated nodes: parts, replicas, drain, recovery.

Real files in real directories (one per simulated node), real checkpoints; the ranks are
threads of this process (the same code runs under mpiexec in test_tiers_mpi.py).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.distributed import DistributedError, run_ranks
from gpuckpt.format.parts import PartRecord, part_name
from gpuckpt.tiers.local import WriteGate


@pytest.fixture
def tiers(load_script: Any) -> Any:
    return load_script("tier_ranks")


def _trained(tiers: Any, base: Path, last: int = 5) -> list[dict[str, Any]]:
    return run_ranks(4, lambda c: tiers.train(c, str(base), last, settle=True), timeout=120)


def _restored(tiers: Any, base: Path, step: int | None = None, **kw: Any) -> list[dict[str, Any]]:
    return run_ranks(4, lambda c: tiers.restore(c, str(base), step, **kw), timeout=120)


def test_every_step_goes_to_the_tier_with_a_replica_and_persist_steps_to_root(
    tiers: Any, tmp_path: Path
) -> None:
    seen = _trained(tiers, tmp_path)
    assert all(s == {"local": [4, 5], "root": [2, 4]} for s in seen), seen
    for node in ("n0", "n1"):  # own parts and the other node's replicas, local_max_to_keep=2 steps
        names = sorted(p.name for p in (tmp_path / node).iterdir() if not p.name.startswith("."))
        assert names == [part_name(s, r) for s in (4, 5) for r in range(4)], (node, names)
    # a part is an ordinary checkpoint with its record; the root step an ordinary distributed one
    md = gpuckpt.read_metadata(tmp_path / "n1" / part_name(5, 0))
    record = PartRecord.from_planner_data(md.planner_data)
    assert record is not None and (record.step, record.rank, record.world_size) == (5, 0, 4)
    assert record.node == "n0" and record.boxes == {"w": (((0, 0), (12, 5)),)}
    part = gpuckpt.load_state_dict(tmp_path / "n1" / part_name(5, 0))
    assert np.array_equal(part["w"], tiers.state(5, 0, 4)["w"].local) and part["step"] == 5
    whole = gpuckpt.load_state_dict(tmp_path / "root" / "step_00000004")
    assert whole["step"] == 4
    zarr = pytest.importorskip("zarr")
    assert np.array_equal(
        zarr.open_array(tmp_path / "n0" / part_name(5, 2) / "w", mode="r")[:], part_w(tiers, 5, 2)
    )


def part_w(tiers: Any, step: int, rank: int) -> np.ndarray:
    return np.asarray(tiers.state(step, rank, 4)["w"].local)


def test_restore_reads_the_tiers_not_the_root(tiers: Any, tmp_path: Path) -> None:
    _trained(tiers, tmp_path)
    shutil.move(tmp_path / "root", tmp_path / "root-moved-away")
    got = _restored(tiers, tmp_path)
    for r, g in enumerate(got):
        assert g["step"] == 5 and g["exact"] and g["source"] == "tiers", (r, g)
        assert g["parts"] == {str(k): ["local", None] for k in range(4)}
    assert not any((tmp_path / "root").iterdir())


def _steps_in(tier: Path) -> list[str]:
    return sorted(p.name for p in tier.iterdir() if not p.name.startswith("."))


def test_a_replaced_node_gets_its_parts_from_the_replicas(tiers: Any, tmp_path: Path) -> None:
    _trained(tiers, tmp_path)
    shutil.rmtree(tmp_path / "n1")
    shutil.move(tmp_path / "root", tmp_path / "root-moved-away")
    replicas = _steps_in(tmp_path / "n0")
    got = _restored(tiers, tmp_path)
    want = {"0": ["local", None], "1": ["local", None], "2": ["peer", 0], "3": ["peer", 1]}
    for r, g in enumerate(got):
        assert g["step"] == 5 and g["exact"] and g["parts"] == want, (r, g)
    # the parts went straight into the restored arrays: the replaced node's tier does not hold
    # them (the copies on n0 do, unchanged) until the next save
    assert _steps_in(tmp_path / "n1") == [] and _steps_in(tmp_path / "n0") == replicas


def test_a_kept_rank_loads_its_own_part_while_it_serves_the_replicas(
    tiers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replaced node's restore: the kept node's ranks send the replicas they hold and load
    their own parts at the same time (the round does not wait for the loads, nor the loads
    for the round; a load begins once the round's manifests are exchanged, before the
    transfer). Each kept rank's transfer is held here until its own load has begun: without
    the overlap that never happens and the round goes on after a timeout, recorded."""
    import gpuckpt.tiers.local as local_module

    _trained(tiers, tmp_path)
    shutil.rmtree(tmp_path / "n1")
    began = {r: threading.Event() for r in range(4)}
    seen: dict[int, bool] = {}
    load, outgoing = local_module.api.load, local_module.LocalTier._outgoing

    def loading(state: Any, path: Any, **kw: Any) -> None:
        name = Path(str(path)).name
        for r in range(4):
            if name == part_name(5, r):
                began[r].set()
        load(state, path, **kw)

    def held(self: Any, step: int, manifests: Any, *a: Any, **kw: Any) -> Any:
        if manifests:  # (only the restore's rounds run from here on: a kept rank's, which sends)
            seen[self.rank] = began[self.rank].wait(timeout=5)
        return outgoing(self, step, manifests, *a, **kw)

    monkeypatch.setattr(local_module.api, "load", loading)
    monkeypatch.setattr(local_module.LocalTier, "_outgoing", held)
    got = _restored(tiers, tmp_path)
    want = {"0": ["local", None], "1": ["local", None], "2": ["peer", 0], "3": ["peer", 1]}
    for r, g in enumerate(got):
        assert g["step"] == 5 and g["exact"] and g["parts"] == want, (r, g)
    assert seen == {0: True, 1: True}


def test_a_kept_rank_whose_own_load_cannot_start_fails_the_restore_on_every_rank(
    tiers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kept ranks' own loads start inside the round, once its manifests are exchanged: one
    that cannot start fails the restore on every rank after the round, and no rank waits
    forever for a transfer that rank never joins."""
    import gpuckpt.tiers.local as local_module
    from gpuckpt.runtime.workers import Workers

    _trained(tiers, tmp_path)
    shutil.rmtree(tmp_path / "n1")
    real = Workers.submit

    def submit(self: Any, fn: Any, *a: Any, **kw: Any) -> Any:
        if fn is local_module.api.load and threading.current_thread().name.endswith("-0"):
            raise RuntimeError("no thread left for rank 0's load")
        return real(self, fn, *a, **kw)

    monkeypatch.setattr(Workers, "submit", submit)
    with pytest.raises(DistributedError, match="no thread left for rank 0's load"):
        _restored(tiers, tmp_path)


def test_after_a_replaced_nodes_restore_the_next_save_fills_its_tier_again(
    tiers: Any, tmp_path: Path
) -> None:
    _trained(tiers, tmp_path)
    shutil.rmtree(tmp_path / "n1")
    got = _restored(tiers, tmp_path, then=1)
    assert all(g["step"] == 5 and g["exact"] for g in got), got
    for node in ("n0", "n1"):  # each node: step 6 of its own ranks and of the other node's
        assert [n for n in _steps_in(tmp_path / node) if n.startswith("step_00000006")] == [
            part_name(6, r) for r in range(4)
        ], node


def test_a_part_fetched_into_arrays_it_cannot_fill_in_place_is_kept_in_the_tier(
    tiers: Any, tmp_path: Path
) -> None:
    # a Fortran-ordered array cannot take the stored (C-order) bytes as they arrive: the part
    # is received into a buffer, loaded from it, and written into the replaced node's tier
    _trained(tiers, tmp_path)
    shutil.rmtree(tmp_path / "n1")
    got = _restored(tiers, tmp_path, fortran=True)
    want = {"0": ["local", None], "1": ["local", None], "2": ["peer", 0], "3": ["peer", 1]}
    for r, g in enumerate(got):
        assert g["step"] == 5 and g["exact"] and g["parts"] == want, (r, g)
    assert _steps_in(tmp_path / "n1") == [part_name(5, 2), part_name(5, 3)]
    for r in (2, 3):
        kept = gpuckpt.load_state_dict(tmp_path / "n1" / part_name(5, r))
        assert np.array_equal(kept["w"], tiers.state(5, r, 4)["w"].local) and kept["step"] == 5


def test_a_holder_that_cannot_send_fails_the_restore_on_every_rank_and_deletes_nothing(
    tiers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replaced node's restore where rank 0 cannot map the replica it holds: it sends zeros
    of the sizes announced (the round completes on every rank), the receiver's check of them
    fails, and each rank goes on to the restore's closing collective without waiting for the
    others' transfers. The restore fails on every rank naming rank 0's error alone (the zeros
    are not reported as damage), and no copy is deleted: a later restore finds the step."""
    import gpuckpt.tiers.exchange as exchange_module

    _trained(tiers, tmp_path)
    shutil.rmtree(tmp_path / "n1")
    replicas = _steps_in(tmp_path / "n0")
    real = exchange_module.mapped

    def mapped(directory: Path, *a: Any, **kw: Any) -> Any:
        if Path(directory).name == part_name(5, 2):
            raise OSError("the replica of rank 2 cannot be mapped here")
        return real(directory, *a, **kw)

    monkeypatch.setattr(exchange_module, "mapped", mapped)
    errors: list[DistributedError] = []

    def restore(c: Any) -> None:
        mgr = tiers.manager(c, str(tmp_path))
        try:
            mgr.restore(tiers.empty(c.rank, c.world_size))
        except DistributedError as exc:
            errors.append(exc)
        finally:
            mgr.close()

    run_ranks(4, restore, timeout=120)
    assert len(errors) == 4
    for exc in errors:
        assert exc.failures == {0: "OSError: the replica of rank 2 cannot be mapped here"}, exc.failures
    assert _steps_in(tmp_path / "n0") == replicas and _steps_in(tmp_path / "n1") == []
    monkeypatch.setattr(exchange_module, "mapped", real)
    got = _restored(tiers, tmp_path)
    for r, g in enumerate(got):
        assert g["step"] == 5 and g["exact"] and g["parts"]["2"] == ["peer", 0], (r, g)


def test_a_damaged_local_copy_is_skipped_and_its_replica_used(tiers: Any, tmp_path: Path) -> None:
    _trained(tiers, tmp_path)
    chunk = tmp_path / "n0" / part_name(5, 0) / "w" / "c" / "0" / "0"
    if not chunk.is_file():
        chunk = next(
            p
            for p in (tmp_path / "n0" / part_name(5, 0) / "w").rglob("*")
            if p.is_file() and p.name != "zarr.json"
        )
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0x40
    chunk.write_bytes(bytes(data))
    got = _restored(tiers, tmp_path)
    for r, g in enumerate(got):
        assert g["step"] == 5 and g["exact"] and g["skipped"] == 1, (r, g)
        assert g["parts"]["0"] == ["peer", 2], (r, g)


def _flip_a_chunk_byte(array: Path, at: int, mask: int) -> None:
    """Damage a chunk file of the stored ``array``: its byte ``at`` xor ``mask``."""
    chunk = next(p for p in array.rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[at] ^= mask
    chunk.write_bytes(bytes(data))


def test_a_damaged_replica_fetched_by_a_replaced_node_is_skipped_for_the_step_before(
    tiers: Any, tmp_path: Path
) -> None:
    # the replaced node loads a fetched part from the bytes received (never written to files
    # first): their checksums are checked all the same
    _trained(tiers, tmp_path)
    shutil.rmtree(tmp_path / "n1")
    _flip_a_chunk_byte(tmp_path / "n0" / part_name(5, 2) / "w", 5, 0x10)
    shutil.move(tmp_path / "root", tmp_path / "root-moved-away")
    got = _restored(tiers, tmp_path)
    want = {"0": ["local", None], "1": ["local", None], "2": ["peer", 0], "3": ["peer", 1]}
    for r, g in enumerate(got):
        assert g["step"] == 4 and g["exact"] and g["skipped"] == 1 and g["parts"] == want, (r, g)
    # step 5 is abandoned everywhere (the line goes on from step 4)
    assert not any(p.startswith("step_00000005") for n in ("n0", "n1") for p in _steps_in(tmp_path / n))


def test_a_damaged_own_part_beside_a_replaced_nodes_fetch_is_skipped_for_the_step_before(
    tiers: Any, tmp_path: Path
) -> None:
    """A damaged chunk in the part of a rank that loads it from its own node's tier, while the
    replaced node's parts are fetched: that copy fails (its replica was on the replaced node),
    and the step before is restored, every part exact."""
    _trained(tiers, tmp_path)
    shutil.rmtree(tmp_path / "n1")
    _flip_a_chunk_byte(tmp_path / "n0" / part_name(5, 0) / "w", 7, 0x08)
    shutil.move(tmp_path / "root", tmp_path / "root-moved-away")
    got = _restored(tiers, tmp_path)
    want = {"0": ["local", None], "1": ["local", None], "2": ["peer", 0], "3": ["peer", 1]}
    for r, g in enumerate(got):
        assert g["step"] == 4 and g["exact"] and g["skipped"] == 1 and g["parts"] == want, (r, g)


def test_with_both_copies_of_a_part_gone_restore_falls_back_to_root(tiers: Any, tmp_path: Path) -> None:
    _trained(tiers, tmp_path)
    for node in ("n0", "n1"):
        for step in (4, 5):
            shutil.rmtree(tmp_path / node / part_name(step, 1))
    got = _restored(tiers, tmp_path)
    for r, g in enumerate(got):
        assert g["step"] == 4 and g["exact"] and g["source"] == "root", (r, g)
        assert g["parts"] == {str(k): ["root", None] for k in range(4)}
        # each rank's bytes and seconds, as for parts from the tiers (the same on every rank)
        assert g["counted"] == got[0]["counted"] and all(n > 0 and t > 0 for n, t in g["counted"].values())


def test_copies_whose_record_does_not_read_are_named_when_the_root_serves(tiers: Any, tmp_path: Path) -> None:
    """Both copies of rank 1's part of step 5 with a root document that does not read, of step 4
    gone: the root's step 4 serves, and last_restore.skipped names the two copies passed over."""
    _trained(tiers, tmp_path)
    for node in ("n0", "n1"):
        (tmp_path / node / part_name(5, 1) / "zarr.json").write_text("{not json")
        shutil.rmtree(tmp_path / node / part_name(4, 1))
    got = _restored(tiers, tmp_path)
    for r, g in enumerate(got):
        assert (g["step"], g["exact"], g["source"], g["skipped"]) == (4, True, "root", 2), (r, g)


def test_a_rank_failing_its_part_fails_the_step_on_every_rank_and_the_next_save_goes_on(
    tiers: Any, tmp_path: Path
) -> None:
    def work(c: Any) -> dict[str, Any]:
        mgr = tiers.manager(c, tmp_path)
        r, n = c.rank, c.world_size
        mgr.save(1, tiers.state(1, r, n))
        mgr.save(2, tiers.state(2, r, n, bad=(r == 1)))  # rank 1 cannot store a value of step 2
        out: dict[str, Any] = {}
        try:
            mgr.save(3, tiers.state(3, r, n))
            mgr.wait()
        except DistributedError as exc:
            out["failed"] = sorted(exc.failures)
        mgr.save(4, tiers.state(4, r, n))
        mgr.wait()
        target = tiers.empty(r, n)
        out["restored"] = mgr.restore(target)
        out["exact"] = tiers.exact(target, 4, r, n)
        out["root"] = mgr.all_steps()
        mgr.close()
        return out

    got = run_ranks(4, work, timeout=120)
    assert all(g == {"failed": [1], "restored": 4, "exact": True, "root": [4]} for g in got), got
    assert not any(part_name(2, r) in {p.name for p in (tmp_path / "n0").iterdir()} for r in range(4))


def test_a_step_refused_by_its_checks_writes_nothing_and_leaves_the_saved_step_as_it_was(
    tiers: Any, tmp_path: Path
) -> None:
    # the tier writes its parts with overwrite=True: a refused step must write nothing, above
    # all not over the part of the step it repeats
    from gpuckpt import pending

    def work(c: Any) -> dict[str, Any]:
        mgr = tiers.manager(c, tmp_path)
        r, n = c.rank, c.world_size
        mgr.save(3, tiers.state(3, r, n))
        mgr.wait()
        out: dict[str, Any] = {}
        for step, data_of in ((3, 9), (2, 2)):  # the same step again (other data), an older one
            try:
                mgr.save(step, tiers.state(data_of, r, n))
                out[step] = "saved"
            except (gpuckpt.CheckpointExistsError, gpuckpt.StepOrderError) as exc:
                out[step] = type(exc).__name__
        mgr.wait()
        target = tiers.empty(r, n)
        out["restored"] = mgr.restore(target)
        out["exact"] = tiers.exact(target, 3, r, n)
        mgr.save(4, tiers.state(4, r, n))
        mgr.wait()
        out["steps"] = mgr.all_steps()
        mgr.close()
        return out

    got = run_ranks(4, work, timeout=120)
    want = {3: "CheckpointExistsError", 2: "StepOrderError", "restored": 3, "exact": True, "steps": [4]}
    assert all(g == want for g in got), got
    for node in ("n0", "n1"):
        names = {p.name for p in (tmp_path / node).iterdir()}
        assert not {part_name(2, r) for r in range(4)} & names, names
    # no save of theirs was started: nothing is reported at exit
    assert not [f for f in pending._unhandled_failures() if str(tmp_path) in f.path]


def test_a_tier_too_small_for_its_steps_is_refused_on_every_rank_before_any_write(
    tiers: Any, tmp_path: Path
) -> None:
    def work(c: Any) -> str:
        mgr = tiers.manager(c, tmp_path, local_max_to_keep=10**15)
        try:
            mgr.save(1, tiers.state(1, c.rank, c.world_size))
        except gpuckpt.TierBudgetError as exc:
            return str(exc)
        return "saved"

    got = run_ranks(4, work, timeout=60)
    assert all("node 'n0' needs" in g and "local_max_to_keep" in g for g in got), got
    assert not [p for p in (tmp_path / "n0").iterdir() if not p.name.startswith(".")]


def test_replicas_need_another_node(tiers: Any, tmp_path: Path) -> None:
    def work(c: Any) -> str:
        try:
            gpuckpt.CheckpointManager(tmp_path / "root", local_dir=tmp_path / "one", node="n0", coordinator=c)
        except gpuckpt.InvalidOptionError as exc:
            return str(exc)
        return "made"

    got = run_ranks(2, work)
    assert all("replicas=1 needs 2 nodes; this job has 1" in g for g in got), got


def test_a_local_dir_one_node_cannot_make_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Node n1's directory cannot be made (a file lies on its path): every rank raises, none
    waits for the others in the manager's first collective."""
    (tmp_path / "file").write_text("x")

    def work(c: Any) -> str:
        node = f"n{c.rank // 2}"
        local = tmp_path / node if node == "n0" else tmp_path / "file" / node
        try:
            gpuckpt.CheckpointManager(tmp_path / "root", local_dir=local, node=node, coordinator=c)
        except gpuckpt.InvalidOptionError as exc:
            return str(exc)
        return "made"

    got = run_ranks(4, work, timeout=60)
    assert all(
        g.startswith(("rank 2 (node 'n1'): local_dir", "rank 3 (node 'n1'): local_dir")) for g in got
    ), got
    assert all(
        "cannot be used" in g and "pass a directory this process can create and write" in g for g in got
    ), got


def test_inspect_shows_the_parts_of_a_local_tier(tiers: Any, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    _trained(tiers, tmp_path)
    shutil.rmtree(tmp_path / "n1" / part_name(4, 0))  # n1 then lacks rank 0's replica of step 4
    cmd = [sys.executable, "-m", "gpuckpt.cli", "inspect"]
    text = subprocess.run([*cmd, str(tmp_path / "n1")], capture_output=True, text=True, check=True).stdout
    assert "is a local tier with 2 step(s)" in text
    assert "4  not every rank's part here: rank 1 from n0, rank 2 from n1, rank 3 from n1" in text
    assert "5  every rank's part here: rank 0 from n0, rank 1 from n0, rank 2 from n1, rank 3 from n1" in text
    out = subprocess.run([*cmd, "--json", str(tmp_path / "n1")], capture_output=True, text=True, check=True)
    steps = json.loads(out.stdout)["steps"]
    assert [(s["step"], s["complete_here"], sorted(s["parts"])) for s in steps] == [
        (4, False, ["1", "2", "3"]),
        (5, True, ["0", "1", "2", "3"]),
    ]
    assert all(p["bytes"] > 0 for s in steps for p in s["parts"].values())
    # a part under another step's name (its record says step 5) is shown as not that part
    os.rename(tmp_path / "n1" / part_name(5, 3), tmp_path / "n1" / part_name(4, 0))
    text = subprocess.run([*cmd, str(tmp_path / "n1")], capture_output=True, text=True, check=True).stdout
    assert (
        "4  not every rank's part here: rank 0 damaged (its record is of step 5, rank 3: not the part" in text
    )
    # a tier or a root with nothing in it says so
    for d in (tmp_path / "n1", tmp_path / "root"):
        for child in d.iterdir():
            if child.name not in (".lock", ".root"):  # (the tier's lock, the record of its root)
                shutil.rmtree(child)
    for d, what in (
        (tmp_path / "n1", "is a local tier with no part in it"),
        (tmp_path / "root", "is not a committed checkpoint, nor"),
    ):
        out = subprocess.run([*cmd, str(d)], capture_output=True, text=True)
        assert out.returncode == 1 and what in out.stderr, out.stderr


def test_a_drained_step_restores_on_another_number_of_ranks_from_root(tiers: Any, tmp_path: Path) -> None:
    """Parts fit only the layout that wrote them: 3 ranks restore the root's newest step,
    resharded, and the report says so."""
    _trained(tiers, tmp_path)

    def work(c: Any) -> tuple[int, bool, str | None]:
        node = f"n{c.rank // 2}"
        mgr = gpuckpt.CheckpointManager(
            tmp_path / "root", local_dir=tmp_path / f"three-{node}", node=node, coordinator=c
        )
        target = tiers.empty(c.rank, c.world_size)
        step = mgr.restore(target)
        report = mgr.last_restore
        mgr.close()
        return step, bool(tiers.exact(target, step, c.rank, c.world_size)), report and report.source

    assert run_ranks(3, work) == [(4, True, "root")] * 3


def test_a_failed_drain_never_deletes_the_last_root_step(tiers: Any, tmp_path: Path) -> None:
    def work(c: Any) -> dict[str, Any]:
        mgr = tiers.manager(c, tmp_path, max_to_keep=1)
        r, n = c.rank, c.world_size
        out: dict[str, Any] = {}
        mgr.save(2, tiers.state(2, r, n))
        mgr.wait()
        c.barrier()
        if r == 0:  # something else already sits where step 4 would be persisted
            (tmp_path / "root" / "step_00000004").write_text("not a checkpoint")
        c.barrier()
        mgr.save(4, tiers.state(4, r, n))
        try:
            mgr.wait()
        except DistributedError as exc:
            out["failed"] = "persisting step 4" in str(exc)
        out["root"] = mgr.all_steps()
        target = tiers.empty(r, n)
        out["restored"] = mgr.restore(target)  # the tiers hold step 4 complete
        out["exact"] = tiers.exact(target, 4, r, n)
        mgr.close()
        return out

    got = run_ranks(4, work, timeout=120)
    assert all(g == {"failed": True, "root": [2], "restored": 4, "exact": True} for g in got), got
    assert gpuckpt.load_state_dict(tmp_path / "root" / "step_00000002")["step"] == 2


def test_a_restore_of_an_earlier_step_starts_the_line_again(tiers: Any, tmp_path: Path) -> None:
    """Restoring step 4 deletes tier step 5 on every node: saving 5 again later makes a step
    that a restore takes, never the old 5."""
    _trained(tiers, tmp_path)

    def work(c: Any) -> tuple[int, list[int], int, bool]:
        mgr = tiers.manager(c, tmp_path)
        r, n = c.rank, c.world_size
        mgr.restore(tiers.empty(r, n), step=4)
        after = mgr.local_steps()
        mgr.save(5, tiers.state(50, r, n))  # another step 5: the line after the roll-back
        mgr.wait()
        target = tiers.empty(r, n)
        got = mgr.restore(target)
        mgr.close()
        return got, after, target["step"], bool(tiers.exact(target, 50, r, n))

    assert run_ranks(4, work, timeout=120) == [(5, [4], 50, True)] * 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_drain_runs_at_the_least_priority_and_the_tiers_threads_at_the_callers(tmp_path: Path) -> None:
    """The drain yields the cores to training's threads; the part's write and the tier's
    thread, which the next save waits for, run at the caller's priority, which is unchanged."""
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    state = {"w": np.arange(1 << 16, dtype=np.float32), "step": 0}
    with gpuckpt.CheckpointManager(
        tmp_path / "root", local_dir=tmp_path / "local", persist_interval_steps=1, replicas=0
    ) as mgr:
        for step in (1, 2):
            state["step"] = step
            mgr.save(step, state)
            mgr.wait()
        # idle pool threads stay a few seconds: those of the save just waited for are alive
        nice = {
            t.name: os.getpriority(os.PRIO_PROCESS, t.native_id)
            for t in threading.enumerate()
            if t.name.startswith(("gpuckpt-tier", "gpuckpt-drain")) and t.native_id is not None
        }
    assert {"gpuckpt-tier_0", "gpuckpt-tier-write_0", "gpuckpt-drain_0"} <= set(nice), nice
    assert nice == {**{k: before for k in nice}, "gpuckpt-drain_0": 19}, nice
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_replicas_small_files_that_cannot_be_written_fail_the_step_on_every_rank(
    tiers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica's small files (documents, small chunks) are received into a buffer and
    written into the tier once the transfer is over: a tier that refuses them (ENOSPC) fails
    the step on every rank, naming the file, leaves no received directory behind, and the
    step before restores bit-exact."""
    import errno

    import gpuckpt.tiers.exchange as exchange_module

    write_copies = exchange_module.write_copies

    def refusing(tmp: Path, copies: list[tuple[str, memoryview]]) -> None:
        if tmp.parent.name == "n1" and refuse.is_set() and copies:
            raise OSError(errno.ENOSPC, "No space left on device", copies[0][0])
        write_copies(tmp, copies)

    refuse = threading.Event()
    monkeypatch.setattr(exchange_module, "write_copies", refusing)

    def job(c: Any) -> dict[str, Any]:
        mgr = tiers.manager(c, tmp_path, persist_interval_steps=100)
        r, n = c.rank, c.world_size
        mgr.save(1, tiers.state(1, r, n))
        mgr.wait()
        c.barrier()
        if r == 0:
            refuse.set()
        c.barrier()
        out: dict[str, Any] = {}
        try:
            mgr.save(2, tiers.state(2, r, n))
            mgr.wait()
        except DistributedError as exc:
            out["failed"] = {str(k): v for k, v in exc.failures.items()}
        c.barrier()
        if r == 0:
            refuse.clear()
        c.barrier()
        target = tiers.empty(r, n)
        out["restored"] = mgr.restore(target)
        out["exact"] = tiers.exact(target, out["restored"], r, n)
        mgr.close()
        return out

    got = run_ranks(4, job, timeout=120)
    for r, g in enumerate(got):
        assert sorted(g["failed"]) == ["2", "3"], (r, g)
        assert all("No space left on device" in m and str(tmp_path / "n1") in m for m in g["failed"].values())
        assert g["restored"] == 1 and g["exact"], (r, g)
    assert not [p for p in (tmp_path / "n1").iterdir() if p.name.startswith(".recv-")]


def test_a_replica_is_written_into_the_files_of_the_copy_it_retires(tiers: Any, tmp_path: Path) -> None:
    """With local_max_to_keep=2, step s's replica goes into the files of step s-2's copy (on
    tmpfs: pages already allocated): the largest file of that copy, held open, is a file of
    step s's replica after. Every byte is step s's, and the replica holds exactly the files of
    the part it copies, also when the layout changes (an array more at step 4 only)."""

    def run(c: Any) -> dict[str, Any]:
        r, n = c.rank, c.world_size
        mgr = tiers.manager(c, str(tmp_path), persist_interval_steps=100)
        tier = mgr._tiered.tier
        out: dict[str, Any] = {}
        for step in range(1, 7):
            st = tiers.state(step, r, n)
            if step == 4:
                st["more"] = np.arange(1000 + step, dtype=np.int64)
            witness = None
            if step >= 3:  # the largest file of the copy this step retires, held open (no other name)
                old = tier.dir / part_name(step - 2, tier.held[0])
                largest = max((p for p in old.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
                witness = os.open(largest, os.O_RDONLY)
            mgr.save(step, st)
            mgr.wait()
            whose = tier.held[0]
            replica = tier.dir / part_name(step, whose)
            original = tmp_path / f"n{whose // 2}" / part_name(step, whose)
            files = sorted(str(p.relative_to(replica)) for p in replica.rglob("*") if p.is_file())
            expected = sorted(str(p.relative_to(original)) for p in original.rglob("*") if p.is_file())
            same = all((replica / f).read_bytes() == (original / f).read_bytes() for f in files)
            recycled = False
            if witness is not None:
                held = os.fstat(witness)
                recycled = any(
                    os.path.samestat(held, (replica / f).stat()) for f in files if (replica / f).exists()
                )
                os.close(witness)
            out[str(step)] = {"files": files == expected, "bytes": same, "recycled": recycled}
        mgr.close()
        return out

    seen = run_ranks(4, run, timeout=120)
    for r, by_step in enumerate(seen):
        for step, got in by_step.items():
            assert got["files"] and got["bytes"], (r, step, got)
            # step 6 retires step 4's copy, whose largest file (the array "more") step 6 lacks
            assert got["recycled"] == (3 <= int(step) <= 5), (r, step, got)
    for node in ("n0", "n1"):
        names = sorted(p.name for p in (tmp_path / node).iterdir() if not p.name.startswith("."))
        assert names == [part_name(s, r) for s in (5, 6) for r in range(4)], (node, names)


def test_a_replica_left_as_a_link_to_a_directory_elsewhere_is_not_written_through(
    tiers: Any, tmp_path: Path
) -> None:
    """A replica that someone moved to another disk and left as a symbolic link: the replica of
    the step that retires it goes into new files, and the moved copy keeps its bytes."""

    def run(c: Any) -> dict[str, Any]:
        r, n = c.rank, c.world_size
        mgr = tiers.manager(c, str(tmp_path), persist_interval_steps=100)
        tier = mgr._tiered.tier
        whose = tier.held[0]
        kept = tmp_path / f"kept-{whose}"
        for step in range(1, 4):
            if step == 3:  # step 3 retires step 1's copy of rank whose's part
                old = tier.dir / part_name(1, whose)
                shutil.move(old, kept)
                old.symlink_to(kept, target_is_directory=True)
                before = {str(p.relative_to(kept)): p.read_bytes() for p in kept.rglob("*") if p.is_file()}
            mgr.save(step, tiers.state(step, r, n))
            mgr.wait()
        after = {str(p.relative_to(kept)): p.read_bytes() for p in kept.rglob("*") if p.is_file()}
        replica = tier.dir / part_name(3, whose)
        ok = not replica.is_symlink() and not any(p.is_symlink() for p in replica.rglob("*"))
        mgr.close()
        return {"kept": after == before and bool(before), "replica": ok}

    for r, got in enumerate(run_ranks(4, run, timeout=120)):
        assert got["kept"] and got["replica"], (r, got)


@pytest.mark.parametrize("first", [True, False], ids=["first-save", "later-save"])
def test_a_state_one_rank_cannot_describe_fails_the_step_on_every_rank_without_a_hang(
    tiers: Any, tmp_path: Path, first: bool
) -> None:
    """A key that is not a string on one rank: at the first save (inside the tier's budget
    check) or a later one, every rank raises, no rank waits for a collective the others never
    join, and the next save goes on."""

    def work(c: Any) -> dict[str, Any]:
        mgr = tiers.manager(c, tmp_path)
        r, n = c.rank, c.world_size
        out: dict[str, Any] = {}
        if not first:
            mgr.save(1, tiers.state(1, r, n))
            mgr.wait()
        bad = tiers.state(2, r, n)
        if r == 2:
            bad[None] = 1  # type: ignore[index]
        try:
            mgr.save(2, bad)
            mgr.wait()
        except DistributedError as exc:
            out["failed"] = sorted(exc.failures)
        mgr.save(3, tiers.state(3, r, n))
        mgr.wait()
        target = tiers.empty(r, n)
        out["restored"] = mgr.restore(target)
        out["exact"] = tiers.exact(target, 3, r, n)
        mgr.close()
        return out

    got = run_ranks(4, work, timeout=60)
    assert all(g == {"failed": [2], "restored": 3, "exact": True} for g in got), got
    assert not {part_name(2, r) for r in range(4)} & {p.name for p in (tmp_path / "n0").iterdir()}


def test_boxes_that_do_not_tile_fail_a_step_that_goes_to_the_tier_only(tiers: Any, tmp_path: Path) -> None:
    """Step 3 (not a persist step: it never reaches the drain's plan) with rank 2's box moved
    onto rank 0's rows (the same box twice: a replica, and rank 2's rows uncovered): the step
    fails on every rank, naming the tensor, and is not kept."""

    def work(c: Any) -> dict[str, Any]:
        mgr = tiers.manager(c, tmp_path, persist_interval_steps=100)
        r, n = c.rank, c.world_size
        mgr.save(1, tiers.state(1, r, n))
        mgr.wait()
        st = tiers.state(3, r, n)
        if r == 2:
            w = st["w"]
            st["w"] = gpuckpt.ShardedArray(w.local, (0, 0), w.global_shape)
        out: dict[str, Any] = {}
        try:
            mgr.save(3, st)
            mgr.wait()
        except DistributedError as exc:  # every rank's tier found it
            out["failed"] = sorted(exc.failures)
            out["said"] = all(
                "tensor 'w'" in f and "must tile the whole tensor exactly" in f for f in exc.failures.values()
            )
        mgr.save(4, tiers.state(4, r, n))
        mgr.wait()
        out["local"] = mgr.local_steps()
        mgr.close()
        return out

    got = run_ranks(4, work, timeout=60)
    assert all(g == {"failed": [0, 1, 2, 3], "said": True, "local": [1, 4]} for g in got), got


def test_a_restore_into_a_state_of_another_layout_deletes_nothing_and_says_why(
    tiers: Any, tmp_path: Path
) -> None:
    """The tiers hold steps 4 and 5 (the root only 4): rank 2 restores into ``rep`` of another
    dtype. The root's step 4 is tried (its load fails the same way), and the error says that
    the tiers' newer steps were passed over for rank 2's layout; nothing is deleted, and the
    right state restores step 5 from the tiers afterwards. With no root step, the error is not
    a bare "nothing found"."""
    _trained(tiers, tmp_path)

    def wrong(c: Any) -> str:
        target = tiers.empty(c.rank, c.world_size)
        if c.rank == 2:
            target["rep"] = target["rep"].astype(np.int32)
        mgr = tiers.manager(c, tmp_path)
        try:
            mgr.restore(target)
            return "restored"
        except gpuckpt.GpuckptError as exc:
            return "\n".join([str(exc), *getattr(exc, "__notes__", [])])
        finally:
            mgr.close()

    before = {node: _steps_in(tmp_path / node) for node in ("n0", "n1")}
    got = run_ranks(4, wrong, timeout=60)
    for g in got:
        assert "DTypeMismatchError" in g and "the local tiers hold step(s) [5]" in g and "rank(s) [2]" in g, g
    assert {node: _steps_in(tmp_path / node) for node in ("n0", "n1")} == before
    assert all(g["step"] == 5 and g["source"] == "tiers" for g in _restored(tiers, tmp_path))
    shutil.rmtree(tmp_path / "root")
    got = run_ranks(4, wrong, timeout=60)
    for g in got:
        assert g.startswith("no step is complete") and "step(s) [4, 5]" in g and "rank(s) [2]" in g, g


class _TimedThread:
    """A tier's writer thread that notes when each job it runs starts."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.starts = inner, []

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        def run() -> Any:
            self.starts.append(time.monotonic())
            return fn(*args, **kwargs)

        return self.inner.submit(run)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _held_writes(tmp_path: Path, delay: float) -> list[dict[str, Any]]:
    """Two ranks save step 2, rank 1 ``delay`` s late in beginning its part: when each rank's
    snapshot was done, when its part's write started, how long its save took, its part."""

    def rank(c: Any) -> dict[str, Any]:
        mgr = gpuckpt.CheckpointManager(
            tmp_path / "root", local_dir=tmp_path / f"n{c.rank}", node=f"n{c.rank}", replicas=0, coordinator=c
        )
        tier = mgr._tiered.tier  # type: ignore[union-attr]
        tier._writer = timed = _TimedThread(tier._writer)
        begin, out = tier.begin, {}

        def late_begin(step: int, *a: Any) -> None:
            if c.rank == 1 and step == 2:
                time.sleep(delay)
            begin(step, *a)
            out["snapshot_done"] = time.monotonic()

        tier.begin = late_begin
        mgr.save(1, {"w": np.zeros(1 << 16, np.float32)})  # (the first save checks the budget: a collective)
        mgr.wait()
        t = time.monotonic()
        mgr.save(2, {"w": np.full(1 << 16, c.rank, np.float32)})
        out["save_s"] = time.monotonic() - t
        mgr.wait()
        out["write_started"] = timed.starts[3]  # each step's first job is its gate's hold
        out["part"] = gpuckpt.load_state_dict(tmp_path / f"n{c.rank}" / part_name(2, c.rank))["w"]
        mgr.close()
        return out

    return run_ranks(2, rank, timeout=60)


def test_a_parts_write_starts_once_every_ranks_snapshot_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 begins its step 0.4 s late: rank 0's part is written only after rank 1's snapshot
    is done (rank 0's save itself does not wait for it), and both parts are whole."""
    monkeypatch.setattr(WriteGate, "MIN_HOLD_S", 30.0)
    r0, r1 = _held_writes(tmp_path, 0.4)
    assert r0["write_started"] >= r1["snapshot_done"], (r0, r1)
    assert r0["save_s"] < 0.3, r0  # the wait is the tier thread's, not the save's
    assert (r0["part"] == 0).all() and (r1["part"] == 1).all()


def test_a_write_is_held_at_most_twice_its_own_snapshot(tmp_path: Path) -> None:
    """A rank far slower than the others (1 s late, the others' snapshots taking milliseconds)
    does not hold their writes for long: rank 0's part is written before rank 1's snapshot."""
    r0, r1 = _held_writes(tmp_path, 1.0)
    assert r0["write_started"] < r1["snapshot_done"] - 0.5, (r0, r1)
    assert (r0["part"] == 0).all() and (r1["part"] == 1).all()


def test_maps_kept_between_rounds_never_hold_a_retired_parts_memory(tmp_path: Path) -> None:
    """Large parts' files stay mapped from one replication round to the next (the tier's
    files are recycled from step to step); no map outlives its file in the tier, whichever
    rank of the node deletes it (the node's lowest), with drains pinning steps and a layout
    that changes; none outlives the manager."""
    from gpuckpt.tiers.files import FileMaps

    rows = FileMaps.MIN_BYTES // (4 * 256) * 2  # a 2 MiB box per rank: its chunk file's map is kept

    def mapped_here() -> list[str]:
        """This process's maps of files under ``tmp_path``."""
        marker = str(tmp_path) + "/"
        return [line for line in Path("/proc/self/maps").read_text().splitlines() if marker in line]

    def run(c: Any) -> dict[str, Any]:
        r, n = c.rank, c.world_size
        node = f"n{r // 2}"
        mgr = gpuckpt.CheckpointManager(
            tmp_path / "root", local_dir=tmp_path / node, node=node, coordinator=c, persist_interval_steps=3
        )
        kept, deleted = [], []
        for step in range(1, 8):
            w = np.full((rows, 256), step * 10 + r, dtype=np.float32)
            st: dict[str, Any] = {"w": gpuckpt.ShardedArray(w, (r * rows, 0), (n * rows, 256))}
            if step in (3, 4):  # an array more for two steps: its files go when the layout changes back
                st["more"] = gpuckpt.ShardedArray(w + 1, (r * rows, 0), (n * rows, 256))
            mgr.save(step, st)
            mgr.wait()
            c.barrier()  # every rank's round and retention over
            kept.append(len(mgr._tiered.tier._file_maps))
            deleted.append(sum(line.endswith("(deleted)") for line in mapped_here()))
            c.barrier()
        mgr.close()
        return {"kept": kept, "deleted": deleted}

    seen = run_ranks(4, run, timeout=120)
    for r, got in enumerate(seen):
        # from the first round on: this rank's part and the replica it holds
        assert all(k >= 2 for k in got["kept"]), (r, got)
        assert got["deleted"] == [0] * 7, (r, got)
    deadline = time.monotonic() + 10  # (the tier thread closes them after its queued work)
    while time.monotonic() < deadline and mapped_here():
        time.sleep(0.05)
    assert not mapped_here()


def _many_tensors(c: Any, base: Path, count: int) -> list[int]:
    """Three steps of ``count`` tensors per rank through a tier (a part of 2 files per tensor,
    its chunk file of 64 KiB: large enough to be mapped, where the smaller files are copied);
    returns the files of this rank's last part."""
    r, n = c.rank, c.world_size
    node = f"n{r // 2}"
    mgr = gpuckpt.CheckpointManager(
        base / "root", local_dir=base / node, node=node, coordinator=c, persist_interval_steps=100
    )
    st = {
        f"t{i}": gpuckpt.ShardedArray(np.full((1024, 16), i + r, np.float32), (1024 * r, 0), (1024 * n, 16))
        for i in range(count)
    }
    for step in range(1, 4):
        mgr.save(step, st)
        mgr.wait()
    files = sum(len(f) for _, _, f in os.walk(base / node / part_name(3, r)))
    mgr.close()
    return [files]


def test_a_tier_raises_the_open_files_limit_that_its_rounds_need(tmp_path: Path) -> None:
    """A round maps every large file of the parts it moves (from 64 KiB), each map holding a
    file descriptor: 4 ranks (threads of one process) moving parts of 300 such tensors hold
    about 2,400 at once. Under
    a soft limit of 1,024 the tier raises it to the hard limit, and every step replicates."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 8192:
        pytest.skip(f"the hard limit on open files here ({hard}) is below what the test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        seen = run_ranks(4, lambda c: _many_tensors(c, tmp_path, 300), timeout=120)
        assert seen == [[601]] * 4
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_round_over_the_hard_open_files_limit_says_what_to_raise(tmp_path: Path) -> None:
    """Where the hard limit itself is too low, the step fails on every rank with an error that
    names the files the round maps, the limit, and what to raise (a process of its own: the
    limit cannot be raised again once lowered)."""
    script = f"""
import resource, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))
from gpuckpt.distributed import DistributedError, run_ranks
import test_tiers_threads as t
try:
    run_ranks(4, lambda c: t._many_tensors(c, Path({str(tmp_path)!r}), 150), timeout=120)
except DistributedError as exc:
    print("ERROR", exc)
else:
    print("NO ERROR")
"""
    import subprocess

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert "ERROR" in out.stdout and "NO ERROR" not in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "too many open files" in out.stdout and "ulimit -n" in out.stdout, out.stdout
    assert "this process may have 512 open" in out.stdout, out.stdout


def test_a_step_being_drained_never_takes_the_place_of_the_newest_complete_step(
    tiers: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drain slower than the steps (step 3's, held here while steps 4 and 5 are saved) keeps its
    step in the tier besides the newest ``local_max_to_keep``: while step 5 was written, step 4
    (complete on every rank) had given its files to it, leaving the drained step 3 as the newest
    complete one; a crash then lost two steps of work, not one."""
    from gpuckpt.tiers.local import LocalTier

    release = threading.Event()
    read_part = LocalTier.read_part

    def slow_read_part(self: LocalTier, step: int) -> Any:
        if step == 3:
            release.wait(60)
        return read_part(self, step)

    monkeypatch.setattr(LocalTier, "read_part", slow_read_part)

    def train(c: Any) -> list[str]:
        mgr = tiers.manager(c, tmp_path, local_max_to_keep=2, persist_interval_steps=3)
        try:
            for step in range(1, 6):
                mgr.save(step, tiers.state(step, c.rank, c.world_size))
            mgr._tiered.tier.wait_all()  # step 5's tier work over everywhere; step 3 still draining
            c.barrier()
            node = tmp_path / f"n{c.rank // 2}"
            held = sorted(p.name for p in node.iterdir() if p.name.startswith("step_"))
            c.barrier()
        finally:
            release.set()
        mgr.close()
        return held

    got = run_ranks(4, train, timeout=120)
    for node in (0, 1):
        # own parts and the other node's replicas: the drained step, then the newest two
        assert got[2 * node] == sorted(part_name(s, r) for s in (3, 4, 5) for r in range(4)), got[2 * node]
    shutil.rmtree(tmp_path / "n1")  # a replaced node
    restored = _restored(tiers, tmp_path)
    assert all(r["step"] == 5 and r["exact"] for r in restored), restored
