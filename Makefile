# Every target installs what it needs into .venv first (Python >= 3.12; see .python-version).
# `make test` also runs the torch suite in a second venv, .venv311, on Python 3.11 (gpuckpt
# supports 3.11 too, and the CPU build of torch that it installs there is a 3.11 wheel).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# PY311 picks the Python 3.11 (else .ci/find-python311 looks for one)
PY311 ?=
TORCH_VERSION ?= 2.13.0
VENV311 := .venv311
BIN311 := $(VENV311)/bin
STAMP311 := $(VENV311)/.installed
INSTALL_INPUTS := pyproject.toml hatch_build.py gpuckpt/storage/local/crccopy.c gpuckpt/storage/local/batchio.c gpuckpt/storage/local/crc32c_simd.h

.PHONY: setup setup-torch demo test test-main test-torch test-fast bench bench-kernels gpu-check lint typecheck clean

DEMO_STAMP := $(VENV)/.installed-demo

$(VENV)/bin/python:
	$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "the main venv (.venv) needs Python >= 3.12: run with PY=python3.12")'
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# the demo needs gpuckpt and its dependencies only (not the test stack)
$(DEMO_STAMP): $(INSTALL_INPUTS) | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e .
	touch $(DEMO_STAMP)

$(STAMP): $(INSTALL_INPUTS) | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP) $(DEMO_STAMP)

# only what the torch-marked tests need (the test-torch extra), and torch itself
$(STAMP311): $(INSTALL_INPUTS) .ci/find-python311
	py311=$$(PY311='$(PY311)' sh .ci/find-python311) && $$py311 -m venv $(VENV311)
	$(BIN311)/python -m pip install -q -e ".[test-torch]" "torch==$(TORCH_VERSION)"
	touch $(STAMP311)

setup: $(STAMP)

setup-torch: $(STAMP311)

## the main job: train a small model with a CheckpointManager, SIGKILL it mid-save, resume, check bit-exact
demo: $(DEMO_STAMP)
	$(BIN)/gpuckpt demo

## the whole test suite (CPU; GPU tests skip cleanly without a device): the main suite on
## Python >= 3.12, then the torch suite on Python 3.11, where no torch test may skip
test: test-main test-torch

# The suites start hundreds of Python processes (ranks, crash victims, command lines): each
# would compile gpuckpt's modules again, 0.5 s of CPU, where none of them wrote byte code (an
# editable install compiles nothing ahead, and PYTHONDONTWRITEBYTECODE stops every process from
# writing it). It is written once here, for each interpreter; unchanged files are skipped.
BYTECODE_DIRS := gpuckpt tests bench

test-main: $(STAMP)
	$(BIN)/python -m compileall -q $(BYTECODE_DIRS) >/dev/null
	$(BIN)/python -m pytest -q -m "not torch" -n 3 --dist loadfile

test-torch: $(STAMP311)
	$(BIN311)/python -m compileall -q $(BYTECODE_DIRS) >/dev/null
	GPUCKPT_REQUIRE_TORCH=1 $(BIN311)/python -m pytest -q -m torch -n 2 --dist loadfile

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
	$(BIN)/ruff format --check gpuckpt tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VENV311) build dist .pytest_cache .mypy_cache .ruff_cache .hypothesis
