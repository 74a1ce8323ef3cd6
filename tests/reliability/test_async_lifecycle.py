"""Background saves across the life of a process: exit, failures, fork, memory limits.

A return from ``async_save`` promises that the state will be written: the
saves still queued when the process exits are finished first (plain end,
``sys.exit``, an uncaught exception, a manager never closed, a thread that
outlives the main thread, an exit handler); a save that fails unseen makes
the process say so and exit non-zero. Bad options fail at the call, before
any staging memory is taken; staging memory is sized to the state and a
failure to get it is a typed error; a forked child saves on its own.
Every scenario runs in a real subprocess (bounded by a timeout that kills its
whole process group) against real checkpoint directories.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt import background
from gpuckpt.device import staging
from gpuckpt.device.host_backend import HostBackend
from gpuckpt.device.staging import ArenaPool
from gpuckpt.errors import InvalidOptionError, StagingMemoryError, StagingTimeoutError
from gpuckpt.testing.fakedevice import EmulatedDeviceArray

REPO = Path(__file__).resolve().parents[2]

# a state of several chunk files and several I/O batches, and its known values
STATE = """
import numpy as np
def state(i):
    rng = np.random.default_rng(i)
    return {"w": rng.standard_normal((512, 1024)).astype(np.float32), "step": i}
"""


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def run_script(code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None) -> Run:
    """Run ``code`` in a new Python process (its own process group, killed whole on timeout)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    full_env.pop("GPUCKPT_DIRECT_IO", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(STATE) + textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the child hung (killed after {timeout} s); stderr:\n{err}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return Run(proc.returncode, out, err)


def state(i: int) -> dict[str, object]:
    rng = np.random.default_rng(i)
    return {"w": rng.standard_normal((512, 1024)).astype(np.float32), "step": i}


def assert_saved(path: Path, i: int) -> None:
    back = gpuckpt.load_state_dict(path)
    want = state(i)
    assert back["step"] == i
    assert back["w"].tobytes() == want["w"].tobytes()  # type: ignore[attr-defined]


def temporaries(root: Path) -> list[str]:
    return [p.name for p in root.rglob("*") if ".gpuckpt-" in p.name]


# -- exit -------------------------------------------------------------------

ENDINGS = {
    "plain": ("", 0),
    "sys_exit": ("import sys; sys.exit(0)", 0),
    "exception": ("raise RuntimeError('training crashed')", 1),
    "keyboard_interrupt": ("raise KeyboardInterrupt", -signal.SIGINT),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_queued_async_saves_are_written_before_exit(tmp_path: Path, ending: str) -> None:
    code, status = ENDINGS[ending]
    run = run_script(
        f"""
        import sys, gpuckpt
        root = sys.argv[1]
        for i in range(1, 4):
            gpuckpt.async_save(state(i), f"{{root}}/c{{i}}", chunk_bytes=64 << 10, sync="none")
        {code}
        """,
        str(tmp_path),
    )
    assert run.returncode == status, run.stderr
    for i in range(1, 4):
        assert_saved(tmp_path / f"c{i}", i)
    assert not temporaries(tmp_path)


def test_manager_without_close_writes_its_last_step(tmp_path: Path) -> None:
    # the README's training loop, without mgr.close()
    run = run_script(
        """
        import sys, gpuckpt
        mgr = gpuckpt.CheckpointManager(sys.argv[1], sync="none")
        for step in range(1, 6):
            mgr.save(step, state(step))
        """,
        str(tmp_path),
    )
    assert run.returncode == 0, run.stderr
    mgr = gpuckpt.CheckpointManager(tmp_path)
    assert mgr.all_steps() == [1, 2, 3, 4, 5]
    assert_saved(mgr.step_path(5), 5)


def test_save_from_a_thread_that_outlives_the_main_thread(tmp_path: Path) -> None:
    # the main thread ends first; the interpreter then waits for this (non-daemon)
    # thread, whose save is queued after the first drain at exit has run
    run = run_script(
        """
        import sys, threading, gpuckpt
        def late():
            threading.main_thread().join()
            gpuckpt.async_save(state(7), sys.argv[1] + "/late", chunk_bytes=64 << 10, sync="none")
        threading.Thread(target=late).start()
        """,
        str(tmp_path),
    )
    assert run.returncode == 0, run.stderr
    assert_saved(tmp_path / "late", 7)


def test_a_daemon_thread_saving_back_to_back_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    # the exit drain took each new save of such a thread, and never ended; the interpreter
    # abandons daemon threads: the saves queued when the program ended are written, one the
    # daemon starts during the drain runs in that thread and, cut short, publishes nothing
    run = run_script(
        """
        import sys, threading, time, numpy as np, gpuckpt
        big = {f"t{i}": np.full(2_000_000, i, np.float32) for i in range(8)}  # 64 MB: one always queued
        def periodic():
            i = 0
            while True:
                i += 1
                gpuckpt.async_save(big | {"step": i}, sys.argv[1] + "/ckpt", overwrite=True, sync="file")
        threading.Thread(target=periodic, daemon=True).start()
        time.sleep(0.5)
        """,
        str(tmp_path),
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    back = gpuckpt.load_state_dict(tmp_path / "ckpt")  # a whole save, the last one published
    assert back["step"] >= 1 and all((back[f"t{i}"] == i).all() for i in range(8))


def test_saves_from_exit_handlers(tmp_path: Path) -> None:
    # one handler registered before gpuckpt is imported (it runs after gpuckpt's own
    # drain at exit), one after (it runs before)
    run = run_script(
        """
        import atexit, sys
        root = sys.argv[1]
        def save(i):
            import gpuckpt
            gpuckpt.async_save(state(i), f"{root}/h{i}", chunk_bytes=64 << 10, sync="none")
        atexit.register(save, 1)
        import gpuckpt
        atexit.register(save, 2)
        """,
        str(tmp_path),
    )
    assert run.returncode == 0, run.stderr
    assert_saved(tmp_path / "h1", 1)
    assert_saved(tmp_path / "h2", 2)


def test_unseen_failure_is_reported_and_exit_status_is_1(tmp_path: Path) -> None:
    gpuckpt.save({"x": np.ones(3)}, tmp_path / "taken")
    code = """
        import sys, gpuckpt
        root = sys.argv[1]
        fut = gpuckpt.async_save(state(1), root + "/taken")  # exists: the save fails
        gpuckpt.async_save(state(2), root + "/fine-" + sys.argv[2], sync="none")
        if sys.argv[2] == "seen":
            print(type(fut.exception()).__name__)
        """
    unseen = run_script(code, str(tmp_path), "unseen")
    assert unseen.returncode == 1
    assert f"background save to {tmp_path / 'taken'} failed" in unseen.stderr
    assert "CheckpointExistsError" in unseen.stderr and "exiting with status 1" in unseen.stderr
    seen = run_script(code, str(tmp_path), "seen")
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.strip() == "CheckpointExistsError" and "gpuckpt:" not in seen.stderr
    assert_saved(tmp_path / "fine-unseen", 2)
    assert_saved(tmp_path / "fine-seen", 2)
    assert gpuckpt.load_state_dict(tmp_path / "taken")["x"].tolist() == [1.0, 1.0, 1.0]


def test_interrupt_while_waiting_at_exit_is_reported_and_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    # Ctrl-C while the exit waits for a save: the save is abandoned, loudly, and the
    # checkpoint it was replacing is still the old one
    gpuckpt.save(state(1), tmp_path / "c")
    run = run_script(
        """
        import os, signal, sys, threading, time, gpuckpt
        # Python's own Ctrl-C handler, whatever this process inherited (a shell without job
        # control starts background commands with SIGINT ignored, and Python then installs none)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        main = threading.main_thread().ident
        def waiting_at_exit():
            f = sys._current_frames().get(main)
            while f is not None:
                if f.f_code.co_name == "_drain_at_exit":
                    return True
                f = f.f_back
            return False
        def interrupt_once(done, total):
            if done:
                # only once the main thread waits at exit (an interrupt that reached it still
                # inside async_save would end the script before the wait)
                while not waiting_at_exit():
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGINT)
                threading.Event().wait()  # the save never ends: only the interrupt ends the wait
        gpuckpt.async_save(state(2), sys.argv[1] + "/c", overwrite=True, chunk_bytes=64 << 10,
                           threads=1, progress=interrupt_once)
        """,
        str(tmp_path),
    )
    assert run.returncode == 1, run.stderr
    assert "interrupted while waiting for background saves at exit" in run.stderr
    assert str(tmp_path / "c") in run.stderr
    assert_saved(tmp_path / "c", 1)


# -- bad options and staging --------------------------------------------------


def test_bad_options_take_no_staging_and_later_saves_work(tmp_path: Path) -> None:
    # before: each bad call kept a staging arena; the third (valid) call waited forever
    run = run_script(
        """
        import os, sys, gpuckpt
        root = sys.argv[1]
        def bad(path, **kw):
            try:
                gpuckpt.async_save(state(0), path, **kw).result(timeout=60)
            except Exception as e:
                print(type(e).__name__, isinstance(e, ValueError))
        bad(root + "/a", sync="fsync")
        bad("nosuchscheme://bucket/a")
        os.environ["GPUCKPT_DIRECT_IO"] = "sometimes"
        bad(root + "/b")
        del os.environ["GPUCKPT_DIRECT_IO"]
        bad(root + "/c", threads=0)
        for i in range(1, 4):
            gpuckpt.async_save(state(i), f"{root}/ok{i}", sync="none").result(timeout=60)
        print("saved")
        """,
        str(tmp_path),
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n") == [
        "InvalidOptionError True",
        "InvalidPathError True",
        "InvalidOptionError True",
        "InvalidOptionError True",
        "saved",
        "",
    ]
    for i in range(1, 4):
        assert_saved(tmp_path / f"ok{i}", i)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok1", "ok2", "ok3"]


@pytest.mark.parametrize(
    ("option", "value"),
    [("sync", "fsync"), ("sync", None), ("chunk_bytes", 0), ("threads", 0), ("progress", "yes")],
)
def test_manager_rejects_bad_options_at_construction(tmp_path: Path, option: str, value: object) -> None:
    with pytest.raises(InvalidOptionError, match=option):
        gpuckpt.CheckpointManager(tmp_path / "m", **{option: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match=option):
        gpuckpt.save(state(0), tmp_path / "s", **{option: value})  # type: ignore[arg-type]
    assert not (tmp_path / "s").exists()


def test_small_state_takes_little_staging_memory(tmp_path: Path) -> None:
    background.wait_all()
    with background._lock:  # drop the free arenas of earlier, larger saves in this process
        for pool in background._pools.values():
            pool.clear()
    gpuckpt.async_save({"w": np.ones(512)}, tmp_path / "c").result(timeout=60)  # 4 KiB
    with background._lock:
        pools = list(background._pools.values())
    arenas = [a for p in pools for a in p._free]
    assert arenas and max(a.capacity for a in arenas) <= 1 << 20


def test_staging_of_a_growing_state_is_the_largest_state_not_their_sum(tmp_path: Path) -> None:
    # each larger state had added a piece of its own beside the smaller ones, never given back
    background.wait_all()
    with background._lock:
        for pool in background._pools.values():
            pool.clear()
    for i, mib in enumerate((2, 4, 6, 8)):
        gpuckpt.async_save({"w": np.ones(mib << 17)}, tmp_path / f"c{i}", sync="none").result(timeout=60)
    with background._lock:
        arenas = [a for p in background._pools.values() for a in p._free]
    assert len(arenas) == 1 and len(arenas[0].pieces) == 1
    assert 8 << 20 <= arenas[0].capacity <= (8 << 20) + (64 << 10)  # the largest, and its alignment


LIMITED = """
import re, resource, sys, numpy as np, gpuckpt
def address_space():
    return int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) << 10
big = np.ones(int(sys.argv[2]) << 17)  # MiB of float64, allocated before the limit
resource.setrlimit(resource.RLIMIT_AS, (address_space() + (128 << 20), resource.RLIM_INFINITY))
try:
    fut = gpuckpt.async_save({"w": np.ones(512), "big": big}, sys.argv[1], threads=1, sync="none")
    fut.result(timeout=60)
    print("saved")
except BaseException as e:
    print(type(e).__name__, isinstance(e, gpuckpt.GpuckptError), isinstance(e, MemoryError), e)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_async_save_of_small_state_under_address_space_limit(tmp_path: Path) -> None:
    # before: the first snapshot reserved 256 MiB whatever the state's size
    run = run_script(LIMITED, str(tmp_path / "c"), "0", env={"MALLOC_ARENA_MAX": "1"})
    assert run.stdout.strip() == "saved", run.stdout + run.stderr
    assert gpuckpt.load_state_dict(tmp_path / "c")["w"].nbytes == 4096


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_staging_beyond_address_space_limit_is_a_typed_error(tmp_path: Path) -> None:
    run = run_script(LIMITED, str(tmp_path / "c"), "192", env={"MALLOC_ARENA_MAX": "1"})
    assert run.stdout.startswith("StagingMemoryError True True cannot allocate"), run.stdout + run.stderr
    assert "ulimit -v" in run.stdout
    assert not (tmp_path / "c").exists()


def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``fn`` in a daemon thread; the list receives its result or its exception."""
    out: list[object] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


def test_arenas_no_one_can_release_raise_instead_of_blocking() -> None:
    # held by a thread that has ended
    pool = ArenaPool(max_arenas=2)
    leaker, _ = in_thread(lambda: [pool.acquire(), pool.acquire()])
    leaker.join()
    t, out = in_thread(pool.acquire)
    t.join(60)
    assert not t.is_alive() and isinstance(out[0], StagingTimeoutError), out
    assert isinstance(out[0], TimeoutError) and "held by no save in flight" in str(out[0])
    # held by the waiting thread itself
    own = ArenaPool(max_arenas=1)
    t, out = in_thread(lambda: [own.acquire(), own.acquire()])
    t.join(60)
    assert not t.is_alive() and isinstance(out[0], StagingTimeoutError), out


class CountingFuture(Future[None]):
    """A pending save whose liveness checks are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = threading.Semaphore(0)

    def done(self) -> bool:
        self.checked.release()
        return super().done()


def test_arena_held_by_a_pending_save_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "_CHECK_SECONDS", 0.001)
    pool = ArenaPool(max_arenas=1)
    arena = pool.acquire()
    save = CountingFuture()
    pool.hold(arena, save)
    save.add_done_callback(lambda _: pool.release(arena))
    t, out = in_thread(pool.acquire)
    for _ in range(5):  # more checks than an arena without a live holder survives
        assert save.checked.acquire(timeout=60)
    assert not out  # still waiting: its holder may release it
    save.set_result(None)
    t.join(60)
    assert out == [arena]


class FailingCopyBackend(HostBackend):
    """A slow host 'device' whose copies of one array fail at once."""

    def __init__(self, bad: np.ndarray) -> None:
        super().__init__(bytes_per_second=4 << 20)
        self.bad = bad

    def snapshot_to_host(self, array: Any, dest: np.ndarray) -> Any:
        if array is self.bad:
            return _FailedTicket()
        return super().snapshot_to_host(array, dest)


class _FailedTicket:
    def wait(self) -> None:
        raise RuntimeError("injected device copy failure")


def test_failed_snapshot_gives_back_its_arena_only_after_every_copy_ended(tmp_path: Path) -> None:
    # the first copy fails at once while a slow one is still writing into the arena:
    # the arena must not be given back (to the next snapshot) before that one ends
    bad = np.ones(1024, np.float32)
    backend = FailingCopyBackend(bad)
    slow = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: about 0.25 s at the backend's rate
    state_ = {"a": EmulatedDeviceArray(bad, backend), "b": EmulatedDeviceArray(slow, backend)}
    with pytest.raises(RuntimeError, match="injected device copy failure"):
        gpuckpt.async_save(state_, tmp_path / "c")
    assert backend._in_flight == 0 and backend.copies == 1
    gpuckpt.async_save({"b": EmulatedDeviceArray(slow, backend)}, tmp_path / "d").result(timeout=60)
    assert gpuckpt.load_state_dict(tmp_path / "d")["b"].tobytes() == slow.tobytes()
    assert not (tmp_path / "c").exists()


class RefusingMemoryBackend(HostBackend):
    """A slow host 'device' whose staging memory can be refused from some point on."""

    def __init__(self) -> None:
        super().__init__(bytes_per_second=4 << 20)
        self.refuse = False

    def pinned_allocator(self) -> Any:
        def allocate(nbytes: int) -> np.ndarray:
            if self.refuse:
                raise MemoryError(f"injected: no {nbytes} bytes of staging memory")
            return np.empty(nbytes, np.uint8)

        return allocate


def test_snapshot_that_cannot_get_memory_ends_its_copies_first(tmp_path: Path) -> None:
    # the first tensor is copied into the arena kept from an earlier save while the second
    # needs memory that cannot be had: the error comes only after that copy has ended
    backend = RefusingMemoryBackend()
    slow = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: about 0.25 s at the backend's rate
    gpuckpt.async_save({"a": EmulatedDeviceArray(slow, backend)}, tmp_path / "warm").result(timeout=60)
    backend.refuse = True
    big = np.ones(1 << 20, np.float32)  # does not fit the arena kept: new memory is needed
    state_ = {"a": EmulatedDeviceArray(slow, backend), "b": EmulatedDeviceArray(big, backend)}
    with pytest.raises(StagingMemoryError, match="injected"):
        gpuckpt.async_save(state_, tmp_path / "c")
    assert backend._in_flight == 0
    backend.refuse = False
    gpuckpt.async_save({"a": EmulatedDeviceArray(slow, backend)}, tmp_path / "d").result(timeout=60)
    assert gpuckpt.load_state_dict(tmp_path / "d")["a"].tobytes() == slow.tobytes()
    assert not (tmp_path / "c").exists()


def test_a_new_backend_never_gets_the_staging_pool_of_one_that_is_gone(tmp_path: Path) -> None:
    # pools are found by the back end's id; a back end made after another was freed may get
    # its id (the staging-memory test above once passed a refused allocation that way, in a
    # full run of the suite). Here the pool left under the new back end's id is one made for
    # another back end, with an arena large enough for the save: the save must not use it
    other = HostBackend()
    big = np.ones(1 << 20, np.float32)
    gpuckpt.async_save({"w": EmulatedDeviceArray(big, other)}, tmp_path / "a").result(timeout=60)
    second = RefusingMemoryBackend()
    second.refuse = True
    with background._lock:
        stale = background._pools[id(other)]
        background._pools[id(second)] = stale  # what a reused id finds
    try:
        slow = np.arange(1 << 18, dtype=np.float32)
        with pytest.raises(StagingMemoryError, match="injected"):
            gpuckpt.async_save({"w": EmulatedDeviceArray(slow, second)}, tmp_path / "b")
        assert not (tmp_path / "b").exists()
        with background._lock:
            assert background._pools[id(second)] is not stale
    finally:
        with background._lock:
            background._pools.pop(id(second), None)


def test_a_staging_pool_holds_its_backend() -> None:
    # so that the back end's id, the pool's key, is not reused while the pool is kept
    pools: dict[int, ArenaPool] = {}
    backend = HostBackend()
    pool = staging.pool_for(pools, backend, max_arenas=2)
    assert pool.owner is backend and pools == {id(backend): pool}
    assert staging.pool_for(pools, backend, max_arenas=2) is pool
    assert staging.pool_for(pools, None, max_arenas=2).owner is None and 0 in pools


# -- fork ---------------------------------------------------------------------

FORK = """
import os, sys, gpuckpt, numpy as np
root = sys.argv[1]
big = np.random.default_rng(5).standard_normal(6_000_000)  # 48 MB: the snapshot copy runs on threads
gpuckpt.async_save({"w": big}, root + "/warm", sync="none").result(timeout=60)  # threads exist now
inflight = gpuckpt.async_save(state(1), root + "/parent", sync="none")
pid = os.fork()
if pid == 0:
    fut = gpuckpt.async_save({"w": big + 1}, root + "/child", sync="none")
    fut.result(timeout=60)
    try:
        inflight.result(timeout=60)
    except gpuckpt.GpuckptError as e:
        print("inherited", type(e).__name__, flush=True)
    gpuckpt.async_save(state(3), root + "/child-at-exit", sync="none")  # written as the child exits
    sys.exit(0)
gpuckpt.async_save(state(2), root + "/parent-after", sync="none").result(timeout=60)
inflight.result(timeout=60)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_parent_and_forked_child_both_save(tmp_path: Path) -> None:
    run = run_script(FORK, str(tmp_path), timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n") == ["inherited ForkedSaveError", "child 0", ""], run.stderr
    assert_saved(tmp_path / "parent", 1)
    assert_saved(tmp_path / "parent-after", 2)
    assert_saved(tmp_path / "child-at-exit", 3)
    big = np.random.default_rng(5).standard_normal(6_000_000)
    assert gpuckpt.load_state_dict(tmp_path / "child")["w"].tobytes() == (big + 1).tobytes()


def test_multiprocessing_fork_child_saves_are_written(tmp_path: Path) -> None:
    # a multiprocessing child leaves through os._exit: atexit does not run there,
    # the interpreter's thread join does
    run = run_script(
        """
        import multiprocessing as mp, sys, gpuckpt
        root = sys.argv[1]
        def child():
            gpuckpt.async_save(state(4), root + "/mp-child", chunk_bytes=64 << 10, sync="none")
        gpuckpt.async_save(state(1), root + "/warm", sync="none").result(timeout=60)
        p = mp.get_context("fork").Process(target=child)
        p.start()
        p.join(60)
        print(p.exitcode)
        """,
        str(tmp_path),
    )
    assert run.returncode == 0 and run.stdout.strip() == "0", run.stderr
    assert_saved(tmp_path / "mp-child", 4)


# -- object storage -------------------------------------------------------------


@pytest.fixture
def s3_options(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A moto S3 server on loopback with a bucket ``ckpts``; the options to reach it."""
    pytest.importorskip("obstore")
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    opts = {
        "endpoint_url": f"http://127.0.0.1:{port}",
        "region": "us-east-1",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "allow_http": True,
    }
    try:
        boto3.client(
            "s3",
            endpoint_url=opts["endpoint_url"],
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket="ckpts")
        yield opts
    finally:
        server.stop()


def test_queued_save_to_object_storage_is_written_before_exit(s3_options: dict[str, Any]) -> None:
    # no thread can be started during exit: the S3 writer's claim heartbeat and the
    # event loop that zarr's store API needs could not be either
    run = run_script(
        """
        import json, sys, gpuckpt
        opts = json.loads(sys.argv[1])
        gpuckpt.async_save(state(3), "s3://ckpts/exit/c", storage_options=opts, chunk_bytes=256 << 10)
        """,
        json.dumps(s3_options),
    )
    assert run.returncode == 0, run.stderr
    back = gpuckpt.load_state_dict("s3://ckpts/exit/c", storage_options=s3_options)
    assert back["step"] == 3 and back["w"].tobytes() == state(3)["w"].tobytes()  # type: ignore[attr-defined]
