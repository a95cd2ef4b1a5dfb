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

Model FLOPs: 4 * H * D per (query, allowed key) pair, i.e. 4*H*D * sum_s (Lq*(Lk - Lq) + Lq^2/2):
2 * sum_s L_s^2 * H * D for causal self-attention. Padding is not counted (it is wasted work).
Timing: the harness's kernel timing (``harness.time_kernel``: median device time over runs, the
L2 cache flushed before each); TFLOP/s are from this median. "ms back-to-back" is the mean of
``--iters`` calls enqueued without syncs, the GPU time per
call when the host runs ahead as it does in a model's forward.
Check column: max |out - FA2 varlen out| over the real rows (FA2 varlen being the service's
current path), so a fast wrong backend shows.

    PYTHONPATH=service python3 benchmarks/bench_attention.py

The table is printed last, and also written to ``$OUT/bench_attention.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import importlib.metadata
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
from logprob_service.ops.attention import cudnn as cda
from logprob_service.ops.attention import flash
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
        pairs = sum(q * (k - q) + q * q / 2 for q, k in zip(self.lq, self.lk))
        return 4.0 * self.heads * self.head_dim * pairs

    @property
    def square(self) -> bool:
        return self.lq == self.lk


@dataclass
class Row:
    case: str
    backend: str
    ms: float | None
    tflops: float | None
    back_to_back_ms: float | None
    check: str


def cases(seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    mixed = tuple(int(x) for x in rng.integers(256, 4097, 64))
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


def cumulative(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor((0, *np.cumsum(lengths).tolist()), dtype=torch.int32, device="cuda")


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
    lines = [
        *header,
        "",
        "| shape | backend | ms | TFLOP/s | ms back-to-back | max abs diff vs FA2 varlen |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in rows:
        ms = f"{row.ms:.3f}" if row.ms is not None else "-"
        tf = f"{row.tflops:.0f}" if row.tflops is not None else "-"
        b2b = f"{row.back_to_back_ms:.3f}" if row.back_to_back_ms is not None else "-"
        lines.append(f"| {row.case} | {row.backend} | {ms} | {tf} | {b2b} | {row.check} |")
    lines += ["", "cuDNN-FE graph builds (s):", *(f"  {name}: {s:.3f}" for name, s in builds.items())]
    publish("\n".join(lines), "bench_attention.md")


if __name__ == "__main__":
    main()
