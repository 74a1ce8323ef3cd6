"""What the first dcp.save and dcp.load of a process through gpuckpt.dcp load besides the data.

A fresh process imports torch, DCP and gpuckpt.dcp, then saves (or loads) CPU tensors:
neither may import the CUDA module (CPU tensors are viewed without it) nor awscrt (whose
load holds the GIL for 40-60 ms, see gpuckpt/format/checksum.py), whatever the sizes
of the chunks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch

STATE = """
    import torch
    state = {
        "mib": torch.arange(262144, dtype=torch.float32),          # a chunk of exactly 1 MiB
        "mid": torch.arange(100_000, dtype=torch.float32),         # 400 KB
        "big": torch.arange(3 << 18, dtype=torch.float32).reshape(768, 1024),  # 3 MiB
        "half": torch.arange(4096, dtype=torch.float32).to(torch.bfloat16),
        "step": torch.tensor(7.0),
    }
"""

SAVE = (
    STATE
    + """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    import gpuckpt.dcp
    before = set(sys.modules)
    dcp.save(state, storage_writer=gpuckpt.dcp.Writer(sys.argv[1]))
    print(" ".join(sorted(m for m in set(sys.modules) - before if m.startswith(("gpuckpt", "_awscrt", "awscrt")))))
"""
)

LOAD = (
    STATE
    + """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    import gpuckpt.dcp
    expected = {k: v.clone() for k, v in state.items()}
    for v in state.values():
        v.zero_()
    before = set(sys.modules)
    dcp.load(state, storage_reader=gpuckpt.dcp.Reader(sys.argv[1]))
    assert all(torch.equal(state[k], expected[k]) for k in state), "loaded tensors differ"
    print(" ".join(sorted(m for m in set(sys.modules) - before if m.startswith(("gpuckpt", "_awscrt", "awscrt")))))
"""
)


def _run(code: str, path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUCKPT_CRC32C", "GPUCKPT_CRCCOPY")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_first_save_and_load_import_neither_the_cuda_module_nor_awscrt(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    r = _run(SAVE, tmp_path / "c")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [], r.stdout
    r = _run(LOAD, tmp_path / "c")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == [], r.stdout
