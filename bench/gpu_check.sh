#!/usr/bin/env bash
# The prepared GPU check (issue 23): the gpu-marked tests (kernels, the load
# pipeline through pinned staging, device snapshots, `gpuckpt bench --device`),
# the kernel table, the save/load/async figures of a 2 GiB state against
# ceilings measured in the same run (D2H, H2D, D2D, disk write, warm and cold
# reads: the load pipeline warm and cold, async_save blocking vs one D2H copy
# and, with staging="device", vs one D2D copy; a CheckpointManager's local tier:
# its save's blocking vs one D2H copy, a restore from it vs min(H2D, warm read)),
# then compute-sanitizer, the PyTorch-only tests (the DCP layer's CUDA tests
# among them) and the demo on the GPU; writes $OUT/<date>-summary.json
# (bench/gpu_summary.py, with the targets) and prints its table last.
#
# Usage (repository root of a machine with an NVIDIA GPU, CuPy and PyTorch;
# no zarr and no network needed: `bash bench/fetch_wheels.sh` beforehand puts
# the missing wheels in .whl/, which travels with the tree):
#
#   COMMIT=<sha> OUT=<dir> bash bench/gpu_check.sh
#   bash bench/gpu_check.sh --dry-run    # no GPU: the plumbing and the summary
#                                        # writer on made-up numbers (format test)
#
# COMMIT names the commit in the summary where the tree has no .git. Full
# outputs land in $OUT (default: a temp dir); copy $OUT/<date>-summary.json to
# bench/gpu/ and commit it. Every step has its own time limit: at most 7.5
# minutes in all; the three runs of 2026-12-04 took 3.5 minutes each.
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; fi
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
DATE=$(date -u +%F)
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
SUMMARY="$OUT/$DATE-summary.json"
PY=${PYTHON:-python3}
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

wheels=(.whl/zarr-*.whl .whl/numcodecs-*.whl .whl/donfig-*.whl .whl/google_crc32c-*.whl
        .whl/crc32c-*.whl .whl/msgspec-*.whl .whl/typing_extensions-*.whl
        .whl/nvidia_nvcomp_cu13-*.whl .whl/nvidia_libnvcomp_cu13-*.whl)
if [ "$DRY" = 0 ] && [ ${#wheels[@]} -gt 0 ]; then
  # only what the GPU machine lacks; its own torch, numpy, pytest stay in charge
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpuckpt-site "${wheels[@]}"
  export PYTHONPATH=/tmp/gpuckpt-site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

status() { if [ "$1" -eq 0 ]; then echo ok; elif [ "$1" -eq 124 ]; then echo "TIMEOUT"; else echo "FAILED(rc=$1)"; fi; }
exec 3>&2
step() { local name=$1 t0=$SECONDS; shift; "$@"; local rc=$?; echo "step $name: $((SECONDS - t0)) s, rc=$rc" >&3; return $rc; }
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers")
STEPS=()

if [ "$DRY" = 1 ]; then
  # What runs without a GPU: the two benchmarks (they say there is nothing to
  # measure and exit 0) and the summary writer on made-up numbers.
  step bench-kernels timeout 60 "$PY" bench/bench_kernels.py --out "$OUT" > "$OUT/bench_kernels.txt" 2>&1
  STEPS+=("--step" "bench-kernels=$(status $?) (dry run)")
  step bench-gpu timeout 60 "$PY" bench/bench_gpu.py --gib 0.01 --rounds 1 --out "$OUT" > "$OUT/bench_gpu.txt" 2>&1
  STEPS+=("--step" "bench-gpu=$(status $?) (dry run)")
  "$PY" bench/gpu_summary.py --format-test --commit "$COMMIT" --date "$DATE" --out "$SUMMARY" "${STEPS[@]}"
  exit $?
fi

# The native helpers, built as an install with a C compiler builds them (the tree that
# travels has no build outputs): without them loads take the pure-Python paths.
"$PY" - > "$OUT/native.txt" 2>&1 <<'PYEOF'
import sys
from pathlib import Path
sys.path.insert(0, ".")
from hatch_build import LIBRARIES, compile_library
for source, what, target in LIBRARIES:
    print(f"{what}: {compile_library(Path(source), Path(target)) or 'built'}")
PYEOF
{ date -u; nvidia-smi; cat "$OUT/native.txt"; "$PY" -c "import sys, cupy, numpy, zarr; print(sys.version); print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'zarr', zarr.__version__)";
  "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"; df -h /tmp; nproc; free -g; } > "$OUT/env.txt" 2>&1

# 1. Correctness on the device first (kernels against NumPy, every path).
step gpu-tests timeout 90 "${PYTEST[@]}" -m gpu tests/device tests/kernels tests/integration/test_load_pipeline.py \
  tests/integration/test_device_snapshot.py tests/integration/test_cli.py -k "not sanitizer and not racecheck" \
  > "$OUT/pytest_gpu.txt" 2>&1
STEPS+=("--step" "gpu-tests=$(status $?)")
# 2. The kernel table (its own budget ends it before the step's limit).
step bench-kernels timeout 70 "$PY" bench/bench_kernels.py --out "$OUT" --budget-s 40 > "$OUT/bench_kernels.txt" 2>&1
STEPS+=("--step" "bench-kernels=$(status $?)")
# 3. Save, the load pipeline (warm, then cold: chunk files evicted from the page
#    cache, read with O_DIRECT into pinned staging) and async_save (pinned host
#    staging vs one D2H copy; staging="device" vs one D2D copy) of a 2 GiB device
#    state against the ceilings of the same run.
step bench-gpu timeout 90 "$PY" bench/bench_gpu.py --gib 2 --rounds 3 --out "$OUT" > "$OUT/bench_gpu.txt" 2>&1
STEPS+=("--step" "bench-gpu=$(status $?)")
# 3b. Compression on the device: nvCOMP's zstd frames against the host codec, that
#     the host reads them, and saves compressed on the device (bench/bench_nvcomp.py;
#     skipped without the nvCOMP wheels).
step bench-nvcomp timeout 45 "$PY" bench/bench_nvcomp.py --mib 256 --rounds 3 --out "$OUT" > "$OUT/bench_nvcomp.txt" 2>&1
STEPS+=("--step" "bench-nvcomp=$(status $?)")
# 4. compute-sanitizer memcheck and racecheck on both kernel paths.
step sanitizer timeout 40 "${PYTEST[@]}" -m gpu tests/kernels/test_kernels_gpu.py -k "sanitizer or racecheck" \
  > "$OUT/pytest_sanitizer.txt" 2>&1
STEPS+=("--step" "sanitizer=$(status $?)")
# 5. The PyTorch-only tests that skip on CI, and the demo on the GPU.
step torch-tests timeout 75 "${PYTEST[@]}" tests/device/test_torch_host.py tests/distributed/test_dtensor.py \
  tests/distributed/test_coordinator_torch.py tests/integration/test_convert.py tests/dcp/test_dcp_cuda.py \
  -k "torch or dcp or dtensor or gloo or subgroup or cuda" \
  > "$OUT/pytest_torch.txt" 2>&1
STEPS+=("--step" "torch-tests=$(status $?)")
step demo timeout 30 "$PY" -m gpuckpt.cli demo "$OUT/demo" --device gpu > "$OUT/demo_gpu.txt" 2>&1
STEPS+=("--step" "demo=$(status $?)")

echo "== test outcomes =="
for f in pytest_gpu pytest_sanitizer pytest_torch demo_gpu; do
  [ -f "$OUT/$f.txt" ] && echo "$f: $(tail -1 "$OUT/$f.txt")"
done
grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest_*.txt | head -20
echo
# The summary and its table, printed last.
"$PY" bench/gpu_summary.py --kernels "$OUT/bench_kernels.json" --gpu "$OUT/bench_gpu.json" \
  --nvcomp "$OUT/bench_nvcomp.json" --commit "$COMMIT" --date "$DATE" --out "$SUMMARY" "${STEPS[@]}"
