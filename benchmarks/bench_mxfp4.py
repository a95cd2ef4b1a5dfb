"""gpt-oss-120b's shape with MXFP4 experts on one GPU: tokens/s on the GRPO-like workload, and memory.

The whole model (36 layers; random weights in the checkpoint's layout: each expert bank's
``*_blocks`` random e2m1 codes and ``*_scales`` e8m0 exponents around 2^-8, the dense weights
~ N(0, 0.02)) built as ``models.quantized`` serves such a checkpoint: banks as ``Mxfp4Experts``
(4.25 bits a weight), dequantized inside each bank's forward into bf16 for its grouped GEMMs.
In bf16 the same model is about 2.2x one H200's memory.

Reported: the weights' memory on the GPU against their bf16 size (the same tensors at 2 bytes a
value), the peak memory above the weights while scoring, and tokens/s in-process
(``OfflineScorer``) over ``--sequences`` GRPO-like sequences (prompts U[256, 1024], completions
U[64, 4096]).

    PYTHONPATH=service:client python3 benchmarks/bench_mxfp4.py

The table is printed last, and also written to ``$OUT/bench_mxfp4.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse

import torch
from bench_batching import BusySampler, Harness, log, make_workload, service_pass
from harness import publish
from logprob_service.models.checkpoint import materialize, skeleton
from logprob_service.models.loading import attention_implementation, use_experts_implementation
from logprob_service.models.quantized import Mxfp4Experts, WeightFormat
from logprob_service.offline import OfflineScorer
from transformers import GptOssConfig, PreTrainedModel

GiB = 2**30
MXFP4 = WeightFormat("mxfp4", "blocks", "mxfp4", None)


def gpt_oss_120b(layers: int) -> GptOssConfig:
    return GptOssConfig(
        num_hidden_layers=layers,
        num_local_experts=128,
        num_experts_per_tok=4,
        hidden_size=2880,
        intermediate_size=2880,
        head_dim=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        vocab_size=201088,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
    )


@torch.no_grad()
def build(config: GptOssConfig, device: torch.device, seed: int) -> PreTrainedModel:
    model = skeleton(config, torch.bfloat16, attention_implementation(config))
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    for name, module in list(model.named_modules()):
        if name.endswith(".experts"):
            model.set_submodule(name, Mxfp4Experts(module, MXFP4))
    materialize(model, buffers, device)
    generator = torch.Generator(device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("_blocks"):
            param.copy_(torch.randint(0, 256, param.shape, generator=generator, device=device, dtype=torch.uint8))
        elif name.endswith("_scales"):
            param.copy_(torch.randint(118, 121, param.shape, generator=generator, device=device, dtype=torch.uint8))
        elif param.dim() >= 2 or name.endswith(".sinks"):
            param.normal_(0.0, 0.02, generator=generator)
        else:
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
    use_experts_implementation(model, device)
    return model.eval()


def sizes(model: PreTrainedModel) -> tuple[float, float]:
    """(bytes on the GPU, bytes the same values take in bf16), in GiB."""
    held = bf16 = 0
    for name, param in model.named_parameters():
        held += param.numel() * param.element_size()
        if name.endswith("_blocks"):
            bf16 += param.numel() * 2 * 2  # two values a byte
        elif not name.endswith("_scales"):
            bf16 += param.numel() * 2
    return held / GiB, bf16 / GiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--max-batch-tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device("cuda:0")
    log(f"gpt-oss-120b shape, {args.layers} layers: building")
    model = build(gpt_oss_120b(args.layers), device, args.seed)
    held, bf16 = sizes(model)
    workload = make_workload(args.sequences, (256, 1024), (64, 4096), 201088, 8, args.seed + 1)
    sampler = BusySampler.for_device(device, 0.05)
    if sampler is not None:
        sampler.start()
    harness = Harness(device, sampler, 1, args.repeats)
    with OfflineScorer(model, max_batch_tokens=args.max_batch_tokens) as scorer:
        measured = harness.measure("mxfp4 experts", lambda: service_pass(scorer, workload))
    if sampler is not None:
        sampler.stop()
    free, total = torch.cuda.mem_get_info(device)
    rate = f"{workload.real_tokens / measured.seconds:,.0f}" if measured.seconds else measured.note
    peak = f"{measured.peak_extra_gib:.1f}" if measured.peak_extra_gib is not None else "n/a"
    table = "\n".join(
        [
            f"gpt-oss-120b shape ({args.layers} layers), MXFP4 experts, {args.sequences} GRPO-like sequences "
            f"({workload.real_tokens:,} tokens), in-process, max_batch_tokens {args.max_batch_tokens}; "
            f"{torch.cuda.get_device_name(device)} ({total / GiB:.0f} GiB), torch {torch.__version__}",
            "",
            "| tokens/s | weights GiB | the same in bf16 GiB | ratio | peak above the weights GiB | free after GiB |",
            "|---:|---:|---:|---:|---:|---:|",
            f"| {rate} | {held:.1f} | {bf16:.1f} | {held / bf16:.3f} | {peak} | {free / GiB:.1f} |",
        ]
    )
    publish(table + "\n", "bench_mxfp4.md")


if __name__ == "__main__":
    main()
