"""``gpuckpt.__version__`` is the version of the installed distribution, not a second copy."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import gpuckpt

PACKAGE_ROOT = Path(gpuckpt.__file__).resolve().parents[1]  # the gpuckpt under test


def test_version_is_the_installed_distributions() -> None:
    assert gpuckpt.__version__ == importlib.metadata.version("gpuckpt")


def test_version_follows_the_distribution_found(tmp_path: Path) -> None:
    # the metadata of another release, first on the path: the package reports that release
    info = tmp_path / "gpuckpt-9.8.7.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gpuckpt\nVersion: 9.8.7\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import gpuckpt; print(gpuckpt.__version__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(PACKAGE_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "9.8.7"
