"""Loads never wait for awscrt to load: chunks of 256 KiB and more are checksummed by the
native library of batchio where crc32c()'s library for large buffers is not loaded yet.

awscrt takes 40-60 ms to load (its random generator starts by measuring CPU jitter), with
the GIL held: the first load of a process with one chunk of 256 KiB to 1 MiB stopped every
thread of the load for that long.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gpuckpt
from gpuckpt.errors import CheckpointCorruptedError
from gpuckpt.format.checksum import SMALL_BYTES, _crc_package, large_backend_ready
from gpuckpt.storage.local import batchio
from gpuckpt.storage.local.reader import _crc

pytestmark = pytest.mark.skipif(
    not batchio.available(), reason="the native batchio library is not built here"
)

# a chunk of exactly 1 MiB (read alone, then checksummed), one of 400 KB (a native batch),
# one of 3 MiB (read piece by piece without the copy-with-CRC loop) and a small one
SHAPES = {"mib": (262144,), "mid": (100_000,), "big": (786_432,), "b": (10,)}

LOAD = """
    import sys, numpy as np, gpuckpt
    shapes = {shapes!r}
    sd = {{k: np.zeros(s, np.float32) for k, s in shapes.items()}}
    gpuckpt.load(sd, sys.argv[1])
    for k, s in shapes.items():
        assert (sd[k] == np.arange(s[0], dtype=np.float32)).all(), k
    whole = gpuckpt.load_state_dict(sys.argv[1])
    assert all((whole[k] == sd[k]).all() for k in shapes)
    print("_awscrt" in sys.modules)
"""


def _state() -> dict[str, np.ndarray]:
    return {k: np.arange(s[0], dtype=np.float32) for k, s in SHAPES.items()}


def _load(path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(LOAD.format(shapes=SHAPES))
    full = {k: v for k, v in os.environ.items() if k != "GPUCKPT_CRC32C"}
    return subprocess.run(
        [sys.executable, "-c", code, str(path)],
        env={**full, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("crccopy", ["auto", "off"])
def test_a_first_load_does_not_load_awscrt(tmp_path: Path, crccopy: str) -> None:
    gpuckpt.save(_state(), tmp_path / "c")
    r = _load(tmp_path / "c", GPUCKPT_CRCCOPY=crccopy)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False"]


def test_awscrt_chosen_by_the_environment_is_used(tmp_path: Path) -> None:
    pytest.importorskip("awscrt")
    gpuckpt.save(_state(), tmp_path / "c")
    r = _load(tmp_path / "c", GPUCKPT_CRC32C="awscrt", GPUCKPT_CRCCOPY="off")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True"]


@pytest.mark.parametrize("name", ["mib", "mid", "big"])
def test_damage_is_still_found_by_the_native_checksum(tmp_path: Path, name: str) -> None:
    gpuckpt.save(_state(), tmp_path / "c")
    chunk = tmp_path / "c" / name / "c.0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    chunk.write_bytes(raw)
    code = textwrap.dedent(
        """
        import sys, numpy as np, gpuckpt
        from gpuckpt.errors import CheckpointCorruptedError
        sd = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
        try:
            gpuckpt.load(sd, sys.argv[1])
        except CheckpointCorruptedError as exc:
            print(type(exc).__name__, "_awscrt" in sys.modules)
        """
    ).replace("SHAPES", repr(SHAPES))
    for crccopy in ("auto", "off"):
        env = {**os.environ, "GPUCKPT_CRCCOPY": crccopy}
        env.pop("GPUCKPT_CRC32C", None)
        r = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "c")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[-1] == "False", (crccopy, r.stdout)
        assert issubclass(getattr(gpuckpt.errors, r.stdout.split()[0]), CheckpointCorruptedError)


@pytest.mark.parametrize("n", [0, 1, SMALL_BYTES - 1, SMALL_BYTES, SMALL_BYTES + 7, 3 << 20])
@pytest.mark.parametrize("start", [0, 0x9ABCDEF0])
def test_the_read_checksum_is_crc32c_whichever_library(n: int, start: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert _crc(data, start) == _crc_package(data, start)
    assert _crc(memoryview(data)[1:], start) == _crc_package(memoryview(data)[1:], start)


def test_ready_means_no_library_load_is_left() -> None:
    # in this process the CRC choice may or may not be made; either way the answer is the cache's
    from gpuckpt.format import checksum

    checksum.crc32c_backend()
    assert large_backend_ready()
