#!/usr/bin/env bash
# The environment of the framework tests (tests/frameworks): verl and OpenRLHF with the pieces
# their tested modules import, apart from the project's own .venv, whose dependency set they must
# not enter (verl 0.9.1 wants transformers>=5.5.3,<5.11 and tensordict<=0.10; OpenRLHF 0.11.2 pins
# transformers==5.15.0, deepspeed, ray==2.55.0 and flash-attn, which does not build without CUDA).
# Both frameworks go in --no-deps; what their tested modules import comes next to them, with
# transformers in verl's range (OpenRLHF's tested modules run on it too). .ci/run runs this.
#
#   VENV        the environment, created if missing       [.venv-frameworks]
#   PYTHON      the interpreter that creates it           [python3]
#   TORCH_SPEC  the torch requirement, installed first    [torch==2.13.0: the CPU build here]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-frameworks}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VERL_SPEC=verl==0.9.1
OPENRLHF_SPEC=openrlhf==0.11.2

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/pip" install --quiet --no-warn-conflicts)
# torch alone first, then everything else with the same spec, so pip never swaps in another build.
"${pip[@]}" "$TORCH_SPEC"
# The project with its server (the tests serve a model) and the integrations' extras; the test
# tools; and what `import verl.workers.engine_workers`, `verl.trainer.ppo.ray_trainer`,
# `openrlhf.models` and `openrlhf.utils` pull in (flash-attn and DeepSpeed excepted: the OpenRLHF
# test stands in for them).
"${pip[@]}" -e ".[server,verl,openrlhf]" "$TORCH_SPEC" \
  "transformers>=5.5.3,<5.11,!=5.6.0" \
  pytest pytest-asyncio pytest-timeout \
  omegaconf hydra-core codetiming psutil "ray>=2.41" datasets torchdata uvicorn fastapi pillow cachetools \
  pylatexenc
"${pip[@]}" --no-deps "$VERL_SPEC" "$OPENRLHF_SPEC"
touch "$VENV/.installed"
