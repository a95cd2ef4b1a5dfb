"""Causal attention backends on packed rows, each alone on the same bf16 inputs: ms and TFLOP/s.

Backends:

* ``FA2 varlen (+repeat)``: ``torch.nn.attention.varlen.varlen_attn`` as the service calls it
  (``ops.attention.flash.varlen_attention``): K/V repeated to H heads inside the timed call when this
  torch's varlen_attn has no ``enable_gqa``.
* ``FA2 varlen (K/V pre-repeated)``: the kernel alone, K/V repeated before timing.
* ``SDPA cuDNN``: ``F.scaled_dot_product_attention`` under ``SDPBackend.CUDNN_ATTENTION``, native
  GQA (``enable_gqa``), on a padded [B, H, L, D] copy of the packed rows made before timing.
* ``cuDNN-FE ragged``: ``ops.attention.cudnn.cudnn_varlen_attention`` (cuDNN frontend graph, THD
  layout with ragged offsets, native GQA). Its graph is built by a first call outside the timing;
  build times are listed under the table.
* For the bottom-right chunk (e), also: both cuDNN paths as a full rectangle (the chunk against the
  keys before it) plus a causal square (against its own keys), merged by log-sum-exp
  (``ops.attention.common.merge_attention``); torch's through
  ``aten._scaled_dot_product_cudnn_attention(compute_log_sumexp)``.

Shapes: (a) 16 x 2048, 14/2 heads, D 64 (Qwen2.5-0.5B); (b) 16 x 2048, 12/2, D 128 (1.5B);
(c) 64 sequences of seeded uniform lengths 256..4096, at 14/2 D 64 and 28/4 D 128; (d) one sequence
of 65,536 and of 131,072 tokens, 28/4, D 128 (7B); (e) 16,384 queries against 131,072 keys
(bottom-right), 28/4, D 128.

Fallback costs, a table of their own, each row a call of ``ops.attention.choice.packed_attention``
(backend "auto", named in the row) or a kernel beside it, on seeded bf16 inputs:

* (f) Llama 4 text's chunked layers (Llama-4-Scout: 40/8 heads, D 128, attention_chunk_size 8192),
  which the service runs as one causal segment per chunk (``choice.chunk_segments``) in one ragged
  call. Rows: the chunked call; the same rows as plain causal attention (more work wherever a
  sequence crosses a chunk); the cut alone (the host's segments, and the gather of their keys and
  values, which only a query chunk of a longer sequence needs). Shapes: the 64 GRPO-like lengths of
  (c) (no sequence crosses a chunk: the same work, so this prices the cut itself), 8 sequences of
  seeded lengths 16,384..32,768 (several chunks each), and 16,384 queries against 131,072 keys.
  The cost: chunked TFLOP/s against plain TFLOP/s on the same rows, and the cut's share of the time.
* (g) DeepSeek-V3's MLA (128/128 heads; V2-Lite 16/16), query/key head dim 192, value head dim 128,
  the 64 lengths of (c). Rows: the values zero-padded to 192 for the D-192 kernel and the output
  sliced back (the service's path); the same with values already 192 wide (no pad, no slice); torch's
  memory-efficient kernel (varlen entry), which takes 128-wide values, at Dv 128 and at Dv 192: what
  a kernel taking them natively would save (analytically (192+192)/(192+128) = 1.2 in FLOPs).
  The figures under the table give these ratios.

Model FLOPs: 4 * H * D per (query, allowed key) pair, i.e. 4*H*D * sum_s (Lq*(Lk - Lq) + Lq^2/2):
2 * sum_s L_s^2 * H * D for causal self-attention. Padding is not counted (it is wasted work).
With value heads of their own width, 2 * H * (Dqk + Dv) per pair, Dv the values a call is given
(so (g)'s padded path is credited with the 128 columns its output needs). A chunked call's pairs
are counted over its segments (each chunk's queries against that chunk's keys up to them).
Timing: the harness's kernel timing (``harness.time_kernel``: median device time over runs, the
L2 cache flushed before each); TFLOP/s are from this median. "ms back-to-back" is the mean of
``--iters`` calls enqueued without syncs, the GPU time per
call when the host runs ahead as it does in a model's forward.
Check column: max |out - FA2 varlen out| over the real rows (FA2 varlen being the service's
current path), so a fast wrong backend shows.

    PYTHONPATH=service python3 benchmarks/bench_attention.py
    PYTHONPATH=service python3 benchmarks/bench_attention.py --only "(f)"   # or "(g)": one section

The timings of (f) include the host's cut (the device waits for it), as a model's forward does.

The tables are printed last, and also written to ``$OUT/bench_attention.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from harness import matmul_tflops, publish, run_environment, time_kernel
from logprob_service.ops.attention import choice, flash
from logprob_service.ops.attention import cudnn as cda
from logprob_service.ops.attention.common import merge_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Case:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    lq: tuple[int, ...]  # query rows per sequence
    lk: tuple[int, ...]  # key rows per sequence (lq[s] <= lk[s]; equal for self-attention)

    @property
    def flops(self) -> float:
        return attention_flops(self.heads, self.head_dim, self.head_dim, self.lq, self.lk)

    @property
    def square(self) -> bool:
        return self.lq == self.lk


def attention_flops(heads: int, qk_dim: int, v_dim: int, lq: tuple[int, ...], lk: tuple[int, ...]) -> float:
    """Model FLOPs: 2 * H * (Dqk + Dv) per (query, allowed key) pair (the score q.k, then the
    weighted sum of the values), pairs = sum_s Lq*(Lk - Lq) + Lq^2/2 (bottom-right causal)."""
    pairs = sum(q * (k - q) + q * q / 2 for q, k in zip(lq, lk))
    return 2.0 * heads * (qk_dim + v_dim) * pairs


@dataclass
class Row:
    case: str
    backend: str
    ms: float | None
    tflops: float | None
    back_to_back_ms: float | None
    check: str


def grpo_lengths(seed: int) -> tuple[int, ...]:
    """64 seeded uniform lengths 256..4096: a GRPO-like packed batch."""
    return tuple(int(x) for x in np.random.default_rng(seed).integers(256, 4097, 64))


def cases(seed: int) -> list[Case]:
    mixed = grpo_lengths(seed)
    return [
        Case("(a) 16x2048 14/2 D64", 14, 2, 64, (2048,) * 16, (2048,) * 16),
        Case("(b) 16x2048 12/2 D128", 12, 2, 128, (2048,) * 16, (2048,) * 16),
        Case("(c) 64 mixed 256..4096 14/2 D64", 14, 2, 64, mixed, mixed),
        Case("(c) 64 mixed 256..4096 28/4 D128", 28, 4, 128, mixed, mixed),
        Case("(d) 1x65536 28/4 D128", 28, 4, 128, (65536,), (65536,)),
        Case("(d) 1x131072 28/4 D128", 28, 4, 128, (131072,), (131072,)),
        Case("(e) 16384 q vs 131072 k 28/4 D128", 28, 4, 128, (16384,), (131072,)),
    ]


def back_to_back_ms(fn: Callable[[], object], iters: int) -> float:
    """Mean of ``iters`` calls enqueued with no sync between them: the GPU's time per call once the
    host runs ahead (as in a model's forward), without the host's launch latency of one lone call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def cumulative(lengths: tuple[int, ...], device: torch.device | str = "cuda") -> torch.Tensor:
    return torch.tensor(bounds_of(lengths), dtype=torch.int32, device=device)


def bounds_of(lengths: tuple[int, ...]) -> list[int]:
    """cu_seqlens as host ints: [0, L0, L0 + L1, ...]."""
    return [0, *np.cumsum(lengths).tolist()]


def padded(x: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """Packed [T, heads, D] -> zero-padded [B, heads, L, D]."""
    out = x.new_zeros(len(lengths), max(lengths), x.shape[1], x.shape[2])
    start = 0
    for s, n in enumerate(lengths):
        out[s, :n] = x[start : start + n]
        start += n
    return out.transpose(1, 2)


def unpadded(x: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """[B, heads, L, D] -> packed [T, heads, D]."""
    return torch.cat([x[s, :, :n].transpose(0, 1) for s, n in enumerate(lengths)])


def run_case(case: Case, iters: int, seed: int) -> tuple[list[Row], dict[str, float]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def normal(rows: int, heads: int) -> torch.Tensor:
        return torch.randn(rows, heads, case.head_dim, generator=gen, device="cuda", dtype=DTYPE)

    q = normal(sum(case.lq), case.heads)  # [Tq, H, D]
    k, v = normal(sum(case.lk), case.kv_heads), normal(sum(case.lk), case.kv_heads)  # [Tk, KV, D]
    cu_q, cu_k = cumulative(case.lq), cumulative(case.lk)
    if case.square:
        cu_k = cu_q
    max_q, max_k = max(case.lq), max(case.lk)
    scale = case.head_dim**-0.5
    groups = case.heads // case.kv_heads
    rows: list[Row] = []
    builds: dict[str, float] = {}
    reference: list[torch.Tensor] = []

    def add(backend: str, fn: Callable[[], torch.Tensor], unpack: Callable[[torch.Tensor], torch.Tensor] = lambda o: o):
        """Time ``fn`` (a row of the table); ``unpack`` maps its output to packed [Tq, H, D] for the check."""
        try:
            out = unpack(fn())
            torch.cuda.synchronize()
            if not reference:
                reference.append(out)
                check = "reference"
            else:
                check = f"{(out.float() - reference[0].float()).abs().max().item():.2e}"
            ms = time_kernel(fn)
            rows.append(Row(case.name, backend, ms, case.flops / ms / 1e9, back_to_back_ms(fn, iters), check))
        except Exception as exc:  # one backend's failure must not cost the others' rows
            rows.append(Row(case.name, backend, None, None, None, f"{type(exc).__name__}: {str(exc)[:90]}"))
        torch.cuda.synchronize()

    # --- FA2 varlen (bottom-right aligned by construction)
    add(
        "FA2 varlen (+repeat)",
        lambda: flash.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0)),
    )
    varlen = flash._varlen_attn()
    if varlen is not None and groups > 1 and not flash._accepts_enable_gqa(varlen):
        k_rep, v_rep = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        add(
            "FA2 varlen (K/V pre-repeated)",
            lambda: varlen(q, k_rep, v_rep, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0)),
        )
        del k_rep, v_rep

    # --- cuDNN frontend, ragged
    def fe() -> torch.Tensor:
        return cda.cudnn_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)

    if cda.available():
        before = set(cda.graph_build_seconds())
        start = time.perf_counter()
        try:
            fe()
            torch.cuda.synchronize()
        except Exception:
            pass  # add() below reports it
        first_call = time.perf_counter() - start
        new = {name: s for name, s in cda.graph_build_seconds().items() if name not in before}
        builds.update({f"{case.name}: {name}": s for name, s in new.items()})
        if new:
            builds[f"{case.name}: first call incl. build"] = first_call
        add("cuDNN-FE ragged", fe)
        if case.name.startswith("(c)"):
            bucket = cda._bucket
            cda._bucket = lambda x, floor: x  # graph for the exact n and max lengths
            try:
                add("cuDNN-FE ragged, exact-shape graph", fe)
            finally:
                cda._bucket = bucket
    else:
        rows.append(Row(case.name, "cuDNN-FE ragged", None, None, None, cda._load()[1] or "unavailable"))

    # --- SDPA cuDNN
    if case.square:
        qp, kp, vp = padded(q, case.lq), padded(k, case.lk), padded(v, case.lk)  # [B, heads, L, D]

        def sdpa_cudnn() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)

        label = "SDPA cuDNN (padded)" if len(case.lq) > 1 else "SDPA cuDNN"
        add(label, sdpa_cudnn, lambda o: unpadded(o, case.lq))
        del qp, kp, vp
    else:
        add_split_rows(case, q, k, v, scale, add)
    return rows, builds


def add_split_rows(
    case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, add: Callable[..., None]
) -> None:
    """(e): one sequence, Lq queries at the end of Lk keys = full rectangle (the Lk - Lq keys before
    the chunk) + causal square (its own Lq keys), merged by log-sum-exp."""
    (lq,), (lk,) = case.lq, case.lk
    prefix = lk - lq
    groups = case.heads // case.kv_heads

    # torch's cuDNN attention op (returns the log-sum-exp); [1, heads, L, D] views of the packed rows.
    def bhsd(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)[None]

    def cudnn_op(qq, kk, vv, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qq, kk, vv, None, True, 0.0, causal, False, scale=scale
        )[:2]
        return out[0].transpose(0, 1), lse.reshape(case.heads, -1).transpose(0, 1)  # [Lq, H, D], [Lq, H]

    # Does torch's cuDNN op take fewer K/V heads than query heads? Asked once on a tiny input.
    try:
        tiny = torch.zeros(1, case.heads, 64, case.head_dim, device="cuda", dtype=DTYPE)
        cudnn_op(tiny, tiny[:, : case.kv_heads], tiny[:, : case.kv_heads], causal=True)
        native = True
    except RuntimeError:
        native = False
    kk = k if native else k.repeat_interleave(groups, dim=1)
    vv = v if native else v.repeat_interleave(groups, dim=1)
    qb, k_rect, v_rect = bhsd(q), bhsd(kk[:prefix]), bhsd(vv[:prefix])
    k_sq, v_sq = bhsd(kk[prefix:]), bhsd(vv[prefix:])

    def torch_split() -> torch.Tensor:
        out_a, lse_a = cudnn_op(qb, k_rect, v_rect, causal=False)
        out_b, lse_b = cudnn_op(qb, k_sq, v_sq, causal=True)
        return merge_attention(out_a, lse_a, out_b, lse_b)[0]

    add("SDPA-cuDNN op rect+square, lse merge" + ("" if native else " (K/V repeated)"), torch_split)
    if cda.available():
        cu_q, cu_prefix = cumulative((lq,)), cumulative((prefix,))
        k_before, v_before = k[:prefix], v[:prefix]  # [P, KV, D] views
        k_own, v_own = k[prefix:], v[prefix:]  # [Lq, KV, D]

        def fe_split() -> torch.Tensor:
            out_a, lse_a = cda.cudnn_varlen_attention(
                q, k_before, v_before, cu_q, cu_prefix, lq, prefix, scale=scale, window_size=(-1, -1), return_lse=True
            )
            out_b, lse_b = cda.cudnn_varlen_attention(q, k_own, v_own, cu_q, cu_q, lq, lq, scale=scale, return_lse=True)
            return merge_attention(out_a, lse_a, out_b, lse_b)[0]

        add("cuDNN-FE rect+square, lse merge", fe_split)


# --- (f), (g): what the service's ways around two missing kernel features cost


@dataclass(frozen=True)
class FallbackCase:
    name: str
    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    lq: tuple[int, ...]  # query rows per sequence
    lk: tuple[int, ...]  # key rows per sequence (lq[s] <= lk[s])


@dataclass(frozen=True)
class Variant:
    """One way of computing a case's attention, timed against the others."""

    label: str
    fn: Callable[[], object]
    flops: float | None  # the FLOPs its output needs; None: not attention (the cut alone)
    same_as_first: bool = False  # its output's first Dv columns should equal the first call's


LLAMA4_CHUNK = 8192  # Llama-4-Scout's attention_chunk_size


def fallback_cases(seed: int) -> list[FallbackCase]:
    mixed = grpo_lengths(seed)
    long = tuple(int(x) for x in np.random.default_rng(seed + 1).integers(16384, 32769, 8))
    return [
        FallbackCase("(f) 64 mixed 256..4096 40/8 D128 chunk 8192 (Llama-4-Scout)", 40, 8, 128, 128, mixed, mixed),
        FallbackCase("(f) 8 x 16384..32768 40/8 D128 chunk 8192 (Llama-4-Scout)", 40, 8, 128, 128, long, long),
        FallbackCase(
            "(f) 16384 q vs 131072 k 40/8 D128 chunk 8192 (Llama-4-Scout)", 40, 8, 128, 128, (16384,), (131072,)
        ),
        FallbackCase("(g) 64 mixed 256..4096 128/128 D192/128 (DeepSeek-V3 MLA)", 128, 128, 192, 128, mixed, mixed),
        FallbackCase("(g) 64 mixed 256..4096 16/16 D192/128 (DeepSeek-V2-Lite MLA)", 16, 16, 192, 128, mixed, mixed),
    ]


def packed_inputs(
    case: FallbackCase, seed: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded normal q [Tq, H, Dqk], k [Tk, KV, Dqk], v [Tk, KV, Dv]."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(rows: int, heads: int, dim: int) -> torch.Tensor:
        return torch.randn(rows, heads, dim, generator=gen, device=device, dtype=dtype)

    tq, tk = sum(case.lq), sum(case.lk)
    return (
        normal(tq, case.heads, case.qk_dim),
        normal(tk, case.kv_heads, case.qk_dim),
        normal(tk, case.kv_heads, case.v_dim),
    )


def lengths_of(bounds: list[int]) -> tuple[int, ...]:
    return tuple(b - a for a, b in itertools.pairwise(bounds))


def backend_label(label: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sequences: int) -> str:
    """``label (backend)``: the backend ``packed_attention`` picks for this call under "auto"."""
    v = choice._padded_values(q, v)
    backend = choice.choose_backend("auto", q, k, v, one_sequence=sequences == 1, sliding_window=None, softcap=None)[0]
    return f"{label} ({backend})"


def chunked_calls(case: FallbackCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> list[Variant]:
    """(f): ``packed_attention`` with ``attention_chunk`` (one causal segment per chunk); the same
    rows as plain causal attention (the same work when no sequence crosses a chunk, more when one
    does); and the cut alone: ``chunk_segments`` on the host from host bounds (two small pinned
    copies to the device), then the gather of the segments' keys and values, which only a chunk
    of a longer sequence needs (for self-attention the segments' keys tile the keys: no gather).
    FLOPs of the chunked call are counted over its segments (``attention_flops`` of the segments'
    lengths): 2*H*(Dqk+Dv) * sum_seg (Lq*(Lk - Lq) + Lq^2/2), Lk the segment's keys from its chunk
    start; of the plain call over the whole sequences."""
    device = q.device
    cu_q, cu_k = cumulative(case.lq, device), cumulative(case.lk, device)
    bounds = (bounds_of(case.lq), bounds_of(case.lk))
    max_q, max_k, scale = max(case.lq), max(case.lk), case.qk_dim**-0.5
    seg_q, seg_k = choice.chunk_segments(cu_q, cu_k, chunk, bounds)[-1]
    pieces_q, pieces_k = lengths_of(seg_q), lengths_of(seg_k)

    def flops(lq: tuple[int, ...], lk: tuple[int, ...]) -> float:
        return attention_flops(case.heads, case.qk_dim, case.v_dim, lq, lk)

    def chunked() -> torch.Tensor:
        return choice.packed_attention(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, attention_chunk=chunk, bounds=bounds
        )

    def plain() -> torch.Tensor:
        return choice.packed_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, bounds=bounds)

    def cut() -> tuple[torch.Tensor, torch.Tensor]:
        index = choice.chunk_segments(cu_q, cu_k, chunk, bounds)[4]
        return (k, v) if index is None else (k.index_select(0, index), v.index_select(0, index))

    crosses = len(pieces_q) > len(case.lq)
    return [
        Variant(backend_label("chunked", q, k, v, len(pieces_q)), chunked, flops(pieces_q, pieces_k)),
        Variant(backend_label("plain causal", q, k, v, len(case.lq)), plain, flops(case.lq, case.lk), not crosses),
        Variant("the cut alone (host segments + K/V gather)", cut, None),
    ]


def efficient_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """torch's memory-efficient attention kernel (SDPA's ``EFFICIENT_ATTENTION``) on the packed
    rows through its varlen entry, causal: it takes value heads narrower than the query's.
    q: [T, H, Dqk]; k: [T, H, Dqk]; v: [T, H, Dv] -> [T, H, Dv]."""
    out = torch.ops.aten._efficient_attention_forward(
        q[None], k[None], v[None], None, cu, cu, max_len, max_len, 0.0, 1, False, scale=scale
    )[0]  # custom_mask_type 1: causal from the top left (= bottom-right for self-attention)
    return out[0]


def mla_calls(case: FallbackCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[Variant]:
    """(g): ``packed_attention`` with MLA's narrower values (zero-padded to Dqk, the Dqk kernel,
    the output sliced back); the same with the values already Dqk wide (the same values and zero
    columns: no pad, no slice); and torch's memory-efficient kernel at Dv = 128 and at Dv = 192,
    the one kernel here that takes Dv != Dqk, as the estimate of what a kernel taking the narrow
    values natively would save. FLOPs: 2*H*(Dqk+Dv) per pair with Dv = the values given (so the
    padded path is credited with the 128 its output needs); analytically padded/native =
    (192+192)/(192+128) = 1.2."""
    cu = cumulative(case.lq, q.device)
    max_len, scale = max(case.lq), case.qk_dim**-0.5
    wide = F.pad(v, (0, case.qk_dim - case.v_dim))

    def flops(v_dim: int) -> float:
        return attention_flops(case.heads, case.qk_dim, v_dim, case.lq, case.lq)

    def attention(values: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: choice.packed_attention(q, k, values, cu, cu, max_len, max_len, scale=scale)

    def efficient(values: torch.Tensor) -> Callable[[], torch.Tensor]:
        return lambda: efficient_attention(q, k, values, cu, max_len, scale)

    n = len(case.lq)
    return [
        Variant(
            backend_label(f"Dv {case.v_dim}, padded to {case.qk_dim}", q, k, v, n), attention(v), flops(case.v_dim)
        ),
        Variant(backend_label(f"Dv {case.qk_dim} given", q, k, wide, n), attention(wide), flops(case.qk_dim), True),
        Variant(f"mem-efficient kernel, Dv {case.v_dim}", efficient(v), flops(case.v_dim), True),
        Variant(f"mem-efficient kernel, Dv {case.qk_dim}", efficient(wide), flops(case.qk_dim), True),
    ]


def fallback_calls(case: FallbackCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[Variant]:
    return chunked_calls(case, q, k, v, LLAMA4_CHUNK) if case.name.startswith("(f)") else mla_calls(case, q, k, v)


def max_diff(out: object, first: object, columns: int) -> float:
    """max |out - first| over the first ``columns`` output columns."""
    assert isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor)
    return (out[..., :columns].float() - first[..., :columns].float()).abs().max().item()


def run_fallback_case(case: FallbackCase, iters: int, seed: int) -> tuple[list[Row], list[str]]:
    """The case's rows (first call untimed: graph builds), and its cost figures."""
    q, k, v = packed_inputs(case, seed, torch.device("cuda"), DTYPE)
    rows: list[Row] = []
    first: object = None
    for call in fallback_calls(case, q, k, v):
        try:
            out = call.fn()
            torch.cuda.synchronize()
            if first is None:
                first, note = out, "reference"
            else:
                note = f"{max_diff(out, first, case.v_dim):.2e}" if call.same_as_first else ""
            del out
            ms = time_kernel(call.fn)
            tflops = call.flops / ms / 1e9 if call.flops is not None else None
            rows.append(Row(case.name, call.label, ms, tflops, back_to_back_ms(call.fn, iters), note))
        except Exception as exc:  # a refused shape is a row, not the end of the run
            rows.append(Row(case.name, call.label, None, None, None, f"{type(exc).__name__}: {str(exc)[:90]}"))
        torch.cuda.synchronize()
    return rows, cost_figures(case, rows)


def cost_figures(case: FallbackCase, rows: list[Row]) -> list[str]:
    """(f): chunked TFLOP/s over plain causal TFLOP/s (the efficiency the segments lose) and the
    cut's share of the chunked call; (g): the pad and slice (padded path / Dv-192 values), and the
    mem-efficient kernel's Dv-192 / Dv-128 time."""

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.3f}" if a is not None and b else "-"

    if case.name.startswith("(f)"):
        chunked, plain, cut = rows
        return [
            f"{case.name}: chunked/plain TFLOP/s {ratio(chunked.tflops, plain.tflops)}, "
            f"chunked/plain ms {ratio(chunked.ms, plain.ms)}, cut/chunked ms {ratio(cut.ms, chunked.ms)}"
        ]
    padded_path, wide, eff_narrow, eff_wide = rows
    return [
        f"{case.name}: padded path / Dv-{case.qk_dim} values ms {ratio(padded_path.ms, wide.ms)} (the pad and slice); "
        f"mem-efficient Dv {case.qk_dim} / Dv {case.v_dim} ms {ratio(eff_wide.ms, eff_narrow.ms)} "
        f"(analytic FLOPs {(2 * case.qk_dim) / (case.qk_dim + case.v_dim):.2f})"
    ]


def table(rows: list[Row], last_column: str) -> list[str]:
    lines = [
        f"| shape | backend | ms | TFLOP/s | ms back-to-back | {last_column} |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in rows:
        ms = f"{row.ms:.3f}" if row.ms is not None else "-"
        tf = f"{row.tflops:.0f}" if row.tflops is not None else "-"
        b2b = f"{row.back_to_back_ms:.3f}" if row.back_to_back_ms is not None else "-"
        lines.append(f"| {row.case} | {row.backend} | {ms} | {tf} | {b2b} | {row.check} |")
    return lines


def versions() -> list[str]:
    def dist(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cudnn, reason = cda._load()
    backend = f"cuDNN backend {cudnn.backend_version()}" if cudnn is not None else f"cudnn-frontend: {reason}"
    libs = sorted(
        {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libcudnn.so" in line}
    )
    return [
        f"torch {torch.__version__} (cuDNN {torch.backends.cudnn.version()}), python {platform.python_version()}",
        f"{cda.CUDNN_FRONTEND_PACKAGE} {dist(cda.CUDNN_FRONTEND_PACKAGE)}, {backend}",
        f"libcudnn loaded from: {', '.join(libs) or 'none'}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=10, help="timed runs per backend (median; at least 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA device")
    iters = max(10, args.iters)
    header = [
        *run_environment(torch.device("cuda")),
        *versions(),
        f"bf16 matmul 8192^3 in this run: {matmul_tflops(torch.device('cuda')):.0f} TFLOP/s",
    ]
    rows: list[Row] = []
    builds: dict[str, float] = {}
    for case in cases(args.seed):
        if args.only in case.name:
            case_rows, case_builds = run_case(case, iters, args.seed)
            rows += case_rows
            builds.update(case_builds)
            for row in case_rows:
                print(f"  {row.case} | {row.backend} | {row.ms} | {row.check}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
    fallback_rows: list[Row] = []
    figures: list[str] = []
    for fallback in fallback_cases(args.seed):
        if args.only in fallback.name:
            case_rows, case_figures = run_fallback_case(fallback, iters, args.seed)
            fallback_rows += case_rows
            figures += case_figures
            for row in case_rows:
                print(f"  {row.case} | {row.backend} | {row.ms} | {row.check}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
    lines = [*header]
    if rows:
        lines += ["", *table(rows, "max abs diff vs FA2 varlen")]
    if fallback_rows:
        lines += [
            "",
            "Fallback costs: (f) Llama 4 chunked layers as one causal segment per chunk, (g) MLA's values",
            "zero-padded to the query/key head dim (TFLOP/s on the FLOPs each output needs):",
            "",
            *table(fallback_rows, "max abs diff vs the shape's first row"),
            "",
            *figures,
        ]
    lines += ["", "cuDNN-FE graph builds (s):", *(f"  {name}: {s:.3f}" for name, s in builds.items())]
    publish("\n".join(lines), "bench_attention.md")


if __name__ == "__main__":
    main()
