"""The log-prob stage alone: hidden rows [N, H] x lm_head [V, H] -> one log-prob per row.

Methods, side by side on the same bf16 inputs in one run:

* matmul limit: ``torch.mm(h, W.T)`` in bf16 (cuBLAS), nothing else. Its measured rate is the
  limit; every other time is reported as a multiple of it.
* full logits + log_softmax: ``(h @ W.T).float().log_softmax(-1).gather(...)``.
* eager 256 MiB chunks: this service's CPU path (``chunked_token_logprobs``), fp32 logits per chunk.
* Liger fused linear cross entropy, ``reduction="none"`` (log p = -loss), liger-kernel 0.8.5.
* fused Triton kernel: this service's GPU path (``fused_token_logprobs``), without and with entropy,
  and with the batch-invariant plan of ``--deterministic`` (the vocabulary splits fixed by the
  model's shape and the GPU, not the batch: ``invariant_plan``).

Timing: ``triton.testing.do_bench`` (median; it flushes the L2 cache before each run). Peak extra
memory: ``max_memory_allocated`` during one more run, minus what was allocated before it (inputs).
Error: max |log p - reference| over the first ``--ref-rows`` rows, the reference being float64
logits from the same bf16 inputs (float64 log_softmax).

On a GPU (the run that counts; liger-kernel installed):

    PYTHONPATH=service:client python3 benchmarks/bench_logprobs.py

``--sweep`` also times a grid of kernel tile configurations at every shape (how the defaults in
``ops/lm_head/plans.py`` were picked). ``--top-k`` also times the teacher outputs at
every shape and at 8,192 x 3,584 x 152,064: the fused kernel with ``top_k`` 20, 128 and 256 and
with 256 candidate ids per row, against the plain fused kernel, the matmul limit, the eager 256 MiB
chunks with the same ``top_k`` (what served top-k on CUDA while ``ops.dispatch.FUSED_TOP_K`` was
off), and full logits + ``torch.topk`` (what vLLM's ``prompt_logprobs`` does); error: max |top-k
log-prob - float64 top-k's| over the reference rows.

    PYTHONPATH=service:client python3 benchmarks/bench_logprobs.py --top-k

The table is printed last, and also written to ``$OUT/bench_logprobs.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.testing
from harness import GiB, peak_extra_bytes, publish, release, run_environment, time_kernel
from logprob_service.domain import ScoreOptions
from logprob_service.ops.lm_head.fused_logprobs import fused_token_logprobs
from logprob_service.ops.lm_head.plans import KernelConfig, LaunchPlan, default_config, device_info, plan_launch
from logprob_service.ops.logprobs import DEFAULT_LM_HEAD_CHUNK_BYTES, chunked_token_logprobs

SHAPES = [(24576, 896, 151936), (16384, 3584, 152064), (65536, 4096, 128256)]
GOAL_X_LIMIT = 1.15
GOAL_PEAK_GIB = 0.25
GOAL_ERR = 1e-4
TOP_KS = (20, 128, 256)
CANDIDATES = 256
TOPK_MEMORY_SHAPE = (8192, 3584, 152064)  # the memory goal: >= 10x less than full logits + topk
# The goals, in multiples of the plain fused kernel's time.
GOAL_TOPK_X_FUSED = {20: 1.25, 256: 2.0, "candidates": 1.5}


@dataclass(frozen=True)
class Result:
    method: str
    ms: float | None  # None: failed (the note says why)
    peak_gib: float | None
    err: float | None
    note: str = ""


def make_inputs(n: int, h: int, v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()  # [N, H]
    weight = (torch.randn(v, h, device="cuda", generator=g) * 3 / h**0.5).bfloat16()  # [V, H]: logits std ~3
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)  # [N]
    return hidden, weight, targets


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
    """Float64 log-probs of the first ``rows`` rows: [rows]."""
    out = []
    for start in range(0, rows, 128):  # [128, V] float64 slabs
        x = hidden[start : start + 128].double() @ weight.double().T
        out.append(x.log_softmax(-1).gather(1, targets[start : start + 128, None]).squeeze(1))
    return torch.cat(out)


def full_logits(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (hidden @ weight.T).float().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)


def liger_method() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")
    return lambda hidden, weight, targets: -loss(weight, hidden, targets)


def measure(
    name: str, fn: Callable[[], torch.Tensor], ref: torch.Tensor | None, *, warmup_ms: int, rep_ms: int
) -> Result:
    print(f"  {name}", file=sys.stderr, flush=True)
    try:
        ms = time_kernel(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)
        peak_bytes, out = peak_extra_bytes(fn, torch.device("cuda"))
        peak = peak_bytes / GiB
    except torch.OutOfMemoryError:
        release(torch.device("cuda"))
        return Result(name, None, None, None, note="out of memory")
    except Exception as exc:  # a peer's kernel failing at a shape is a result, not a crash of the run
        release(torch.device("cuda"))
        return Result(name, None, None, None, note=f"failed: {type(exc).__name__}: {str(exc)[:80]}")
    err = None if ref is None else (out[: len(ref)].double() - ref).abs().max().item()
    del out
    release(torch.device("cuda"))
    return Result(name, ms, peak, err)


def run_shape(n: int, h: int, v: int, args: argparse.Namespace) -> list[Result]:
    hidden, weight, targets = make_inputs(n, h, v, args.seed)
    ref = reference(hidden, weight, targets, min(args.ref_rows, n))
    timing = {"warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms}
    results = [
        measure("matmul limit (bf16 torch.mm)", lambda: hidden @ weight.T, None, **timing),
        measure("full logits + log_softmax", lambda: full_logits(hidden, weight, targets), ref, **timing),
        measure(
            "eager 256 MiB chunks (fp32 logits)",
            lambda: chunked_token_logprobs(hidden, weight, targets, chunk_bytes=DEFAULT_LM_HEAD_CHUNK_BYTES).logprobs,
            ref,
            **timing,
        ),
    ]
    liger = liger_method()
    if liger is None:
        results.append(Result("Liger fused linear CE", None, None, None, note="liger-kernel not installed"))
    else:
        results.append(measure("Liger fused linear CE", lambda: liger(hidden, weight, targets), ref, **timing))
    results += [
        measure("fused Triton kernel", lambda: fused_token_logprobs(hidden, weight, targets).logprobs, ref, **timing),
        measure(
            "fused Triton kernel + entropy",
            lambda: fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(return_entropy=True)).logprobs,
            ref,
            **timing,
        ),
        measure(
            "fused Triton kernel, batch-invariant plan (--deterministic)",
            lambda: fused_token_logprobs(hidden, weight, targets, invariant=True).logprobs,
            ref,
            **timing,
        ),
    ]
    return results


def reference_top_k(hidden: torch.Tensor, weight: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Float64 top-k log-probs of the first ``rows`` rows: [rows, k], descending."""
    out = []
    for start in range(0, rows, 128):
        x = hidden[start : start + 128].double() @ weight.double().T
        out.append(x.log_softmax(-1).topk(k, dim=-1).values)
    return torch.cat(out)


def full_logits_top_k(hidden: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    """vLLM's way: the [N, V] logits, an fp32 log_softmax of them, then ``torch.topk``."""
    return (hidden @ weight.T).float().log_softmax(-1).topk(k, dim=-1).values


def run_top_k_shape(n: int, h: int, v: int, args: argparse.Namespace) -> list[Result]:
    """The teacher outputs at one shape: first row the matmul limit, second the plain fused kernel."""
    hidden, weight, targets = make_inputs(n, h, v, args.seed)
    rows = min(args.ref_rows, n)
    timing = {"warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms}
    results = [
        measure("matmul limit (bf16 torch.mm)", lambda: hidden @ weight.T, None, **timing),
        measure(
            "fused Triton kernel (K=0)", lambda: fused_token_logprobs(hidden, weight, targets).logprobs, None, **timing
        ),
    ]
    for k in TOP_KS:
        ref = reference_top_k(hidden, weight, rows, k)
        results.append(
            measure(
                f"fused Triton kernel, top_k={k}",
                lambda k=k: fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=k)).top_logprobs,
                ref,
                **timing,
            )
        )
        results.append(
            measure(
                f"eager 256 MiB chunks, top_k={k}",
                lambda k=k: chunked_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=k)).top_logprobs,
                ref,
                **timing,
            )
        )
        results.append(
            measure(f"full logits + torch.topk, k={k}", lambda k=k: full_logits_top_k(hidden, weight, k), ref, **timing)
        )
    g = torch.Generator(device="cuda").manual_seed(args.seed + 1)
    candidates = torch.randint(0, v, (n, CANDIDATES), device="cuda", generator=g)
    logp_ref = []
    for start in range(0, rows, 128):
        x = hidden[start : start + 128].double() @ weight.double().T
        logp_ref.append(x.log_softmax(-1).gather(1, candidates[start : start + 128]))
    results.append(
        measure(
            f"fused Triton kernel, {CANDIDATES} candidates",
            lambda: fused_token_logprobs(hidden, weight, targets, candidates=candidates).candidate_logprobs,
            torch.cat(logp_ref),
            **timing,
        )
    )
    results.append(
        measure(
            "fused Triton kernel, top_k=20, batch-invariant plan",
            lambda: (
                fused_token_logprobs(
                    hidden, weight, targets, options=ScoreOptions(top_k=20), invariant=True
                ).top_logprobs
            ),
            None,
            **timing,
        )
    )
    return results


def top_k_goal_lines(per_shape: list[tuple[tuple[int, int, int], list[Result]]]) -> list[str]:
    lines = []
    for (n, h, v), results in per_shape:
        by_name = {r.method: r for r in results}
        plain = by_name["fused Triton kernel (K=0)"].ms
        if plain is None:
            lines.append(f"N={n}: the plain fused kernel did not run")
            continue
        checks = []
        for key, limit in GOAL_TOPK_X_FUSED.items():
            name = (
                f"fused Triton kernel, {CANDIDATES} candidates"
                if key == "candidates"
                else f"fused Triton kernel, top_k={key}"
            )
            r = by_name[name]
            if r.ms is None:
                checks.append(f"{name}: {r.note}")
                continue
            checks.append(
                f"{key}: {r.ms / plain:.2f}x fused ({'met' if r.ms / plain <= limit else 'NOT met'}, <= {limit}x)"
            )
        ours, full = by_name["fused Triton kernel, top_k=256"], by_name["full logits + torch.topk, k=256"]
        if ours.peak_gib and full.peak_gib:
            checks.append(f"memory at k=256: {full.peak_gib / ours.peak_gib:.1f}x less than full logits + topk")
        elif full.ms is None:
            checks.append(f"full logits + topk: {full.note}")
        lines.append(f"N={n}, H={h}, V={v}: " + "; ".join(checks))
    return lines


def sweep_configs() -> list[KernelConfig]:
    """Tiles that fit Hopper's shared memory and registers with a [BLOCK_N, BLOCK_V] fp32 accumulator."""
    return [
        KernelConfig(128, 256, 64, 8, 3),
        KernelConfig(128, 256, 64, 8, 4),
        KernelConfig(256, 128, 64, 8, 3),
        KernelConfig(256, 128, 64, 8, 4),
        KernelConfig(128, 256, 128, 8, 2),
        KernelConfig(128, 128, 64, 4, 4),
        KernelConfig(128, 128, 128, 8, 3),
        KernelConfig(64, 256, 64, 4, 4),
    ]


def run_sweep(n: int, h: int, v: int, args: argparse.Namespace) -> list[str]:
    """Time tile configurations with the default plan, then the default tiles with other plans."""
    hidden, weight, targets = make_inputs(n, h, v, args.seed)
    limit = time_kernel(lambda: hidden @ weight.T, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    dev = device_info(hidden.device)
    base_cfg = default_config(hidden.dtype)
    base = plan_launch(n, h, v, hidden.element_size(), base_cfg, dev)
    candidates = [(cfg, None) for cfg in sweep_configs()]
    for group in sorted({1, base.group_rows // 2, base.group_rows * 2, triton.cdiv(n, base_cfg.block_n)} - {0}):
        for splits in sorted({base.splits, max(1, triton.cdiv(dev.num_sms, group))}):
            candidates.append((base_cfg, LaunchPlan(splits=splits, group_rows=group)))
    timed = []
    for cfg, plan in candidates:
        try:
            ms = time_kernel(
                lambda cfg=cfg, plan=plan: fused_token_logprobs(hidden, weight, targets, config=cfg, plan=plan),
                warmup_ms=args.warmup_ms,
                rep_ms=args.rep_ms,
            )
        except Exception as exc:  # out of shared memory / registers: skip that config
            print(f"  {cfg} {plan}: {type(exc).__name__}", file=sys.stderr)
            continue
        timed.append((ms, cfg, plan or base))
    timed.sort(key=lambda item: item[0])
    lines = [f"sweep at N={n}, H={h}, V={v} (limit {limit:.2f} ms; default plan {base}); best first:"]
    lines += [f"  {ms / limit:.3f}x  {ms:.2f} ms  {cfg}  {plan}" for ms, cfg, plan in timed[:10]]
    return lines


def format_shape(n: int, h: int, v: int, results: list[Result]) -> str:
    limit = results[0].ms
    tflops = 2 * n * h * v / (limit * 1e-3) / 1e12 if limit else float("nan")
    lines = [
        f"### N={n}, H={h}, V={v}: limit {limit:.2f} ms ({tflops:.0f} TFLOP/s bf16)",
        "",
        "| method | ms | x limit | peak extra GiB | max abs err vs fp64 |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.ms is None:
            lines.append(f"| {r.method} | {r.note} | | | |")
            continue
        err = "n/a" if r.err is None else f"{r.err:.1e}"
        lines.append(f"| {r.method} | {r.ms:.2f} | {r.ms / limit:.3f} | {r.peak_gib:.3f} | {err} |")
    return "\n".join(lines)


def goal_lines(per_shape: list[tuple[tuple[int, int, int], list[Result]]]) -> list[str]:
    lines = []
    for (n, h, v), results in per_shape:
        by_name = {r.method: r for r in results}
        ours, limit = by_name["fused Triton kernel"], results[0].ms
        liger = by_name["Liger fused linear CE"]
        if ours.ms is None or limit is None:
            lines.append(f"N={n}: fused kernel did not run ({ours.note})")
            continue
        x = ours.ms / limit
        vs_liger = "n/a (Liger did not run)" if liger.ms is None else f"{liger.ms / ours.ms:.2f}x faster than Liger"
        checks = [
            f"{x:.3f}x limit ({'met' if x <= GOAL_X_LIMIT else 'NOT met'})",
            vs_liger + ("" if liger.ms is None or liger.ms > ours.ms else " (NOT met)"),
            f"peak {ours.peak_gib:.3f} GiB ({'met' if ours.peak_gib <= GOAL_PEAK_GIB else 'NOT met'})",
            f"err {ours.err:.1e} ({'met' if ours.err <= GOAL_ERR else 'NOT met'})",
        ]
        lines.append(f"N={n}, H={h}, V={v}: " + "; ".join(checks))
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None, help="N,H,V;N,H,V;... (default: the three reference shapes)")
    parser.add_argument("--ref-rows", type=int, default=512, help="rows checked against the float64 reference")
    parser.add_argument("--warmup-ms", type=int, default=100)
    parser.add_argument("--rep-ms", type=int, default=500)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of kernel tile configurations")
    parser.add_argument("--top-k", action="store_true", help="also time top-k and candidate outputs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.shapes:
        args.shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";")]
    else:
        args.shapes = SHAPES
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_logprobs.py measures GPU kernels: it needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    per_shape = []
    top_k_shapes = []
    sweeps: list[str] = []
    with torch.inference_mode():
        for n, h, v in args.shapes:
            print(f"shape N={n}, H={h}, V={v}", file=sys.stderr, flush=True)
            per_shape.append(((n, h, v), run_shape(n, h, v, args)))
            if args.sweep:
                sweeps += run_sweep(n, h, v, args)
        if args.top_k:
            for n, h, v in [*args.shapes, TOPK_MEMORY_SHAPE]:
                print(f"top-k at N={n}, H={h}, V={v}", file=sys.stderr, flush=True)
                top_k_shapes.append(((n, h, v), run_top_k_shape(n, h, v, args)))
    cfg16 = default_config(torch.bfloat16)
    header = [
        "# The log-prob stage alone (bf16 inputs)",
        "",
        *run_environment(device),
        f"timing: triton.testing.do_bench median (warm-up {args.warmup_ms} ms, {args.rep_ms} ms of runs, L2 flushed); "
        f"error over the first {args.ref_rows} rows; fused kernel tiles {cfg16}",
    ]
    sections = ["\n".join(header)] + [format_shape(*shape, results) for shape, results in per_shape]
    goals = "goals (<= 1.15x limit, faster than Liger, <= 0.25 GiB, <= 1e-4):"
    sections.append("\n".join([goals, *goal_lines(per_shape)]))
    if top_k_shapes:
        sections.append("## Teacher outputs: top-k and candidate log-probs")
        sections += [format_shape(*shape, results) for shape, results in top_k_shapes]
        goals = "top-k goals (x the plain fused kernel: top_k 20 <= 1.25, 256 <= 2.0, 256 candidates <= 1.5):"
        sections.append("\n".join([goals, *top_k_goal_lines(top_k_shapes)]))
    if sweeps:
        sections.append("\n".join(sweeps))
    report = "\n\n".join(sections) + "\n"
    publish(report, "bench_logprobs.md")


if __name__ == "__main__":
    main()
