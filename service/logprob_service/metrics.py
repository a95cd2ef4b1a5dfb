"""Prometheus series (prefix ``logprob_``) and the /metrics HTTP endpoint.

The core request series live here; the observability issue extends this module with queue,
batch and GPU-memory series and the dashboards.
"""

from __future__ import annotations

import logging

import grpc
from prometheus_client import Counter, Gauge, Histogram, Info, start_http_server

from . import __version__

log = logging.getLogger(__name__)

# 1 ms .. 5 min, roughly x2.5 per bucket.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300)

REQUESTS = Counter("logprob_requests", "RPCs answered, by method and final status code.", ["rpc", "code"])
REQUEST_DURATION = Histogram(
    "logprob_request_duration_seconds", "RPC wall time, arrival to answer.", ["rpc"], buckets=LATENCY_BUCKETS
)
TOKENS_SCORED = Counter("logprob_tokens_scored", "Prompt + completion tokens scored.", ["model"])
SEQUENCES_SCORED = Counter("logprob_sequences_scored", "Sequences scored.", ["model"])
QUEUED_TOKENS = Gauge("logprob_queue_tokens", "Tokens admitted and not yet scored.")
BUILD = Info("logprob_build", "Version of the running service.")
BUILD.info({"version": __version__})


def observe_rpc(rpc: str, code: grpc.StatusCode, seconds: float) -> None:
    REQUESTS.labels(rpc=rpc, code=code.name).inc()
    REQUEST_DURATION.labels(rpc=rpc).observe(seconds)


def observe_scored(model: str, tokens: int, sequences: int) -> None:
    TOKENS_SCORED.labels(model=model).inc(tokens)
    SEQUENCES_SCORED.labels(model=model).inc(sequences)


def start_metrics_server(host: str, port: int) -> None:
    """Serve /metrics on its own port (0 disables it)."""
    if port == 0:
        return
    start_http_server(port, addr=host)
    log.info("Prometheus metrics on http://%s:%d/metrics", host, port)
