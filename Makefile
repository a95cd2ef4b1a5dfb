# logprob-service developer commands. `make serve` and `make test` work on a fresh machine:
# each creates .venv, installs the project into it, then serves / tests.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of torch by default; set TORCH_SPEC="torch" (or a CUDA index) on a GPU host.
TORCH_SPEC ?= torch==2.13.0
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install serve test test-sweep test-stress test-gpu image image-test proto lint format bench example clean

# scripts/install.sh is also the Dockerfile's install step: CI runs the image's install this way.
# The stamp holds the TORCH_SPEC installed: another one (`make serve TORCH_SPEC=torch` after an
# install of the CPU build) installs again, where the stamp's date alone kept the CPU build.
$(VENV)/.installed: pyproject.toml scripts/install.sh
	VENV="$(VENV)" PYTHON="$(PYTHON)" TORCH_SPEC="$(TORCH_SPEC)" EXTRAS=dev EDITABLE=1 scripts/install.sh
	echo '$(TORCH_SPEC)' > $@

ifneq "$(strip $(shell cat $(VENV)/.installed 2>/dev/null))" "$(strip $(TORCH_SPEC))"
$(VENV)/.installed: FORCE
endif
FORCE:

install: $(VENV)/.installed  ## create .venv and install the server, client and dev tools

# The HTTP edge on vLLM's port, for vLLM / SGLang / TRL callers (docs/http.md); a later
# --http-port in SERVE_ARGS wins (0: off).
serve: install  ## serve builtin:tiny-llama: gRPC on 127.0.0.1:50051, HTTP on :8000 (pass flags in SERVE_ARGS)
	$(BIN)/logprob-service serve --http-port 8000 $(SERVE_ARGS)

test: install  ## run the test suite (GPU tests are skipped without CUDA)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

SEEDS ?= 200
JOBS ?= $(shell nproc)
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

format: install
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

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
