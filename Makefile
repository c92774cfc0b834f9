# One-command set-up: every target installs what it needs, from nothing, on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch; a looser spec makes pip download a multi-GB CUDA build.
# GPU machines: make install TORCH_SPEC=torch (or the CUDA wheel index of your choice).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
CLUSTER := tests/slurm/cluster.sh

.PHONY: install test lint format demo bench cluster-up cluster-down clean help

help:
	@echo "make install | test | lint | format | demo | bench | cluster-up | cluster-down | clean"

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

test: install
	$(BIN)/pytest

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

bench: install
	@echo "benchmarks: not yet implemented"

cluster-up:
	bash $(CLUSTER) up

cluster-down:
	bash $(CLUSTER) down

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
