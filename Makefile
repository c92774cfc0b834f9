# One-command set-up: every target installs what it needs, from nothing, on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines (default): the CPU wheel of torch, and a check that no CUDA build crept in.
# GPU machines: make install GPU=1 (PyPI's CUDA build of the same torch version).
GPU ?= 0
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
CLUSTER := tests/cluster/cluster.sh

# The fast tier: unit tests that need no Slurm, no training and no mjlab (under 2 minutes).
FAST := not slurm and not training and not mjlab
# Two workers: half of a test's time is waiting on subprocesses. Each file stays on one worker,
# the Slurm tests on one (tests/conftest.py).
PYTEST_ARGS ?= -n 2 --dist loadgroup

.PHONY: install test test-fast lint format demo bench cluster-up cluster-down clean help

help:
	@echo "make install | test | test-fast | lint | format | demo | bench | cluster-up | cluster-down | clean"

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,mjlab]'
	$(BIN)/pip check
	@if [ "$(GPU)" = 0 ] && $(BIN)/pip list 2>/dev/null | grep -qi '^nvidia-'; then \
		echo "a CUDA build of torch was pulled in on a CPU install"; exit 1; fi
	touch $(STAMP)

test: install
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: install
	$(BIN)/pytest $(PYTEST_ARGS) -m "$(FAST)"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The main job, on this machine: 2 CPU ranks through submitit's local executor.
demo: install
	$(BIN)/mjlab-submit cartpole --executor local --gpus-per-node 0 --tasks-per-node 2 \
		--num-envs 512 --max-iterations 30 --torch-threads 1 --log-root logs --follow

# Performance figures of this machine (~9 min on 2 cores): bench-results/bench.json, bench.png.
# BENCH_ARGS=--quick for a smoke run.
BENCH_ARGS ?=
bench: install
	$(BIN)/python -m mjlab_hpc.bench $(BENCH_ARGS)

cluster-up:
	bash $(CLUSTER) up

cluster-down:
	bash $(CLUSTER) down

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info build dist
