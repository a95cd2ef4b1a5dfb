"""Do the dashboard's figures agree with the benchmark's own, and the GPU memory gauges with torch.cuda?

Load: ``bench_batching.py``'s GRPO-like workload through the real gRPC server in this process,
as its method (c): ``--clients`` client threads, requests of ``--group-size`` sequences (same
flags, same defaults). ``--warmup`` untimed passes, then ``--repeats`` timed passes.

/metrics is scraped over HTTP right before the first timed pass and right after the last, and
the dashboard's PromQL is evaluated on the two scrapes (``promstats``):

* tokens/s = ``rate(logprob_tokens_scored_total[window])`` against the benchmark's real tokens
  over the same wall time;
* p50/p99 = ``histogram_quantile(q, sum by (le) (rate(logprob_request_duration_seconds_bucket[window])))``
  (Prometheus' interpolation within a bucket) against the percentiles of the round trips the
  clients measured (numpy, linear). The server's figure is the request's time in the server
  (``metadata.total_ns``), the client's adds gRPC transport and protobuf, so the client's is a
  little higher; within a bucket the interpolation can be off by up to the bucket's width
  (buckets are at most x1.67 apart).

Then, on CUDA, with the server idle: the ``logprob_gpu_memory_*`` gauges of one more scrape
against ``torch.cuda.memory_allocated / memory_reserved / mem_get_info`` read in this (the
server's) process right after it.

On a GPU (Qwen2.5-0.5B and 1.5B shapes, bf16, 256 sequences, 8 clients, as in RESULTS.md; a few
minutes on an H200):

    PYTHONPATH=service:client python3 benchmarks/bench_metrics.py

On a CPU (tiny Qwen2, float32, 16 short sequences, 2 clients; GPU memory n/a):

    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_metrics.py --smoke

The report is printed last, and written to ``$OUT/bench_metrics.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass

import numpy as np
import promstats
import torch
from bench_batching import (
    MODEL_NAME,
    grpc_pass,
    log,
    open_clients,
    parse_args,
    resolve_device,
    server_settings,
    workload_for,
)
from common import LoopbackServer, ModelShape, build_model
from harness import publish, release, run_environment, synchronize
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.scorer import CausalLMScorer
from logprob_service.models.served import serve_model
from logprob_service.observability.metrics import start_metrics_server


@dataclass(frozen=True)
class Compared:
    figure: str
    benchmark: float | None
    dashboard: float | None
    unit: str


def _cell(value: float | None, unit: str) -> str:
    if value is None or np.isnan(value):
        return "n/a"
    return f"{value:,.0f}" if unit in ("tokens/s", "bytes") else f"{value:,.1f}"


def format_rows(title: str, left: str, right: str, rows: list[Compared]) -> str:
    lines = [f"| {title} | {left} | {right} | ratio |", "|---|---:|---:|---:|"]
    for r in rows:
        ratio = r.dashboard / r.benchmark if r.benchmark and r.dashboard is not None else None
        ratio_text = "n/a" if ratio is None or np.isnan(ratio) else f"{ratio:.4f}"
        lines.append(
            f"| {r.figure} ({r.unit}) | {_cell(r.benchmark, r.unit)} | {_cell(r.dashboard, r.unit)} | {ratio_text} |"
        )
    return "\n".join(lines)


def load_figures(
    before: promstats.Scrape, after: promstats.Scrape, latencies_ms: list[float], real_tokens: int
) -> list[Compared]:
    """The dashboard's throughput and latency figures beside the clients' own."""
    window_s = after.taken_at - before.taken_at
    rows = [
        Compared(
            "tokens/s over the timed passes",
            real_tokens / window_s,
            promstats.rate(before, after, "logprob_tokens_scored_total", model=MODEL_NAME),
            "tokens/s",
        )
    ]
    for q in (0.5, 0.99):
        buckets = promstats.bucket_increases(before, after, "logprob_request_duration_seconds", model=MODEL_NAME)
        rows.append(
            Compared(
                f"p{round(q * 100)} request latency",
                float(np.percentile(latencies_ms, q * 100)),
                promstats.histogram_quantile(q, buckets) * 1e3,
                "ms",
            )
        )
    for metric, name in (
        ("logprob_request_queue_duration_seconds", "queue"),
        ("logprob_request_compute_duration_seconds", "compute"),
    ):
        buckets = promstats.bucket_increases(before, after, metric, model=MODEL_NAME)
        rows.append(
            Compared(f"p99 {name} time (server only)", None, promstats.histogram_quantile(0.99, buckets) * 1e3, "ms")
        )
    return rows


def memory_figures(scrape: promstats.Scrape, device: torch.device) -> list[Compared]:
    """The GPU memory gauges beside torch.cuda's figures, read right after the scrape."""
    free, total = torch.cuda.mem_get_info(device)
    torch_figures = {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "free": free,
        "total": total,
        # Since the last micro-batch's reset of torch's peak counter: a lower bound of the gauge.
        "peak_allocated": torch.cuda.max_memory_allocated(device),
    }
    label = str(device)
    return [
        Compared(
            f"{name}{' (torch: since the last micro-batch)' if name == 'peak_allocated' else ''}",
            float(value),
            scrape.total(f"logprob_gpu_memory_{name}_bytes", device=label),
            "bytes",
        )
        for name, value in torch_figures.items()
    ]


def describe(args: argparse.Namespace, device: torch.device) -> str:
    return "\n".join(
        [
            "# The dashboard's figures against the benchmark's own",
            "",
            *run_environment(device),
            f"load per shape: {args.warmup} warm-up + {args.repeats} timed passes of {args.sequences} sequences "
            f"(prompt U{list(args.prompt_range)} + completion U{list(args.completion_range)} tokens), as requests "
            f"of {args.group_size} from {args.clients} client threads; max_batch_tokens {args.max_batch_tokens}",
        ]
    )


def run_shape(shape: ModelShape, args: argparse.Namespace, device: torch.device, url: str) -> str:
    """Load the server with one shape's model; the report's section for it."""
    log(f"{shape.name} shape: building the model")
    model = build_model(shape, device, getattr(torch, args.dtype), args.seed)
    scorer = CausalLMScorer(model)
    registry = ModelRegistry()
    registry.add(serve_model(MODEL_NAME, "random", scorer))
    workload = workload_for(args, shape.vocab)
    with LoopbackServer(server_settings(args, device), registry) as target:
        clients = open_clients(target, args.clients)
        try:
            for i in range(args.warmup):
                log(f"  warm-up pass {i + 1}/{args.warmup}")
                grpc_pass(clients, workload)
            latencies: list[float] = []
            before = promstats.scrape(url)
            for i in range(args.repeats):
                log(f"  timed pass {i + 1}/{args.repeats}")
                latencies += grpc_pass(clients, workload).latencies_ms
            after = promstats.scrape(url)
        finally:
            for client in clients:
                client.close()
        window_s = after.taken_at - before.taken_at
        lines = [
            f"## {shape.name} shape, {args.dtype}: {len(latencies)} requests in {window_s:.2f} s between the scrapes",
            "",
            format_rows(
                "figure",
                "benchmark (clients)",
                "dashboard (PromQL on /metrics)",
                load_figures(before, after, latencies, args.repeats * workload.real_tokens),
            ),
        ]
        if device.type == "cuda":
            synchronize(device)
            idle = promstats.scrape(url)
            rows = memory_figures(idle, device)
            lines += ["", format_rows(f"GPU memory of {device}, idle", "torch.cuda", "/metrics gauge", rows)]
        else:
            lines += ["", "GPU memory: n/a (no CUDA device)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    metrics_server = start_metrics_server("127.0.0.1", 0)
    url = f"http://127.0.0.1:{metrics_server.server_port}/metrics"
    try:
        sections = [describe(args, device)]
        for shape in args.shape_list:
            sections.append(run_shape(shape, args, device, url))
            gc.collect()  # the shape's model and server go before the next model is built
            release(device)
    finally:
        metrics_server.shutdown()
        metrics_server.server_close()
    report = "\n\n".join(sections) + "\n"
    publish(report, "bench_metrics.md")


if __name__ == "__main__":
    main()
