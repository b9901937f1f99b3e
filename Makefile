# megasweep: the README's two commands are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build installs from a local file on the project's machines; pinning it first
# keeps pip from resolving `torch>=2.4` to the multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# On a cluster, `make install VENV_FLAGS=--system-site-packages` reuses the site's CUDA torch.
VENV_FLAGS ?=

.PHONY: venv install install-test ds-ops demo test lint compile bench clean cluster-up cluster-down

$(VENV)/.created:
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 (Debian: apt-get install python3.11 python3.11-venv)"; exit 1; }
	@# Debian ships venv without ensurepip; as root, fetch it rather than fail.
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV) || { rm -rf $(VENV); [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV_FLAGS) $(VENV); } || { echo "error: cannot create a venv; install python3-venv"; exit 1; }
	$(PIP) install -q --upgrade pip setuptools wheel
	touch $@

venv: $(VENV)/.created

# torch first, and only when absent: a cluster user's own CUDA build is left alone.
$(VENV)/.torch: $(VENV)/.created
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_PIN)
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e .
	touch $@

# One pip run for the package and its test extras (a second would resolve and build the editable wheel
# again); the package's own stamp follows, since `.[test]` holds everything `make install` does.
$(VENV)/.installed-test: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[test]"
	$(PY) -c "import deepspeed" 2>/dev/null || $(PIP) install -q --no-build-isolation "deepspeed>=0.14"
	touch $(VENV)/.installed $@

# DeepSpeed compiles its CPU Adam (optimizer offload) on first use, into ~/.cache/torch_extensions,
# again for every new venv path (its shared-memory collectives serve inference only: train.ds_engine
# skips them). Built here, before any test (make test runs lint beside it), not inside a timed Slurm
# job while test workers share the cores; a failure only defers the build.
# train.ds_engine loads it past a lock file that a killed earlier load left behind.
$(VENV)/.ds-ops: $(VENV)/.installed-test
	$(PY) -c "import torch, sys; sys.exit(torch.cuda.is_available())" && \
	$(PY) -c "from train.ds_engine import import_deepspeed, load_cpu_op; \
	import_deepspeed('cpu'); load_cpu_op('CPUAdamBuilder')" >/dev/null || \
	echo "make: DeepSpeed's CPU Adam was not built ahead; the tests that need it build it"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test
ds-ops: $(VENV)/.ds-ops

demo: install
	WANDB_MODE=offline $(PY) -m train

lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy conf train launchers analysis hydra_plugins tests

# A real single-machine Slurm (munge, MariaDB + slurmdbd, slurmctld, 4 emulated slurmd); root only.
cluster-up:
	bash slurm/cluster-up.sh

cluster-down:
	bash slurm/cluster-down.sh

# pytest-xdist workers: the Slurm tests keep to one of them (tests/conftest.py), so the others run
# the process-only tests while Slurm jobs wait in the queue or sleep out their signals. Three on two
# cores: with two, the cores were 11.7% idle over the run (vmstat) and it took 879-884 s; with three,
# 1.6% idle and 831 s (2026-11-26, the same clone, one run after the other).
PYTEST_WORKERS ?= 3
PYTEST := $(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not alone"
# The tests marked `alone` compare timings with predictions: one pytest of their own, after the
# others, with no worker beside them (tests/conftest.py). Both always run; either failing fails.
PYTEST_ALONE := $(VENV)/bin/pytest -p no:xdist -m alone

# Where PYTHONDONTWRITEBYTECODE is set (this machine sets it), no process caches the bytecode it
# compiles: each of the hundreds the tests start (CLIs, ranks, Slurm jobs) would compile the package's
# modules again. Compiled once here, they read it (2026-11-26: 3% less CPU in tests/train/test_main.py).
compile: install
	$(PY) -m compileall -q conf train launchers analysis hydra_plugins tests >/dev/null

# The op build (CPU Adam: compilers on both cores, 29 s alone without debug info, 55 s with it) and lint
# (mypy on one, ~30 s) side by side (2026-11-27, when the shm op was built too: 87 s in CI's fresh clone
# against 113 s one after the other, same machine). A failing lint still stops make test before pytest.
# As root: bring the cluster up, run pytest, and bring it down whatever pytest returns.
# Not root: plain pytest; the Slurm tests skip themselves and say why.
test: install-test
	$(MAKE) --no-print-directory -j2 ds-ops lint compile
	@if [ "$$(id -u)" -ne 0 ]; then rc=0; $(PYTEST) || rc=$$?; $(PYTEST_ALONE) || rc=$$?; exit $$rc; fi; \
	trap 'bash slurm/cluster-down.sh' EXIT; \
	bash slurm/cluster-up.sh || echo "make test: slurm/cluster-up.sh failed; the Slurm tests will report why"; \
	rc=0; $(PYTEST) || rc=$$?; $(PYTEST_ALONE) || rc=$$?; exit $$rc

bench: ds-ops
	$(PY) -m tests.bench

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .mypy_cache .ruff_cache
