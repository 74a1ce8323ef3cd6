"""Build hook: compile gpuckpt's native libraries where a C compiler is available.

* ``gpuckpt/storage/local/crccopy.c`` into ``_crccopy.so``: the one-pass copy-with-CRC32C
  load loop (without it: pread + a CRC32C library);
* ``gpuckpt/storage/local/batchio.c`` into ``_batchio.so``: batches of small chunk files
  written and read with the GIL released (without it: one file at a time from Python).

Both are optional, so a missing compiler or a failed build prints a warning and
the build goes on. A wheel that contains a library is tagged for this platform;
one without any stays pure Python. An editable install builds them in place,
next to their sources.
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

try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # outside a build (the test suite imports compile_library): no hatchling needed
    BuildHookInterface = object

#: (source, what it is, where the library goes in the package)
_LOCAL = "gpuckpt/storage/local"
LIBRARIES = (
    (Path(f"{_LOCAL}/crccopy.c"), "the native copy-with-CRC loop", f"{_LOCAL}/_crccopy.so"),
    (Path(f"{_LOCAL}/batchio.c"), "the native small-file batches", f"{_LOCAL}/_batchio.so"),
)


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


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg,misc]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        built = False
        for source, what, target in LIBRARIES:
            if version == "editable":
                output = Path(self.root) / target
            else:
                output = Path(tempfile.mkdtemp(prefix="gpuckpt-build-")) / Path(target).name
            why = compile_library(Path(self.root) / source, output)
            if why is not None:
                print(f"gpuckpt: building without {what}: {why}", file=sys.stderr)
                continue
            built = True
            if version != "editable":
                build_data["force_include"][os.fspath(output)] = target
        if built and version != "editable":
            # no Python C API in the libraries: any Python 3, this platform only
            build_data["pure_python"] = False
            build_data["tag"] = f"py3-none-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}"
