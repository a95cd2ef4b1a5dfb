"""Completion log-probs of one batch, several ways, side by side: time and peak memory.

Shape: Qwen2.5-0.5B (hidden 896, 24 layers, 14/2 heads, vocab 151936, tied embeddings), random
weights (transformers' normal(0, 0.02) init, seeded), bf16, SDPA, 16 sequences x (512 prompt +
1536 completion) random token ids. Methods, all on the same inputs:

1. model body alone: ``model.base_model(...).last_hidden_state`` (the lower bound)
2. full logits + log_softmax: ``model(ids).logits``, completion rows -> ``.float().log_softmax`` -> gather
3. TRL-style: ``model(ids, logits_to_keep=C + 1)`` + TRL's row-looped ``selective_log_softmax``
4. this service's own body pass alone (packed, padding-free attention; inputs already on the device):
   as the server runs it (by default its layers' norms and MLPs compiled, ``--compile-layers``),
   and again with every layer eager when they are compiled
5. this service in-process: ``OfflineScorer.score``, the server's queue, loop and device worker
   (body -> completion rows -> lm_head log-prob op: the fused Triton kernel on CUDA; also with the
   eager fp32 chunks, for comparison)
6. this service through gRPC on loopback: the real ``grpc.aio`` server in this process, ``LogprobClient``;
   with the server's defaults, and with ``max_wait_ms`` 0 (in-process scoring's setting)

Each method: 2 warm-up runs, then ``--repeats`` timed runs, the device synchronized around each;
the median wall time is reported. Peak memory: peak allocated bytes over the timed runs
(``harness.time_calls``) minus what was allocated before the method ran (weights + inputs).
Error: max |log p - reference| over the first ``--ref-seqs`` sequences, the reference being
float64 logits from the same bf16 hidden states (``h.double() @ W.double().T``, float64 log_softmax):
HF's body's for the HF methods, the service's packed body's for the service's.

On a GPU (the run that counts):

    PYTHONPATH=service:client python3 benchmarks/bench_scoring.py

Smoke test on a CPU (tiny shapes, float32, memory columns n/a):

    PYTHONPATH=service:client .venv/bin/python benchmarks/bench_scoring.py --smoke

The table is printed last, and also written to ``$OUT/bench_scoring.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from common import (
    SHAPES,
    TINY,
    LoopbackServer,
    add_scoring_arguments,
    build_model,
    layers_label,
    scoring_options,
    selective_log_softmax,
)
from harness import GiB, publish, release, run_environment, time_calls
from logprob_client import LogprobClient, Overloaded
from logprob_service.domain import SequenceScores, TokenSequence
from logprob_service.engine.registry import ModelRegistry
from logprob_service.models.compiled import eager_layers
from logprob_service.models.scorer import CausalLMScorer
from logprob_service.models.served import serve_model
from logprob_service.offline import OfflineScorer
from logprob_service.ops.attention import packed_forward_kwargs
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.ops.logprobs import DEFAULT_LM_HEAD_CHUNK_BYTES
from logprob_service.settings.model import DEFAULT_MAX_BATCH_TOKENS, Settings
from logprob_service.worker.packing import pack
from transformers import PreTrainedModel

MODEL_NAME = "qwen2.5-0.5b-shape"


# ----------------------------------------------------------------------------- setup


@dataclass(frozen=True)
class Batch:
    """One batch of B sequences of P prompt + C completion tokens, on the device and on the host."""

    input_ids: torch.Tensor  # [B, L] int64 on the device, L = P + C
    position_ids: torch.Tensor  # [B, L] int64, 0..L-1 per row
    prompt_len: int  # P
    completion_len: int  # C
    sequences: list[TokenSequence]  # the same B sequences as numpy int64 arrays, for the service

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len :]  # [B, C]

    @property
    def completion_rows(self) -> slice:
        """Positions whose hidden state predicts completion tokens 0..C-1 (P-1 .. P+C-2)."""
        return slice(self.prompt_len - 1, self.prompt_len - 1 + self.completion_len)


def make_batch(batch: int, prompt_len: int, completion_len: int, vocab: int, device: torch.device, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, prompt_len + completion_len), dtype=np.int64)  # [B, L]
    sequences = [
        TokenSequence(prompt_ids=row[:prompt_len].copy(), completion_ids=row[prompt_len:].copy()) for row in ids
    ]
    input_ids = torch.from_numpy(ids).to(device)
    position_ids = torch.arange(ids.shape[1], device=device).expand(batch, -1).contiguous()
    return Batch(input_ids, position_ids, prompt_len, completion_len, sequences)


# ----------------------------------------------------------------------------- the methods


def body_alone(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """The decoder body's final hidden states: what every method must compute at least."""
    out = model.base_model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    return out.last_hidden_state  # [B, L, H]


def full_logits_log_softmax(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """The naive way: all logits, then float32 log_softmax of the completion rows, then gather."""
    logits = model(input_ids=batch.input_ids, use_cache=False).logits  # [B, L, V] bf16
    logprobs = logits[:, batch.completion_rows].float().log_softmax(-1)  # [B, C, V] fp32
    return logprobs.gather(-1, batch.completion_ids[..., None]).squeeze(-1)  # [B, C] fp32


def trl_style(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """TRL GRPOTrainer's per-token log-probs: logits of the last C + 1 positions only.

    TRL also divides the logits by the sampling temperature (a further [B, C, V] copy, even at
    T = 1); that step is left out here, so this is TRL's best case.
    """
    c = batch.completion_len
    logits = model(input_ids=batch.input_ids, use_cache=False, logits_to_keep=c + 1).logits  # [B, C+1, V] bf16
    logits = logits[:, :-1]  # [B, C, V]: the last position predicts past the sequence
    return selective_log_softmax(logits, batch.completion_ids)  # [B, C] bf16


def packed_body_alone(scorer: CausalLMScorer, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The service's own body pass (packed, padding-free attention) on inputs already on the device."""
    return scorer.body(use_cache=False, **inputs).last_hidden_state  # [1, T, H]


def packed_inputs(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    packed = pack(batch.sequences)
    cu_seqlens = torch.from_numpy(packed.cu_seqlens).to(device)
    return {
        "input_ids": torch.from_numpy(packed.input_ids).to(device)[None],
        "position_ids": torch.from_numpy(packed.position_ids).to(device)[None],
        **packed_forward_kwargs(cu_seqlens, packed.max_seqlen),
    }


def service_in_process(scorer: OfflineScorer, batch: Batch) -> list[SequenceScores]:
    """This service's served path in this process, less the wire (includes the device -> host copy)."""
    return scorer.score(batch.sequences)  # B x [C] float32 numpy


def service_grpc(client: LogprobClient, batch: Batch) -> list[np.ndarray]:
    """One ScoreTokens call through gRPC on loopback, as a trainer would make it."""
    prompts = [s.prompt_ids for s in batch.sequences]
    completions = [s.completion_ids for s in batch.sequences]
    return client.score(prompts, completions, model=MODEL_NAME)  # B x [C] float32 numpy


# ----------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Row:
    method: str
    median_ms: float | None  # None: the method failed (out of memory)
    peak_extra_gib: float | None  # None: not measured (CPU)
    max_abs_err: float | None  # None: not applicable (body) or failed
    note: str = ""


def completion_logprobs(out: Any, k: int) -> np.ndarray:
    """The first ``k`` sequences' completion log-probs from any method's output, as [k, C] float64."""
    if isinstance(out, torch.Tensor):
        return out[:k].double().cpu().numpy()
    if out and isinstance(out[0], SequenceScores):
        out = [s.logprobs for s in out]
    return np.stack([np.asarray(lp, dtype=np.float64) for lp in out[:k]])


def reference_logprobs(model: PreTrainedModel, hidden: torch.Tensor, batch: Batch, k: int) -> np.ndarray:
    """Float64 log-probs of the first ``k`` sequences' completion tokens: [k, C].

    ``hidden``: [B, L, H], the final bf16 hidden states of the batch as the methods to be checked
    compute them; only the lm_head and the log_softmax are float64, so the error columns measure
    the log-prob stage, not two bodies' bf16 rounding.
    """
    hidden = hidden[:k, batch.completion_rows]  # [k, C, H]
    weight = model.get_output_embeddings().weight.double()  # [V, H]
    targets = batch.completion_ids[:k]  # [k, C]
    ref = []
    for h, y in zip(hidden, targets, strict=True):  # one sequence at a time: a [C, V] float64 slab
        logprobs = (h.double() @ weight.T).log_softmax(-1)  # [C, V]
        ref.append(logprobs.gather(-1, y[:, None]).squeeze(-1).cpu().numpy())
    del hidden, weight
    return np.stack(ref)


def run_method(
    name: str, fn: Callable[[], Any], ref: np.ndarray | None, device: torch.device, warmup: int, repeats: int
) -> Row:
    print(f"running: {name}", file=sys.stderr, flush=True)
    try:
        timing = time_calls(fn, device, warmup=warmup, repeats=repeats)
        median_ms, out = timing.median_ms, timing.out
        peak = timing.peak_extra_bytes / GiB if timing.peak_extra_bytes is not None else None
    except (torch.OutOfMemoryError, Overloaded):  # the service reports its OOM as Overloaded
        out = None
    if out is None:  # released outside the except block: its traceback holds the failed run's tensors
        release(device)
        return Row(name, None, None, None, note="out of memory")
    err_max = None if ref is None else float(np.abs(completion_logprobs(out, len(ref)) - ref).max())
    del out
    release(device)
    return Row(name, median_ms, peak, err_max)


def run_all(
    model: PreTrainedModel, batch: Batch, args: argparse.Namespace, device: torch.device
) -> tuple[list[Row], str]:
    """The rows of the table, and a line on how the service's scorer was built."""
    ref = reference_logprobs(model, body_alone(model, batch), batch, args.ref_seqs)  # HF's own states
    release(device)
    options = scoring_options(args)
    start = time.perf_counter()
    scorer = OfflineScorer(model, options=options, max_batch_tokens=args.max_batch_tokens)  # auto lm_head kernel
    built = (
        f"service: attention {scorer.served.info.attention}; "
        + layers_label(scorer.scorer)
        + f"; scorer built in {time.perf_counter() - start:.1f} s"
    )
    eager = OfflineScorer(
        model,
        options=options,
        logprob_op=LogprobOp("eager", DEFAULT_LM_HEAD_CHUNK_BYTES),
        max_batch_tokens=args.max_batch_tokens,
        max_batch_sequences=256,
    )
    common = {"device": device, "warmup": args.warmup, "repeats": args.repeats}
    # The service's bf16 hidden states differ from HF's by kernel rounding (other attention
    # kernels, fused norms), so its rows are checked against float64 logits of its own packed
    # body's states, as [B, L, H] (every sequence has L tokens).
    inputs = packed_inputs(batch, device)
    with torch.inference_mode():
        states = packed_body_alone(scorer.scorer, inputs).view(*batch.input_ids.shape, -1)
    ref_packed = reference_logprobs(model, states, batch, args.ref_seqs)
    del states
    release(device)
    # The baselines run as HF users run them: sdpa, every layer eager.
    packed = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    with eager_layers(model.base_model):
        rows = [
            run_method("model body alone (lower bound)", lambda: body_alone(model, batch), None, **common),
            run_method(
                "full logits + float log_softmax + gather", lambda: full_logits_log_softmax(model, batch), ref, **common
            ),
            run_method(
                "TRL: logits_to_keep + row-looped selective_log_softmax", lambda: trl_style(model, batch), ref, **common
            ),
        ]
    model.set_attn_implementation(packed)  # the scorers' own, after the baselines' sdpa
    rows.append(
        run_method(
            f"service's packed body alone (no lm_head), {layers_label(scorer.scorer)}",
            lambda: packed_body_alone(scorer.scorer, inputs),
            None,
            **common,
        )
    )
    if scorer.scorer.layers_compiled:
        with eager_layers(model.base_model):
            rows.append(
                run_method(
                    "service's packed body alone (no lm_head), layers eager",
                    lambda: packed_body_alone(scorer.scorer, inputs),
                    None,
                    **common,
                )
            )
    rows.append(
        run_method(
            f"service in-process (OfflineScorer.score), {scorer.scorer.logprob_op.kernel} lm_head",
            lambda: service_in_process(scorer, batch),
            ref_packed,
            **common,
        )
    )
    if scorer.scorer.logprob_op.kernel != "eager":
        rows.append(
            run_method(
                "service in-process, eager 256 MiB chunks lm_head",
                lambda: service_in_process(eager, batch),
                ref_packed,
                **common,
            )
        )
    settings = Settings(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        models={MODEL_NAME: "random weights, built by benchmarks/bench_scoring.py"},
        device=str(device),
        max_batch_tokens=args.max_batch_tokens,
        max_batch_sequences=256,
    )
    registry = ModelRegistry()
    registry.add(serve_model(MODEL_NAME, "random", scorer.scorer))
    with LoopbackServer(settings, registry) as target, LogprobClient(target, timeout=600.0) as client:
        rows.append(
            run_method("service via gRPC (loopback)", lambda: service_grpc(client, batch), ref_packed, **common)
        )
    # The same with the idle device's wait for more work off, as in-process scoring runs it: what
    # is left over the in-process row is the wire's alone.
    no_wait = settings.model_copy(update={"max_wait_ms": 0.0})
    with LoopbackServer(no_wait, registry) as target, LogprobClient(target, timeout=600.0) as client:
        rows.append(
            run_method(
                "service via gRPC (loopback), max_wait_ms 0", lambda: service_grpc(client, batch), ref_packed, **common
            )
        )
    scorer.close()
    eager.close()
    return rows, built


# ----------------------------------------------------------------------------- report


def format_table(rows: list[Row]) -> str:
    body_ms = rows[0].median_ms

    def num(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    lines = ["| method | median ms | x body | peak extra GiB | max abs err vs fp64 |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r.median_ms / body_ms if r.median_ms is not None and body_ms else None
        cells = [
            r.method,
            r.note or num(r.median_ms, ".1f"),
            num(ratio, ".2f"),
            num(r.peak_extra_gib, ".2f"),
            num(r.max_abs_err, ".1e"),
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def describe_run(model: PreTrainedModel, batch: Batch, args: argparse.Namespace, device: torch.device) -> str:
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / GiB
    cfg = model.config
    return "\n".join(
        [
            *run_environment(device),
            f"model: Qwen2ForCausalLM, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
            f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, vocab {cfg.vocab_size}, tied, "
            f"random weights, {str(model.dtype).removeprefix('torch.')}, sdpa; weights {weights_gib:.2f} GiB",
            f"batch: {batch.input_ids.shape[0]} x ({batch.prompt_len} prompt + {batch.completion_len} completion) "
            f"tokens; {args.warmup} warm-up + {args.repeats} timed runs, median; "
            f"error over the first {args.ref_seqs} sequences; service: default (auto) lm_head kernel, "
            f"max_batch_tokens {args.max_batch_tokens}",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model and batch, cpu, float32: checks the script runs"
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda, or cpu with --smoke)")
    parser.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float16", "float32"], help="default: bf16 on cuda"
    )
    parser.add_argument("--batch", type=int, default=None, help="sequences (default 16; 2 with --smoke)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; 16 with --smoke)")
    parser.add_argument("--completion-len", type=int, default=None, help="completion tokens (default 1536; 32 --smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per method (default 5; 2 with --smoke)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per method first")
    parser.add_argument("--ref-seqs", type=int, default=2, help="sequences checked against the float64 reference")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=DEFAULT_MAX_BATCH_TOKENS,
        help="the service's token budget per packed micro-batch",
    )
    parser.add_argument("--shape", default="0.5b", choices=sorted(SHAPES), help="the model's (ignored with --smoke)")
    add_scoring_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    smoke = args.smoke
    defaults = {
        "device": "cpu" if smoke else "cuda",
        "batch": 2 if smoke else 16,
        "prompt_len": 16 if smoke else 512,
        "completion_len": 32 if smoke else 1536,
        "repeats": 2 if smoke else 5,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    if min(args.batch, args.prompt_len, args.completion_len, args.repeats) < 1 or args.warmup < 0:
        parser.error("--batch, --prompt-len, --completion-len and --repeats must be >= 1, --warmup >= 0")
    args.ref_seqs = max(1, min(args.ref_seqs, args.batch))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shape = TINY if args.smoke else SHAPES[args.shape]
    if args.prompt_len + args.completion_len > shape.max_positions:
        raise SystemExit(f"prompt + completion ({args.prompt_len + args.completion_len}) > {shape.max_positions}")
    model = build_model(shape, device, getattr(torch, args.dtype), args.seed)
    batch = make_batch(args.batch, args.prompt_len, args.completion_len, shape.vocab, device, args.seed + 1)
    with torch.inference_mode():
        rows, built = run_all(model, batch, args, device)
    report = f"{describe_run(model, batch, args, device)}\n{built}\n\n{format_table(rows)}\n"
    publish(report, "bench_scoring.md")


if __name__ == "__main__":
    main()
