"""One long sequence at the Qwen2.5-7B shape: the service against HF's own body on SDPA.

    PYTHONPATH=service:client python3 benchmarks/bench_long.py                         # 32K .. 512K
    PYTHONPATH=service:client python3 benchmarks/bench_long.py --lengths 1048576 --no-hf   # 1M alone
    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_long.py --smoke             # CPU check

For each length T: one sequence of 1024 prompt + T - 1024 completion tokens (random ids, random
bf16 weights: speed and memory depend on shapes only), scored by

* the service in-process (``OfflineScorer``: the server's queue, loop and device worker; a lone
  sequence longer than ``--long-sequence-tokens`` runs layer by layer in ``--chunk-tokens``
  chunks, ``models.chunked``), log-probs of every completion token;
* HF's body, ``model.model(input_ids)`` on SDPA (hidden states only: no logits), where it fits
  (``--hf-max``); out of memory is reported as such.

Columns: wall seconds of one call (the device synchronized; the first length is preceded by a
short warm-up call; "first call" pays the cuDNN plans of the length's new chunk shapes once, and
"service s" is a second call up to ``--warm-up-to``), peak bytes allocated beyond the weights, and
achieved TFLOP/s of model FLOPs: attention 2 * T^2 * hidden * layers (causal: half of 4 T^2
hidden) plus 2 * params * T (params without the input embedding, which is a lookup). Where HF ran,
"max |dlogp|" compares the service's log-probs of the last 256 completion tokens with log-probs
from HF's hidden states and float32 logits (bf16 bodies: differences of a few 1e-2 are kernel
rounding).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

import numpy as np
import torch
from common import SHAPES, TINY, add_scoring_arguments, build_model, layers_label, scoring_options
from harness import GiB, matmul_tflops, publish, release, run_environment, time_calls
from logprob_service.domain import TokenSequence
from logprob_service.models.compiled import eager_layers
from logprob_service.offline import OfflineScorer

PROMPT = 1024
CHECKED = 256  # completion tokens compared with HF's


def model_flops(model: torch.nn.Module, tokens: int) -> float:
    config = model.config
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        params += model.get_input_embeddings().weight.numel()  # tied: the lm_head matmul still runs
    attention = 2 * tokens**2 * config.hidden_size * config.num_hidden_layers
    return attention + 2 * params * tokens


def once(fn, device: torch.device) -> tuple[float, float, object]:
    """(seconds, GiB beyond what was allocated before (0 off CUDA), the result) of one call."""
    timing = time_calls(fn, device, warmup=0, repeats=1)
    return timing.median_ms / 1e3, (timing.peak_extra_bytes or 0) / GiB, timing.out


@torch.no_grad()
def hf_tail_logprobs(model: torch.nn.Module, ids: torch.Tensor, checked: int) -> tuple[float, float, np.ndarray]:
    """HF's body on SDPA, then float32 log-probs of the last ``checked`` tokens."""
    model.set_attn_implementation("sdpa")
    with eager_layers(model.model):
        seconds, peak, hidden = once(lambda: model.model(input_ids=ids[None]).last_hidden_state[0], ids.device)
    rows = hidden[-checked - 1 : -1].float()  # the rows predicting the last ``checked`` tokens
    del hidden
    logits = rows @ model.get_output_embeddings().weight.float().T
    logp = logits.log_softmax(-1).gather(1, ids[-checked:, None]).squeeze(1)
    return seconds, peak, logp.cpu().numpy()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="32768,131072,262144,524288", help="comma-separated T")
    parser.add_argument("--hf-max", type=int, default=524288, help="longest T for HF's body")
    parser.add_argument(
        "--warm-up-to", type=int, default=262144, help="time the service twice up to this T (new shapes' plans)"
    )
    parser.add_argument("--no-hf", action="store_true", help="the service alone")
    parser.add_argument("--long-sequence-tokens", type=int, default=65536)
    parser.add_argument("--chunk-tokens", type=int, default=32768)
    add_scoring_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny model, short lengths, cpu, float32")
    args = parser.parse_args(argv)
    if args.smoke:
        args.lengths, args.long_sequence_tokens, args.chunk_tokens = "1200,2048", 1100, 300
    device = torch.device("cpu" if args.smoke else "cuda")
    lengths = [int(x) for x in args.lengths.split(",")]
    # the smoke lengths (up to 2,048) exceed TINY's 256 positions: its rotary limit raised
    shape = dataclasses.replace(TINY, max_positions=4096) if args.smoke else SHAPES["7b"]
    model = build_model(shape, device, torch.float32 if args.smoke else torch.bfloat16, args.seed)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    options = scoring_options(args, long_sequence_tokens=args.long_sequence_tokens, chunk_tokens=args.chunk_tokens)
    scorer = OfflineScorer(model, options=options, max_batch_tokens=32768)
    packed = model.config._attn_implementation  # the scorer's; HF's runs switch to sdpa and back
    rng = np.random.default_rng(args.seed)
    header = [
        *run_environment(device),
        f"model: {shape.name} shape, {scorer.served.info.dtype}, random weights {weights / GiB:.1f} GiB; "
        f"attention: {scorer.served.info.attention}; {layers_label(scorer.scorer)}",
        f"chunks of {args.chunk_tokens} tokens above {args.long_sequence_tokens}",
        f"bf16 matmul 8192^3 in this run: {matmul_tflops(device):.0f} TFLOP/s" if device.type == "cuda" else "",
    ]
    warm = TokenSequence(rng.integers(0, shape.vocab, PROMPT), rng.integers(0, shape.vocab, 64 if args.smoke else 4096))
    scorer.score([warm])  # kernels compiled, graphs built: not in the first length's time
    rows = []
    for total in lengths:
        seq = TokenSequence(rng.integers(0, shape.vocab, PROMPT), rng.integers(0, shape.vocab, total - PROMPT))
        print(f"  T={total}: service", flush=True)
        first_sec, s_peak, scores = once(lambda seq=seq: scorer.score([seq])[0].logprobs, device)
        s_sec = once(lambda seq=seq: scorer.score([seq]), device)[0] if total <= args.warm_up_to else first_sec
        flops = model_flops(model, total)
        row = {"T": total, "first call s": first_sec, "service s": s_sec, "service GiB": s_peak}
        row["service TF/s"] = flops / s_sec / 1e12
        if not args.no_hf and total <= args.hf_max:
            print(f"  T={total}: HF body", flush=True)
            ids = torch.from_numpy(np.concatenate([seq.prompt_ids, seq.completion_ids])).to(device)
            try:
                checked = min(CHECKED, total - PROMPT)
                h_sec, h_peak, hf = hf_tail_logprobs(model, ids, checked)
                row |= {"HF s": h_sec, "HF GiB": h_peak, "HF TF/s": flops / h_sec / 1e12}
                row["max |dlogp|"] = float(np.abs(scores[-checked:] - hf).max())
            except torch.OutOfMemoryError:
                row["HF s"] = "out of memory"
            finally:
                del ids
                gc.collect()
                release(device)
                model.set_attn_implementation(packed)
        rows.append(row)
    columns = ["T", "first call s", "service s", "service GiB", "service TF/s", "HF s", "HF GiB", "HF TF/s", "x HF"]
    columns.append("max |dlogp|")
    lines = [*header, "", "| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    for row in rows:
        if isinstance(row.get("HF s"), float):
            row["x HF"] = row["service s"] / row["HF s"]
        cells = []
        for c in columns:
            v = row.get(c, "-")
            cells.append(f"{v:,}" if c == "T" else f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("(x HF: service seconds / HF body seconds; the service's include the lm_head stage and the copy out)")
    publish("\n".join(lines), "bench_long.md")
    scorer.close()


if __name__ == "__main__":
    main()
