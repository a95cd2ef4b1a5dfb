"""What a Prometheus dashboard computes, from two scrapes of /metrics taken a window apart.

``rate`` is a counter's increase over the window divided by its length (Prometheus' ``rate()``
when the window starts and ends on a scrape); ``histogram_quantile`` is Prometheus' own bucket
interpolation (``bucketQuantile`` in promql/quantile.go), applied to the buckets' increases,
as ``histogram_quantile(q, sum by (le) (rate(x_bucket[w])))`` does. The Prometheus integration
test checks this implementation against a real Prometheus server on the same data.

Only the prometheus-client parser is needed (no torch), so tests import this module too.
"""

from __future__ import annotations

import math
import time
import urllib.request
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs


@dataclass(frozen=True)
class Scrape:
    """Every sample of one scrape, and when it was taken (time.monotonic())."""

    samples: dict[tuple[str, Labels], float]
    taken_at: float

    def select(self, name: str, **match: str) -> dict[Labels, float]:
        """Samples named ``name`` whose labels include ``match``."""
        wanted = set(match.items())
        return {labels: v for (n, labels), v in self.samples.items() if n == name and wanted <= set(labels)}

    def total(self, name: str, **match: str) -> float:
        return sum(self.select(name, **match).values())


def parse(text: str, taken_at: float) -> Scrape:
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return Scrape(samples, taken_at)


def scrape(url: str, timeout: float = 10.0) -> Scrape:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    return parse(text, time.monotonic())


def rate(before: Scrape, after: Scrape, name: str, **match: str) -> float:
    """Per-second increase of a counter (summed over matching series) between two scrapes."""
    return (after.total(name, **match) - before.total(name, **match)) / (after.taken_at - before.taken_at)


def bucket_increases(before: Scrape, after: Scrape, histogram: str, **match: str) -> list[tuple[float, float]]:
    """(upper bound, increase of the cumulative count) of each bucket, summed over matching series."""
    by_le: dict[float, float] = {}
    for scrape_, sign in ((after, 1.0), (before, -1.0)):
        for labels, value in scrape_.select(f"{histogram}_bucket", **match).items():
            le = float(dict(labels)["le"])
            by_le[le] = by_le.get(le, 0.0) + sign * value
    return sorted(by_le.items())


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float:
    """Prometheus' ``bucketQuantile``: linear interpolation within the bucket holding rank q * n.

    ``buckets``: (upper bound, cumulative count), the last one +Inf. Like Prometheus, the
    quantile of an empty histogram is NaN, a rank in the +Inf bucket answers the highest finite
    bound, and the first bucket starts at 0 (for positive bounds).
    """
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    merged: dict[float, float] = {}
    for le, count in buckets:  # buckets of equal bounds (from several series) add up
        merged[le] = merged.get(le, 0.0) + count
    ordered = sorted(merged.items())
    if not ordered or not math.isinf(ordered[-1][0]):
        return math.nan
    bounds = [le for le, _ in ordered]
    counts = []
    for _, count in ordered:  # Prometheus forces monotonic counts (scrapes are not atomic)
        counts.append(max(count, counts[-1]) if counts else count)
    if len(counts) < 2 or counts[-1] == 0:
        return math.nan
    rank = q * counts[-1]
    b = bisect_left(counts[:-1], rank)  # first bucket whose count >= rank
    if b == len(counts) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        start = bounds[b - 1]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    if count == 0:  # only for q = 0 with an empty first bucket: Go's 0/0
        return math.nan
    return start + (end - start) * (rank / count)
