"""A real Prometheus server (Debian's ``prometheus``) scrapes a running service; its HTTP API then
answers the request counter, a latency quantile, and every query of the dashboard.

Prometheus runs on a free port with its own config (1 s scrapes) and a temporary storage
directory, and is stopped at the end. Skipped, saying why, when the binary is absent.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, generate_latest

from tests.helpers.calls import call, request
from tests.helpers.deploy import NO_PROMETHEUS, ROOT, dashboard, dashboard_queries, which

sys.path.insert(0, str(ROOT / "benchmarks"))
import promstats

PROMETHEUS = which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS.format("prometheus"))
JOB = "logprob-service"
TIMEOUT_S = 30.0
# The overview's p99 latency and tokens/s panels.
OVERVIEW_P99 = "histogram_quantile(0.99, sum by (le) (rate(logprob_request_duration_seconds_bucket"
OVERVIEW_TOKENS = "sum(rate(logprob_tokens_scored_total"  # for Prometheus to start, and to scrape what the test did


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """Its HTTP API; every call blocks, so tests run them in a thread."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict]:
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        """The value of a one-series answer; None while there is none."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, expected: float) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while (got := self.scalar(expr)) != expected:
            assert time.monotonic() < deadline, f"{expr} = {got}, expected {expected}, after {TIMEOUT_S} s"
            time.sleep(0.2)


@pytest.fixture
def prometheus(tmp_path: Path, metrics_url: str):
    target = urllib.parse.urlsplit(metrics_url).netloc
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = Prometheus(port)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not api.ready():
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "Prometheus did not become ready"
            time.sleep(0.1)
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def registry_now() -> promstats.Scrape:
    return promstats.parse(generate_latest(REGISTRY).decode(), time.monotonic())


def substitute(expr: str) -> str:
    """A dashboard query as Grafana sends it, with every variable set to 'all'."""
    expr = expr.replace("$__rate_interval", "1m").replace('"$job"', f'"{JOB}"')
    return re.sub(r'"\$\w+"', '".*"', expr)


async def test_prometheus_scrapes_the_service_and_answers_the_counter_and_a_latency_quantile(running, prometheus, rng):
    # Prometheus' first scrape of the warm server, then the requests this test sends.
    await asyncio.to_thread(prometheus.wait_for, f'up{{job="{JOB}"}}', 1.0)
    for _ in range(3):
        await asyncio.gather(
            *(
                call(running.target, request((rng.integers(0, 4096, n).tolist(), rng.integers(0, 4096, n).tolist())))
                for n in rng.integers(1, 120, 4)
            )
        )
    now = registry_now()  # the server is idle: what Prometheus scrapes next

    # The request counter, exactly as the service counts it.
    counter = f'sum(logprob_requests_total{{job="{JOB}", model="default", rpc="ScoreTokens", code="OK"}})'
    expected = now.total("logprob_requests_total", model="default", rpc="ScoreTokens", code="OK")
    assert expected >= 12
    await asyncio.to_thread(prometheus.wait_for, counter, expected)

    # A latency quantile over the cumulative buckets: Prometheus' interpolation equals the one
    # the benchmark uses (promstats) on the same counts.
    selector = f'logprob_request_duration_seconds_bucket{{job="{JOB}", model="default"}}'
    quantile = f"histogram_quantile(0.9, sum by (le) ({selector}))"
    buckets = [
        (float(dict(labels)["le"]), v)
        for labels, v in now.select("logprob_request_duration_seconds_bucket", model="default").items()
    ]
    got = await asyncio.to_thread(prometheus.scalar, quantile)
    assert got == pytest.approx(promstats.histogram_quantile(0.9, buckets), rel=1e-12)

    # The dashboard's own p99, a quantile of rates: a value within the observed buckets. (Not
    # compared with the requests above: Prometheus extrapolates each bucket's rate on its own,
    # and while Prometheus is younger than the window the extrapolations differ between
    # buckets, which moves the quantile; bench_metrics.py compares over a window of scrapes.)
    queries = dashboard_queries(dashboard())
    p99 = await asyncio.to_thread(prometheus.scalar, substitute(next(q for q in queries if q.startswith(OVERVIEW_P99))))
    filled = [le for le, count in buckets if count > 0 and not math.isinf(le)]
    assert p99 is not None and 0 < p99 <= max(filled), (p99, buckets)
    tokens_per_s = await asyncio.to_thread(
        prometheus.scalar, substitute(next(q for q in queries if q.startswith(OVERVIEW_TOKENS)))
    )
    assert tokens_per_s is not None and tokens_per_s > 0

    # Every query of the dashboard is valid PromQL for a real Prometheus.
    for expr in queries:
        if not expr.startswith("label_values("):  # Grafana's own variable function
            await asyncio.to_thread(prometheus.query, substitute(expr))
