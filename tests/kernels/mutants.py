"""Deliberately broken variants of the channels-last kernels, made by the tests from the source.

Each mutant is a list of exact replacements in ``kernels/channels_last.cu``,
each expected a given number of times (so a change of the source that a
mutant no longer matches fails loudly instead of testing nothing). The
harness builds a mutant (CPU emulation, NVRTC) to prove that its checks
notice that kind of bug; the shipped source carries none of them.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuckpt.device.kernels import kernel_source_dir

_SYNC = "__syncthreads();"
_TILE_BARRIER = "  __syncthreads();  // the tile is complete before anyone reads it"
_BOX_BARRIER = "          __syncthreads();\n          if (TO_CF) {"

#: name -> (what it breaks, [(original, replacement, times)])
MUTANTS: dict[str, tuple[str, list[tuple[str, str, int]]]] = {
    "sync": (
        "no barrier before the tile is read",
        [
            (_TILE_BARRIER, "  // (no barrier)", 1),
            (_BOX_BARRIER, "          // (no barrier)\n          if (TO_CF) {", 1),
        ],
    ),
    "divergence": (
        "one thread skips the barrier",
        [
            (_TILE_BARRIER, "  if (threadIdx.x != GK_THREADS - 1) " + _SYNC, 1),
            (
                _BOX_BARRIER,
                "          if (threadIdx.x != GK_THREADS - 1) " + _SYNC + "\n          if (TO_CF) {",
                1,
            ),
        ],
    ),
    "bounds": (
        "no bounds check along the run",
        [
            ("#define GK_IN_RUN(q) ((q) < run_len)", "#define GK_IN_RUN(q) true", 1),
            ("#define GK_PX_FULL(q, p) ((q) + (p) <= run_len)", "#define GK_PX_FULL(q, p) true", 1),
        ],
    ),
    "index32": (
        "32-bit offsets, which overflow on large tensors",
        [("typedef long long gk_index;", "typedef int gk_index;", 1)],
    ),
    "align": (
        "assumes 16-byte alignment",
        [
            (
                "  const int w = (bits & 15ULL) == 0ULL                              ? 16\n"
                "                : (bits & (unsigned long long)(WN - 1)) == 0ULL ? WN\n"
                "                                                                : 0;",
                "  const int w = 16;\n  (void)bits;",
                1,
            ),
            (
                "  const int w = (cl_bits & 15ULL) != 0ULL                       ? 0\n"
                "                : (cf_bits & 15ULL) == 0ULL                     ? 16\n"
                "                : (cf_bits & (unsigned long long)(WN - 1)) == 0 ? WN\n"
                "                                                                : 0;",
                "  const int w = 16;\n  (void)cl_bits;\n  (void)cf_bits;",
                1,
            ),
        ],
    ),
    "px_slots": (
        "pairs of threads own the same slots",
        [
            ("      const int t = (int)threadIdx.x;", "      const int t = (int)threadIdx.x / 2;", 1),
            ("#define GK_MT_LANE(t) (t)", "#define GK_MT_LANE(t) ((t) / 2)", 1),
        ],
    ),
}


def clean_source() -> str:
    return (kernel_source_dir() / "channels_last.cu").read_text()


def mutated_source(names: Iterable[str], source: str | None = None) -> str:
    """The kernel source with the mutants ``names`` applied (each replacement checked to occur
    exactly as often as expected)."""
    text = clean_source() if source is None else source
    for name in names:
        for original, replacement, times in MUTANTS[name][1]:
            found = text.count(original)
            if found != times:
                raise AssertionError(
                    f"mutant {name!r}: {original!r} occurs {found} times in channels_last.cu, expected "
                    f"{times}; update tests/kernels/mutants.py to the changed source"
                )
            text = text.replace(original, replacement)
    return text
