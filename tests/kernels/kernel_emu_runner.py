"""Run emulated kernel cases in a separate process (for sanitizer builds).

Usage: ``python kernel_emu_runner.py LIBRARY CASES_JSON``

Each case is a dict with ``shape``, ``itemsize``, ``to_channels_last`` and
optionally ``box`` ([offsets, sizes]), ``order``, ``seed``, ``grid_limit``,
``path`` ("tiled", "pixel" or "micro"), ``misalign`` (elements off 64-byte
boundaries); or ``{"huge": true, "shape": ..., "itemsize": ...,
"to_channels_last": ..., "nblocks": k}`` (optionally ``path``) for the far end
of a tensor over 2**31 elements.

Exit status: 0 all cases passed, 10 a result differed from NumPy, 11 the
emulator reported an error.  Sanitizers exit with their own status.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import kernel_emu


def main(argv: list[str]) -> int:
    lib = kernel_emu.EmuLibrary(Path(argv[1]))
    cases = json.loads(argv[2])
    for case in cases:
        shape = tuple(case["shape"])
        try:
            if case.get("huge"):
                top = kernel_emu.check_huge_tail(
                    lib,
                    shape,
                    case["itemsize"],
                    to_channels_last=case["to_channels_last"],
                    nblocks=case["nblocks"],
                    path=case.get("path"),
                )
                print(f"huge ok, highest element offset {top}")
                continue
            box = case.get("box")
            kernel_emu.check_case(
                lib,
                shape,
                case["itemsize"],
                None if box is None else (tuple(box[0]), tuple(box[1])),
                to_channels_last=case["to_channels_last"],
                order=case.get("order", "forward"),
                seed=case.get("seed", 0),
                grid_limit=tuple(case.get("grid_limit") or kernel_emu.MAX_GRID),
                path=case.get("path"),
                misalign=case.get("misalign", 0),
            )
        except kernel_emu.EmuError as exc:
            print(f"emulator error in case {case}: {exc}", flush=True)
            return 11
        except AssertionError as exc:
            print(f"mismatch in case {case}: {exc}", flush=True)
            return 10
    print(f"{len(cases)} cases ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
