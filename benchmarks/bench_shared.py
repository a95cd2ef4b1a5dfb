"""GRPO groups through gRPC with the prompt run once (``--share-prompts``) against every sequence whole.

Workloads, each sent as one ScoreTokens request per prompt group (the G completions of one prompt,
as TRL lays them out), by ``--clients`` client threads pulling from a shared queue:

* (P, R, G) groups: P prompt tokens, G completions of R tokens each, random ids; enough groups
  for about ``--target-tokens`` real tokens a pass. Beside each, the bound on the linear layers'
  saving, G (k + 1) / (k + G) with k = P / R (attention saves a little more: the prompt's own
  causal attention runs once).
* the GRPO-like workload of ``bench_batching.py`` (256 sequences, prompts U[256, 1024],
  completions U[64, 4096]) with each group of 8 consecutive sequences given one prompt.

Both ways run the same model and server code; only the setting differs: the server's (its scheduler
and its scorer's packing) and the client's (shared: each group's prompt sent once, as a
``SequenceGroup``; unshared: every sequence whole, as before groups). Tokens/s count the sequences'
real tokens, G * (P + R) a group, whatever is run. Peak extra GiB: peak allocated over the timed
passes beyond what was there before. max |dlogp|: the first request's log-probs, shared against
unshared (bf16 bodies whose kernels see other shapes: differences of a few 1e-2 are bf16 rounding).

    PYTHONPATH=service:client python3 benchmarks/bench_shared.py               # a GPU
    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_shared.py --smoke   # the CPU: runs, nothing more

The table is printed last, and written to ``$OUT/bench_shared.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import torch
from bench_batching import (
    Harness,
    Measured,
    Workload,
    grpc_pass,
    log,
    make_workload,
    open_clients,
    service_pass,
)
from common import SHAPES, TINY, LoopbackServer, ModelShape, add_scoring_arguments, build_model, scoring_options
from harness import publish, run_environment
from logprob_service.domain import TokenSequence
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.scorer import CausalLMScorer
from logprob_service.models.served import serve_model
from logprob_service.offline import OfflineScorer
from logprob_service.settings.model import DEFAULT_MAX_BATCH_TOKENS, Settings
from transformers import PreTrainedModel

MODEL_NAME = "bench"
CONFIGS = "512,2048,8;1024,512,16;4096,1024,8;16384,1024,8"
GOALS = {(1024, 512, 16): 2.0, (4096, 1024, 8): 2.5, (16384, 1024, 8): 4.0, (512, 2048, 8): 1.0}


def linear_bound(p: int, r: int, g: int) -> float:
    k = p / r
    return g * (k + 1) / (k + g)


def grouped(p: int, r: int, g: int, groups: int, vocab: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    sequences = []
    for _ in range(groups):
        prompt = rng.integers(1, vocab, p, dtype=np.int64)
        sequences += [TokenSequence(prompt.copy(), rng.integers(1, vocab, r, dtype=np.int64)) for _ in range(g)]
    return Workload(sequences, g)


def grpo_grouped(vocab: int, seed: int, smoke: bool) -> Workload:
    """bench_batching's workload, each group of 8 consecutive sequences given its first prompt."""
    n, prompts, completions = (16, (4, 16), (2, 24)) if smoke else (256, (256, 1024), (64, 4096))
    base = make_workload(n, prompts, completions, vocab, 8, seed)
    sequences = [TokenSequence(group[0].prompt_ids, s.completion_ids) for group in base.groups for s in group]
    return Workload(sequences, 8)


@dataclass
class Row:
    name: str
    bound: float | None
    goal: float | None
    real_tokens: int
    shared: Measured
    unshared: Measured
    max_diff: float | None


def run_one(
    model: PreTrainedModel, workload: Workload, share: bool, args: argparse.Namespace, harness: Harness
) -> Measured:
    """The workload through a fresh server whose scheduler and scorer share prompts or not (or,
    with ``--in-process``, one ``OfflineScorer.score`` call over all of it)."""
    scorer = CausalLMScorer(model, options=scoring_options(args, share_prompts=share))
    if args.in_process:
        with OfflineScorer(serve_model(MODEL_NAME, "random", scorer), max_batch_tokens=args.max_batch_tokens) as off:
            return harness.measure(f"in-process, share_prompts={share}", lambda: service_pass(off, workload))
    registry = ModelRegistry()
    registry.add(serve_model(MODEL_NAME, "random", scorer))
    settings = Settings(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        models={MODEL_NAME: "random weights, built by benchmarks/bench_shared.py"},
        device=str(harness.device),
        max_batch_tokens=args.max_batch_tokens,
        share_prompts=share,
    )
    with LoopbackServer(settings, registry) as target:
        clients = open_clients(target, args.clients, share_prompts=share)
        try:
            return harness.measure(f"share_prompts={share}", lambda: grpc_pass(clients, workload))
        finally:
            for client in clients:
                client.close()


def run_shape(shape: ModelShape, args: argparse.Namespace, harness: Harness) -> list[Row]:
    log(f"{shape.name} shape")
    model = build_model(shape, harness.device, torch.float32 if args.smoke else torch.bfloat16, args.seed)
    workloads = []
    for p, r, g in args.configs:
        groups = max(args.clients, -(-args.target_tokens // (g * (p + r))))
        workloads.append(
            (
                f"P {p}, R {r}, G {g}",
                linear_bound(p, r, g),
                GOALS.get((p, r, g)),
                grouped(p, r, g, groups, shape.vocab, args.seed),
            )
        )
    workloads.append(("GRPO workload, groups of 8", None, None, grpo_grouped(shape.vocab, args.seed, args.smoke)))
    rows = []
    for name, bound, goal, workload in workloads:
        log(f" {name}: {len(workload.sequences)} sequences, {workload.real_tokens:,} real tokens")
        shared = run_one(model, workload, True, args, harness)
        unshared = run_one(model, workload, False, args, harness)
        diff = None
        if shared.first is not None and unshared.first is not None:
            diff = max(float(np.abs(a - b).max()) for a, b in zip(shared.first, unshared.first, strict=True))
        rows.append(Row(name, bound, goal, workload.real_tokens, shared, unshared, diff))
    return rows


def table(shape: ModelShape, rows: list[Row]) -> str:
    lines = [
        f"## {shape.name} shape",
        "",
        "| workload | real tokens | unshared tok/s | shared tok/s | x unshared | linear bound | goal | "
        "peak GiB unshared | peak GiB shared | max abs dlogp |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        speeds = [row.real_tokens / m.seconds if m.seconds else None for m in (row.unshared, row.shared)]
        ratio = speeds[1] / speeds[0] if all(speeds) else None
        goal = "-" if row.goal is None else f">= {row.goal:.1f}x: {'met' if ratio and ratio >= row.goal else 'missed'}"
        cells = [
            row.name,
            f"{row.real_tokens:,}",
            *(f"{s:,.0f}" if s else m.note for s, m in zip(speeds, (row.unshared, row.shared))),
            f"{ratio:.2f}x" if ratio else "n/a",
            f"{row.bound:.2f}x" if row.bound else "-",
            goal,
            *(f"{m.peak_extra_gib:.2f}" if m.peak_extra_gib is not None else "n/a" for m in (row.unshared, row.shared)),
            f"{row.max_diff:.2e}" if row.max_diff is not None else "n/a",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="tiny model, tiny groups, cpu: checks the script runs")
    add("--shapes", default="0.5b,1.5b", help=f"comma-separated, of: {', '.join(SHAPES)}")
    add("--configs", default=CONFIGS, help="P,R,G;P,R,G;... (prompt, completion, group size)")
    add("--target-tokens", type=int, default=1_000_000, help="real tokens a pass, about (at least one group a client)")
    add("--clients", type=int, default=8)
    add("--in-process", action="store_true", help="OfflineScorer.score over the whole workload instead of gRPC")
    add("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS)
    add("--warmup", type=int, default=1)
    add("--repeats", type=int, default=2)
    add("--seed", type=int, default=0)
    add_scoring_arguments(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.configs, args.target_tokens, args.clients, args.max_batch_tokens = "8,4,4;20,6,3", 200, 2, 128
    args.configs = [tuple(int(x) for x in c.split(",")) for c in args.configs.split(";") if c.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    harness = Harness(device, None, args.warmup, args.repeats)  # GPU busy: see bench_batching.py
    shapes = [TINY] if args.smoke else [SHAPES[s] for s in args.shapes.split(",")]
    reports = [table(shape, run_shape(shape, args, harness)) for shape in shapes]
    header = [
        "# GRPO groups: the prompt run once (share_prompts) vs every sequence whole",
        "",
        *run_environment(device),
        (
            "in-process: one OfflineScorer.score call a pass"
            if args.in_process
            else f"{args.clients} client threads, one request per prompt group"
        )
        + f"; max_batch_tokens {args.max_batch_tokens}; "
        f"{args.warmup} warm-up + {args.repeats} timed passes, median; tokens/s = real tokens (G * (P + R)) / pass",
    ]
    publish("\n".join(header) + "\n\n" + "\n\n".join(reports) + "\n", "bench_shared.md")


if __name__ == "__main__":
    main()
