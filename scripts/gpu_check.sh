#!/usr/bin/env bash
# One GPU session's checks, in one call: the whole test suite (GPU tests included), then the
# benchmarks. Run on the lent GPU from the repo root, after installing the wheels .whl/ carries
# (see ../shared/device/README.md). Logs go to $OUT when set.
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONPATH=$PWD/service:$PWD/client:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider -rs "$@" 2>&1 | tee "$out/pytest.log" | tail -25
python3 benchmarks/bench_scoring.py 2>&1 | tee "$out/bench_scoring.log"
python3 benchmarks/bench_batching.py 2>&1 | tee "$out/bench_batching.log"
python3 benchmarks/bench_logprobs.py 2>&1 | tee "$out/bench_logprobs.log"
python3 benchmarks/bench_attention.py 2>&1 | tee "$out/bench_attention.log"
python3 benchmarks/bench_metrics.py 2>&1 | tee "$out/bench_metrics.log"
