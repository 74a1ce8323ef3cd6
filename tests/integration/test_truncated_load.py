"""A chunk file truncated while a load copies it out of its memory map: a typed error, never a crash.

Cached chunks of 1 MiB and more are loaded through a memory map (gpuckpt/storage/local/crccopy.c).
A file truncated after its size was checked (``cp``, ``rsync --inplace`` or ``: > file`` over
a checkpoint during a load) turns the copy's next read into SIGBUS, which used to kill the
process. Here the truncation happens at the worst moment on every run, after the map is made
and its pages were found cached and before a byte is copied, through an LD_PRELOAD library
(``truncate_on_mmap.c``) that wraps ``mmap`` and ``mincore``. Everything that could crash runs in a subprocess, so that a crash fails the
test instead of ending the test run.

Also checked: a SIGBUS outside a copy still takes its default action or reaches Python's
``faulthandler``, whichever was installed, and copies on many threads at once, some of them
interrupted, each get their own outcome.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import CheckpointCorruptedError, GpuckptError
from gpuckpt.storage.local import crccopy, fsutil
from gpuckpt.storage.local.crccopy import CrcCopy

pytestmark = pytest.mark.skipif(
    not crccopy.available(), reason="the native copy-with-CRC loop is not built here"
)

SHIM_SOURCE = Path(__file__).with_name("truncate_on_mmap.c")
CRCCOPY_SOURCE = Path(crccopy.__file__).with_name("crccopy.c")
SHAPE = (1024, 2048)  # float32: one chunk of 8 MiB, well above the 1 MiB of the mapped path


def _cc() -> str:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler: the mmap shim cannot be built here")
    return cc


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shim") / "truncate_on_mmap.so"
    subprocess.run(
        [_cc(), "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(out), str(SHIM_SOURCE), "-ldl"], check=True
    )
    return out


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, faulthandler off unless the code enables it."""
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONFAULTHANDLER", "LD_PRELOAD")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _truncating(shim: Path, under: Path, to: int = 0) -> dict[str, str]:
    """Environment under which every file below ``under`` is truncated to ``to`` bytes once mapped
    (by the copy loop: once its pages were found cached)."""
    return {"LD_PRELOAD": str(shim), "GCK_TRUNCATE_DIR": str(under), "GCK_TRUNCATE_TO": str(to)}


def _survived(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON the child printed last; a failure naming the signal if it was killed."""
    if done.returncode < 0:
        pytest.fail(
            f"the process was killed by {signal.Signals(-done.returncode).name} "
            f"(exit {done.returncode}); stderr:\n{done.stderr[-3000:]}"
        )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _write_cached(path: Path, data: bytes) -> None:
    """A file whose bytes are in the page cache (written through it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


LOAD = """
    import json, sys
    from pathlib import Path
    import numpy as np
    import gpuckpt
    from gpuckpt.errors import GpuckptError
    from gpuckpt.storage.local import crccopy

    path, how, shape = sys.argv[1], sys.argv[2], tuple(json.loads(sys.argv[3]))
    assert crccopy.available(), "the mapped path must be the one under test"
    for f in Path(path, "big").iterdir():  # in the page cache now (whatever ran beside evicted):
        f.read_bytes()  # the mapped path is the one a load takes
    try:
        if how == "load":
            target = {"big": np.zeros(shape, np.float32), "small": np.zeros(100, np.float32)}
            gpuckpt.load(target, path)
        else:
            gpuckpt.load_state_dict(path)
        outcome = {"error": None}
    except GpuckptError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["faults"] = crccopy.faults()
    print(json.dumps(outcome))
"""


@pytest.fixture(params=["disk", "tmpfs"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Where the checkpoint lies: the test's directory (its pages cached, probed with mincore
    before the copy) or a tmpfs directory (a local tier: its maps populated, not probed)."""
    if request.param == "disk":
        yield tmp_path
        return
    shm = Path("/dev/shm")
    if not shm.is_dir() or not fsutil.memory_backed(shm):
        pytest.skip("no tmpfs at /dev/shm")
    d = Path(tempfile.mkdtemp(prefix="gpuckpt-test-", dir=shm))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("how", ["load", "load_state_dict"])
@pytest.mark.parametrize("keep", ["emptied", "half left"])
def test_a_chunk_truncated_during_the_copy_raises_the_typed_error(
    where: Path, shim: Path, monkeypatch: pytest.MonkeyPatch, how: str, keep: str
) -> None:
    rng = np.random.default_rng(7)
    state = {
        "big": rng.standard_normal(SHAPE).astype(np.float32),
        "small": rng.standard_normal(100).astype(np.float32),
    }
    path = where / "ckpt"
    gpuckpt.save(state, path, chunk_bytes=1 << 24)  # written through the page cache: cached
    (chunk,) = [p for p in (path / "big").iterdir() if p.name.startswith("c")]
    size = chunk.stat().st_size
    to = 0 if keep == "emptied" else size // 2

    done = _run(LOAD, str(path), how, json.dumps(SHAPE), env=_truncating(shim, path / "big", to))

    outcome = _survived(done)
    assert chunk.stat().st_size == to, "the file was truncated under the map"
    assert outcome["faults"] >= 1, "the copy out of the map met the truncation (the guarded path ran)"
    named = f"chunk {chunk.name} of tensor 'big'"
    assert outcome["error"] == "CheckpointCorruptedError", outcome
    assert named in outcome["message"] and "truncated" in outcome["message"], outcome["message"]

    # the same file read without the map (pread): the same typed error
    monkeypatch.setenv("GPUCKPT_CRCCOPY", "off")
    crccopy._instance.cache_clear()
    try:
        with pytest.raises(GpuckptError) as caught:
            if how == "load":
                gpuckpt.load({"big": np.zeros(SHAPE, np.float32), "small": np.zeros(100, np.float32)}, path)
            else:
                gpuckpt.load_state_dict(path)
    finally:
        monkeypatch.delenv("GPUCKPT_CRCCOPY")
        crccopy._instance.cache_clear()
    assert isinstance(caught.value, CheckpointCorruptedError)
    assert type(caught.value).__name__ == outcome["error"]
    assert named in str(caught.value) and "truncated" in str(caught.value)


def test_an_intact_checkpoint_under_the_shim_loads_through_the_map(tmp_path: Path, shim: Path) -> None:
    """The shim truncates only under its directory: elsewhere the mapped path runs as usual."""
    state = {"big": np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)}
    path = tmp_path / "ckpt"
    gpuckpt.save(state, path, chunk_bytes=1 << 24)
    code = """
        import json, sys
        import numpy as np
        import gpuckpt
        from gpuckpt.storage.local import crccopy

        calls = []
        real = crccopy.cached_copy_crc
        def spy(*args):
            got = real(*args)
            calls.append(got is not None)
            return got
        crccopy.cached_copy_crc = spy
        got = gpuckpt.load_state_dict(sys.argv[1])["big"]
        print(json.dumps({"sum": float(got.sum(dtype=np.float64)), "calls": calls, "faults": crccopy.faults()}))
    """
    outcome = _survived(_run(code, str(path), env=_truncating(shim, tmp_path / "elsewhere")))
    assert outcome["calls"] == [True] and outcome["faults"] == 0
    assert outcome["sum"] == float(state["big"].sum(dtype=np.float64))


FAULT_OUTSIDE = """
    import faulthandler, json, mmap, os, sys
    from gpuckpt.storage.local import crccopy

    intact, victim, outside, when = sys.argv[1:5]
    if when == "before":
        faulthandler.enable()

    def copy(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            return crccopy.cached_copy_crc(fd, 0, memoryview(bytearray(os.fstat(fd).st_size)))
        finally:
            os.close(fd)

    assert copy(intact) is not None  # the library's handler is installed by now
    if when == "after":
        faulthandler.enable()  # installed over the library's handler
    assert copy(victim) is None and crccopy.faults() == 1, "a fault inside a copy is still caught"
    assert copy(intact) is not None
    print("outside", flush=True)
    with open(outside, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    os.truncate(outside, 0)
    m[len(m) // 2]  # SIGBUS, outside any copy
    print("survived a SIGBUS outside the copy", flush=True)
"""


@pytest.mark.parametrize("faulthandler", ["off", "before", "after"])
def test_a_sigbus_outside_a_copy_reaches_the_handler_installed_before(
    tmp_path: Path, shim: Path, faulthandler: str
) -> None:
    """Default action (killed by SIGBUS), or faulthandler's report then the default action,
    whether faulthandler was enabled before the library installed its handler or after."""
    data = os.urandom(2 << 20)
    intact, victim, outside = tmp_path / "intact", tmp_path / "victims" / "chunk", tmp_path / "outside"
    for p in (intact, victim, outside):
        _write_cached(p, data)
    done = _run(
        FAULT_OUTSIDE,
        str(intact),
        str(victim),
        str(outside),
        faulthandler,
        env=_truncating(shim, tmp_path / "victims"),
    )
    assert "outside" in done.stdout, done.stderr[-3000:]
    assert "survived" not in done.stdout
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr[-3000:])
    reports = done.stderr.count("Fatal Python error: Bus error")
    if faulthandler == "off":
        assert reports == 0, done.stderr
    else:
        assert reports == 1, done.stderr  # reported once, not passed around in a loop
        assert 'File "<string>"' in done.stderr  # with the Python traceback of the fault


THREADS = """
    import json, os, sys, threading
    import numpy as np
    from gpuckpt.storage.local import crccopy
    from gpuckpt.format.checksum import crc32c

    root, rounds, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    failures, expected_faults = [], []

    def worker(i):
        victim = i % 2 == 0
        path = os.path.join(root, "victims" if victim else "intact", f"chunk{i}")
        data = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
        for r in range(rounds):
            if victim or r == 0:
                with open(path, "wb") as f:
                    f.write(data)
            out = bytearray(size)
            fd = os.open(path, os.O_RDONLY)
            try:
                got = crccopy.cached_copy_crc(fd, 0, memoryview(out))
            finally:
                os.close(fd)
            if victim:
                expected_faults.append(1)
                if got is not None:
                    failures.append(f"thread {i} round {r}: a truncated copy returned {got}")
            elif got != crc32c(data) or out != data:
                failures.append(f"thread {i} round {r}: an intact copy came back wrong ({got})")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"failures": failures, "faults": crccopy.faults(), "expected": len(expected_faults)}))
"""


def test_copies_on_many_threads_each_get_their_own_outcome(tmp_path: Path, shim: Path) -> None:
    """Eight threads copy at once (the GIL is released), every other one from files truncated
    under it: each interrupted copy returns None, each intact one its bytes and CRC."""
    (tmp_path / "victims").mkdir()
    (tmp_path / "intact").mkdir()
    done = _run(THREADS, str(tmp_path), "12", str(2 << 20), env=_truncating(shim, tmp_path / "victims"))
    outcome = _survived(done)
    assert outcome["failures"] == []
    assert outcome["faults"] == outcome["expected"] == 4 * 12


TWO_LIBRARIES = """
    import json, os, sys
    from gpuckpt.storage.local.crccopy import CrcCopy

    intact, victim, outside = sys.argv[1:4]
    libs = [CrcCopy(p) for p in sys.argv[4:]]
    for lib, isa in zip(libs, ["avx512", "pclmul"]):
        assert lib.limit(isa) == isa, isa

    def copy(lib, path):
        fd = os.open(path, os.O_RDONLY)
        try:
            return lib.cached_copy_crc(fd, 0, memoryview(bytearray(os.fstat(fd).st_size)))
        finally:
            os.close(fd)

    def rewrite(path):
        with open(path, "wb") as f:
            f.write(bytes(range(256)) * 8192)

    ok = []
    for lib in libs + libs[::-1]:  # each installs its handler over the other's in turn
        ok.append(copy(lib, intact) is not None)
        rewrite(victim)
        ok.append(copy(lib, victim) is None)
    print(json.dumps({"ok": ok, "faults": [lib.faults for lib in libs]}), flush=True)
    import mmap
    with open(outside, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    os.truncate(outside, 0)
    m[100]
"""


def test_each_instruction_set_path_of_the_source_survives_a_truncation(tmp_path: Path, shim: Path) -> None:
    """The C function itself, built from the source (as tests/unit/test_crccopy.py does): each
    vector path, two copies of the library in one process chaining to each other, and a fault
    outside both still ends in the default action (no loop between the two handlers)."""
    built = tmp_path / "_crccopy.so"
    subprocess.run(
        [
            _cc(),
            "-O2",
            "-std=gnu11",
            "-Wall",
            "-Werror",
            "-shared",
            "-fPIC",
            "-o",
            str(built),
            str(CRCCOPY_SOURCE),
        ],
        check=True,
    )
    if CrcCopy(built).isa != "avx512":
        pytest.skip("this CPU has no AVX-512 path: the two-path test needs both")
    copies = []
    for isa in ("avx512", "pclmul"):  # copies under other names load as separate libraries
        copies.append(tmp_path / f"_crccopy_{isa}.so")
        shutil.copy(built, copies[-1])
    data = bytes(range(256)) * 8192
    intact, victim, outside = tmp_path / "intact", tmp_path / "victims" / "chunk", tmp_path / "outside"
    for p in (intact, outside):
        _write_cached(p, data)
    victim.parent.mkdir()
    done = _run(
        TWO_LIBRARIES,
        str(intact),
        str(victim),
        str(outside),
        *map(str, copies),
        env=_truncating(shim, tmp_path / "victims"),
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"no output (exit {done.returncode}); stderr:\n{done.stderr[-3000:]}"
    outcome = json.loads(lines[-1])
    assert all(outcome["ok"]), outcome
    assert outcome["faults"] == [2, 2]
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr[-3000:])


MEMMAP_TARGET = """
    import errno, json, sys
    import numpy as np
    import gpuckpt
    from gpuckpt.storage.local import crccopy

    path, target_file, shape = sys.argv[1], sys.argv[2], tuple(json.loads(sys.argv[3]))
    target = np.memmap(target_file, dtype=np.float32, mode="r+", shape=shape)  # truncated as it is mapped
    try:
        gpuckpt.load({"big": target}, path)
        outcome = {"error": None}
    except OSError as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["faults"] = crccopy.faults()
    print(json.dumps(outcome))
"""


def test_a_target_memmap_truncated_under_the_copy_fails_without_a_crash(tmp_path: Path, shim: Path) -> None:
    """The copy writes into a memory map of the target's file, which shrinks: a fault on the
    destination is caught as well, and the read again with pread fails as pread does."""
    path = tmp_path / "ckpt"
    gpuckpt.save({"big": np.ones(SHAPE, np.float32)}, path, chunk_bytes=1 << 24)
    target = tmp_path / "targets" / "big.f32"
    target.parent.mkdir()
    np.zeros(SHAPE, np.float32).tofile(target)
    done = _run(
        MEMMAP_TARGET, str(path), str(target), json.dumps(SHAPE), env=_truncating(shim, tmp_path / "targets")
    )
    outcome = _survived(done)
    assert target.stat().st_size == 0
    assert outcome["faults"] == 1
    assert outcome["error"] is not None, "a load into memory that is gone cannot succeed"
