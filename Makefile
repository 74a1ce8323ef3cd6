# Every target installs what it needs into .venv first (Python >= 3.12; see .python-version).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast bench bench-kernels gpu-check lint typecheck clean

$(STAMP): pyproject.toml hatch_build.py gpuckpt/storage/crccopy.c
	$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "gpuckpt needs Python >= 3.12: run with PY=python3.12")'
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

## the main job: save a realistic model state, reload it, verify bit-exact, print throughput
demo: $(STAMP)
	$(BIN)/gpuckpt demo

## the whole test suite (CPU; GPU tests skip cleanly without a device)
test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x tests/unit

bench: $(STAMP)
	$(BIN)/python bench/bench_host.py

bench-kernels: $(STAMP)
	$(BIN)/python bench/bench_kernels.py --out bench/out

gpu-check:
	bash bench/gpu_check.sh

lint: $(STAMP)
	$(BIN)/ruff check gpuckpt tests bench
	$(BIN)/ruff format --check gpuckpt

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache .hypothesis
