"""FP8 checkpoints against bf16 on the GRPO-like workload: tokens/s, weight memory, and error.

Shapes (random weights, transformers' init, full depth; ``--shapes``):

* Qwen3-8B: hidden 4096, 36 layers, 32/8 heads of 128, MLP 12288, vocab 151936, untied.
* Qwen3-32B: hidden 5120, 64 layers, 64/8 heads of 128, MLP 25600, vocab 151936, untied.

For each shape, on one GPU, in one run, the same sequences (``bench_batching``'s workload, fewer
sequences: ``--sequences``) through the service in-process (``OfflineScorer``):

1. bf16: the model as built.
2. dequantized: each decoder linear weight quantized as an FP8 checkpoint stores it (``ops.fp8.quantize``:
   float8_e4m3fn, a float32 scale per 128 x 128 block) and put back dequantized, in bf16: the model
   a trainer gets when it loads the checkpoint. The reference of the two FP8 modes.
3. fp8 weights-only: the same layers as ``models.quantized.Fp8Linear`` (what the loader makes from
   such a checkpoint): FP8 weights and scales in memory, each dequantized inside its layer.
4. fp8 w8a8: the same layers, activations quantized per token and 128-group, torch's ``_scaled_mm``.
5. fp8 weights-only with ``input_embeddings=host``: the input embedding table in pinned host memory,
   each micro-batch's rows gathered there and copied up.

``--linears`` adds, in the same run, one table of each layer shape of the shapes alone (M tokens,
``triton.testing.do_bench``): the bf16 GEMM, weights-only, W8A8 with the activations quantized by
the Triton pass or by torch's ops, and its parts (the quantization, cuBLAS's block-scaled GEMM).

Reported: tokens/s and its ratio to bf16, weight memory (the model's parameters in GPU memory) and its
ratio to bf16, and the largest and mean |difference| of the first group's log-probs from the
dequantized model's (weights-only is expected to be bitwise equal).

    PYTHONPATH=service:client python3 benchmarks/bench_fp8.py
    PYTHONPATH=service:client python3 benchmarks/bench_fp8.py --shapes qwen3-8b --sequences 16

The table is printed last, and also written to ``$OUT/bench_fp8.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import dataclass, replace

import numpy as np
import torch
from bench_batching import BusySampler, Harness, Measured, log, make_workload, service_pass
from harness import publish
from logprob_service.models.loading import to_serving_dtype
from logprob_service.models.quantized import Fp8Linear, WeightFormat, quantized_layers
from logprob_service.models.scorer import ScoringOptions
from logprob_service.offline import OfflineScorer
from logprob_service.ops.fp8 import dequantize, quantize
from torch import nn
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

GiB = 2**30


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


SHAPES = {
    "qwen3-8b": Shape("Qwen3-8B", 4096, 12288, 36, 32, 8),
    "qwen3-32b": Shape("Qwen3-32B", 5120, 25600, 64, 64, 8),
}
BLOCKS = WeightFormat("fp8", "weight_scale_inv", "block", (128, 128))


def build(shape: Shape, device: torch.device, seed: int) -> PreTrainedModel:
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return to_serving_dtype(model, torch.bfloat16).eval().requires_grad_(False)


def weight_gib(model: nn.Module) -> float:
    """The model's parameters in device memory (an input embedding held on the host is not)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.is_cuda) / GiB


@torch.no_grad()
def dequantize_in_place(model: PreTrainedModel) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each decoder linear weight as an FP8 checkpoint would hold it; the bf16 weight set to its
    dequantized value. Returns the quantized (Q, S) by layer name."""
    quantized = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear and ".layers." in name:
            q, s = quantize(module.weight, BLOCKS.block_size)
            module.weight.copy_(dequantize(q, s, BLOCKS.block_size, module.weight.dtype))
            quantized[name] = (q, s)
    return quantized


@torch.no_grad()
def to_fp8_layers(model: PreTrainedModel, quantized: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The decoder linears as the loader makes them from the checkpoint (their bf16 weights freed)."""
    for name, (q, s) in quantized.items():
        layer = Fp8Linear(model.get_submodule(name), s, BLOCKS)
        layer.weight.copy_(q)
        layer.scale.copy_(s)
        model.set_submodule(name, layer)
    quantized.clear()
    gc.collect()
    torch.cuda.empty_cache()


def differences(m: Measured, reference: Measured) -> tuple[float | None, float | None]:
    if m.first is None or reference.first is None:
        return None, None
    diffs = np.concatenate([np.abs(a - b) for a, b in zip(m.first, reference.first)])
    return float(diffs.max()), float(diffs.mean())


def run_shape(shape: Shape, args: argparse.Namespace, harness: Harness) -> list[str]:
    log(f"{shape.name}: building")
    model = build(shape, harness.device, args.seed)
    workload = make_workload(args.sequences, (256, 1024), (64, 4096), 151936, 8, args.seed + 1)
    options = ScoringOptions(deterministic=True)

    def measure(label: str, options: ScoringOptions = options) -> Measured:
        with OfflineScorer(model, options=options, max_batch_tokens=args.max_batch_tokens) as scorer:
            return harness.measure(label, lambda: service_pass(scorer, workload))

    rows: list[tuple[str, Measured, float]] = [("bf16", measure("bf16"), weight_gib(model))]
    quantized = dequantize_in_place(model)
    dequantized = measure("dequantized (bf16)")
    rows.append(("dequantized, bf16", dequantized, weight_gib(model)))
    to_fp8_layers(model, quantized)
    rows.append(("fp8 weights-only", measure("fp8 weights-only"), weight_gib(model)))
    for layer in quantized_layers(model):
        layer.compute = "w8a8"
    rows.append(("fp8 w8a8", measure("fp8 w8a8"), weight_gib(model)))
    for layer in quantized_layers(model):
        layer.compute = "weights-only"
    host = replace(options, input_embeddings="host")  # moves the model's input embedding for good
    rows.append(
        ("fp8 weights-only, embedding on host", measure("fp8 weights-only, host embedding", host), weight_gib(model))
    )

    tokens = workload.real_tokens
    base = rows[0]
    lines = []
    for label, m, gib in rows:
        rate = tokens / m.seconds if m.seconds else None
        worst, mean = differences(m, dequantized)
        lines.append(
            f"| {shape.name} | {label} | {rate:,.0f} | {rate / (tokens / base[1].seconds):.3f} | {gib:.2f} | "
            f"{gib / base[2]:.3f} | {worst:.2e} | {mean:.2e} |"
            if rate and worst is not None
            else f"| {shape.name} | {label} | {m.note or 'n/a'} | | {gib:.2f} | | | |"
        )
    return lines


def layer_times(n: int, k: int, rows: int) -> dict[str, float]:
    """Milliseconds of one [rows, k] x [k, n] layer, each way it can run, and W8A8's parts."""
    from logprob_service.ops import fp8
    from triton.testing import do_bench

    w = torch.randn(n, k, device="cuda") * 0.02
    q, s = quantize(w, BLOCKS.block_size)
    dense = w.to(torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    x_q, x_s = fp8.quantize_activations(x, 128)
    times = {
        "bf16": do_bench(lambda: torch.nn.functional.linear(x, dense)),
        "weights-only": do_bench(lambda: fp8.weights_only_linear(x, q, s, BLOCKS.block_size, None)),
        "w8a8": do_bench(lambda: fp8.w8a8_linear(x, q, s, BLOCKS.block_size, None)),
        "quantize (Triton)": do_bench(lambda: fp8.quantize_activations(x, 128)),
        "FP8 GEMM": do_bench(lambda: fp8.scaled_mm_fp8(x_q, x_s, q, s, True, torch.bfloat16)),
    }
    fp8.FUSED_ACTIVATIONS = False
    times["w8a8, torch quantize"] = do_bench(lambda: fp8.w8a8_linear(x, q, s, BLOCKS.block_size, None))
    times["quantize (torch)"] = do_bench(lambda: fp8.quantize_activations(x, 128))
    fp8.FUSED_ACTIVATIONS = True
    return times


def linear_table(shape: Shape, rows: int) -> list[str]:
    """Each of ``shape``'s layer shapes alone, the ways it can run."""
    attention = shape.heads * 128 + 2 * shape.kv_heads * 128
    layers = {
        "q/k/v": (attention, shape.hidden),
        "o": (shape.hidden, shape.heads * 128),
        "gate/up": (shape.intermediate, shape.hidden),
        "down": (shape.hidden, shape.intermediate),
    }
    lines, header = [], ""
    for label, (n, k) in layers.items():
        times = layer_times(n, k, rows)
        header = " | ".join(times)
        cells = " | ".join(f"{t:.3f} ({times['bf16'] / t:.2f}x)" for t in times.values())
        lines.append(f"| {shape.name} {label} {n}x{k} | {cells} |")
    return [
        "",
        f"Each layer alone, {rows:,} tokens: ms (bf16's time over it)",
        "",
        f"| layer | {header} |",
        "|---|" + "---:|" * 7,
        *lines,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=32768)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--linears", action="store_true", help="also each layer shape alone (first)")
    parser.add_argument("--no-model", action="store_true", help="the layer shapes only")
    args = parser.parse_args()
    device = torch.device("cuda:0")
    sampler = BusySampler.for_device(device, 0.05)
    if sampler is not None:
        sampler.start()
    harness = Harness(device, sampler, args.warmup, args.repeats)
    lines = [
        f"FP8 against bf16, GRPO-like workload ({args.sequences} sequences, prompts U[256, 1024], completions "
        f"U[64, 4096]), in-process, max_batch_tokens {args.max_batch_tokens}, deterministic; "
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}",
        "",
        "| shape | weights | tokens/s | vs bf16 | weight GiB | vs bf16 | max abs diff vs dequantized | mean |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    linears = [line for name in args.shapes for line in linear_table(SHAPES[name], 16384)] if args.linears else []
    for name in [] if args.no_model else args.shapes:
        lines += run_shape(replace(SHAPES[name]), args, harness)
        gc.collect()
        torch.cuda.empty_cache()
    if sampler is not None:
        sampler.stop()
    table = "\n".join(lines + linears)
    publish(table + "\n", "bench_fp8.md")


if __name__ == "__main__":
    main()
