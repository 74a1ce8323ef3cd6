#!/usr/bin/env bash
# The prepared GPU check: gpu-marked tests, the PyTorch-only tests, the demo on
# the GPU, kernel and save/load benchmarks, compute-sanitizer last.
# Runs from the repository root on a machine with an NVIDIA GPU, CuPy and PyTorch
# (no zarr, no network): wheels for the missing packages are fetched beforehand
# with `bash bench/fetch_wheels.sh` into .whl/ and carried along.
# Writes full results under $OUT (default: a temp dir); prints a short table last.
# Every step has its own time limit (about 9 minutes in all, 4-5 expected).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  # only what the GPU machine lacks; its own torch, numpy, pytest stay in charge
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpuckpt-site \
    .whl/zarr-*.whl .whl/numcodecs-*.whl .whl/donfig-*.whl .whl/google_crc32c-*.whl \
    .whl/crc32c-*.whl .whl/msgspec-*.whl .whl/typing_extensions-*.whl
  export PYTHONPATH=/tmp/gpuckpt-site:$PWD
else
  export PYTHONPATH=$PWD
fi
{ date -u; nvidia-smi; python3 -c "import sys, cupy, numpy, zarr; print(sys.version); print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'zarr', zarr.__version__)";
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"; df -h /tmp; nproc; free -g; } > "$OUT/env.txt" 2>&1

status() { if [ "$1" -eq 0 ]; then echo ok; else echo "FAILED (rc=$1)"; fi; }
exec 3>&2
step() { local name=$1 t0=$SECONDS; shift; "$@"; local rc=$?; echo "step $name: $((SECONDS - t0)) s, rc=$rc" >&3; return $rc; }
PYTEST=(python3 -m pytest -q -p no:cacheprovider -o addopts="-ra --strict-markers")

step gpu-tests timeout 120 "${PYTEST[@]}" -m gpu tests/device tests/kernels -k "not sanitizer and not racecheck" \
  > "$OUT/pytest_gpu.txt" 2>&1
rc_tests=$?
step torch-tests timeout 75 "${PYTEST[@]}" tests/device/test_torch_host.py tests/distributed/test_dtensor.py \
  tests/distributed/test_coordinator_torch.py tests/integration/test_convert.py -k "torch or dcp or dtensor or gloo or subgroup" \
  > "$OUT/pytest_torch.txt" 2>&1
rc_torch=$?
step demo timeout 60 python3 -m gpuckpt.demo --device gpu > "$OUT/demo_gpu.txt" 2>&1
rc_demo=$?
step bench-kernels timeout 100 python3 bench/bench_kernels.py --out "$OUT" > "$OUT/bench_kernels.txt" 2>&1
rc_kernels=$?
step bench-gpu timeout 130 python3 bench/bench_gpu.py --gib 2 --rounds 3 --out "$OUT" > "$OUT/bench_gpu.txt" 2>&1
rc_gpu=$?
step sanitizer timeout 90 "${PYTEST[@]}" -m gpu tests/kernels/test_kernels_gpu.py -k "sanitizer or racecheck" \
  > "$OUT/pytest_sanitizer.txt" 2>&1
rc_san=$?

echo "== gpuckpt GPU check ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)) =="
echo "gpu tests:       $(status $rc_tests)  $(tail -1 "$OUT/pytest_gpu.txt")"
echo "torch tests:     $(status $rc_torch)  $(tail -1 "$OUT/pytest_torch.txt")"
echo "sanitizer tests: $(status $rc_san)  $(tail -1 "$OUT/pytest_sanitizer.txt")"
echo "demo on GPU:     $(status $rc_demo)  $(tail -1 "$OUT/demo_gpu.txt")"
echo "kernel bench:    $(status $rc_kernels)"
grep -E "^(device-to-device|targets met)" "$OUT/bench_kernels.txt"
echo "gpu bench:       $(status $rc_gpu)"
tail -n 7 "$OUT/bench_gpu.txt"
grep -h -E "^(FAILED|ERROR)" "$OUT"/pytest_*.txt | head -20
