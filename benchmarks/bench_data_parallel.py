"""Data parallel inside one server: one gRPC endpoint over every GPU against the same server on one.

The GRPO-like workload of ``bench_batching.py`` (256 sequences, prompts ~U[256, 1024], completions
~U[64, 4096] tokens, requests of 8 sequences pulled by client threads from one queue, 32 by
default, in a process of their own as a trainer's would be) goes through the real grpc.aio server
of this process, first holding the model on ``cuda:0`` alone,
then one replica per GPU (``device="cuda:0,cuda:1,..."``: a lane per GPU, each micro-batch to the
lane with the fewest tokens in flight). Same random weights (Qwen2.5 shapes, bf16, seeded) on
every GPU. Per shape: real tokens/s of the median of ``--repeats`` timed passes after a warm-up
pass, the ratio of the two, and whether every request's log-probs are bitwise equal between the
two servers (they are scored in different micro-batches, on different GPUs; with the
deterministic setting, on by default, they must be).

Run (2 or more GPUs): PYTHONPATH=service:client python3 benchmarks/bench_data_parallel.py
Smoke run on the CPU: ... bench_data_parallel.py --smoke (two CPU lanes; the figures mean nothing)
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import statistics

import numpy as np
import torch
from bench_batching import MODEL_NAME, Workload, make_workload, timed_passes
from common import SHAPES, TINY, LoopbackServer, ModelShape, add_scoring_arguments, build_model, scoring_options
from harness import publish, run_environment
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.scorer import CausalLMScorer
from logprob_service.models.served import serve_model
from logprob_service.settings.model import Settings


def serve(shape: ModelShape, devices: list[torch.device], args: argparse.Namespace) -> tuple[Settings, ModelRegistry]:
    """A registry with one replica per device (the same seeded weights) and the settings naming them."""
    dtype = torch.float32 if devices[0].type == "cpu" else torch.bfloat16
    options = scoring_options(args)
    scorers = [CausalLMScorer(build_model(shape, d, dtype, seed=0), options=options) for d in devices]
    replicas = [serve_model(MODEL_NAME, "random", scorer) for scorer in scorers]
    registry = ModelRegistry()
    registry.add(replicas[0], replicas[1:])
    settings = Settings(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        models={MODEL_NAME: "random"},
        device=",".join(str(d) for d in devices),
        max_batch_tokens=args.max_batch_tokens,
    )
    return settings, registry


def synchronize(devices: list[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def measure(
    shape: ModelShape, devices: list[torch.device], workload: Workload, args: argparse.Namespace
) -> tuple[float, dict[int, list[np.ndarray]]]:
    """Median real tokens/s over the timed passes, and the last pass's log-probs by request."""
    settings, registry = serve(shape, devices, args)
    with LoopbackServer(settings, registry) as target:
        synchronize(devices)
        # The clients run in a process of their own, as a trainer does: in this one they would
        # take the GIL from the server (8-32 threads encoding requests and decoding results).
        spawn = multiprocessing.get_context("spawn")
        receive, send = spawn.Pipe(duplex=False)
        clients = spawn.Process(target=client_passes, args=(target, args.clients, workload, args.repeats, send))
        clients.start()
        seconds, results = receive.recv()
        clients.join()
    del registry
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next server's replicas take this one's memory
    return workload.real_tokens / statistics.median(seconds), results


def client_passes(
    target: str, count: int, workload: Workload, repeats: int, results: multiprocessing.connection.Connection
) -> None:
    """In the client process: ``timed_passes``, sent back."""
    results.send(timed_passes(target, count, workload, repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, two CPU lanes, a short workload")
    parser.add_argument("--shapes", default="0.5b,1.5b", help=f"comma-separated, of: {', '.join(SHAPES)}")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs for the data-parallel server (default: all)")
    parser.add_argument("--clients", type=int, default=32, help="client threads, in a process of their own")
    parser.add_argument("--max-batch-tokens", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    add_scoring_arguments(parser)
    args = parser.parse_args()
    if args.smoke:
        shapes, one, many = [TINY], [torch.device("cpu")], [torch.device("cpu")] * 2
        workload_args = (16, (4, 16), (2, 24))
        args.clients, args.max_batch_tokens, args.repeats = 2, 128, 1
    else:
        count = args.gpus or torch.cuda.device_count()
        if count < 2:
            raise SystemExit(f"needs 2 or more GPUs, found {torch.cuda.device_count()}")
        shapes = [SHAPES[name] for name in args.shapes.split(",")]
        one, many = [torch.device("cuda", 0)], [torch.device("cuda", i) for i in range(count)]
        workload_args = (256, (256, 1024), (64, 4096))

    lines = [
        f"# Data parallel inside one server: 1 device against {len(many)}, through one gRPC endpoint",
        *run_environment(one[0]),
        f"workload: {workload_args[0]} sequences, prompts U{workload_args[1]}, completions U{workload_args[2]}, "
        f"requests of 8 from {args.clients} clients (their own process); max_batch_tokens {args.max_batch_tokens}; "
        f"median of {args.repeats} passes after 1 warm-up",
        "",
        f"| shape | 1 device (tokens/s) | {len(many)} devices (tokens/s) | ratio | bitwise equal requests |",
        "|---|---|---|---|---|",
    ]
    for shape in shapes:
        workload = make_workload(*workload_args, shape.vocab, 8, seed=1)
        single, by_one = measure(shape, one, workload, args)
        parallel, by_many = measure(shape, many, workload, args)
        equal = sum(all(np.array_equal(a, b) for a, b in zip(by_one[i], by_many[i], strict=True)) for i in by_one)
        lines.append(
            f"| {shape.name} | {single:,.0f} | {parallel:,.0f} | {parallel / single:.2f}x | {equal} of {len(by_one)} |"
        )
    publish("\n".join(lines), "bench_data_parallel.md")


if __name__ == "__main__":
    main()
