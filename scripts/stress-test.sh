#!/usr/bin/env bash
# `make test` in RUNS fresh clones of HEAD, one after another, as CI runs it: a test that fails
# by chance fails here sooner or later. Stops at the first failing run and keeps its clone and
# log; prints each run's time and result. Usage: scripts/stress-test.sh [RUNS] (default 10).
# The image test (marker image) is left out: it builds a 2.4 GB image each time (~4-5 minutes
# here), which `make test` in CI does once; `make image-test` repeats it on its own.
set -uo pipefail
runs=${1:-10}
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d "${TMPDIR:-/tmp}/logprob-stress.XXXXXX")
echo "stress: $runs fresh clones of $(git -C "$root" rev-parse --short HEAD) under $work"
for i in $(seq 1 "$runs"); do
  clone="$work/run$i"
  git clone -q "$root" "$clone"
  start=$(date +%s)
  if make -C "$clone" test PYTEST_ARGS="-q -p no:cacheprovider -m 'not image'" >"$work/run$i.log" 2>&1; then
    echo "run $i: passed in $(($(date +%s) - start)) s: $(grep -E "[0-9]+ passed" "$work/run$i.log" | tail -n 1)"
    rm -rf "$clone"
  else
    echo "run $i: FAILED after $(($(date +%s) - start)) s; log: $work/run$i.log, clone: $clone"
    grep -E "^(FAILED|ERROR)|replay it with" "$work/run$i.log"
    exit 1
  fi
done
echo "stress: $runs of $runs runs passed"
