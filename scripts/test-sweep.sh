#!/usr/bin/env bash
# The numerical tests (marker `numerical`) once per seed in 0..SEEDS-1, the seeds split over JOBS
# processes of one thread each (default: one per core), so that no tolerance holds by luck of one
# seed. Each process logs to $LOG_DIR/seedsA-B.log; the script prints each range's result and
# exits non-zero if any range failed (its log has the failing seed and the replay command).
# Usage: scripts/test-sweep.sh [SEEDS] [JOBS]; PYTEST_ARGS is passed on; PYTHON picks the interpreter.
set -uo pipefail
seeds=${1:-200}
jobs=${2:-$(nproc)}
python=${PYTHON:-.venv/bin/python}
log_dir=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/logprob-sweep.XXXXXX")}
mkdir -p "$log_dir"
(( jobs > seeds )) && jobs=$seeds
echo "sweep: seeds 0-$((seeds - 1)) over $jobs processes; logs in $log_dir"
start=$(date +%s)
pids=() ranges=()
for j in $(seq 0 $((jobs - 1))); do
  lo=$((j * seeds / jobs))
  hi=$(((j + 1) * seeds / jobs - 1))
  ranges+=("$lo-$hi")
  # One thread per process: JOBS processes share the cores instead of fighting over them.
  OMP_NUM_THREADS=1 LOGPROB_TEST_SEEDS="$lo-$hi" "$python" -m pytest -m numerical -q \
    -p no:cacheprovider ${PYTEST_ARGS:-} >"$log_dir/seeds$lo-$hi.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then status=passed; else status=FAILED; failed=1; fi
  echo "seeds ${ranges[$i]}: $status: $(grep -E "[0-9]+ (passed|failed)" "$log_dir/seeds${ranges[$i]}.log" | tail -n 1)"
done
echo "sweep: $seeds seeds in $(($(date +%s) - start)) s: $([[ $failed == 0 ]] && echo passed || echo FAILED)"
exit $failed
