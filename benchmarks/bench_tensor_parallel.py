"""Tensor parallel: one model sharded over 2 GPUs, against the same model on one, through one gRPC endpoint.

The GRPO-like workload of ``bench_batching.py`` (prompts ~U[256, 1024], completions ~U[64, 4096]
tokens, requests of 8 sequences pulled by client threads from one queue; fewer sequences than
there, ``--sequences``, as these models are slow) goes through the real grpc.aio server of this
process. The same seeded random weights (``common.RandomWeights``, Qwen2.5 shapes, bf16, untied
lm_head) are served:

* ``--shape 14b`` (default): on ``cuda:0`` alone (TP=1), then sharded over ``cuda:0`` and
  ``cuda:1`` (``tensor_parallel=2``: this process is rank 0, a spawned process rank 1). Real
  tokens/s of the median of ``--repeats`` passes after a warm-up pass, their ratio, and the
  largest difference between the two servers' log-probs (bf16 bodies summed in other orders:
  agreement at the bf16 level is what to expect; the vocab-parallel lm_head alone is checked
  against TP=1 to 1e-4 nats by ``tests/gpu/test_vocab_parallel_cuda.py``).
* ``--shape 72b``: too large for one GPU (145 GB of bf16 weights); TP=2 only: tokens/s, and the
  peak memory in use on each GPU (sampled every 20 ms: the driver's view, context included).

Both servers run with the same ``--compile-layers`` (default ``auto``: norms and MLPs compiled, as
served by default), so the ratio measures the parallelism, not the compiler.

Run (2 GPUs): PYTHONPATH=service:client python3 benchmarks/bench_tensor_parallel.py [--shape 72b]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import threading
from collections.abc import Callable

import numpy as np
import torch
from bench_batching import MODEL_NAME, Workload, make_workload, timed_passes
from common import (
    SHAPES,
    TINY,
    LoopbackServer,
    ModelShape,
    RandomWeights,
    add_scoring_arguments,
    build_model,
    scoring_options,
    shape_config,
)
from harness import publish, run_environment
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.served import ServedModel, serve_model
from logprob_service.models.tensor_parallel import TensorParallel, fill_shards_, run_locally_, sharded_skeleton
from logprob_service.ops.dispatch import select_logprob_op
from logprob_service.settings.model import Settings

SEED = 0


def dtype_on(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_rank(
    shape: ModelShape, options: ScoringOptions, tp: TensorParallel, device: torch.device
) -> dict[str, ServedModel]:
    """One rank's shards of the ``shape`` model (``worker.tensor_parallel.Build``: runs on every rank)."""
    model = sharded_skeleton(shape_config(shape), tp, device, dtype_on(device))
    run_locally_(fill_shards_(model, RandomWeights(shape, device, dtype_on(device), SEED), tp), tp)
    op = select_logprob_op("auto", device, invariant=True)
    scorer = CausalLMScorer(model, logprob_op=op, options=options, tensor_parallel=tp)
    return {MODEL_NAME: serve_model(MODEL_NAME, "random", scorer)}


def settings(devices: str, tensor_parallel: int, args: argparse.Namespace) -> Settings:
    return Settings(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        models={MODEL_NAME: "random"},
        device=devices,
        tensor_parallel=tensor_parallel,
        compile_layers=args.compile_layers,
        max_batch_tokens=args.max_batch_tokens,
    )


class PeakMemory:
    """The most memory in use on each GPU, as ``nvidia-smi`` reports it (every process's, context
    included; asking torch would open a context on the other rank's GPU), sampled on a thread."""

    def __init__(self, count: int) -> None:
        self.peak = [0] * count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.wait(0.2):
            try:
                used = subprocess.run(query, capture_output=True, text=True, check=True).stdout.split()
            except (OSError, subprocess.CalledProcessError):
                return  # no nvidia-smi (the CPU smoke run): no figures
            for i, mib in enumerate(used[: len(self.peak)]):
                self.peak[i] = max(self.peak[i], int(mib) * 2**20)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def passes(server: LoopbackServer, workload: Workload, args: argparse.Namespace) -> tuple[float, dict]:
    """Median real tokens/s of the timed passes, and the last pass's log-probs by request."""
    with server as target:
        seconds, results = timed_passes(target, args.clients, workload, args.repeats)
    return workload.real_tokens / statistics.median(seconds), results


def one_gpu(shape: ModelShape, workload: Workload, args: argparse.Namespace) -> tuple[float, dict]:
    device = torch.device(args.devices[0])
    model = RandomWeights(shape, device, dtype_on(device), SEED).fill_(build_model(shape, device, dtype_on(device), 0))
    op = select_logprob_op("auto", device, invariant=True)
    scorer = CausalLMScorer(model, logprob_op=op, options=scoring_options(args))
    registry = ModelRegistry()
    registry.add(serve_model(MODEL_NAME, "random", scorer))
    result = passes(LoopbackServer(settings(str(device), 1, args), registry), workload, args)
    del registry, scorer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def two_gpus(shape: ModelShape, workload: Workload, args: argparse.Namespace) -> tuple[float, dict, list[int]]:
    build: Callable = functools.partial(build_rank, shape, scoring_options(args))
    server = LoopbackServer(settings(",".join(args.devices), 2, args), ModelRegistry(), build)
    with PeakMemory(2) as memory:
        rate, results = passes(server, workload, args)
    return rate, results, memory.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="14b", choices=["14b", "72b"])
    parser.add_argument("--sequences", type=int, default=64, help="sequences in the workload")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-batch-tokens", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=2)
    add_scoring_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="tiny model, two CPU ranks (gloo); figures mean nothing")
    args = parser.parse_args()
    lengths = ((256, 1024), (64, 4096))
    if args.smoke:
        shape, args.devices, lengths = TINY, ["cpu", "cpu"], ((4, 16), (2, 24))
        args.sequences, args.clients, args.max_batch_tokens, args.repeats = 16, 2, 128, 1
    else:
        if torch.cuda.device_count() < 2:
            raise SystemExit(f"needs 2 GPUs, found {torch.cuda.device_count()}")
        shape, args.devices = SHAPES[args.shape], ["cuda:0", "cuda:1"]
    workload = make_workload(args.sequences, *lengths, shape.vocab, 8, seed=1)
    lines = [
        f"# Tensor parallel over 2 GPUs, {shape.name} shape, through one gRPC endpoint",
        *run_environment(torch.device(args.devices[0])),
        f"workload: {args.sequences} sequences ({workload.real_tokens:,} tokens), prompts U{lengths[0]}, "
        f"completions U{lengths[1]}, requests of 8 from {args.clients} clients; max_batch_tokens "
        f"{args.max_batch_tokens}; compile_layers {args.compile_layers} on both; "
        f"median of {args.repeats} passes after 1 warm-up",
        "",
    ]
    parallel, by_two, peak = two_gpus(shape, workload, args)
    memory = ", ".join(f"GPU {i} {p / 2**30:.1f} GiB" for i, p in enumerate(peak))
    if args.shape == "72b" and not args.smoke:
        lines += [
            "| TP | tokens/s | peak memory in use |",
            "|---|---|---|",
            f"| 2 | {parallel:,.0f} | {memory} |",
        ]
    else:
        single, by_one = one_gpu(shape, workload, args)
        diff = max(float(np.abs(a - b).max()) for i in by_one for a, b in zip(by_one[i], by_two[i], strict=True))
        lines += [
            "| TP=1 (tokens/s) | TP=2 (tokens/s) | ratio | max abs log-prob difference | TP=2 peak memory in use |",
            "|---|---|---|---|---|",
            f"| {single:,.0f} | {parallel:,.0f} | {parallel / single:.2f}x | {diff:.3g} | {memory} |",
        ]
    publish("\n".join(lines), f"bench_tensor_parallel_{args.shape}.md")


if __name__ == "__main__":
    main()
