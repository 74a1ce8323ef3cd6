"""The CRC32C implementations: awscrt (fast) and the crc32c package agree everywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import gpuckpt.format.checksum as checksum
from gpuckpt.format.checksum import _aws_function, _crc_package, crc32c, crc32c_backend

aws = _aws_function()
needs_aws = pytest.mark.skipif(aws is None, reason="awscrt is not installed here")


def test_check_vector_with_the_backend_in_use():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c_backend() in ("awscrt", "crc32c")


def test_awscrt_is_chosen_where_installed():
    # the test environment installs awscrt: the fast path is what the suite exercises
    if aws is None:
        pytest.skip("awscrt is not installed here")
    assert crc32c_backend() == "awscrt"


@needs_aws
@given(data=st.binary(max_size=5000), start=st.integers(0, 2**32 - 1), cut=st.integers(0, 5000))
def test_awscrt_matches_the_crc32c_package(data, start, cut):
    assert aws(data, start) == _crc_package(data, start)
    # continuing from a prefix's value gives the whole buffer's value
    cut = min(cut, len(data))
    assert aws(data[cut:], aws(data[:cut], start)) == _crc_package(data, start)


@needs_aws
@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "uint8", "complex64"])
def test_awscrt_takes_arrays_of_any_dtype_as_bytes(dtype):
    a = (np.arange(70_001) % 251).astype(dtype)
    assert aws(a, 0) == _crc_package(a.tobytes(), 0)
    assert aws(memoryview(a).cast("B")[13:], 5) == _crc_package(a.tobytes()[13:], 5)


@needs_aws
def test_awscrt_rejects_a_strided_buffer():
    with pytest.raises(ValueError, match="C-contiguous"):
        aws(np.arange(100, dtype=np.uint8)[::2], 0)


@needs_aws
def test_awscrt_splits_buffers_above_its_length_limit(monkeypatch):
    # the C library takes an int length; large buffers are fed in pieces
    data = os.urandom(10_007)
    monkeypatch.setattr(checksum, "_AWS_PIECE", 1000)
    assert aws(data, 9) == _crc_package(data, 9)


def _run(code: str, env_value: str | None, block_awscrt: bool = False) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("GPUCKPT_CRC32C", None)
    if env_value is not None:
        env["GPUCKPT_CRC32C"] = env_value
    prelude = "import sys; sys.modules['awscrt'] = None\n" if block_awscrt else ""
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], env=env, capture_output=True, text=True
    )


def test_environment_variable_forces_the_package():
    r = _run("from gpuckpt.format.checksum import crc32c_backend; print(crc32c_backend())", "crc32c")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "crc32c"


def test_without_awscrt_auto_falls_back_and_forcing_it_is_a_clear_error():
    code = "from gpuckpt.format.checksum import crc32c_backend; print(crc32c_backend())"
    r = _run(code, None, block_awscrt=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "crc32c"
    r = _run(code, "awscrt", block_awscrt=True)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "pip install" in r.stderr


def test_unknown_choice_names_the_valid_ones():
    r = _run("from gpuckpt.format.checksum import crc32c; crc32c(b'x')", "fastest")
    assert r.returncode != 0
    assert "GPUCKPT_CRC32C='fastest'" in r.stderr and "'auto', 'awscrt' or 'crc32c'" in r.stderr
    assert "InvalidOptionError" in r.stderr


def test_checkpoints_verify_across_backends(tmp_path):
    # saved with one implementation, loaded (and verified) with the other, both ways
    save = """
        import numpy as np, gpuckpt, sys
        gpuckpt.save({"w": np.arange(300_000, dtype=np.float32), "b": np.ones(7)}, sys.argv[1])
    """
    load = """
        import numpy as np, gpuckpt, sys
        sd = {"w": np.zeros(300_000, np.float32), "b": np.zeros(7)}
        gpuckpt.load(sd, sys.argv[1])
        assert (sd["w"] == np.arange(300_000, dtype=np.float32)).all() and (sd["b"] == 1).all()
        from gpuckpt.format.checksum import crc32c_backend
        print(crc32c_backend())
    """
    choices = ["crc32c", "awscrt"] if aws is not None else ["crc32c", "crc32c"]
    for i, (a, b) in enumerate([(choices[0], choices[1]), (choices[1], choices[0])]):
        path = str(tmp_path / f"c{i}")
        env = {**os.environ, "GPUCKPT_CRC32C": a}
        r = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(save), path], env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        env["GPUCKPT_CRC32C"] = b
        r = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(load), path], env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == b


def test_a_small_save_and_load_do_not_wait_for_awscrt_to_load(tmp_path):
    """Loading awscrt's library takes 40-60 ms, more than a small state's whole save: buffers
    under SMALL_BYTES go to the crc32c package, and awscrt is loaded by the first large one."""
    if aws is None:
        pytest.skip("awscrt is not installed here")
    code = """
        import sys, numpy as np, gpuckpt
        from gpuckpt.format.checksum import SMALL_BYTES, crc32c
        sd = {f"t{i}": np.full(4096 + i, i, np.float32) for i in range(20)}
        gpuckpt.save(sd, sys.argv[1])
        gpuckpt.load(sd, sys.argv[1])
        gpuckpt.load_state_dict(sys.argv[1])
        print("awscrt" in sys.modules)
        big = np.arange(SMALL_BYTES, dtype=np.uint8)
        crc32c(big)
        print("awscrt" in sys.modules)
    """
    r = _run(code.replace("sys.argv[1]", repr(str(tmp_path / "c"))), None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]
