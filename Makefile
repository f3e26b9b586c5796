# Two commands: `make run` (set-up + the default experiment) and `make test` (set-up + the suite).
# Set-up is idempotent: the venv is rebuilt only when pyproject.toml changes.
# Habits: `make lint` (ruff format --check, ruff check, mypy) and `make test-fast` (the in-process tests, < 1 min).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
export OMP_NUM_THREADS ?= 1

LINT_PATHS := dpsgd topologies experiments tests

.PHONY: setup run test test-fast lint typecheck clean soak bench

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU torch first: a bare `torch` requirement would otherwise pull a CUDA build
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m experiments.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

# the tests that start no OS process (no mpiexec, torch.distributed or app subprocess): about a minute;
# --forbid-processes fails one that does (it is then missing the `processes` marker: tests/conftest.py)
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not processes" --forbid-processes $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy

# mypy on dpsgd/ and topologies/ ([tool.mypy] in pyproject.toml)
typecheck: $(STAMP)
	$(PY) -m mypy

clean:
	rm -rf $(VENV) outputs multirun

soak: $(STAMP)
	$(PY) -m pytest -q -m slow $(ARGS)

# every benchmark, one after the other (14 min on 2 idle cores); results in outputs/bench/
BENCHMARKS := comm_overhead allreduce_vs_ddp local_sgd_vs_torch step_time_vs_network time_to_accuracy overlap \
	stragglers fleet
bench: $(STAMP)
	set -e; for b in $(BENCHMARKS); do echo "== $$b"; $(PY) -m experiments.bench.$$b; done
