"""The guard of the torch suite (tests/conftest.py): with GPUCKPT_REQUIRE_TORCH=1 no torch test may skip.

Each test runs a fresh pytest on a small test folder whose conftest is a copy
of the suite's, so the hooks act exactly as in `make test`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

INNER_TESTS = """
import pytest

@pytest.mark.torch
def test_torch_skips_inside():
    pytest.skip("no device here")

@pytest.mark.torch
@pytest.mark.skipif(True, reason="switched off")
def test_torch_skip_marker():
    pass

@pytest.mark.torch
def test_torch_runs():
    pass

@pytest.mark.torch
@pytest.mark.xfail(strict=True, reason="known")
def test_torch_expected_failure():
    raise AssertionError

def test_unmarked_may_skip():
    pytest.skip("not a torch test")
"""

INNER_MODULE_SKIP = """
import pytest

torch_extra = pytest.importorskip("torch_extra_that_is_not_installed")

def test_never_collected():
    pass
"""


def run_inner(
    tmp_path: Path,
    files: dict[str, str],
    *,
    require: bool,
    pythonpath: str = "",
    extra: list[str] | None = None,
) -> str:
    """Run pytest on ``files`` next to a copy of the suite's conftest; return its output."""
    folder = tmp_path / "inner"
    folder.mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", folder / "conftest.py")
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    torch: t\n    gpu: g\n")
    for name, text in files.items():
        (folder / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "GPUCKPT_REQUIRE_TORCH"}
    if require:
        env["GPUCKPT_REQUIRE_TORCH"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, str(REPO), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *(extra or []), str(folder)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return f"exit status {done.returncode}\n{done.stdout}{done.stderr}"


def test_without_the_guard_torch_tests_may_skip(tmp_path: Path) -> None:
    out = run_inner(tmp_path, {"test_inner.py": INNER_TESTS}, require=False)
    assert "exit status 0" in out, out
    assert "1 passed, 3 skipped, 1 xfailed" in out, out


def test_the_guard_refuses_to_start_without_torch(tmp_path: Path) -> None:
    # a `torch` module that fails to import stands for an environment without torch
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "torch.py").write_text("raise ImportError('torch is blocked for this test')\n")
    out = run_inner(tmp_path, {"test_inner.py": INNER_TESTS}, require=True, pythonpath=str(blocker))
    assert "exit status 4" in out, out  # pytest's usage error: no test ran
    assert "GPUCKPT_REQUIRE_TORCH=1, but torch does not import" in out, out
    assert "torch is blocked for this test" in out, out


@pytest.mark.torch
def test_the_guard_turns_skipped_torch_tests_into_failures(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # the guard starts only where torch imports
    files = {"test_inner.py": INNER_TESTS, "test_module_skip.py": INNER_MODULE_SKIP}
    out = run_inner(tmp_path, files, require=True, extra=["--continue-on-collection-errors"])
    assert "exit status 1" in out, out
    assert "FAILED test_inner.py::test_torch_skips_inside" in out, out
    # a skip marker acts in setup, so that one is reported as an error
    assert "ERROR test_inner.py::test_torch_skip_marker" in out, out
    assert "it skipped: no device here" in out and "it skipped: switched off" in out, out
    assert "PASSED test_inner.py::test_torch_runs" in out, out
    assert "XFAIL test_inner.py::test_torch_expected_failure" in out, out
    assert "SKIPPED [1] test_inner.py" in out, out  # the unmarked test still skips
    # a module that skips while it is imported, for a reason that names torch
    assert "ERROR test_module_skip.py" in out, out
    assert "could not import 'torch_extra_that_is_not_installed'" in out, out
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 2 errors" in out, out
