# One-command set-up: every target installs what it needs, from nothing, on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU machines (default): a CPU build of torch where one is reachable (a wheel pip finds, e.g.
# through PIP_FIND_LINKS, or PyTorch's CPU index), else PyPI's build, which carries CUDA (GBs)
# and runs on CPU too. GPU machines: make install GPU=1 (PyPI's CUDA build).
GPU ?= 0
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed
CLUSTER := tests/cluster/cluster.sh

# The fast tier: unit tests that need no Slurm, no training, no mjlab and no GPU (under 2
# minutes). The GPU tests are left out of `make test` too (pyproject's addopts: -m "not gpu").
FAST := not slurm and not training and not mjlab and not gpu
# Three workers on CI's two cores: a test spends much of its time waiting on subprocesses and
# Slurm (two workers kept the cores ~50% busy). Each file stays on one worker, the Slurm tests
# on one (tests/conftest.py).
PYTEST_ARGS ?= -n 3 --dist loadgroup --durations=25

# make gpu-check: the GPU tests (tests/gpu, marker `gpu`) in a venv of their own with torch's
# CUDA build (GPU=1), so the CPU venv stays as it is; one test at a time (they share the GPU).
GPU_VENV ?= .venv-gpu

.PHONY: install install-offline wheelhouse test test-fast test-slurm-24.11 gpu-check lint format demo bench bench-recovery bench-kernels scale bench-fs cluster-up cluster-down clean help

help:
	@echo "make install | install-offline | wheelhouse | test | test-fast | test-slurm-24.11 | gpu-check | lint | format | demo | bench | bench-recovery | bench-kernels | scale | bench-fs | cluster-up | cluster-down | clean"

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@# Offscreen rendering for mjlab's --video on CPU (Mesa's software EGL), as root.
	@if ! ldconfig -p | grep -q 'libEGL_mesa.so.0' && command -v apt-get >/dev/null \
		&& [ "$$(id -u)" = 0 ]; then \
		echo "installing Mesa EGL (libegl1 libegl-mesa0 libgl1-mesa-dri) for --video on CPU"; \
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -qq \
		&& DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
			--no-install-recommends libegl1 libegl-mesa0 libgl1-mesa-dri >/dev/null; fi
	@# rsl-rl stores a git diff of the code it runs: git, where apt can install it (as root).
	@if ! command -v git >/dev/null && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing git (rsl-rl records the code's git state)"; \
		DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
			--no-install-recommends git >/dev/null || echo "note: git not installed"; fi
	@# The tests run commands with another clock (faketime, Debian's libfaketime), as root.
	@if ! command -v faketime >/dev/null && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing faketime (tests with a clock an hour ahead)"; \
		{ apt-cache show faketime >/dev/null 2>&1 \
			|| apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null; } \
		&& DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
			--no-install-recommends faketime >/dev/null || echo "note: faketime not installed"; fi
	@# make bench-fs counts a run's filesystem operations with strace, as root.
	@if ! command -v strace >/dev/null && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing strace (make bench-fs counts filesystem operations)"; \
		{ apt-cache show strace >/dev/null 2>&1 \
			|| apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null; } \
		&& DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
			--no-install-recommends strace >/dev/null || echo "note: strace not installed"; fi
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# PyTorch's CPU index only where it answers: pip retries an unreachable index for every
	@# package (over a minute), and a CPU build it serves sorts above PyPI's (2.13.0+cpu).
	@index=""; if [ "$(GPU)" = 0 ] && $(BIN)/python -c "import urllib.request as u; \
		u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=15)" 2>/dev/null; then \
		index="--extra-index-url $(TORCH_CPU_INDEX)"; fi; \
		echo "$(BIN)/pip install -q -c constraints.txt $$index \"$(TORCH_SPEC)\""; \
		$(BIN)/pip install -q -c constraints.txt $$index "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,mjlab]'
	$(BIN)/pip check
	@# What was installed, and what it cost: where no CPU build was reachable (PyPI has only the
	@# CUDA build), that build runs on CPU too, with GBs of CUDA libraries.
	@torch=$$($(BIN)/python -c 'import torch; print(torch.__version__, "(CUDA", torch.version.cuda, "build)" if torch.version.cuda else "(CPU build)")'); \
	echo "installed torch $$torch for $$($(BIN)/python -V); $(VENV) holds $$(du -sm $(VENV) | cut -f1) MB"; \
	if [ "$(GPU)" = 0 ] && $(BIN)/pip list 2>/dev/null | grep -qi '^nvidia-'; then \
		echo "note: no CPU build of $(TORCH_SPEC) was reachable for this Python, so PyPI's CUDA build came with $$(du -scm $(VENV)/lib/python*/site-packages/nvidia* 2>/dev/null | tail -1 | cut -f1) MB of CUDA libraries; it runs on CPU. For a smaller venv, put the CPU wheel where pip finds it (PIP_FIND_LINKS, or TORCH_CPU_INDEX reachable) and make install again."; fi
	touch $(STAMP)

test: install
	$(BIN)/pytest $(PYTEST_ARGS)

# The quick check: the hostile-input property tests try 12 strings per flag (make test: 40).
test-fast: install
	HOSTILE_EXAMPLES=$${HOSTILE_EXAMPLES:-12} $(BIN)/pytest $(PYTEST_ARGS) -m "$(FAST)"

# The Slurm tests again on Slurm 24.11 (Debian trixie's, in a root made once and cached under
# /var/cache/mjlab-hpc; the tests run inside it with this .venv), with cgroup-constrained tasks
# (task/cgroup, ConstrainDevices). make test runs them on Debian 12's 22.05. docs/testing.md.
SLURM_2411_DIR ?= $${TMPDIR:-/tmp}/mjlab-hpc-cluster-24.11
# A named subset of the Slurm tests, to keep CI short: submit on 2 nodes, ranks without Slurm's
# commands, crash and hang healing with node exclusion, restart inside the allocation, node
# loss, a node lost for good past SlurmdTimeout with a spare (3 nodes), a chain across time
# limits (requeue), salloc allocations, the dry run against what is submitted, a sweep,
# status/cancel of 250 runs, doctor (and --write-profile from slurmdbd's accounts), fake GPUs
# under ConstrainDevices, a requeue from inside a job, the rendezvous host, a job suspended
# (the cgroup freezer there), a requeue of one array element, the signals and admin actions (scontrol's fields), slurmctld
# away during a heal and after a requeue, a node an admin sets DOWN (accounting's events), one
# exit code per kind of failure, and report's sacct figures. The rest (hostile input, the
# other 3-node tests, ...) run on 22.05 only.
T := tests/launch/test_slurm_jobs.py::test_
H := tests/launch/test_healing.py::test_slurm_
C := tests/launch/test_chain_and_allocation.py::test_
S := tests/launch/test_slurm_signals.py::test_
SLURM_2411_ARGS ?= -m slurm -p no:xdist --durations=15 \
	$(T)submit_2x2_cpu $(T)ranks_without_slurm_commands \
	$(H)crash_excludes_the_node_and_heals $(H)hang_then_node_down_on_two_nodes \
	$(H)crash_restarts_in_the_allocation $(H)node_lost_for_good_past_slurmd_timeout \
	$(C)chain_continues_the_run_after_the_time_limit_and_cancel_stops_it_all \
	$(C)inside_salloc_the_ranks_run_in_the_allocation_and_ctrl_c_saves_them \
	$(C)what_is_submitted_is_what_the_dry_run_shows \
	$(S)a_suspended_job_resumes_as_if_nothing_happened \
	$(S)a_requeue_of_one_array_element_is_that_elements_alone \
	$(S)signals_and_admin_actions_mean_what_the_docs_say \
	tests/launch/test_controller_outage.py \
	$(H)node_set_down_with_a_spare $(H)failures_of_one_kind_end_with_one_exit_code \
	tests/ops/test_report.py::test_report_of_a_slurm_job_with_sacct \
	tests/ops/test_slurm_ops.py::test_sweep_is_one_throttled_job_array \
	tests/ops/test_status_scale.py \
	tests/ops/test_doctor.py::test_doctor_passes_and_finds_a_private_log_root_and_unusable_gpus \
	tests/ops/test_doctor.py::test_write_profile_from_the_clusters_accounts_qos_and_partition \
	tests/slurm/test_cluster.py::test_fake_gpus \
	tests/slurm/test_cluster.py::test_each_task_trains_on_a_gpu_it_may_open \
	tests/slurm/test_cluster.py::test_requeue_from_inside_job \
	tests/slurm/test_hostlist.py::test_first_host_agrees_with_scontrol
test-slurm-24.11: install
	MJLAB_HPC_SLURM_VERSION=24.11 MJLAB_HPC_CLUSTER_CGROUP=1 \
		MJLAB_HPC_CLUSTER_DIR="$${MJLAB_HPC_CLUSTER_DIR:-$(SLURM_2411_DIR)}" \
		bash $(CLUSTER) exec $(BIN)/pytest $(SLURM_2411_ARGS)

wheelhouse:
	@[ -n "$(WHEELHOUSE)" ] || { echo "usage: make wheelhouse WHEELHOUSE=DIR [WHEEL_PYTHON=3.12]"; exit 2; }
	$(PYTHON) tools/wheelhouse.py make "$(WHEELHOUSE)" $(if $(WHEEL_PYTHON),--python-version $(WHEEL_PYTHON),)

install-offline:
	@[ -n "$(WHEELHOUSE)" ] || { echo "usage: make install-offline WHEELHOUSE=DIR [SITE_PYTHON=python3] [VENV=.venv]"; exit 2; }
	$(PYTHON) tools/wheelhouse.py install "$(WHEELHOUSE)" --venv $(VENV) --python $(SITE_PYTHON) \
		$(if $(filter 1,$(KEEP_INSTALLED)),--keep-installed,)
	touch $(STAMP)

# Without a GPU (nvidia-smi missing, or it lists none) this prints why it did nothing and
# exits 0. With one, a missing GPU is an error: MJLAB_HPC_REQUIRE_GPU=1 makes a GPU test fail
# where it would otherwise skip (torch without CUDA, a driver that does not answer). Within 8
# minutes on one GPU from a cold kernel cache (docs/performance.md).
gpu-check:
	@if ! command -v nvidia-smi >/dev/null 2>&1; then why="nvidia-smi is not installed: no NVIDIA driver"; \
	elif ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then why="nvidia-smi lists no GPU"; \
	else why=""; fi; \
	if [ -n "$$why" ]; then \
		echo "make gpu-check did nothing: this machine has no GPU ($$why)."; \
		echo "The GPU checks (tests/gpu: cartpole, ant and an mjlab velocity task training on"; \
		echo "CUDA, the device mapping, Warp arrays and graphs on the rank's device, resume, two"; \
		echo "ranks on one GPU) and the GPU figures need an NVIDIA GPU; run make gpu-check on a"; \
		echo "GPU machine. Nothing was installed or run."; \
		exit 0; \
	fi; \
	nvidia-smi -L; \
	if [ -n "$(WHEELHOUSE)" ]; then \
		$(MAKE) --no-print-directory install-offline VENV=$(GPU_VENV) || exit 1; \
	else $(MAKE) --no-print-directory install VENV=$(GPU_VENV) GPU=1 || exit 1; fi; \
	$(GPU_VENV)/bin/python -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available())'; \
	$(GPU_VENV)/bin/python -m benchmarks.gpucheck $(GPU_CHECK_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The main job, on this machine: 2 CPU ranks through submitit's local executor, cartpole with
# its defaults (64 envs per rank, 60 iterations): it ends balancing for whole episodes (reward
# 500, the most there is) and its closing line says so.
demo: install
	$(BIN)/mjlab-submit cartpole --executor local --gpus-per-node 0 --tasks-per-node 2 \
		--torch-threads 1 --log-root logs --follow

# Performance figures of this machine (~10 min on 2 cores, then the time to a target reward:
# 10-25 min a task on a busy machine; BENCH_ARGS=--no-target skips it): bench-results/.
# BENCH_ARGS=--quick for a smoke run. GPU figures where torch sees a GPU: on a GPU machine,
# make bench VENV=.venv-gpu GPU=1 (torch's CUDA build); without one they are skipped, and said so.
BENCH_ARGS ?=
# Then self-healing and a new node's kernels on Slurm (make bench-recovery bench-kernels; as root
# only, BENCH_RECOVERY=0 skips them).
BENCH_RECOVERY ?= 1
bench: install
	$(BIN)/python -m benchmarks $(BENCH_ARGS)
	@if [ "$(BENCH_RECOVERY)" = 0 ]; then :; elif [ "$$(id -u)" != 0 ]; then \
		echo "self-healing on Slurm not measured: make bench-recovery starts a test cluster, as root"; \
	else $(MAKE) --no-print-directory bench-recovery bench-kernels; fi

# Self-healing on Slurm (~4 min on 2 cores): its own 3-node Slurm 22.05 test cluster (as root,
# in RECOVERY_DIR, SlurmdTimeout 20 s, stopped at the end), a crash, a hang and a hard node
# loss of a 2-node job, each with a spare node and with --min-nodes 1, and the node loss with
# neither: seconds from the fault to the first resumed iteration, iterations recomputed,
# requeues, bit-identical; bench-results/recovery.json.
RECOVERY_DIR ?= $${TMPDIR:-/tmp}/mjlab-hpc-recovery
RECOVERY_ARGS ?=
bench-recovery: install
	@export MJLAB_HPC_CLUSTER_DIR="$(RECOVERY_DIR)/cluster" MJLAB_HPC_CLUSTER_NODES=3 \
		MJLAB_HPC_SLURM_VERSION=22.05 MJLAB_HPC_CLUSTER_SLURMD_TIMEOUT=20; \
	trap 'bash $(CLUSTER) down' EXIT; \
	bash $(CLUSTER) up || exit 1; \
	source "$$MJLAB_HPC_CLUSTER_DIR/env.sh"; \
	$(BIN)/python -m benchmarks.recovery --work "$(RECOVERY_DIR)/runs" $(RECOVERY_ARGS)

# A new log root's first iteration (~2 min on 2 cores): its own 3-node Slurm test cluster (as
# root, in KERNELS_DIR, stopped at the end), a job per node, each in a new log root: a cold
# kernel cache in a new home, the same home on another node, and a new home with the first
# one's folder named as a site's shared one; bench-results/kernel_cache.json.
KERNELS_DIR ?= $${TMPDIR:-/tmp}/mjlab-hpc-kernels
bench-kernels: install
	@export MJLAB_HPC_CLUSTER_DIR="$(KERNELS_DIR)/cluster" MJLAB_HPC_CLUSTER_NODES=3; \
	trap 'bash $(CLUSTER) down' EXIT; \
	bash $(CLUSTER) up || exit 1; \
	source "$$MJLAB_HPC_CLUSTER_DIR/env.sh"; \
	$(BIN)/python -m benchmarks.kernel_cache --work "$(KERNELS_DIR)/runs"

# What grows with the world size (~11 min on 2 cores): its own 8-node Slurm test cluster (as
# root, in SCALE_DIR, stopped at the end), then jobs of 1-32 CPU ranks through mjlab-submit;
# bench-results/scale.json and a table. SCALE_ARGS=--sizes 1,2,4 for fewer. Not in make test.
SCALE_DIR ?= $${TMPDIR:-/tmp}/mjlab-hpc-scale
SCALE_NODES ?= 8
SCALE_ARGS ?=
scale: install
	@export MJLAB_HPC_CLUSTER_DIR="$(SCALE_DIR)/cluster" MJLAB_HPC_CLUSTER_NODES=$(SCALE_NODES); \
	bash $(CLUSTER) up || exit 1; \
	source "$$MJLAB_HPC_CLUSTER_DIR/env.sh"; \
	$(BIN)/python -m benchmarks.scale --max-nodes $(SCALE_NODES) $(SCALE_ARGS); rc=$$?; \
	bash $(CLUSTER) down; exit $$rc

# What a run costs a shared filesystem's metadata server (~75 min on 2 cores): its own 8-node
# Slurm test cluster (as root, in FSOPS_DIR, stopped at the end); strace counts the operations
# on the run directory of jobs of 2-32 CPU ranks on one node and over the nodes, and of up to
# 256 simulated ranks, then fits their growth; bench-results/fsops.json and tables.
# FSOPS_ARGS=--sim (or --real, --sizes 2,4, --label NAME) for a part.
FSOPS_DIR ?= $${TMPDIR:-/tmp}/mjlab-hpc-fsops
FSOPS_ARGS ?=
bench-fs: install
	@export MJLAB_HPC_CLUSTER_DIR="$(FSOPS_DIR)/cluster" MJLAB_HPC_CLUSTER_NODES=$(SCALE_NODES); \
	trap 'bash $(CLUSTER) down' EXIT; \
	bash $(CLUSTER) up || exit 1; \
	source "$$MJLAB_HPC_CLUSTER_DIR/env.sh"; \
	$(BIN)/python -m benchmarks.fsops --max-nodes $(SCALE_NODES) $(FSOPS_ARGS)

cluster-up:
	bash $(CLUSTER) up

cluster-down:
	bash $(CLUSTER) down

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache .ruff_cache *.egg-info build dist gpu-check-results
