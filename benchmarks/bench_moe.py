"""The GRPO-like workload on mixture-of-experts shapes: the service against the padded trainer
baseline and against transformers' own body on packed rows with each experts implementation.

Shapes (random weights, transformers' init, bf16 on CUDA; ``--layers`` of the model's decoder
layers, so that it fits one GPU with the baseline's padded activations beside it):

* Qwen3-30B-A3B: hidden 2048, 48 layers, 32/4 heads of 128, 128 experts of width 768, 8 per
  token (normalized), vocab 151936, untied. 1.26 GB of bf16 weights per layer.
* gpt-oss-20b: hidden 2880, 24 layers, 64/8 heads of 64 with attention sinks, sliding window 128
  on every other layer, 32 experts of width 2880, 4 per token, vocab 201088, untied. 1.7 GB per layer.

Workload and drivers: ``bench_batching``'s (256 sequences, prompts U[256, 1024], completions
U[64, 4096]; requests of 8 from 8 gRPC client threads). Methods, on the same sequences:

(a) trainer baseline: groups of 8 padded (``bench_batching.pad_group``/``baseline_pass``),
    ``model(..., logits_to_keep)`` + TRL's ``selective_log_softmax``; attention SDPA (gpt-oss,
    which SDPA cannot serve: its first of flex_attention, eager); experts as transformers loads
    them by default (grouped_mm).
(c) the service through gRPC (``bench_batching.run_grpc``): the real server in this process.
(h) transformers' body on the service's packed rows, once per experts implementation
    (``--experts``): the same micro-batches as the service would make (greedy, in order, under
    ``--max-batch-tokens``), the model's own decoder layers (eager), the service's varlen
    attention (transformers would need flash-attn for packed rows), no lm_head. The time of the
    body alone: the service's whole pass (body + log-prob op + queue + wire) should not exceed it.

A single GPU: tokens/s is tokens/s/GPU. NeMo-RL's published 4,740-9,692 log-prob tokens/s/GPU on
Qwen3-30B-A3B are on B200s with the full 48 layers; the report scales this run's (c) by
layers/48 for a rough whole-model figure (it leaves out the embedding and lm_head, ~3% at 48 layers).

On a GPU (Qwen3-30B-A3B at 16 layers and gpt-oss-20b at 12 fit an H100's 80 GB beside the baseline):

    PYTHONPATH=service:client python3 benchmarks/bench_moe.py
    PYTHONPATH=service:client python3 benchmarks/bench_moe.py --shapes gpt-oss-20b --no-baseline --experts grouped_mm

Smoke test on a CPU (tiny shapes, float32, 16 short sequences, under a minute):

    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_moe.py --smoke

The table is printed last, and also written to ``$OUT/bench_moe.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import gc
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from bench_batching import (
    BusySampler,
    Harness,
    IntervalTimer,
    Measured,
    PassResult,
    Workload,
    baseline_pass,
    fill_workload_defaults,
    format_table,
    int_pair,
    log,
    pad_group,
    resolve_device,
    run_grpc,
    tokens_per_s,
    workload_for,
)
from common import add_scoring_arguments, scoring_options
from harness import publish, release, run_environment
from logprob_service.models.compiled import eager_layers
from logprob_service.models.loading import expert_modules
from logprob_service.offline import OfflineScorer
from logprob_service.ops.attention import (
    attention_implementation_name,
    packed_forward_kwargs,
    register_packed_attention,
)
from logprob_service.worker.packing import pack
from transformers import GptOssConfig, GptOssForCausalLM, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

NEMO_RL_TOKENS_PER_S_GPU = (4740, 9692)  # NeMo-RL#3295: Qwen3-30B-A3B log-probs, B200, 48 layers


@dataclass(frozen=True)
class MoeShape:
    name: str
    full_layers: int
    make: Callable[[int, bool], PreTrainedModel]  # (layers, tiny) -> model


def _qwen3_30b_a3b(layers: int, tiny: bool) -> PreTrainedModel:
    size = (
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96, vocab_size=1000)
        if tiny
        else dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                  num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936)
    )  # fmt: skip
    config = Qwen3MoeConfig(
        **size, num_hidden_layers=layers, norm_topk_prob=True, max_position_embeddings=40960, tie_word_embeddings=False
    )
    return Qwen3MoeForCausalLM(config)


def _gpt_oss_20b(layers: int, tiny: bool) -> PreTrainedModel:
    size = (
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
             num_experts_per_tok=2, intermediate_size=32, vocab_size=1000, sliding_window=8)
        if tiny
        else dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                  num_experts_per_tok=4, intermediate_size=2880, vocab_size=201088, sliding_window=128)
    )  # fmt: skip
    return GptOssForCausalLM(GptOssConfig(**size, num_hidden_layers=layers, tie_word_embeddings=False))


SHAPES = {
    "qwen3-30b-a3b": MoeShape("Qwen3-30B-A3B", 48, _qwen3_30b_a3b),
    "gpt-oss-20b": MoeShape("gpt-oss-20b", 24, _gpt_oss_20b),
}
DEFAULT_LAYERS = {"qwen3-30b-a3b": 16, "gpt-oss-20b": 12}


def build(
    shape: MoeShape, layers: int, tiny: bool, device: torch.device, dtype: torch.dtype, seed: int
) -> PreTrainedModel:
    """Made on ``device`` in ``dtype`` directly (no float32 copy of a model that barely fits)."""
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = shape.make(layers, tiny)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def describe_model(shape: MoeShape, model: PreTrainedModel) -> str:
    c = model.config
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 1024**3
    experts = getattr(c, "num_experts", None) or c.num_local_experts
    width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    return (
        f"{shape.name} shape: {type(model).__name__}, {c.num_hidden_layers} of {shape.full_layers} layers, hidden "
        f"{c.hidden_size}, {c.num_attention_heads}/{c.num_key_value_heads} heads, {experts} experts of width {width}, "
        f"{c.num_experts_per_tok} per token, vocab {c.vocab_size}; random weights, "
        f"{str(model.dtype).removeprefix('torch.')}; weights {gib:.2f} GiB"
    )


# ----------------------------------------------------------------------------- (a) and (h)


def baseline_attention(model: PreTrainedModel, device: torch.device) -> str:
    """SDPA, as trainers run HF models; for a model SDPA cannot serve (gpt-oss), the next stock one
    (flex_attention runs sinks on CUDA only)."""
    for name in ("sdpa", "flex_attention", "eager") if device.type == "cuda" else ("sdpa", "eager"):
        try:
            model.set_attn_implementation(name)
            return name
        except (ValueError, ImportError):
            continue
    raise RuntimeError(f"{type(model).__name__}: no stock attention implementation")


def run_baseline(harness: Harness, model: PreTrainedModel, workload: Workload) -> Measured:
    try:
        attention = baseline_attention(model, harness.device)
        model.set_experts_implementation("grouped_mm" if harness.device.type == "cuda" else "eager")
    except Exception as err:
        return Measured(method="(a) trainer baseline", note=f"failed ({type(err).__name__}: {err})")
    groups = [pad_group(g, harness.device) for g in workload.groups]
    method = (
        f"(a) trainer baseline: pad, {attention}, experts {model.config._experts_implementation}, logits_to_keep, "
        f"selective_log_softmax, micro-batches of {workload.group_size}"
    )
    with eager_layers(model.base_model):
        return harness.measure(method, lambda: baseline_pass(model, groups, harness.device))


def packed_micro_batches(workload: Workload, max_batch_tokens: int, device: torch.device) -> list[dict[str, Any]]:
    """The workload in order, cut greedily under ``max_batch_tokens``, packed as the service packs
    it, as the body's inputs on ``device`` (made once: the timed passes run the body only)."""
    batches, current, tokens = [], [], 0
    for seq in workload.sequences:
        if current and tokens + seq.num_tokens > max_batch_tokens:
            batches.append(current)
            current, tokens = [], 0
        current.append(seq)
        tokens += seq.num_tokens
    batches.append(current)
    inputs = []
    for batch in batches:
        packed = pack(batch, share_prompts=False)
        cu = torch.from_numpy(packed.cu_seqlens).to(device)
        inputs.append(
            dict(
                input_ids=torch.from_numpy(packed.input_ids).to(device)[None],
                position_ids=torch.from_numpy(packed.position_ids).to(device)[None],
                use_cache=False,
                **packed_forward_kwargs(cu, packed.max_seqlen),
            )
        )
    return inputs


@torch.inference_mode()
def hf_packed_pass(model: PreTrainedModel, inputs: list[dict[str, Any]], device: torch.device) -> PassResult:
    timer = IntervalTimer(device)
    for kwargs in inputs:
        timer.start()
        model.base_model(**kwargs)
        timer.stop()
    return PassResult(timer.elapsed_ms(), None)  # type: ignore[arg-type]  # no log-probs: the body only


def run_hf_packed(
    harness: Harness, model: PreTrainedModel, workload: Workload, args: argparse.Namespace
) -> list[Measured]:
    register_packed_attention()
    model.set_attn_implementation(attention_implementation_name(args.attention_backend))
    inputs = packed_micro_batches(workload, args.max_batch_tokens, harness.device)
    rows = []
    for implementation in args.experts:
        method = f"(h) HF body on packed rows, experts {implementation}, {len(inputs)} micro-batches, no lm_head"
        try:
            model.set_experts_implementation(implementation)
        except Exception as err:
            rows.append(Measured(method=method, note=f"unavailable ({type(err).__name__})"))
            continue
        with eager_layers(model.base_model):
            rows.append(harness.measure(method, lambda: hf_packed_pass(model, inputs, harness.device)))
    return rows


# ----------------------------------------------------------------------------- one shape


def run_shape(key: str, args: argparse.Namespace, harness: Harness, dtype: torch.dtype) -> str:
    shape = SHAPES[key]
    layers = args.layers or (2 if args.smoke else DEFAULT_LAYERS[key])
    log(f"{shape.name} shape, {layers} layers: building the model")
    model = build(shape, layers, args.smoke, harness.device, dtype, args.seed)
    assert expert_modules(model), "an MoE shape without experts"
    workload = workload_for(args, model.config.vocab_size)
    # (a) is the slowest method by far (gpt-oss: its flex_attention compiles for 2 minutes first)
    skipped = Measured(method="(a) trainer baseline", note="not run (--no-baseline)")
    rows = [run_baseline(harness, model, workload) if args.baseline else skipped]
    service = ""
    with OfflineScorer(
        model,
        options=scoring_options(args, deterministic=args.deterministic),
        max_batch_tokens=args.max_batch_tokens,
        max_batch_sequences=args.max_batch_sequences,
    ) as scorer:
        info = scorer.served.info
        service = f"service: attention {info.attention}; {info.determinism}"
        try:
            rows.append(run_grpc(harness, scorer, workload, args))
        except Exception as err:  # the server's warm-up scores: a model it cannot serve fails there
            traceback.print_exc()
            rows.append(Measured(method="(c) service via gRPC", note=f"failed ({type(err).__name__})"))
    rows += run_hf_packed(harness, model, workload, args)
    lines = [f"## {describe_model(shape, model)}", service, "", format_table(rows, workload), ""]
    lines += checks(shape, layers, rows, workload)
    del model
    gc.collect()
    release(harness.device)
    return "\n".join(lines)


def checks(shape: MoeShape, layers: int, rows: list[Measured], workload: Workload) -> list[str]:
    """The goals: (c) >= 3x (a), and (c)'s whole pass <= the best (h) body pass."""
    baseline, grpc, packed = rows[0], rows[1], [m for m in rows[2:] if m.seconds]
    rate = tokens_per_s(grpc, workload)
    lines = []
    if rate and baseline.seconds:
        lines.append(f"(c) over (a): {rate / tokens_per_s(baseline, workload):.2f}x (goal >= 3x)")  # type: ignore[operator]
    if grpc.seconds and packed:
        best = min(packed, key=lambda m: m.seconds)  # type: ignore[arg-type, return-value]
        lines.append(f"(c) pass / best (h) body pass: {grpc.seconds / best.seconds:.2f} (goal <= 1.0; {best.method})")  # type: ignore[operator]
    if rate and shape.name == "Qwen3-30B-A3B":
        low, high = NEMO_RL_TOKENS_PER_S_GPU
        lines.append(
            f"(c) tokens/s/GPU: {rate:,.0f} at {layers} layers, ~{rate * layers / shape.full_layers:,.0f} scaled to "
            f"{shape.full_layers} (NeMo-RL: {low:,}-{high:,} on B200, a newer GPU with ~2.3x an H100's bf16 FLOP/s)"
        )
    return lines


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--smoke", action="store_true", help="tiny shapes, 16 short sequences, cpu, float32: checks the script runs")
    add("--shapes", default="qwen3-30b-a3b,gpt-oss-20b", help=f"comma-separated, of: {', '.join(SHAPES)}")
    add("--layers", type=int, default=None, help=f"decoder layers (default {DEFAULT_LAYERS}; 2 with --smoke)")
    add("--experts", default=None, help="experts implementations for (h) (default grouped_mm,eager; eager on a CPU)")
    add("--device", default=None)
    add("--sequences", type=int, default=None)
    add("--prompt-range", type=int_pair, default=None)
    add("--completion-range", type=int_pair, default=None)
    add("--group-size", type=int, default=8)
    add("--clients", type=int, default=None)
    add("--max-batch-tokens", type=int, default=None)
    add("--max-batch-sequences", type=int, default=256)
    add("--warmup", type=int, default=None, help="untimed passes per method first (default 1; 0 with --smoke)")
    add("--repeats", type=int, default=None)
    add("--sample-ms", type=float, default=100.0)
    add("--deterministic", action="store_true", help="the service's deterministic setting (default off)")
    add("--baseline", action=argparse.BooleanOptionalAction, default=True, help="run (a), the padded trainer pass")
    add("--seed", type=int, default=0)
    add_scoring_arguments(parser)
    args = parser.parse_args(argv)
    smoke = args.smoke
    fill_workload_defaults(args, smoke, repeats=1 if smoke else 3, warmup=0 if smoke else 1)
    on_cuda = torch.device(args.device).type == "cuda"
    args.experts = [e for e in (args.experts or ("grouped_mm,eager" if on_cuda else "eager")).split(",") if e]
    args.shape_keys = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = sorted(set(args.shape_keys) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sampler = BusySampler.for_device(device, args.sample_ms / 1e3)
    if sampler is not None:
        sampler.start()
    harness = Harness(device, sampler, args.warmup, args.repeats)
    sections = []
    try:
        for key in args.shape_keys:
            sections.append(run_shape(key, args, harness, dtype))
    finally:
        if sampler is not None:
            sampler.stop()
    workload = workload_for(args, 1000)  # token counts do not depend on the vocabulary
    header = [
        "# GRPO-like scoring on mixture-of-experts shapes",
        "",
        *run_environment(device),
        f"workload: {len(workload.sequences)} sequences, {workload.real_tokens:,} real tokens "
        f"({workload.completion_tokens:,} completion); (a) pads them to {workload.padded_tokens:,} positions",
        f"service: max_batch_tokens {args.max_batch_tokens}, deterministic {'on' if args.deterministic else 'off'}; "
        f"(c): {args.clients} clients, requests of {args.group_size}; {args.warmup} warm-up + {args.repeats} timed "
        "passes per method, tokens/s = real tokens / median pass; one GPU, so tokens/s is tokens/s/GPU",
    ]
    publish("\n".join(header) + "\n\n" + "\n\n".join(sections) + "\n", "bench_moe.md")


if __name__ == "__main__":
    main()
