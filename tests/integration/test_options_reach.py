"""Every save and load option reaches every path that takes it.

The public calls make one options value (:class:`gpuckpt.options.SaveOptions`,
:class:`gpuckpt.options.LoadOptions`) and pass it down whole. Each test here
gives one option to every path that takes it (host and device arrays,
ShardedArray boxes in one process and in two ranks, background saves, the
manager, S3 object storage) and observes what the option does there: the
chunk grid (``chunk_bytes``, ``portable``), progress calls, the threads that
did the I/O, fsync calls (``sync``), which copies the device backend ran
(``staging``) and how many were in flight at once (``staging_bytes``),
pickled values, replacement of an existing checkpoint, missing keys, and
settings reaching the S3 client. An option dropped on one path fails that
path's case. Everything is real: checkpoints on ``tmp_path``, a moto S3
server on loopback, ranks as threads, the host stand-in for a device.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt import CheckpointManager, ShardedArray
from gpuckpt.background import wait_all
from gpuckpt.device.host_backend import HostBackend
from gpuckpt.distributed import run_ranks
from gpuckpt.storage.local import batchio
from gpuckpt.testing.fakedevice import EmulatedDeviceArray
from gpuckpt.verify import verify_checkpoint

SHAPE = (64, 256)  # float32 rows of 1 KiB: 64 KiB
CUT = 20  # ShardedArray boxes: rows [0, 20) and [20, n), an uneven split


def full(shape: tuple[int, int] = SHAPE) -> np.ndarray:
    return (np.arange(math.prod(shape), dtype=np.float32) * 0.25).reshape(shape)


class CountingBackend(HostBackend):
    """The host stand-in for a device, slowed down, that records which copies it was asked for."""

    def __init__(self) -> None:
        super().__init__(bytes_per_second=4 << 20)
        self.calls: list[str] = []

    def stage_out(self, array: Any, offsets: Any, sizes: Any, dest: np.ndarray) -> Any:
        self.calls.append("stage_out")
        return super().stage_out(array, offsets, sizes, dest)

    def snapshot_to_host(self, array: Any, dest: np.ndarray) -> Any:
        self.calls.append("snapshot_to_host")
        return super().snapshot_to_host(array, dest)

    def copy_on_device(self, array: Any) -> Any:
        self.calls.append("copy_on_device")
        return super().copy_on_device(array)

    def copy_many_on_device(self, arrays: Any) -> Any:
        self.calls.append("copy_many_on_device")
        return super().copy_many_on_device(arrays)


def rows_of(g: np.ndarray, lo: int, hi: int, backend: HostBackend | None) -> ShardedArray:
    part = g[lo:hi].copy()
    return ShardedArray(part if backend is None else EmulatedDeviceArray(part, backend), (lo, 0), g.shape)


def make_state(
    kind: str,
    rank: int = 0,
    *,
    backend: HostBackend | None = None,
    shape: tuple[int, int] = SHAPE,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``kind``: host, device, sharded (two uneven boxes in one process) or ranks (rank 0
    holds the first box, rank 1 the second); device arrays where ``backend`` is given."""
    g = full(shape)
    w: Any
    if kind in ("host", "device"):
        w = g if backend is None else EmulatedDeviceArray(g.copy(), backend)
    elif kind == "sharded":
        w = [rows_of(g, 0, CUT, backend), rows_of(g, CUT, shape[0], backend)]
    elif kind == "ranks":
        w = rows_of(g, 0, CUT, backend) if rank == 0 else rows_of(g, CUT, shape[0], backend)
    else:
        raise ValueError(kind)
    return {"w": w, "step": 3, **(extra or {})}


# -- save paths ------------------------------------------------------------------------------

# name -> (how, state kind)
SAVE_PATHS = {
    "save": ("save", "host"),
    "save-device": ("save", "device"),
    "save-sharded": ("save", "sharded"),
    "save-ranks": ("save", "ranks"),
    "async": ("async", "host"),
    "async-device": ("async", "device"),
    "async-sharded": ("async", "sharded"),
    "async-ranks": ("async", "ranks"),
    "manager": ("manager", "host"),
    "manager-async": ("manager-async", "host"),
    "manager-sharded": ("manager", "sharded"),
    "manager-async-sharded": ("manager-async", "sharded"),
    "s3-save": ("save", "host"),
    "s3-async": ("async", "host"),
    "s3-sharded": ("save", "sharded"),
    "s3-async-sharded": ("async", "sharded"),
}
LOCAL = [p for p in SAVE_PATHS if not p.startswith("s3-")]
ALL = list(SAVE_PATHS)


def world_of(path: str) -> int:
    return 2 if SAVE_PATHS[path][1] == "ranks" else 1


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server on loopback with a bucket ``ckpts``; the storage_options that reach it.

    The endpoint and credentials are given only through storage_options (no AWS_*
    environment), so a path that drops them does not reach this server.
    """
    pytest.importorskip("obstore")
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with pytest.MonkeyPatch.context() as mp:
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            mp.delenv(k, raising=False)
        for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
            mp.delenv(k, raising=False)
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        opts = {
            "endpoint_url": f"http://127.0.0.1:{port}",
            "region": "us-east-1",
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
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


class Where:
    """Where a path saves: a directory (a manager's root for manager paths) or an S3 URL."""

    def __init__(self, path: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        self.path = path
        self.how, self.kind = SAVE_PATHS[path]
        self.opts: dict[str, Any] = {}
        if path.startswith("s3-"):
            self.opts = {"storage_options": request.getfixturevalue("s3")}
        self.tmp_path = tmp_path
        self.n = 0

    def target(self) -> str | Path:
        self.n += 1
        if self.path.startswith("s3-"):
            return f"s3://ckpts/{uuid.uuid4().hex[:12]}/c{self.n}"
        return self.tmp_path / f"c{self.n}"

    def read_options(self) -> dict[str, Any]:
        return dict(self.opts)

    def save(
        self,
        target: str | Path | None = None,
        *,
        backend: HostBackend | None = None,
        shape: tuple[int, int] = SHAPE,
        extra: dict[str, Any] | None = None,
        **options: Any,
    ) -> str | Path:
        """Save with ``options`` along this path; returns the checkpoint's location."""
        target = self.target() if target is None else target
        options = {**self.opts, **options}

        def state(rank: int = 0) -> dict[str, Any]:
            return make_state(self.kind, rank, backend=backend, shape=shape, extra=extra)

        if self.kind == "ranks":

            def one(c: Any) -> None:
                if self.how == "save":
                    gpuckpt.save(state(c.rank), target, coordinator=c, **options)
                else:
                    gpuckpt.async_save(state(c.rank), target, coordinator=c, **options).result(timeout=60)

            run_ranks(2, one)
            return target
        if self.how == "save":
            gpuckpt.save(state(), target, **options)
        elif self.how == "async":
            gpuckpt.async_save(state(), target, **options).result(timeout=60)
        else:
            assert isinstance(target, Path)
            with CheckpointManager(target, async_save=self.how == "manager-async", **options) as mgr:
                assert mgr.save(1, state())
            return mgr.step_path(1)
        return target


@pytest.fixture
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    return Where(request.param, tmp_path, request)


def on(paths: list[str]) -> Any:
    return pytest.mark.parametrize("where", paths, indirect=True)


#: the names of gpuckpt's I/O threads start with these
IO_THREADS = ("gpuckpt-write", "gpuckpt-read", "gpuckpt-reshard")


class Recorder:
    """A progress callback that keeps every call and the thread that made it.

    With ``hold``, the first report of each I/O thread holds that thread for a
    moment: the jobs queued meanwhile then go to other threads wherever the
    pool may start more, so that a bound on the threads shows whatever the
    timing of the I/O.
    """

    def __init__(self, hold: float = 0.0) -> None:
        self.calls: list[tuple[int, int]] = []
        self.threads: set[threading.Thread] = set()
        self.hold = hold

    def __call__(self, done: int, total: int) -> None:
        me = threading.current_thread()
        self.calls.append((done, total))
        if self.hold and me not in self.threads and me.name.startswith(IO_THREADS):
            time.sleep(self.hold)
        self.threads.add(me)

    def io_threads(self, prefix: str) -> set[threading.Thread]:
        return {t for t in self.threads if t.name.startswith(prefix)}


@on(ALL)
def test_chunk_bytes_sets_the_chunk_grid(where: Where) -> None:
    loc = where.save(chunk_bytes=4096)
    chunks = gpuckpt.read_metadata(loc, **where.read_options()).state_dict_metadata["w"].chunks  # type: ignore[union-attr]
    assert max(math.prod(c.sizes) * 4 for c in chunks) <= 4096
    assert len(chunks) == math.prod(SHAPE) * 4 // 4096


@on(ALL)
def test_progress_is_called_until_done(where: Where) -> None:
    rec = Recorder()
    where.save(progress=rec)
    finals = sorted(t for d, t in rec.calls if d == t and t > 0)
    # each rank counts the bytes it writes
    want = [CUT * 1024, (SHAPE[0] - CUT) * 1024] if where.kind == "ranks" else [math.prod(SHAPE) * 4]
    assert finals == want
    assert all(0 <= d <= t for d, t in rec.calls)


@on(ALL)
def test_threads_bounds_the_writing_threads(where: Where) -> None:
    # 128 one-row chunks: two batches of host chunks (or 128 staged ones), which more
    # threads than one would share
    rec = Recorder(hold=0.05)
    where.save(shape=(128, 256), chunk_bytes=1024, threads=1, progress=rec, sync="none")
    writers = rec.io_threads("gpuckpt-write")
    assert 1 <= len(writers) <= world_of(where.path)


@on([p for p in LOCAL if SAVE_PATHS[p][1] != "ranks"])
def test_sync_mode_decides_the_fsyncs(where: Where, monkeypatch: pytest.MonkeyPatch) -> None:
    # (ranks other than the first write with sync="file" whatever the option says)
    wait_all()
    fsyncs: list[int] = []
    real = os.fsync

    def counted(fd: int) -> None:
        fsyncs.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counted)
    # the native small-file batches fsync in C: count the files they are asked to fsync
    lib = batchio.instance()
    if lib is not None:

        class Counting:
            def __getattr__(self, name: str) -> Any:
                return getattr(lib, name)

            def write(self, root: str, kinds: list[int], *args: Any, fsync: str | None, **kw: Any) -> Any:
                if fsync is not None:
                    fsyncs.extend(-1 for k in kinds if k != batchio.MKDIR)
                return lib.write(root, kinds, *args, fsync=fsync, **kw)  # type: ignore[union-attr]

        monkeypatch.setattr(batchio, "instance", Counting)
    where.save(sync="none", chunk_bytes=4096)
    assert fsyncs == []
    where.save(sync="file", chunk_bytes=4096)
    assert len(fsyncs) >= math.prod(SHAPE) * 4 // 4096  # at least one per chunk file


@on(ALL)
def test_allow_pickle_stores_other_values(where: Where) -> None:
    loc = where.save(allow_pickle=True, extra={"odd": {1, 2}})
    assert gpuckpt.load_state_dict(loc, allow_pickle=True, **where.read_options())["odd"] == {1, 2}


@on([p for p in ALL if not SAVE_PATHS[p][0].startswith("manager")])
def test_overwrite_replaces_an_existing_checkpoint(where: Where) -> None:
    loc = where.save(extra={"round": 1})
    if where.path.startswith("s3-"):
        # object storage refuses to replace a checkpoint, and says that it was asked to
        with pytest.raises(Exception, match="overwrite=True cannot replace it"):
            where.save(loc, overwrite=True, extra={"round": 2})
        return
    where.save(loc, overwrite=True, extra={"round": 2})
    assert gpuckpt.load_state_dict(loc, **where.read_options())["round"] == 2


DEVICE_STAGED = [
    "save-device",
    "save-sharded",
    "save-ranks",
    "async-device",
    "async-sharded",
    "manager",
    "manager-async",
]


@on(DEVICE_STAGED)
def test_staging_bytes_bounds_the_copies_in_flight(where: Where) -> None:
    # one 4 KiB staging buffer: a device chunk is copied out only once the previous one is
    # written; without the bound, the slow copies of many chunks are queued at once
    backend = CountingBackend()
    staging = {"staging": "device"} if where.how in ("async", "manager-async") else {}
    loc = where.save(backend=backend, chunk_bytes=4096, staging_bytes=4096, sync="none", **staging)
    assert backend.calls.count("stage_out") == math.prod(SHAPE) * 4 // 4096
    assert backend.max_in_flight == 1
    assert np.array_equal(gpuckpt.load_state_dict(loc)["w"], full())


ASYNC_DEVICE = ["async-device", "async-sharded", "async-ranks", "manager-async", "manager-async-sharded"]


@pytest.mark.parametrize("staging", ["host", "device"])
@on(ASYNC_DEVICE)
def test_staging_decides_where_the_snapshot_is_taken(where: Where, staging: str) -> None:
    backend = CountingBackend()
    loc = where.save(backend=backend, staging=staging, sync="none")
    if staging == "host":
        assert "copy_many_on_device" not in backend.calls and "copy_on_device" not in backend.calls
        assert "snapshot_to_host" in backend.calls
    else:
        assert "copy_many_on_device" in backend.calls
        assert "snapshot_to_host" not in backend.calls
    assert np.array_equal(gpuckpt.load_state_dict(loc)["w"], full())


SHARDED = [p for p in ALL if SAVE_PATHS[p][1] in ("sharded", "ranks")]


@on(SHARDED)
def test_portable_gives_a_regular_grid_for_uneven_boxes(where: Where) -> None:
    def grid(loc: str | Path) -> str:
        md = gpuckpt.read_metadata(loc, **where.read_options())
        return str(md.storage_data["tensors"]["w"]["chunk_grid"]["name"])

    assert grid(where.save()) == "rectilinear"  # boxes of 20 and 44 rows
    assert grid(where.save(portable=True)) == "regular"


@on([p for p in ALL if p.startswith("s3-")])
def test_storage_options_reach_the_s3_client(where: Where) -> None:
    bad = {**where.opts["storage_options"], "no_such_setting": 1}
    with pytest.raises(Exception, match="not valid S3 settings"):
        where.save(storage_options=bad)
    # and the good ones reach the server (nothing else names it)
    loc = where.save()
    assert np.array_equal(gpuckpt.load_state_dict(loc, **where.read_options())["w"], full())


@pytest.mark.parametrize(
    ("option", "value", "why"),
    [
        ("overwrite", True, "never overwrites"),
        ("storage_options", {"endpoint_url": "http://127.0.0.1:9"}, "local directory"),
        ("coordinator", "mpi", "must be a gpuckpt.distributed.Coordinator"),
        ("chunk_size", 1, "expected some of"),
    ],
)
def test_manager_refuses_options_it_cannot_use(tmp_path: Path, option: str, value: Any, why: str) -> None:
    with pytest.raises(TypeError, match=why):
        CheckpointManager(tmp_path, **{option: value})


@pytest.mark.parametrize(
    ("option", "value", "error", "why"),
    [
        ("save_interval_steps", None, ValueError, r"save_interval_steps must be an integer >= 1, got None"),
        ("save_interval_steps", 0, ValueError, r"save_interval_steps must be an integer >= 1, got 0"),
        ("max_to_keep", 0, ValueError, r"max_to_keep must be an integer >= 1 or None"),
        ("local_dir", True, TypeError, r"local_dir must be a directory path .* got bool"),
        ("local_dir", 3, TypeError, r"local_dir must be a directory path .* got int"),
    ],
)
def test_manager_arguments_of_the_wrong_type_are_refused_by_name(
    tmp_path: Path, option: str, value: Any, error: type[Exception], why: str
) -> None:
    # save_interval_steps=None once failed at the first save ("unsupported operand type(s) for %")
    with pytest.raises(error, match=why):
        CheckpointManager(tmp_path / "r", **{option: value})
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value", [True, "mpi", 3, object()])
def test_a_coordinator_that_is_not_one_is_a_type_error_on_every_path(tmp_path: Path, value: Any) -> None:
    # a save once failed on it with "'bool' object has no attribute 'all_reduce_errors'"
    state = {"w": np.zeros(4, np.float32)}
    gpuckpt.save(state, tmp_path / "good")
    calls = [
        lambda: gpuckpt.save(state, tmp_path / "a", coordinator=value),
        lambda: gpuckpt.async_save(state, tmp_path / "b", coordinator=value),
        lambda: gpuckpt.load(state, tmp_path / "good", coordinator=value),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="coordinator must be a gpuckpt.distributed.Coordinator"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good"]  # nothing written, nothing left


# -- load paths ------------------------------------------------------------------------------

LOAD_PATHS = [
    "load",
    "load-device",
    "load_state_dict",
    "load_state_dict-device",
    "load-sharded",
    "load-ranks",
    "restore",
    "restore_state_dict",
    "s3-load",
    "s3-load_state_dict",
]


class Loader:
    """A checkpoint saved for a load path, and the load along that path."""

    def __init__(self, path: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
        self.path = path
        self.opts: dict[str, Any] = {}
        self.tmp_path = tmp_path
        self.request = request
        if path.startswith("s3-"):
            self.opts = {"storage_options": request.getfixturevalue("s3")}
        self.world = 2 if path == "load-ranks" else 1

    def saved(self, *, shape: tuple[int, int] = SHAPE, chunk_bytes: int = 4096, **extra: Any) -> str | Path:
        state = {"w": full(shape), "step": 3, **extra}
        if self.path.startswith("s3-"):
            loc: str | Path = f"s3://ckpts/{uuid.uuid4().hex[:12]}/c"
        elif self.path.startswith("restore"):
            loc = self.tmp_path / "root" / "step_00000001"
        else:
            loc = self.tmp_path / "c"
        gpuckpt.save(state, loc, chunk_bytes=chunk_bytes, allow_pickle=True, sync="none", **self.opts)
        return loc

    def load(
        self,
        loc: str | Path,
        *,
        backend: HostBackend | None = None,
        shape: tuple[int, int] = SHAPE,
        extra: dict[str, Any] | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """Load with ``options``; returns the state loaded (``w`` as a NumPy array)."""
        options = {**self.opts, **options}
        p = self.path
        if p.startswith("restore"):
            mgr = CheckpointManager(Path(loc).parent)
            if p == "restore_state_dict":
                return mgr.restore_state_dict(**options)
            state = {"w": np.zeros(shape, np.float32), "step": None, **(extra or {})}
            assert mgr.restore(state, **options) == 1
            return state
        if p.endswith("load_state_dict") or p == "load_state_dict-device":
            device = backend if p.endswith("-device") else "cpu"
            out = gpuckpt.load_state_dict(loc, device=device, **options)
            if p.endswith("-device"):
                out["w"] = np.asarray(out["w"])
            return out
        if p == "load-ranks":
            g = np.zeros(shape, np.float32)
            bounds = [(0, CUT), (CUT, shape[0])]

            def one(c: Any) -> dict[str, Any]:
                lo, hi = bounds[c.rank]
                s = {"w": ShardedArray(g[lo:hi], (lo, 0), shape), "step": None, **(extra or {})}
                gpuckpt.load(s, loc, coordinator=c, **options)
                return s

            states = run_ranks(2, one)
            return {**states[0], "w": g}
        w: Any = np.zeros(shape, np.float32)
        target: Any = w
        if p == "load-device":
            assert backend is not None
            target = EmulatedDeviceArray(w, backend)
        elif p == "load-sharded":
            target = [ShardedArray(w[:CUT], (0, 0), shape), ShardedArray(w[CUT:], (CUT, 0), shape)]
        state = {"w": target, "step": None, **(extra or {})}
        gpuckpt.load(state, loc, **options)
        return {**state, "w": w}


@pytest.fixture
def loader(request: pytest.FixtureRequest, tmp_path: Path) -> Loader:
    return Loader(request.param, tmp_path, request)


def loads(paths: list[str]) -> Any:
    return pytest.mark.parametrize("loader", paths, indirect=True)


def backend_for(loader: Loader) -> HostBackend | None:
    return CountingBackend() if loader.path.endswith("-device") else None


@loads([p for p in LOAD_PATHS if "state_dict" not in p])
def test_strict_false_leaves_missing_keys(loader: Loader) -> None:
    loc = loader.saved()
    back = loader.load(loc, backend=backend_for(loader), strict=False, extra={"absent": "kept"})
    assert back["absent"] == "kept" and back["step"] == 3
    assert np.array_equal(back["w"], full())


@loads(LOAD_PATHS)
def test_allow_pickle_loads_pickled_values(loader: Loader) -> None:
    loc = loader.saved(odd={1, 2})
    back = loader.load(loc, backend=backend_for(loader), allow_pickle=True, extra={"odd": None})
    assert back["odd"] == {1, 2}


@loads(LOAD_PATHS)
def test_progress_is_called_until_done_on_load(loader: Loader) -> None:
    loc = loader.saved()
    rec = Recorder()
    loader.load(loc, backend=backend_for(loader), progress=rec)
    want = [CUT * 1024, (SHAPE[0] - CUT) * 1024] if loader.world == 2 else [math.prod(SHAPE) * 4]
    # each rank's load is one count: (0, total) first, done never falls, (total, total) last;
    # no second count of another total (a load once began again at (0, 0) after its tensors)
    assert sorted({t for _, t in rec.calls}) == sorted(want)
    for total in want:
        dones = [d for d, t in rec.calls if t == total]
        assert dones[0] == 0 and dones[-1] == total and dones == sorted(dones)


@loads(LOAD_PATHS)
def test_threads_bounds_the_reading_threads(loader: Loader) -> None:
    shape = (128, 256)
    loc = loader.saved(shape=shape, chunk_bytes=1024)
    rec = Recorder(hold=0.05)
    back = loader.load(loc, backend=backend_for(loader), shape=shape, threads=1, progress=rec)
    readers = rec.io_threads("gpuckpt-read") | rec.io_threads("gpuckpt-reshard")
    assert len(readers) <= loader.world
    assert np.array_equal(back["w"], full(shape))


@loads(["load-device", "load_state_dict-device"])
def test_staging_bytes_bounds_the_copies_in_flight_on_load(loader: Loader) -> None:
    loc = loader.saved(chunk_bytes=4096)
    backend = CountingBackend()
    back = loader.load(loc, backend=backend, staging_bytes=4096, threads=4)
    assert backend.copies == math.prod(SHAPE) * 4 // 4096
    assert backend.max_in_flight == 1
    assert np.array_equal(back["w"], full())


@loads([p for p in LOAD_PATHS if p.startswith("s3-")])
def test_storage_options_reach_the_s3_client_on_load(loader: Loader) -> None:
    loc = loader.saved()
    bad = {**loader.opts["storage_options"], "no_such_setting": 1}
    with pytest.raises(ValueError, match="not valid S3 settings"):
        loader.load(loc, storage_options=bad)
    with pytest.raises(ValueError, match="not valid S3 settings"):
        gpuckpt.read_metadata(loc, storage_options=bad)
    assert gpuckpt.read_metadata(loc, **loader.opts).state_dict_metadata["w"].size == SHAPE  # type: ignore[union-attr]


def test_keys_devices_and_paths_that_are_not_such_are_typed_errors(tmp_path: Path) -> None:
    """Each is the typed error of its kind (InvalidOptionError, InvalidPathError, both ValueError
    and TypeError), never a bare one from deep inside; an int key is selected by its digits."""
    gpuckpt.save({1: np.ones(2), "step": 3, "m": {"w": np.zeros(3)}}, tmp_path / "c")
    assert list(gpuckpt.load_state_dict(tmp_path / "c", keys=[1])) == [1]
    assert list(gpuckpt.load_state_dict(tmp_path / "c", keys=1)) == [1]  # (one name, not a list)
    assert list(gpuckpt.load_state_dict(tmp_path / "c", keys="m")["m"]) == ["w"]
    for keys in ([None], [b"step"], [1.5], b"step", {"m": 1}, 7.0, [True]):
        with pytest.raises(gpuckpt.InvalidOptionError, match="keys must"):
            gpuckpt.load_state_dict(tmp_path / "c", keys=keys)  # type: ignore[arg-type]
    for device in ("CPU", "cpu:0", "gpu", "cuda:x", 0):
        with pytest.raises(gpuckpt.InvalidOptionError, match="device"):
            gpuckpt.load_state_dict(tmp_path / "c", device=device)  # type: ignore[arg-type]
    nul = str(tmp_path / "a\0b")
    calls = (
        lambda: gpuckpt.save({"w": np.ones(2)}, nul),
        lambda: gpuckpt.load_state_dict(nul),
        lambda: gpuckpt.read_metadata(nul),
        lambda: verify_checkpoint(nul),
        lambda: CheckpointManager(nul),
    )
    for call in calls:
        with pytest.raises(gpuckpt.InvalidPathError, match="NUL"):
            call()
    long = tmp_path / ("x" * 300)
    for call in (lambda: gpuckpt.load_state_dict(long), lambda: gpuckpt.read_metadata(long)):
        with pytest.raises(gpuckpt.CheckpointNotFoundError):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
