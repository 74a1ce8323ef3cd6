"""On the I/O threads of a save, awscrt is loaded only once it pays back.

Its load takes 40-60 ms with the GIL held (seconds where its pages were paged out), during
which every other thread of the run waits: the first save of a process paid it for its
first chunk of 256 KiB or more. On threads of gpuckpt's worker pools large buffers go to
the crc32c package until the process has checksummed LOAD_AFTER_BYTES that way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("awscrt")


def _run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "GPUCKPT_CRC32C"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**full, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


SAVE_AND_LOAD = """
    import sys, numpy as np, gpuckpt
    sd = {"a": np.arange(1 << 18, dtype=np.float32), "b": np.arange(3 << 20, dtype=np.float32).reshape(3, -1),
          "c": np.arange(100_000, dtype=np.float32), "d": np.ones(7, np.float32)}
    gpuckpt.save(sd, sys.argv[1])
    print("_awscrt" in sys.modules)
    out = {k: np.zeros_like(v) for k, v in sd.items()}
    gpuckpt.load(out, sys.argv[1])
    assert all((out[k] == sd[k]).all() for k in sd)
    print("_awscrt" in sys.modules)
"""


def test_a_first_save_and_load_do_not_load_awscrt(tmp_path: Path) -> None:
    r = _run(SAVE_AND_LOAD, str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_a_save_with_awscrt_forced_loads_it(tmp_path: Path) -> None:
    r = _run(SAVE_AND_LOAD, str(tmp_path / "c"), GPUCKPT_CRC32C="awscrt")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"]


def test_awscrt_is_loaded_on_worker_threads_once_it_pays_back() -> None:
    code = """
        import sys, numpy as np
        from gpuckpt.format import checksum
        from gpuckpt.format.checksum import _crc_package, crc32c
        from gpuckpt.runtime.workers import Workers
        checksum.LOAD_AFTER_BYTES = 3 << 20
        data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
        seen = []
        with Workers(2, "test") as pool:
            for i in range(6):
                value = pool.submit(crc32c, data, i).result()
                assert value == _crc_package(data, i)
                seen.append("_awscrt" in sys.modules)
        print(" ".join(map(str, seen)))
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr
    # three 1 MiB buffers by the package, then awscrt
    assert r.stdout.split() == ["False", "False", "False", "True", "True", "True"]


def test_the_callers_own_thread_loads_awscrt_at_the_first_large_buffer() -> None:
    code = """
        import sys, threading, numpy as np
        from gpuckpt.format.checksum import SMALL_BYTES, crc32c
        big = np.arange(SMALL_BYTES, dtype=np.uint8)
        t = threading.Thread(target=crc32c, args=(big,)); t.start(); t.join()
        print("_awscrt" in sys.modules)
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"]
