"""Build hook: compile gpuckpt/storage/crccopy.c into _crccopy.so where a C compiler is available.

The library is optional (gpuckpt falls back to pread + a CRC32C library), so a
missing compiler or a failed build prints a warning and the build goes on. A
wheel that contains the library is tagged for this platform; one without it
stays pure Python. An editable install builds it in place, next to its source.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = Path("gpuckpt/storage/crccopy.c")
TARGET = "gpuckpt/storage/_crccopy.so"


def compile_library(source: Path, output: Path) -> str | None:
    """Compile ``source`` into the shared library ``output``; returns why not, or None."""
    if not sys.platform.startswith("linux"):
        return f"{sys.platform} is not supported (Linux only)"
    cc = shlex.split(os.environ.get("CC", "cc"))
    if not cc or shutil.which(cc[0]) is None:
        return f"no C compiler ({cc[0] if cc else 'CC is empty'} not found; set CC)"
    cmd = [*cc, "-O2", "-std=gnu11", "-Wall", "-shared", "-fPIC", "-o", os.fspath(output), os.fspath(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"{shlex.join(cmd)} failed:\n{done.stderr.strip()}"
    return None


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        source = Path(self.root) / SOURCE
        if version == "editable":
            output = Path(self.root) / TARGET
        else:
            output = Path(tempfile.mkdtemp(prefix="gpuckpt-build-")) / "_crccopy.so"
        why = compile_library(source, output)
        if why is not None:
            print(f"gpuckpt: building without the native copy-with-CRC loop: {why}", file=sys.stderr)
            return
        if version != "editable":
            build_data["force_include"][os.fspath(output)] = TARGET
            # no Python C API in the library: any Python 3, this platform only
            build_data["pure_python"] = False
            build_data["tag"] = f"py3-none-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}"
