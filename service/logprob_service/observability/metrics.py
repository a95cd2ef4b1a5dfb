"""Prometheus series (prefix ``logprob_``) and the /metrics HTTP endpoint.

Names and shapes follow what operators already scrape from text-embeddings-inference, Triton
and vLLM: requests by status, latency histograms in seconds, batch-size histograms, queue
gauges, GPU memory gauges per device. The process's host memory, CPU time and open files are
prometheus-client's own process collector (``process_resident_memory_bytes`` and kin, on Linux),
which the default registry already holds; nothing here re-counts them.

Series labelled ``model`` carry only names of served models: a request for an unknown name is
counted with ``model=""``, so callers cannot create series at will.

Fed two ways, so nothing below this layer imports prometheus-client: the engine, the worker and
the weight updates report ``stats`` records to a ``PrometheusStats``; the served models and their
GPUs' memory are read at scrape time from each server's ``stats.ServerView`` (``track``: its
engine facade, which answers in domain objects): nothing here reaches into the engine or torch.
"""

from __future__ import annotations

import logging
import platform
import weakref
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import ClassVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from logprob_service import __version__
from logprob_service.domain import ModelInfo
from logprob_service.settings.errors import StartupError
from logprob_service.stats import (
    BatchLaunched,
    BatchMemory,
    Limits,
    QueueChanged,
    RefusalHeld,
    RequestScored,
    ServerView,
    Stat,
    WeightsUpdated,
)

log = logging.getLogger(__name__)

# 1 ms .. 5 min, at most x1.67 apart, so a quantile interpolated inside a bucket stays close to
# the true one (Prometheus assumes observations spread evenly within a bucket).
LATENCY_BUCKETS = (
    0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300,
)  # fmt: skip
TOKEN_BUCKETS = tuple(2**k for k in range(4, 21))  # 16 .. 1M tokens
SEQUENCE_BUCKETS = tuple(2**k for k in range(13))  # 1 .. 4096 sequences
MEMORY_BUCKETS = (*(int(m * 2**k) for k in range(26, 38) for m in (1, 1.5)), 2**38)  # 64 MiB .. 256 GiB


def _latency_seconds(name: str, doc: str) -> Histogram:
    """A per-model latency histogram in seconds, on the shared buckets."""
    return Histogram(name, doc, ["model"], buckets=LATENCY_BUCKETS)


# Requests and their latency.
REQUESTS = Counter(
    "logprob_requests",
    "Requests answered, by model, RPC (an HTTP route's path), final status code (gRPC's name; an HTTP answer "
    "the name of the error it stands for) and protocol (grpc, http).",
    ["model", "rpc", "code", "protocol"],
)
REQUEST_DURATION = _latency_seconds(
    "logprob_request_duration_seconds",
    "Scored requests: arrival at the scheduler to result (the response's metadata.total_ns).",
)
QUEUE_DURATION = _latency_seconds(
    "logprob_request_queue_duration_seconds",
    "Scored requests: arrival to the first micro-batch holding them (metadata.queue_ns).",
)
COMPUTE_DURATION = _latency_seconds(
    "logprob_request_compute_duration_seconds",
    "Scored requests: device time of the micro-batches holding them, launch to results (metadata.compute_ns).",
)
REFUSALS_HELD = Counter(
    "logprob_refusals_held",
    "Refused calls held before their answer, their client past its refusal_burst (refusals_per_s), by edge (grpc, "
    "http).",
    ["edge"],
)
TOKENS_SCORED = Counter("logprob_tokens_scored", "Prompt + completion tokens scored.", ["model"])
SEQUENCES_SCORED = Counter("logprob_sequences_scored", "Sequences scored.", ["model"])

# Micro-batches and the queue.
BATCH_TOKENS = Histogram(
    "logprob_batch_tokens",
    "Real tokens in each packed micro-batch launched.",
    ["model", "device"],
    buckets=TOKEN_BUCKETS,
)
PROMPT_TOKENS_SHARED = Counter(
    "logprob_prompt_tokens_shared",
    "Prompt tokens not run because another sequence of the same micro-batch had the same prompt (share_prompts).",
    ["model"],
)
BATCH_SEQUENCES = Histogram(
    "logprob_batch_sequences",
    "Sequences in each packed micro-batch launched.",
    ["model", "device"],
    buckets=SEQUENCE_BUCKETS,
)
QUEUE_REQUESTS = Gauge("logprob_queue_requests", "Requests admitted and not yet answered.", ["model"])
QUEUE_TOKENS = Gauge(
    "logprob_queue_tokens",
    "Tokens admitted and not yet scored (waiting or on the device), as the queue counts them: a shared prompt once "
    "in each micro-batch, and its completions' reads of it.",
    ["model"],
)
BATCH_TOKENS_LIMIT = Gauge("logprob_batch_tokens_limit", "The max_batch_tokens setting.")
BATCH_SEQUENCES_LIMIT = Gauge("logprob_batch_sequences_limit", "The max_batch_sequences setting.")
QUEUE_TOKENS_LIMIT = Gauge("logprob_queue_tokens_limit", "The max_queued_tokens setting.")

# GPU memory of each micro-batch (the current figures are read at scrape time, below).
BATCH_PEAK_MEMORY = Histogram(
    "logprob_gpu_memory_batch_peak_bytes",
    "Peak bytes allocated on the device while each micro-batch was launched, weights included.",
    ["device"],
    buckets=MEMORY_BUCKETS,
)

# What is running.
BUILD = Info("logprob_build", "Versions of the running service and its main libraries.")
WEIGHT_UPDATE_DURATION = _latency_seconds(
    "logprob_weight_update_seconds",
    "Weight updates that went live: from their first message to the end of the swap.",
)
WEIGHT_SWAP_DURATION = _latency_seconds(
    "logprob_weight_swap_seconds",
    "The swap alone of each weight update: scoring of the model paused for this long.",
)
WEIGHT_UPDATE_BYTES = Counter("logprob_weight_update_bytes", "Bytes of weights replaced by updates.", ["model"])

_views: weakref.WeakSet[ServerView] = weakref.WeakSet()  # the servers of this process


def _library_version(name: str) -> str:
    try:
        return package_version(name)
    except PackageNotFoundError:
        return "unknown"


_BUILD = {
    "version": __version__,
    "python": platform.python_version(),
    "torch": _library_version("torch"),
    "cuda": "unknown",  # the start-up module tells (``describe_runtime``): it is torch's build, not a package's
    "transformers": _library_version("transformers"),
    "grpcio": _library_version("grpcio"),
}
BUILD.info(_BUILD)


def describe_runtime(*, cuda: str) -> None:
    """``logprob_build_info``'s ``cuda``: the CUDA version torch was built with ("none": a CPU build)."""
    BUILD.info({**_BUILD, "cuda": cuda})


def track(view: ServerView) -> None:
    """Export a server's models and its GPUs' memory, read from ``view``, while ``view`` lives."""
    _views.add(view)


def _served_infos() -> list[ModelInfo]:
    return [info for view in list(_views) for info in view.models()]


class ModelsCollector(Collector):
    """``logprob_model_info`` (value 1, described by labels) and ``logprob_model_version`` of every
    served model, read from the registries at scrape time: they move with a weight swap."""

    LABELS = ("model", "architecture", "source", "dtype", "weight_format", "device", "version", "fingerprint")

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "logprob_model_info", "Served models (value 1), described by labels.", labels=self.LABELS
            ),
            GaugeMetricFamily(
                "logprob_model_version", "Version of the weights each served model scores with.", labels=["model"]
            ),
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info, version = self._families()
        for m in _served_infos():
            labels = [
                m.name,
                m.architecture,
                m.source,
                m.dtype,
                m.weight_format,
                m.device,
                str(m.version),
                m.fingerprint,
            ]
            info.add_metric(labels, 1)
            version.add_metric([m.name], m.version)
        yield from (info, version)


class GpuMemoryCollector(Collector):
    """Per-device memory of the GPUs that hold served models, read at scrape time.

    Off CUDA the families are still declared (with no samples), so dashboards and alert rules
    name series that every server exports.
    """

    FAMILIES: ClassVar[dict[str, str]] = {
        "logprob_gpu_memory_allocated_bytes": "Bytes held by live tensors (torch.cuda.memory_allocated).",
        "logprob_gpu_memory_reserved_bytes": "Bytes held by torch's caching allocator (torch.cuda.memory_reserved).",
        "logprob_gpu_memory_free_bytes": "Free bytes on the device, for every process (torch.cuda.mem_get_info).",
        "logprob_gpu_memory_total_bytes": "The device's memory (torch.cuda.mem_get_info).",
        "logprob_gpu_memory_peak_allocated_bytes": "Highest allocated bytes since the server started.",
    }

    def _families(self) -> dict[str, GaugeMetricFamily]:
        return {name: GaugeMetricFamily(name, doc, labels=["device"]) for name, doc in self.FAMILIES.items()}

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families().values()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = self._families()
        memories = {device: memory for view in list(_views) for device, memory in view.device_memory().items()}
        for device, memory in sorted(memories.items()):
            for name, value in (
                ("logprob_gpu_memory_allocated_bytes", memory.allocated),
                ("logprob_gpu_memory_reserved_bytes", memory.reserved),
                ("logprob_gpu_memory_free_bytes", memory.free),
                ("logprob_gpu_memory_total_bytes", memory.total),
                ("logprob_gpu_memory_peak_allocated_bytes", memory.peak_allocated),
            ):
                families[name].add_metric([device], value)
        yield from families.values()


REGISTRY.register(ModelsCollector())
REGISTRY.register(GpuMemoryCollector())


# ----------------------------------------------------------------------------- observations


_labelled: set[str] = set()  # names of models served by this process's servers, now or before


def model_label(name: str) -> str:
    """``name`` if a server of this process serves or served a model of that name, else "" (bounded
    label values: operators name models, callers cannot). A name once served stays a label, so a
    record that comes after its server is gone (a cancelled request's release) moves its series."""
    if name not in _labelled and any(info.name == name for info in _served_infos()):
        _labelled.add(name)
    return name if name in _labelled else ""


def observe_request(model: str, rpc: str, code: str, protocol: str = "grpc") -> None:
    """One answered request, by the name of its final status (gRPC's names, which the HTTP edge's
    errors share: ``errors.ErrorCode``), and the edge that answered it."""
    REQUESTS.labels(model=model_label(model), rpc=rpc, code=code, protocol=protocol).inc()


class PrometheusStats:
    """The ``stats.StatsSink`` that turns the engine's, worker's and updates' records into series."""

    def record(self, stat: Stat) -> None:
        match stat:
            case QueueChanged(model, requests, tokens):
                if requests:
                    QUEUE_REQUESTS.labels(model).inc(requests)
                if tokens:
                    QUEUE_TOKENS.labels(model).inc(tokens)
            case BatchLaunched(model, tokens, sequences, shared_tokens, device):
                BATCH_TOKENS.labels(model, device).observe(tokens)
                BATCH_SEQUENCES.labels(model, device).observe(sequences)
                PROMPT_TOKENS_SHARED.labels(model).inc(shared_tokens)
            case RequestScored(model, tokens, sequences, timings):
                TOKENS_SCORED.labels(model).inc(tokens)
                SEQUENCES_SCORED.labels(model).inc(sequences)
                REQUEST_DURATION.labels(model).observe(timings.total_ns / 1e9)
                QUEUE_DURATION.labels(model).observe(timings.queue_ns / 1e9)
                COMPUTE_DURATION.labels(model).observe(timings.compute_ns / 1e9)
            case BatchMemory(device, peak_bytes):
                BATCH_PEAK_MEMORY.labels(device).observe(peak_bytes)
            case WeightsUpdated(model, nbytes, total_ns, swap_ns):
                WEIGHT_UPDATE_DURATION.labels(model).observe(total_ns / 1e9)
                WEIGHT_SWAP_DURATION.labels(model).observe(swap_ns / 1e9)
                WEIGHT_UPDATE_BYTES.labels(model).inc(nbytes)
            case RefusalHeld(edge):
                REFUSALS_HELD.labels(edge).inc()
            case Limits(max_batch_tokens, max_batch_sequences, max_queued_tokens):
                BATCH_TOKENS_LIMIT.set(max_batch_tokens)
                BATCH_SEQUENCES_LIMIT.set(max_batch_sequences)
                QUEUE_TOKENS_LIMIT.set(max_queued_tokens)


def start_metrics_server(host: str, port: int) -> WSGIServer:
    """Serve /metrics on its own port (0 picks a free one: see the returned server's ``server_port``);
    StartupError naming the address and the flag if it cannot."""
    try:
        server, _ = start_http_server(port, addr=host)
    except OSError as err:  # was a traceback ending in "[Errno 98] Address already in use"
        raise StartupError(
            f"cannot serve metrics on {host}:{port} (--metrics-port; 0 turns metrics off): {err.strerror}"
        ) from None
    log.info("Prometheus metrics on http://%s:%d/metrics", host, server.server_port)
    return server
