#!/usr/bin/env bash
# Install logprob-service into a virtual environment. `make install` (and so CI) and the Dockerfile
# both run this script, so every CI run exercises the image's install steps.
#
#   TORCH_SPEC  the torch requirement, installed first (required): CI's CPU build (`torch==2.13.0`
#               from a local wheel), or in the image the build of one CUDA line (TORCH_INDEX)
#   TORCH_INDEX the index torch comes from, e.g. https://download.pytorch.org/whl/cu128 (the image's
#               default) or .../whl/cpu (a CPU build: no CUDA libraries)   [empty: pip's own indexes]
#   VENV        the environment, created if missing                               [.venv]
#   PYTHON      the interpreter that creates it                                   [python3]
#   EXTRAS      the project's extras: dev (server, TRL and test tools), or server,gpu (the image) [dev]
#   EDITABLE    1: an editable install of this checkout (development); 0: a regular one (the image) [1]
set -euo pipefail
cd "$(dirname "$0")/.."

: "${TORCH_SPEC:?set TORCH_SPEC, e.g. torch==2.13.0}"
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-dev}
EDITABLE=${EDITABLE:-1}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/pip" install --quiet)
# torch alone first, then the project with the same spec again: the extras' looser `torch>=2.6` is
# met by the build just installed and pip can never swap in another one (a CUDA build in CI).
if [ -n "${TORCH_INDEX:-}" ]; then
  "${pip[@]}" --index-url "$TORCH_INDEX" "$TORCH_SPEC"
else
  "${pip[@]}" "$TORCH_SPEC"
fi
if [ "$EDITABLE" = 1 ]; then
  "${pip[@]}" -e ".[$EXTRAS]" "$TORCH_SPEC"
else
  "${pip[@]}" ".[$EXTRAS]" "$TORCH_SPEC"
fi
