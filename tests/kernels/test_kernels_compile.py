"""The kernels compile for sm_80 and sm_90 with nvcc and with NVRTC, without
register spills, and the source's parts (what the loader compiles separately)
hold exactly their entry points.  Neither compiler needs a GPU for this."""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
from collections.abc import Callable

import pytest

from gpuckpt.device import kernels as K

ARCHS = ("sm_80", "sm_90")
DIRECTIONS = ("cl_to_cf", "cf_to_cl")


def part_entry_points(part: str | None) -> set[str]:
    """The entry points the source defines with ``part``'s build options."""
    tiled = {f"gpuckpt_{d}_{es}" for d in DIRECTIONS for es in K.SUPPORTED_ITEMSIZES}
    if part is None:
        sizes: tuple[int, ...] = K.SUPPORTED_ITEMSIZES
    elif part in ("tiled", "micro"):
        sizes = ()
    else:
        sizes = (int(part[2:]),)
    pixel = {
        f"gpuckpt_px_{d}_{es}_{c}"
        for d in DIRECTIONS
        for es in sizes
        for c in range(1, K.PIXEL_MAX_CHANNELS + 1)
    }
    micro = {f"gpuckpt_mt_{d}_{es}" for d in DIRECTIONS for es in K.SUPPORTED_ITEMSIZES}
    return (
        pixel | (tiled if part in (None, "tiled") else set()) | (micro if part in (None, "micro") else set())
    )


ENTRY_POINTS = part_entry_points(None)


def test_every_plan_names_an_entry_point() -> None:
    # The planner's kernel names and parts match what the source defines.
    for shape in [(1, c, 4, 4) for c in (1, 3, 8, 9, 64)]:
        for itemsize in K.SUPPORTED_ITEMSIZES:
            plan = K.plan_box_copy(shape, (0,) * 4, shape, itemsize)
            for to_cl in (False, True):
                assert plan.kernel_name(to_cl) in part_entry_points(plan.module_part)
    assert len(ENTRY_POINTS) == 2 * 4 + 2 * 4 + 2 * 4 * K.PIXEL_MAX_CHANNELS
    paths = {K.plan_box_copy(s, (0,) * 4, s, 4).path for s in [(1, c, 4, 4) for c in (1, 9, 64)]}
    assert paths == set(K.PATHS)


def check_ptxas_report(log: str, arch: str, entry_points: set[str] = ENTRY_POINTS) -> None:
    """Every entry point was compiled for ``arch`` and no function spills."""
    compiled = set(re.findall(rf"Compiling entry function '(\w+)' for '{arch}'", log))
    assert compiled == entry_points, sorted(compiled ^ entry_points)
    properties = re.findall(
        r"Function properties for (\w+)\n[^\n]*?(\d+) bytes stack frame, "
        r"(\d+) bytes spill stores, (\d+) bytes spill loads",
        log,
    )
    # entry points, and the out-of-line device functions they call
    assert {name for name, *_ in properties} >= entry_points, log
    for name, frame, stores, loads in properties:
        assert (frame, stores, loads) == ("0", "0", "0"), (
            f"{name} on {arch}: stack {frame}, spill stores {stores}, spill loads {loads}"
        )


# ---- nvcc -------------------------------------------------------------------


@pytest.fixture(scope="module")
def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc not found on PATH (CUDA toolkit not installed)")
    return path


@pytest.fixture(scope="module")
def nvcc_logs(nvcc: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    # Both architectures compile at once: two cores, two processes.
    out = tmp_path_factory.mktemp("nvcc")
    src = K.kernel_source_dir() / K.KERNEL_FILE
    procs = {
        arch: subprocess.Popen(
            [
                nvcc,
                "-cubin",
                f"-arch={arch}",
                "-Xptxas",
                "-v",
                "-Werror",
                "all-warnings",
                str(src),
                "-o",
                str(out / f"{arch}.cubin"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for arch in ARCHS
    }
    logs = {}
    for arch, proc in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log
        assert (out / f"{arch}.cubin").stat().st_size > 0
        logs[arch] = log
    return logs


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_without_spills(nvcc_logs: dict[str, str], arch: str) -> None:
    check_ptxas_report(nvcc_logs[arch], arch)


# ---- NVRTC --------------------------------------------------------------------


def _nvrtc_from_cupy() -> Callable[[str, list[str]], tuple[bool, str]] | None:
    try:
        from cupy.cuda import nvrtc
    except Exception:  # CuPy absent, or without its NVRTC library
        return None

    def compile_(source: str, options: list[str]) -> tuple[bool, str]:
        prog = nvrtc.createProgram(source, K.KERNEL_FILE, [], [])
        try:
            try:
                nvrtc.compileProgram(prog, options)
                ok = len(nvrtc.getCUBIN(prog)) > 0
            except nvrtc.NVRTCError:
                ok = False
            return ok, nvrtc.getProgramLog(prog)
        finally:
            nvrtc.destroyProgram(prog)

    try:
        nvrtc.getVersion()
    except Exception:
        return None
    return compile_


def _find_libnvrtc() -> str | None:
    # The nvidia-cuda-nvrtc wheel puts it under site-packages/nvidia/*/lib.
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    patterns = [os.path.join(r, "*", "lib", "libnvrtc.so*") for r in roots] + [
        os.path.join(cuda_home, "lib64", "libnvrtc.so*")
    ]
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if "builtins" not in path and ".alt." not in path:
                return path
    return None


def _nvrtc_from_ctypes() -> Callable[[str, list[str]], tuple[bool, str]] | None:
    path = _find_libnvrtc()
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    size_t = ctypes.c_size_t

    def compile_(source: str, options: list[str]) -> tuple[bool, str]:
        prog = ctypes.c_void_p()
        rc = lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), K.KERNEL_FILE.encode(), 0, None, None
        )
        assert rc == 0, f"nvrtcCreateProgram: {rc}"
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            ok = lib.nvrtcCompileProgram(prog, len(options), opts) == 0
            n = size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            buf = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetProgramLog(prog, buf)
            if ok:
                lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
                ok = n.value > 0
            return ok, buf.value.decode(errors="replace")
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    return compile_


@pytest.fixture(scope="module")
def nvrtc_compile() -> Callable[[str, list[str]], tuple[bool, str]]:
    compile_ = _nvrtc_from_cupy() or _nvrtc_from_ctypes()
    if compile_ is None:
        pytest.skip("NVRTC not found: install CuPy or nvidia-cuda-nvrtc==13.0.*")
    return compile_


def test_nvrtc_compiles_without_spills(nvrtc_compile: Callable[[str, list[str]], tuple[bool, str]]) -> None:
    # The same options CuPy's RawModule uses for one part (the loader's), plus
    # a real architecture so that NVRTC runs ptxas and reports registers and
    # spills: sm_90, the H100/H200 the targets are set on.  nvcc covers every
    # part for sm_80 and sm_90 above; the other parts go through NVRTC below.
    options = ["--gpu-architecture=sm_90", "-std=c++17", "-Xptxas=-v", *K.module_part_options("px8")]
    ok, log = nvrtc_compile(K.kernel_source(), options)
    assert ok, log
    check_ptxas_report(log, "sm_90", part_entry_points("px8"))


def test_nvrtc_reports_errors(nvrtc_compile: Callable[[str, list[str]], tuple[bool, str]]) -> None:
    # The harness must notice a source NVRTC rejects (here: a standard header,
    # which NVRTC does not have).
    ok, log = nvrtc_compile("#include <cstdio>\n" + K.kernel_source(), ["--gpu-architecture=sm_80"])
    assert not ok and "cstdio" in log


@pytest.mark.parametrize("part", ["tiled", "micro"])
def test_nvrtc_without_cupy_compiles_a_part(part: str) -> None:
    # CI may have the NVRTC wheel but no CuPy: the ctypes path must work too.
    # With the loader's options for one part, exactly that part's kernels.
    compile_ = _nvrtc_from_ctypes()
    if compile_ is None:
        pytest.skip("libnvrtc not found: install nvidia-cuda-nvrtc==13.0.*")
    options = ["--gpu-architecture=sm_90", "-std=c++17", "-Xptxas=-v", *K.module_part_options(part)]
    ok, log = compile_(K.kernel_source(), options)
    assert ok, log
    check_ptxas_report(log, "sm_90", part_entry_points(part))
