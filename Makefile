# logprob-service developer commands (`make help` lists them). `make serve` and `make test` work on
# a fresh machine: each creates .venv, installs what it needs into it, then serves / tests.
# `make serve` installs the server alone (the `server` extra); `make test` and the other developer
# targets the `dev` set (the server, TRL, the test and lint tools, a separate triton).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch, installed first. From PyPI by default: on Linux that is a CUDA build, which brings several
# GB of NVIDIA libraries; on macOS a CPU build. A CPU build on Linux (a laptop without a GPU):
#   make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu
# One CUDA line for a GPU host's driver: TORCH_INDEX=https://download.pytorch.org/whl/cu128 (cu126,
# cu130; docs/deployment.md, "GPU drivers").
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: help install serve test test-sweep test-stress test-gpu image image-test proto lint format bench example clean

help:  ## list the targets
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-z-]+:.*## / {printf "  %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# scripts/install.sh is also the Dockerfile's install step: CI runs the image's install this way.
# One stamp an extra (server, dev), holding the torch it installed: another TORCH_SPEC or
# TORCH_INDEX (`make serve TORCH_INDEX=...` after an install from PyPI) installs again, where the
# stamp's date alone kept the first build.
INSTALLED := $(strip $(TORCH_SPEC) $(TORCH_INDEX))
STAMPS := $(VENV)/.installed-server $(VENV)/.installed-dev
$(STAMPS): $(VENV)/.installed-%: pyproject.toml scripts/install.sh
	VENV="$(VENV)" PYTHON="$(PYTHON)" TORCH_SPEC="$(TORCH_SPEC)" TORCH_INDEX="$(TORCH_INDEX)" EXTRAS=$* EDITABLE=1 scripts/install.sh
	echo '$(INSTALLED)' > $@

ifneq "$(strip $(shell cat $(VENV)/.installed-dev 2>/dev/null))" "$(INSTALLED)"
$(VENV)/.installed-dev: FORCE
# The server alone, unless the dev set (which holds it) is installed with this torch.
SERVER := $(VENV)/.installed-server
else
SERVER := $(VENV)/.installed-dev
endif
ifneq "$(strip $(shell cat $(VENV)/.installed-server 2>/dev/null))" "$(INSTALLED)"
$(VENV)/.installed-server: FORCE
endif
FORCE:

install: $(VENV)/.installed-dev  ## create .venv and install the server, client and dev tools

# The HTTP edge on vLLM's port, for vLLM / SGLang / TRL callers (docs/http.md); a later
# --http-port in SERVE_ARGS wins (0: off), as does --metrics-port 0 for /metrics.
serve: $(SERVER)  ## serve builtin:tiny-llama: gRPC 127.0.0.1:50051, HTTP :8000, /metrics :9481 (flags in SERVE_ARGS)
	$(BIN)/logprob-service serve --http-port 8000 $(SERVE_ARGS)

JOBS ?= $(shell nproc)
# Over JOBS pytest-xdist workers, a test file to a worker (its module fixtures are made once), each
# with one OpenMP thread, so that the processes share the cores rather than fight over them: torch's
# threads spin while they wait (beside two busy processes, a tiny-llama float64 reference took 5x
# as long with two threads as with one). The image test goes first, and tests marked `serial` run
# alone (tests/conftest.py).
test: install  ## the test suite on the CPU over JOBS processes (GPU tests are skipped without CUDA)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(JOBS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

SEEDS ?= 200
# One seed of the numerical tests is ~30 s of one core here (2 cores, Triton's CPU interpreter):
# 200 seeds over 2 processes take about an hour on an otherwise idle machine.
test-sweep: install  ## the numerical tests once per seed in range(SEEDS), over JOBS processes (scripts/test-sweep.sh)
	PYTHON=$(BIN)/python PYTEST_ARGS="$(PYTEST_ARGS)" scripts/test-sweep.sh $(SEEDS) $(JOBS)

RUNS ?= 10
test-stress: ## `make test` in RUNS fresh clones of HEAD, one after another; stops at the first failure
	scripts/stress-test.sh $(RUNS)

test-gpu: install  ## only the GPU tests
	$(BIN)/python -m pytest tests/gpu $(PYTEST_ARGS)

# The container image (scripts/build-image.sh reads BASE, IMAGE, TORCH_SPEC, ENGINE): by default
# the Dockerfile as users build it, on nvidia/cuda from a registry; BASE=debian on a Debian base
# made here, with CPU torch, where no registry is reachable.
image:  ## build the image (docker or podman)
	scripts/build-image.sh

image-test: install  ## the image test alone (`make test` runs it too): build on a Debian base, run, score, drain
	$(BIN)/python -m pytest -m image -rs $(PYTEST_ARGS)

proto: install  ## regenerate client/logprob_proto from protos/
	$(BIN)/python scripts/gen_proto.py

.PHONY: docs
docs: install  ## regenerate docs/configuration.md from the settings model (tests/common/test_docs.py checks it)
	$(BIN)/python scripts/gen_config_docs.py

lint: install  ## ruff lint + format check, and the layer contracts (import-linter, [tool.importlinter])
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

format: install  ## ruff format and ruff's fixes
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install  ## the benchmarks (meant for a GPU host)
	PYTHONPATH=service:client $(BIN)/python benchmarks/bench_scoring.py
	PYTHONPATH=service:client $(BIN)/python benchmarks/bench_batching.py
	PYTHONPATH=service:client $(BIN)/python benchmarks/bench_logprobs.py
	PYTHONPATH=service:client $(BIN)/python benchmarks/bench_attention.py
	PYTHONPATH=service:client $(BIN)/python benchmarks/bench_metrics.py

example: install  ## TRL GRPO on builtin:tiny-llama (CPU) with the reference on a local service
	$(BIN)/python examples/grpo_remote_reference.py

clean:  ## remove .venv and the build files
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
