"""cuDNN frontend varlen attention (ops.attention.cudnn) on CUDA, against a float32 reference.

Reference: each sequence on its own, plain float32 torch (TF32 off), query head h reading key/value
head h // (H / KV), the mask spelled out from its definition (causal aligned bottom-right, window
of w positions). bf16/fp16 inputs are exact in float32, so the reference sees the very inputs.

Tolerances, from where each kernel rounds:
* out: a fused flash kernel rounds the softmax probabilities and the output to the input dtype
  (2^-9 relative each in bf16); torch SDPA's memory-efficient kernel rounds the same two. Each test
  measures SDPA's own result against the same reference: cuDNN's mean abs error must be <= 1.5x
  SDPA's and its max abs error <= 2x SDPA's. A wrong mask, alignment or head mapping moves whole
  rows and misses this by orders of magnitude.
* out merged from two parts (merge_attention): a convex combination of the parts' errors plus one
  more rounding, so the same bounds plus 2^-9 (bf16 half-ulp, relative) of |out|.
* lse: float32 throughout (exact products of bf16 inputs, fp32 sums), so it must agree to the fp32
  error bound of both sides, per row: 2(D+2)u*A + 3Nu + 4u|lse| + 2^-19, u = 2^-24, A = max over
  allowed keys of scale*sum|q_d k_d|, N = allowed keys, 2^-19 for the exp2/log2 approximations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from logprob_service.ops.attention import cudnn as cda
from logprob_service.ops.attention.common import merge_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not cda.available(), reason=f"needs {cda.CUDNN_FRONTEND_PACKAGE} and cuDNN >= 9.6"),
]

U32 = 2.0**-24  # float32 unit roundoff
MAX_LEN = 4096
SHAPES = [(14, 2, 64), (12, 2, 128), (28, 4, 128), (32, 8, 128)]  # Qwen2.5 0.5B, 1.5B, 7B; Llama-3 8B
SHAPE_IDS = [f"{h}-{kv}-d{d}" for h, kv, d in SHAPES]
SCORE_BYTES = 512 * 1024**2  # float32 scores of one reference block


@pytest.fixture(autouse=True)
def _exact_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


# --------------------------------------------------------------------------- inputs


def mixed_lengths(rng: np.random.Generator, n: int) -> list[int]:
    """n lengths in 1..MAX_LEN, with two length-1 sequences and one of MAX_LEN."""
    lengths = [int(x) for x in rng.integers(1, MAX_LEN + 1, n)]
    lengths[0] = lengths[n // 2] = 1
    lengths[1] = MAX_LEN
    return lengths


def chunk_lengths(rng: np.random.Generator, n: int) -> tuple[list[int], list[int]]:
    """(Lq, Lk) per sequence with Lq <= Lk: one query (decode-like), Lq = Lk, a 512-query chunk
    at the end of MAX_LEN keys, the rest random."""
    lk = [int(x) for x in rng.integers(1, MAX_LEN + 1, n)]
    lq = [int(rng.integers(1, x + 1)) for x in lk]
    lk[0], lq[0] = 3000, 1
    lq[1] = lk[1]
    lk[2], lq[2] = MAX_LEN, 512
    lk[3], lq[3] = 1, 1
    return lq, lk


def cumulative(lengths: list[int]) -> torch.Tensor:
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    cu[1:] = np.cumsum(lengths)
    return torch.from_numpy(cu).cuda()


def packed(
    seed: int, lq: list[int], lk: list[int], shape: tuple[int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """q [Tq, H, D], k, v [Tk, KV, D] (seeded normal; q scaled by 2 for peakier softmaxes), cu_q, cu_k."""
    heads, kv_heads, head_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def normal(rows: int, h: int, std: float) -> torch.Tensor:
        x = torch.randn(rows, h, head_dim, generator=gen, device="cuda", dtype=torch.float32)
        return (x * std).to(dtype)

    q = normal(sum(lq), heads, 2.0)
    k, v = normal(sum(lk), kv_heads, 1.0), normal(sum(lk), kv_heads, 1.0)
    return q, k, v, cumulative(lq), cumulative(lk)


# --------------------------------------------------------------------------- references


def allowed_keys(q0: int, q1: int, lq: int, lk: int, window: int | None, causal: bool) -> torch.Tensor:
    """[q1 - q0, lk] bool: query rows q0..q1 of a sequence of lq queries over lk keys, by definition."""
    i = torch.arange(q0, q1, device="cuda")[:, None] + (lk - lq)  # the bottom-right aligned diagonal
    j = torch.arange(lk, device="cuda")[None, :]
    allowed = j <= i if causal else torch.ones_like(j <= i)
    if window is not None:
        allowed &= j > i - window
    return allowed


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 out [Tq, H, D], lse [Tq, H], and the lse tolerance [Tq, H] (module docstring)."""
    total_q, heads, head_dim = q.shape
    groups = heads // k.shape[1]
    out = torch.zeros(total_q, heads, head_dim, device="cuda")
    lse = torch.zeros(total_q, heads, device="cuda")
    lse_tol = torch.zeros(total_q, heads, device="cuda")
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for s in range(len(bq) - 1):
        lq, lk = bq[s + 1] - bq[s], bk[s + 1] - bk[s]
        qs = q[bq[s] : bq[s + 1]].float().transpose(0, 1)  # [H, Lq, D]
        ks = k[bk[s] : bk[s + 1]].float().repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, Lk, D]
        vs = v[bk[s] : bk[s + 1]].float().repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, Lk, D]
        rows = max(1, SCORE_BYTES // (4 * heads * max(lk, 1)))
        for r0 in range(0, lq, rows):
            r1 = min(lq, r0 + rows)
            allowed = allowed_keys(r0, r1, lq, lk, window, causal)  # [r, Lk]
            scores = (qs[:, r0:r1] @ ks.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))  # [H, r, Lk]
            block_lse = torch.logsumexp(scores, dim=-1)  # [H, r]
            o = torch.exp(scores - block_lse[..., None]) @ vs  # [H, r, D]
            bound = (qs[:, r0:r1].abs() @ ks.abs().transpose(1, 2) * scale).masked_fill(~allowed, 0).amax(-1)
            n_keys = allowed.sum(-1).float()  # [r]
            tol = 2 * (head_dim + 2) * U32 * bound + 3 * n_keys * U32 + 4 * U32 * block_lse.abs() + 2.0**-19
            rows_out = slice(bq[s] + r0, bq[s] + r1)
            out[rows_out] = o.transpose(0, 1)
            lse[rows_out] = block_lse.T
            lse_tol[rows_out] = tol.T
    return out, lse, lse_tol


def sdpa_baseline(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """torch SDPA's own result in the input dtype (memory-efficient kernel, explicit mask), per sequence."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        for s in range(len(bq) - 1):
            lq, lk = bq[s + 1] - bq[s], bk[s + 1] - bk[s]
            qs = q[bq[s] : bq[s + 1]].transpose(0, 1)[None]  # [1, H, Lq, D]
            ks = k[bk[s] : bk[s + 1]].repeat_interleave(groups, dim=1).transpose(0, 1)[None]  # [1, H, Lk, D]
            vs = v[bk[s] : bk[s + 1]].repeat_interleave(groups, dim=1).transpose(0, 1)[None]
            mask = allowed_keys(0, lq, lq, lk, window, causal)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            out[bq[s] : bq[s + 1]] = o[0].transpose(0, 1)
    return out


# --------------------------------------------------------------------------- checks


def check_out(got: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, *, extra: float = 0.0) -> None:
    """got / base: kernel outputs in bf16 or fp16; ref: float32. ``extra``: relative slack for merged outputs."""
    err = (got.float() - ref).abs()
    base_err = (base.float() - ref).abs()
    mag = ref.abs()
    limit_mean = 1.5 * base_err.mean().item() + extra * mag.mean().item()
    limit_max = 2.0 * base_err.max().item() + extra * mag.max().item()
    print(
        f"out error mean {err.mean().item():.3g} (SDPA {base_err.mean().item():.3g}), "
        f"max {err.max().item():.3g} (SDPA {base_err.max().item():.3g})"
    )
    assert err.mean().item() <= limit_mean, f"mean error {err.mean().item():.3g} > {limit_mean:.3g} (SDPA's x1.5)"
    assert err.max().item() <= limit_max, f"max error {err.max().item():.3g} > {limit_max:.3g} (SDPA's x2)"


def check_lse(got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == ref.shape
    err = (got - ref).abs()
    excess = err - tol
    worst = int(excess.argmax())
    print(f"lse error max {err.max().item():.3g}, largest error/tolerance {(err / tol).max().item():.3g}")
    assert excess.max().item() <= 0, (
        f"lse off by {err.flatten()[worst].item():.3g} > tolerance {tol.flatten()[worst].item():.3g}"
    )


def run_and_check(
    seed: int,
    lq: list[int],
    lk: list[int],
    shape: tuple[int, int, int],
    *,
    dtype: torch.dtype = torch.bfloat16,
    window: int | None = None,
    causal: bool = True,
) -> None:
    q, k, v, cu_q, cu_k = packed(seed, lq, lk, shape, dtype)
    scale = shape[2] ** -0.5
    window_size = (-1, -1) if not causal else ((-1, 0) if window is None else (window - 1, 0))
    out, lse = cda.cudnn_varlen_attention(
        q, k, v, cu_q, cu_k, max(lq), max(lk), scale=scale, window_size=window_size, return_lse=True
    )
    out_only = cda.cudnn_varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk), scale=scale, window_size=window_size)
    ref, ref_lse, lse_tol = reference(q, k, v, cu_q, cu_k, scale=scale, window=window, causal=causal)
    base = sdpa_baseline(q, k, v, cu_q, cu_k, scale=scale, window=window, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype
    check_out(out, ref, base)
    check_out(out_only, ref, base)
    check_lse(lse, ref_lse, lse_tol)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_causal_packed(shape: tuple[int, int, int], seed: int, rng: np.random.Generator) -> None:
    """Self-attention of 12 packed sequences (Lq = Lk), native GQA."""
    lengths = mixed_lengths(rng, 12)
    run_and_check(seed, lengths, lengths, shape)


def test_causal_fp16_and_head_dim_256(seed: int, rng: np.random.Generator) -> None:
    lengths = mixed_lengths(rng, 6)
    run_and_check(seed, lengths, lengths, (14, 2, 64), dtype=torch.float16)
    run_and_check(seed + 1, lengths, lengths, (8, 1, 256))


@pytest.mark.parametrize("shape", SHAPES[::2], ids=SHAPE_IDS[::2])
def test_bottom_right_chunks(shape: tuple[int, int, int], seed: int, rng: np.random.Generator) -> None:
    """Fewer queries than keys: query i of a sequence sees keys j <= i + Lk - Lq."""
    lq, lk = chunk_lengths(rng, 10)
    run_and_check(seed, lq, lk, shape)


@pytest.mark.parametrize("window", [1, 37, 1024])
def test_sliding_window(window: int, seed: int, rng: np.random.Generator) -> None:
    """transformers' window of w positions (self included), on square and bottom-right sequences."""
    lq, lk = chunk_lengths(rng, 8)
    run_and_check(seed, lq, lk, (14, 2, 64), window=window)
    lengths = mixed_lengths(rng, 8)
    run_and_check(seed + 1, lengths, lengths, (28, 4, 128), window=window)


def test_full_attention(seed: int, rng: np.random.Generator) -> None:
    """window_size (-1, -1): every query sees all its sequence's keys."""
    lq, lk = chunk_lengths(rng, 8)
    run_and_check(seed, lq, lk, (28, 4, 128), causal=False)


def test_merge_prefix_and_chunk(seed: int, rng: np.random.Generator) -> None:
    """A query chunk's attention = merge(full attention over the prefix, causal over the chunk's own keys)."""
    shape = (28, 4, 128)
    lq, lk = chunk_lengths(rng, 8)
    lq = [min(a, b - 1) if b > 1 else a for a, b in zip(lq, lk)]  # every sequence keeps a prefix of >= 1 key
    lq[3], lk[3] = 1, 2
    q, k, v, cu_q, cu_k = packed(seed, lq, lk, shape, torch.bfloat16)
    scale = shape[2] ** -0.5
    # Keys of sequence s: prefix [0, Lk - Lq), then the chunk's own Lq keys.
    prefix = [b - a for a, b in zip(lq, lk)]
    bk = cu_k.tolist()
    prefix_rows = torch.cat([torch.arange(bk[s], bk[s] + prefix[s]) for s in range(len(lq))]).cuda()
    own_rows = torch.cat([torch.arange(bk[s] + prefix[s], bk[s + 1]) for s in range(len(lq))]).cuda()
    out_a, lse_a = cda.cudnn_varlen_attention(
        q, k[prefix_rows], v[prefix_rows], cu_q, cumulative(prefix), max(lq), max(prefix),
        scale=scale, window_size=(-1, -1), return_lse=True,
    )  # fmt: skip
    out_b, lse_b = cda.cudnn_varlen_attention(
        q, k[own_rows], v[own_rows], cu_q, cu_q, max(lq), max(lq), scale=scale, return_lse=True
    )
    merged, merged_lse = merge_attention(out_a, lse_a, out_b, lse_b)
    ref, ref_lse, lse_tol = reference(q, k, v, cu_q, cu_k, scale=scale)
    base = sdpa_baseline(q, k, v, cu_q, cu_k, scale=scale)
    check_out(merged, ref, base, extra=2.0**-9)
    check_lse(merged_lse, ref_lse, lse_tol)


def test_graphs_are_reused_within_a_bucket(seed: int, rng: np.random.Generator) -> None:
    """Batches of 9..16 sequences no longer than 2048 share one graph; a longer one builds another."""
    cda.clear_graph_cache()
    shape = (14, 2, 64)
    for n, longest in ((9, 1100), (16, 2048), (13, 1500)):
        lengths = [int(x) for x in rng.integers(1, longest + 1, n)]
        lengths[-1] = longest
        run_and_check(seed + n, lengths, lengths, shape)
    assert len(cda.graph_build_seconds()) == 2  # one with lse, one without
    run_and_check(seed, [3000], [3000], shape)
    assert len(cda.graph_build_seconds()) == 4


def test_blockers() -> None:
    q = torch.zeros(4, 6, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.zeros(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert cda.cudnn_blocker(q, kv, kv) is None
    assert cda.cudnn_blocker(q, kv, kv, window_size=(7, 0)) is None
    assert cda.cudnn_blocker(q, kv, kv, window_size=(-1, -1)) is None
    assert "CUDA" in cda.cudnn_blocker(q.cpu(), kv.cpu(), kv.cpu())
    assert "softcap" in cda.cudnn_blocker(q, kv, kv, softcap=50.0)
    assert "window_size" in cda.cudnn_blocker(q, kv, kv, window_size=(3, 3))
    assert "dtypes" in cda.cudnn_blocker(q.float(), kv.float(), kv.float())
    assert "head dim" in cda.cudnn_blocker(q[..., :60], kv[..., :60], kv[..., :60])
    assert "heads" in cda.cudnn_blocker(q, kv[:, :1].expand(4, 4, 64), kv[:, :1].expand(4, 4, 64))
    cu = torch.tensor([0, 4], device="cuda", dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="window_size"):
        cda.cudnn_varlen_attention(q, kv, kv, cu, cu, 4, 4, scale=0.1, window_size=(3, 3))
