"""The load test (benchmarks/load_test.py), shortened for CI: a few seconds at 5x the capacity
measured in the same run. LOGPROB_LOAD_FULL=1 runs the full 60 s."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import load_test

FULL = os.environ.get("LOGPROB_LOAD_FULL") == "1"


@pytest.mark.serial  # the rate it offers is measured against the capacity it measured
def test_five_times_capacity(seed):
    argv = ["--seed", str(seed)] + ([] if FULL else ["--duration-s", "4", "--measure-s", "2"])
    report = load_test.main(argv)
    assert not report.failures, report.failures
    # The checks the script made, restated where a reader of this test looks for them.
    ok, refused = report.of(grpc.StatusCode.OK), report.of(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert ok and refused and len(ok) + len(refused) == len(report.outcomes)
    assert all(o.correct for o in ok)
    assert report.offered_rps >= 0.9 * 5 * report.capacity_rps
