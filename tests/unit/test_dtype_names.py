"""The stored dtype names, and ``ml_dtypes`` imported only when one of its types is needed.

Importing ``ml_dtypes`` costs 0.4 s of CPU with NumPy 2.4 (the last NumPy on Python
3.11): every process that imports gpuckpt (MPI and torch ranks, crash-test children,
workers) paid it before any checkpoint asked for bfloat16.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from gpuckpt.errors import MetadataError, UnsupportedValueError
from gpuckpt.format.dtypes import ML_DTYPE_NAMES, dtype_from_name, dtype_name, is_storable_dtype
from gpuckpt.format.safetensors import SAFETENSORS_DTYPES

REPO = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_save_and_load_of_numpy_dtypes_leave_ml_dtypes_out(tmp_path: Path) -> None:
    out = _run(
        "import sys, numpy as np, gpuckpt\n"
        "seen = ['ml_dtypes' in sys.modules]\n"
        f"p = {str(tmp_path / 'ck')!r}\n"
        "gpuckpt.save({'w': np.arange(6, dtype=np.float32), 'i': np.ones(3, np.int8), 'n': 1}, p)\n"
        "seen.append('ml_dtypes' in sys.modules)\n"
        "sd = gpuckpt.load_state_dict(p)\n"
        "assert sd['w'].tolist() == list(range(6)) and sd['n'] == 1\n"
        "seen.append('ml_dtypes' in sys.modules)\n"
        "print(seen)\n"
    )
    assert out == "[False, False, False]"


def test_a_bfloat16_checkpoint_loads_in_a_process_that_never_imported_ml_dtypes(tmp_path: Path) -> None:
    import gpuckpt

    w = np.linspace(-2, 2, 12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4)
    gpuckpt.save({"w": w}, tmp_path / "ck")
    out = _run(
        "import sys, gpuckpt\n"
        f"sd = gpuckpt.load_state_dict({str(tmp_path / 'ck')!r})\n"
        "print(sd['w'].dtype, sd['w'].astype('float32').ravel().tolist())\n"
    )
    assert out == f"bfloat16 {w.astype(np.float32).ravel().tolist()}"


def test_names_map_both_ways_for_every_storable_dtype() -> None:
    for name in ML_DTYPE_NAMES:
        dt = np.dtype(getattr(ml_dtypes, name))
        assert dtype_from_name(name) == dt and dtype_name(dt) == name == dtype_name(name)
        assert is_storable_dtype(dt) and is_storable_dtype(name)
    assert dtype_name(np.dtype(">f4")) == "float32"  # stored little-endian, named as native
    assert SAFETENSORS_DTYPES["BF16"] == np.dtype(ml_dtypes.bfloat16)
    assert "BF16" in SAFETENSORS_DTYPES and "F4" not in SAFETENSORS_DTYPES and len(SAFETENSORS_DTYPES) == 17


def test_unknown_names_and_dtypes_are_typed_errors_that_list_every_known_name() -> None:
    with pytest.raises(MetadataError, match=r"unknown stored data type 'float4'.*bfloat16.*float32"):
        dtype_from_name("float4")
    with pytest.raises(UnsupportedValueError, match=r"dtype <U3 cannot be stored.*float8_e5m2.*uint8"):
        dtype_name(np.dtype("U3"))
    assert not is_storable_dtype(object) and not is_storable_dtype("not-a-dtype")
