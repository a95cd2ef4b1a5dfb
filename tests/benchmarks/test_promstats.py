"""The benchmark's PromQL arithmetic on scrapes: rate, and Prometheus' histogram_quantile.

(The Prometheus integration test also checks histogram_quantile against a real server.)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import promstats

INF = math.inf


@pytest.mark.parametrize(
    "q,buckets,expected",
    [
        (0.5, [(1, 10), (2, 20), (INF, 20)], 1.0),  # rank 10 ends the first bucket
        (0.75, [(1, 10), (2, 20), (INF, 20)], 1.5),  # halfway into (1, 2]
        (0.25, [(1, 10), (2, 20), (INF, 20)], 0.5),  # the first bucket starts at 0
        (0.9, [(1, 10), (2, 20), (INF, 30)], 2.0),  # rank in +Inf: the highest finite bound
        (0.5, [(2, 20), (1, 10), (INF, 20)], 1.0),  # order of the input does not matter
        (0.75, [(1, 6), (1, 4), (2, 10), (2, 10), (INF, 20)], 1.5),  # equal bounds add up (several series)
        (0.75, [(1, 10), (2, 9), (INF, 20)], 2.0),  # non-monotonic counts are made monotonic: (1, 2] is empty
        (0.5, [(1, 0), (INF, 0)], math.nan),  # no observations
        (0.5, [(1, 10), (2, 20)], math.nan),  # no +Inf bucket
        (-0.1, [(1, 10), (INF, 10)], -INF),
        (1.1, [(1, 10), (INF, 10)], INF),
    ],
)
def test_histogram_quantile_interpolates_as_prometheus_does(q, buckets, expected):
    got = promstats.histogram_quantile(q, buckets)
    assert got == expected or (math.isnan(got) and math.isnan(expected))


def test_rate_and_bucket_increases_from_two_scrapes():
    text = """# TYPE x_total counter
x_total{model="a"} {a}
x_total{model="b"} 100
# TYPE h histogram
h_bucket{model="a",le="1.0"} {h1}
h_bucket{model="a",le="+Inf"} {hinf}
h_sum{model="a"} 0
h_count{model="a"} {hinf}
"""
    before = promstats.parse(text.replace("{a}", "10").replace("{h1}", "2").replace("{hinf}", "3"), taken_at=5.0)
    after = promstats.parse(text.replace("{a}", "30").replace("{h1}", "6").replace("{hinf}", "11"), taken_at=9.0)
    assert promstats.rate(before, after, "x_total", model="a") == 5.0
    assert promstats.rate(before, after, "x_total") == 5.0  # b did not move
    assert promstats.bucket_increases(before, after, "h", model="a") == [(1.0, 4.0), (INF, 8.0)]
