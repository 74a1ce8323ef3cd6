"""A local tier's guards, in one process and across processes: one open manager per ``local_dir``
(a lock the process's death releases), the tier's arguments refused before anything is made,
and a tier kept apart from its root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import InvalidOptionError

REPO = Path(__file__).resolve().parents[2]


def _manager(tmp_path: Path, root: str = "root", **kw: object) -> gpuckpt.CheckpointManager:
    return gpuckpt.CheckpointManager(tmp_path / root, local_dir=tmp_path / "tier", replicas=0, **kw)  # type: ignore[arg-type]


def test_a_second_manager_on_an_open_tier_is_refused_and_the_first_goes_on(tmp_path: Path) -> None:
    first = _manager(tmp_path, "a")
    first.save(1, {"w": np.full(4, 1.0)})
    first.wait()
    with pytest.raises(InvalidOptionError, match=f"process {os.getpid()} holds it") as info:
        _manager(tmp_path, "b")
    assert "give each run (and each manager) its own local_dir" in str(info.value)
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())
    first.save(2, {"w": np.full(4, 2.0)})  # nothing of the refused manager touched the tier
    first.wait()
    assert first.local_steps() == [1, 2]
    first.close()
    second = _manager(tmp_path, "a")  # closed: the tier is free again
    target = {"w": np.zeros(4)}
    assert second.restore(target) == 2 and target["w"].tolist() == [2.0] * 4
    second.close()


_HOLDER = """
import sys, time, numpy as np, gpuckpt
mgr = gpuckpt.CheckpointManager(sys.argv[1] + "/root", local_dir=sys.argv[1] + "/tier", replicas=0)
mgr.save(1, {"w": np.ones(4)})
mgr.wait()
print("open", flush=True)
time.sleep(120)
"""


def test_the_lock_of_a_killed_process_is_gone_with_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
        with pytest.raises(InvalidOptionError, match=f"process {proc.pid} holds it"):
            _manager(tmp_path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while True:  # (the kernel drops the lock as it tears the process down)
        try:
            mgr = _manager(tmp_path)
            break
        except InvalidOptionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    target = {"w": np.zeros(4)}
    assert mgr.restore(target) == 1 and target["w"].tolist() == [1.0] * 4
    mgr.close()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"persist_interval_steps": 5}, "persist_interval_steps configure"),
        ({"replicas": 3}, "replicas configure"),
        ({"local_max_to_keep": 4, "node": "n0"}, "local_max_to_keep, node configure"),
    ],
)
def test_tier_arguments_without_a_tier_are_refused(tmp_path: Path, kw: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        gpuckpt.CheckpointManager(tmp_path / "root", **kw)  # type: ignore[arg-type]
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"replicas": -1}, "replicas must be an integer >= 0"),
        ({"local_max_to_keep": 1}, "local_max_to_keep must be an integer >= 2"),
        ({"node": ""}, "node must be a non-empty string"),
    ],
)
def test_bad_tier_arguments_are_refused_before_anything_is_made(
    tmp_path: Path, kw: dict[str, object], match: str
) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        gpuckpt.CheckpointManager(tmp_path / "root", local_dir=tmp_path / "tier", **kw)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_a_local_dir_that_is_a_file_or_overlaps_the_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(InvalidOptionError, match="is not a directory"):
        gpuckpt.CheckpointManager(tmp_path / "root", local_dir=tmp_path / "f", replicas=0)
    for root, tier in (("r", "r"), ("r", "r/tier"), ("t/root", "t")):
        with pytest.raises(InvalidOptionError, match="overlap: give the local tier a directory of its own"):
            gpuckpt.CheckpointManager(tmp_path / root, local_dir=tmp_path / tier, replicas=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_one_process_gets_its_own_typed_errors_through_the_tier(tmp_path: Path) -> None:
    """As a manager without a tier raises them: not wrapped in a DistributedError of one rank."""
    mgr = _manager(tmp_path)
    with pytest.raises(gpuckpt.UnsupportedValueError, match="key None"):
        mgr.save(1, {"w": np.ones(4), None: 1})  # type: ignore[dict-item]
    mgr.save(2, {"w": np.ones(4), "x": np.ones(3)})
    mgr.save(3, {"w": np.ones(4), "x": object()})  # refused by the part's save, in the background
    with pytest.raises(gpuckpt.UnsupportedValueError) as info:
        mgr.wait()
        mgr.save(4, {"w": np.ones(4), "x": np.ones(3)})
    assert any("writing the local tier step 3" in n for n in getattr(info.value, "__notes__", []))
    with pytest.raises(gpuckpt.DTypeMismatchError):
        mgr.restore({"w": np.ones(4, np.float32), "x": np.zeros(3)})
    target = {"w": np.zeros(4), "x": np.zeros(3)}
    assert mgr.restore(target) == 2 and target["x"].tolist() == [1.0] * 3
    mgr.close()
