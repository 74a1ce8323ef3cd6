"""What a save may delete: foreign Zarr stores, set-aside checkpoints, live and dead writers' temporaries.

* ``overwrite=True`` replaces only a gpuckpt checkpoint (or an empty
  directory): another program's Zarr store at the path is refused and kept,
  by :func:`gpuckpt.save`, :class:`gpuckpt.CheckpointManager` and
  ``gpuckpt convert --overwrite`` alike.
* Without ``RENAME_EXCHANGE`` an overwrite renames the old checkpoint aside
  before the new one goes in. A crash between the two renames (a real child
  SIGKILLed there) leaves the old one aside; it stays the last complete copy
  until a checkpoint is back at the path, through a second crash too.
* A temporary is dead when its writer's lock is free: a dead writer that
  was PID 1 (of a real pid namespace, or only by its name) is cleaned up; a
  live writer's temporary (a real process caught mid-save, or one holding
  the lock under a dead pid's name) is never removed.
"""

from __future__ import annotations

import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.cli import main as cli_main
from gpuckpt.manager import CheckpointManager
from gpuckpt.storage.local import fsutil
from gpuckpt.storage.local.writer import LocalWriter
from gpuckpt.testing.crash import make_state
from gpuckpt.testing.faults import temporaries

from .conftest import run_child

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")

SEED = 5100


def assert_bit_exact(path: Path, seed: int) -> None:
    want, got = make_state(seed), gpuckpt.load_state_dict(path)
    assert got["seed"] == seed, f"{path} holds the state of seed {got['seed']}, expected {seed}"
    for k, v in want["model"].items():
        assert got["model"][k].tobytes() == v.tobytes(), f"{path}: tensor {k} differs"


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` by relative name, with its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def zarr_dataset(path: Path, *, array_at_root: bool = False) -> dict[str, bytes]:
    """Another program's Zarr v3 store at ``path`` (a group with an array, or one bare array)."""
    import zarr

    data = np.arange(8, dtype=np.float32)
    if array_at_root:
        arr = zarr.create_array(store=str(path), shape=(8,), chunks=(4,), dtype="f4")
    else:
        arr = zarr.create_group(store=str(path)).create_array("x", shape=(8,), chunks=(4,), dtype="f4")
    arr[:] = data
    files = snapshot(path)
    assert "zarr.json" in files and len(files) >= 3, files
    return files


# 4. overwrite never deletes what is not a gpuckpt checkpoint ---------------------------------------


@pytest.mark.parametrize("array_at_root", [False, True], ids=["group", "array"])
def test_overwrite_refuses_a_foreign_zarr_store_and_deletes_nothing(
    tmp_path: Path, array_at_root: bool
) -> None:
    data = tmp_path / "data"
    before = zarr_dataset(data, array_at_root=array_at_root)
    with pytest.raises(gpuckpt.MetadataError, match="not a gpuckpt checkpoint|not a Zarr v3 group"):
        gpuckpt.read_metadata(data)  # what read_metadata says, the save says too
    with pytest.raises(gpuckpt.CheckpointExistsError) as info:
        gpuckpt.save({"w": np.ones(4)}, data, overwrite=True)
    msg = str(info.value)
    assert str(data) in msg and "not a gpuckpt checkpoint" in msg and "nothing was deleted" in msg, msg
    assert ("attributes.gpuckpt" if not array_at_root else "'array'") in msg, msg
    fut = gpuckpt.async_save({"w": np.ones(4)}, data, overwrite=True)
    with pytest.raises(gpuckpt.CheckpointExistsError, match="not a gpuckpt checkpoint"):
        fut.result()
    assert snapshot(data) == before
    assert temporaries(tmp_path) == []


@pytest.mark.parametrize("what", ["file", "link to a folder", "link to a checkpoint", "dangling link"])
def test_overwrite_refuses_a_file_or_a_link_and_deletes_nothing(tmp_path: Path, what: str) -> None:
    path, ckpt = tmp_path / "c", tmp_path / "elsewhere"
    gpuckpt.save({"w": np.zeros(4)}, ckpt)
    before = snapshot(ckpt)
    if what == "file":
        path.write_bytes(b"mine")
    elif what == "link to a folder":
        (tmp_path / "folder").mkdir()
        path.symlink_to(tmp_path / "folder")
    elif what == "link to a checkpoint":
        path.symlink_to(ckpt)
    else:
        path.symlink_to(tmp_path / "nowhere")
    kind = "not a directory" if what == "file" else "a symbolic link"
    for save in (gpuckpt.save, lambda *a, **k: gpuckpt.async_save(*a, **k).result()):
        with pytest.raises(gpuckpt.CheckpointExistsError, match=f"it is {kind}.*nothing was deleted"):
            save({"w": np.ones(4)}, path, overwrite=True)
    assert path.is_symlink() == (what != "file") and (what != "file" or path.read_bytes() == b"mine")
    assert snapshot(ckpt) == before and not (tmp_path / "nowhere").exists()
    assert temporaries(tmp_path) == []


def test_overwrite_still_replaces_a_damaged_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "c"
    gpuckpt.save({"w": np.zeros(4)}, ckpt)
    raw = bytearray((ckpt / "zarr.json").read_bytes())
    raw[-30] ^= 0x01  # inside the metadata: its checksum no longer matches
    (ckpt / "zarr.json").write_bytes(bytes(raw))
    with pytest.raises(gpuckpt.GpuckptError):
        gpuckpt.read_metadata(ckpt)
    gpuckpt.save({"w": np.ones(4)}, ckpt, overwrite=True)  # a damaged checkpoint is still one
    assert gpuckpt.load_state_dict(ckpt)["w"].tolist() == [1.0] * 4


def test_manager_neither_lists_nor_retires_a_foreign_zarr_store_named_like_a_step(tmp_path: Path) -> None:
    foreign = tmp_path / "step_00000001"
    before = zarr_dataset(foreign)
    mgr = CheckpointManager(tmp_path, max_to_keep=1, async_save=False, sync="none")
    assert mgr.all_steps() == [] and mgr.latest_step() is None
    with pytest.raises(gpuckpt.CheckpointExistsError, match="not a gpuckpt checkpoint"):
        mgr.save(1, {"w": np.ones(2)})
    for step in (2, 3):
        mgr.save(step, {"w": np.full(2, float(step))})
    assert mgr.all_steps() == [3]  # retention ran (step 2 went) and never counted or touched step 1
    assert mgr.restore_state_dict()["w"].tolist() == [3.0, 3.0]
    assert snapshot(foreign) == before


def test_cli_convert_overwrite_refuses_a_foreign_zarr_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    gpuckpt.save({"w": np.arange(6, dtype=np.float32)}, src, sync="none")
    st = tmp_path / "m.safetensors"
    assert cli_main(["convert", "-q", str(src), str(st)]) == 0
    data = tmp_path / "data"
    before = zarr_dataset(data)
    capsys.readouterr()
    assert cli_main(["convert", "-q", "--overwrite", str(st), str(data)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpuckpt: error: ") and len(err.splitlines()) == 1, err
    assert str(data) in err and "not a gpuckpt checkpoint" in err, err
    assert snapshot(data) == before
    # a gpuckpt checkpoint there is replaced as asked
    assert cli_main(["convert", "-q", "--overwrite", str(st), str(src)]) == 0
    assert gpuckpt.load_state_dict(src)["w"].tolist() == list(range(6))


# 6. without RENAME_EXCHANGE: the set-aside checkpoint is the last copy until one is back --------------


def _set_aside(root: Path) -> list[Path]:
    return sorted(root.glob(".good.gpuckpt-old-*"))


def test_not_found_error_names_the_set_aside_copy_and_how_to_recover_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    monkeypatch.setenv("GPUCKPT_TEST_NO_EXCHANGE", "1")
    run = run_child(root, SEED, "overwrite", kill_at="rename:2")  # old aside, new not yet in place
    assert run.killed and run.trace[-1] == "rename", run.trace[-5:]
    good = root / "good"
    assert not good.exists()
    (aside,) = _set_aside(root)
    with pytest.raises(gpuckpt.CheckpointNotFoundError) as info:
        gpuckpt.read_metadata(good)
    msg = str(info.value)
    assert str(aside) in msg and f"mv '{aside}' '{good}'" in msg, msg
    os.rename(aside, good)  # what the message says to do
    assert_bit_exact(good, SEED)


@pytest.mark.parametrize("second_kill", ["chunk:3", "durable:1", "rename:2"])
def test_second_crash_after_a_crash_between_the_two_renames_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second_kill: str
) -> None:
    root = tmp_path / "root"
    good = root / "good"
    monkeypatch.setenv("GPUCKPT_TEST_NO_EXCHANGE", "1")
    first = run_child(root, SEED, "overwrite", kill_at="rename:2")
    assert first.killed and first.trace[-1] == "rename", first.trace[-5:]
    assert not good.exists() and len(_set_aside(root)) == 1
    # the next overwrite dies too, before its new checkpoint is in place
    second = run_child(root, SEED, "reoverwrite", kill_at=second_kill)
    assert second.killed and not second.finished, second.lines
    if second_kill == "rename:2":
        assert not good.exists() and len(_set_aside(root)) == 1  # aside again, as after the first crash
    else:
        assert_bit_exact(good, SEED)  # put back before the second save wrote anything
    # the old checkpoint was never lost: a plain save finds it (put back) and refuses to replace it
    with pytest.raises(gpuckpt.CheckpointExistsError, match="already exists"):
        gpuckpt.save({"x": np.ones(1)}, good)
    assert_bit_exact(good, SEED)
    assert temporaries(root) == []


def test_fallback_overwrite_still_replaces_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    monkeypatch.setenv("GPUCKPT_TEST_NO_EXCHANGE", "1")
    run = run_child(root, SEED, "overwrite")
    assert run.finished and run.trace.count("rename") == 2, run.trace[-5:]
    assert_bit_exact(root / "good", SEED + 1)
    assert temporaries(root) == []


# 11. dead and live writers' temporaries ---------------------------------------------------------------


def _host() -> str:
    return fsutil.tmp_owner().rsplit("-", 1)[0]


def _boot_tag() -> str:
    """The kernel's boot tag as temporaries carry it: the first 8 hex digits of its boot id."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:8]
    except OSError:
        return ""


def _locked_name(path: Path, pid: int, tag: str = "tmp") -> Path:
    """A temporary's name as a writer of this kernel with process id ``pid`` makes it."""
    return path.parent / f".{path.name}.gpuckpt-{tag}-{_host()}-{pid}-k{_boot_tag()}{secrets.token_hex(4)}"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


needs_boot_tag = pytest.mark.skipif(not _boot_tag(), reason="no /proc boot id: temporaries go by pid")


@needs_boot_tag
def test_temporaries_of_a_dead_writer_that_was_pid_1_are_removed(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    gpuckpt.save({"w": np.zeros(2)}, ckpt)
    left = [_locked_name(ckpt, 1), _locked_name(ckpt, 1, "old")]  # PID 1 is alive here: another process
    for d in left:
        d.mkdir()
        (d / "zarr.json").write_bytes(b"{}")
    gpuckpt.save({"w": np.ones(2)}, ckpt, overwrite=True)
    assert temporaries(tmp_path) == []
    assert gpuckpt.load_state_dict(ckpt)["w"].tolist() == [1.0, 1.0]


class _Child:
    """A crash-harness child caught at ``GPUCKPT_TEST_STOP_AT`` (a live writer mid-save)."""

    def __init__(self, argv: list[str], root: Path, mode: str, stop_at: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "GPUCKPT_TEST_STOP_AT": stop_at}
        self.proc = subprocess.Popen(
            [*argv, sys.executable, "-m", "gpuckpt.testing.crash", str(root), str(SEED), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        out = self.proc.stdout
        assert out is not None
        threading.Thread(target=self._pump, args=(out,), daemon=True).start()
        for expected in ("good", "start", "stopped"):
            self.expect(expected)

    def _pump(self, out: IO[str]) -> None:
        for line in out:
            self.lines.put(line.strip())
        self.lines.put("<eof>")

    def expect(self, want: str) -> None:
        try:
            line = self.lines.get(timeout=120)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"the child never printed {want!r}") from None
        assert line == want, (want, line)

    def resume(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=120)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


def _unshare_pid_ns() -> list[str]:
    """A command prefix running its command as PID 1 of a new pid namespace (skips where refused)."""
    argv = ["unshare", "--user", "--map-root-user", "--pid", "--fork"]
    if shutil.which("unshare") is None:
        pytest.skip("no unshare command here")
    probe = subprocess.run(
        [*argv, sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr.strip()[:200]}")
    return argv


def _children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


@needs_boot_tag
def test_a_real_pid_1_writer_sigkilled_mid_save_is_cleaned_up(tmp_path: Path) -> None:
    argv = _unshare_pid_ns()
    root = tmp_path / "root"
    child = _Child(argv, root, "new", "chunk:3")  # PID 1 of its namespace, caught mid-save
    try:
        (writer,) = _children_of(child.proc.pid)  # its pid out here
        left = [n for n in temporaries(root) if n.startswith(".next.gpuckpt-tmp-")]
        assert len(left) == 1 and f"-{_host()}-1-" in left[0], left
        os.kill(writer, signal.SIGKILL)
        child.proc.wait(timeout=120)  # unshare returns once its child is dead and reaped
    finally:
        child.close()
    assert temporaries(root) != []
    gpuckpt.save({"x": np.ones(1)}, root / "next")
    assert temporaries(root) == []
    assert_bit_exact(root / "good", SEED)


def test_a_sigkilled_writers_temporary_is_removed_by_the_next_save(tmp_path: Path) -> None:
    root = tmp_path / "root"
    run = run_child(root, SEED, "new", kill_at="chunk:3")
    assert run.killed and any(n.startswith(".next.gpuckpt-tmp-") for n in temporaries(root))
    gpuckpt.save({"x": np.ones(1)}, root / "next")
    assert temporaries(root) == []


def test_a_live_writers_temporary_survives_other_saves_to_the_same_path(tmp_path: Path) -> None:
    root = tmp_path / "root"
    child = _Child([], root, "overwrite", "chunk:3")  # overwriting ROOT/good, caught mid-save
    try:
        (mine,) = temporaries(root)
        for seed in (1, 2):  # other saves over the same path, while it writes
            gpuckpt.save({"seed": seed}, root / "good", overwrite=True)
            assert mine in temporaries(root), "a live writer's temporary was removed"
        CheckpointManager(root)  # a manager opened on the same directory cleans up too
        assert mine in temporaries(root)
        child.resume()
        child.expect("done")
        child.proc.wait(timeout=120)
    finally:
        child.close()
    assert child.proc.returncode == 0
    assert_bit_exact(root / "good", SEED + 1)  # its save completed, last
    assert temporaries(root) == []


@needs_boot_tag
def test_a_temporary_whose_lock_is_held_is_kept_whatever_its_name_says(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    gpuckpt.save({"w": np.zeros(2)}, ckpt)
    tmp = _locked_name(ckpt, _dead_pid())  # named for a dead process, but its lock is held
    tmp.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n",
            str(tmp),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        gpuckpt.save({"w": np.ones(2)}, ckpt, overwrite=True)
        assert tmp.is_dir(), "the temporary of a writer holding its lock was removed"
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
        if holder.stdout is not None:
            holder.stdout.close()
    gpuckpt.save({"w": np.full(2, 2.0)}, ckpt, overwrite=True)  # the holder is gone: now it goes
    assert temporaries(tmp_path) == []


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads elsewhere in the run
def test_a_forked_child_does_not_keep_a_writers_lock(tmp_path: Path) -> None:
    w = LocalWriter(tmp_path / "c", sync="none")
    w.begin()
    r, wr = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a long-lived child (a data-loader worker) forked during the save
        os.close(wr)
        os.write(ready_w, b"r")  # running: the fork handlers are done
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"r"
    os.close(ready_r)
    try:
        fd: Any = w._lock_fd
        assert fd is not None
        fsutil.unlock(fd)  # the writer lets go (as when it dies): the child must not hold it
        w._lock_fd = None
        again = fsutil.lock_dir(w.tmp)
        assert again is not None, "a forked child kept the writer's lock"
        fsutil.unlock(again)
    finally:
        os.write(wr, b"x")
        os.close(wr)
        os.waitpid(pid, 0)
        w.abort()
    assert temporaries(tmp_path) == []
