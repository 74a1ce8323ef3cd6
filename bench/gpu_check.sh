#!/usr/bin/env bash
# The prepared GPU check: gpu-marked tests, kernel checks, GPU benchmarks.
# Runs from the repository root on a machine with an NVIDIA GPU, CuPy and PyTorch
# (no zarr, no network): wheels for the missing packages are fetched beforehand
# with `bash bench/fetch_wheels.sh` into .whl/ and carried along.
# Writes full results under $OUT (default: a temp dir); prints a short table last.
# Designed to finish in well under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/gpuckpt-site .whl/*.whl
  export PYTHONPATH=/tmp/gpuckpt-site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONDONTWRITEBYTECODE=1
{ nvidia-smi; python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"; } > "$OUT/env.txt" 2>&1

status() { if [ "$1" -eq 0 ]; then echo ok; else echo "FAILED (rc=$1)"; fi; }

timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/device tests/kernels > "$OUT/pytest_gpu.txt" 2>&1
rc_tests=$?
timeout 90 python3 -m gpuckpt.demo --device gpu > "$OUT/demo_gpu.txt" 2>&1
rc_demo=$?
timeout 120 python3 bench/bench_kernels.py --quick --out "$OUT" > "$OUT/bench_kernels.txt" 2>&1
rc_kernels=$?
timeout 150 python3 bench/bench_gpu.py --gib 4 --rounds 3 --out "$OUT" > "$OUT/bench_gpu.txt" 2>&1
rc_gpu=$?

echo "== gpuckpt GPU check ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)) =="
echo "gpu tests:      $(status $rc_tests)  $(tail -1 "$OUT/pytest_gpu.txt")"
echo "demo on GPU:    $(status $rc_demo)  $(tail -1 "$OUT/demo_gpu.txt")"
echo "kernel bench:   $(status $rc_kernels)"
tail -n 25 "$OUT/bench_kernels.txt"
echo "gpu bench:      $(status $rc_gpu)"
tail -n 6 "$OUT/bench_gpu.txt"
