"""The exact backend: each sequence of a packed row on its own, as transformers' eager
implementation computes it, in blocks of query rows so that one block's float32 scores stay under
``FALLBACK_SCORE_BYTES`` (memory O(block x L), not O(L^2)). It serves every call the faster
backends cannot compute exactly: the CPU, float32, softcapped attention.

Attention sinks (gpt-oss): one learned logit per query head that joins every row's softmax and
takes its share of the probability without a value: ``p_j = exp(x_j) / (sum_k exp(x_k) + exp(s_h))``,
as transformers' eager gpt-oss computes it (a column of the sink logit, softmax, the column dropped).
"""

from __future__ import annotations

import itertools

import torch

FALLBACK_SCORE_BYTES = 256 * 1024**2
"""Budget for one block of float32 attention scores in the exact fallback."""


def exact_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: list[int],
    cu_k: list[int] | None = None,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    score_bytes: int | None = None,
) -> torch.Tensor:
    """Eager-exact attention of each sequence of a packed row, on its own.

    q: [H, Tq, D]; k: [KV, Tk, D]; v: [KV, Tk, Dv]; ``cu_q`` / ``cu_k``: host lists [n+1] of query
    and key boundaries (``cu_k`` defaults to ``cu_q``: self-attention) -> [Tq, H, Dv]. A sequence
    with fewer queries than keys holds its last queries (aligned bottom-right). ``sinks``: [H]
    attention-sink logits, or None.
    """
    cu_k = cu_q if cu_k is None else cu_k
    heads, total, _ = q.shape
    for name, bounds, end in (("cu_q", cu_q, total), ("cu_k", cu_k, k.shape[1])):
        if bounds[0] != 0 or bounds[-1] != end or any(a > b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"{name} must rise from 0 to T={end}, got {bounds[:4]}...{bounds[-2:]}")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_q and cu_k must delimit as many sequences, got {len(cu_q) - 1} and {len(cu_k) - 1}")
    out = q.new_empty(total, heads, v.shape[-1])  # [Tq, H, Dv]
    for (qs, qe), (ks, ke) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k)):
        if qe > qs:
            out[qs:qe] = sequence_attention(
                q[:, qs:qe], k[:, ks:ke], v[:, ks:ke],
                scale=scale, sliding_window=sliding_window, softcap=softcap, sinks=sinks, score_bytes=score_bytes,
            )  # fmt: skip
    return out


def sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    score_bytes: int | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence, as transformers' eager implementation computes it.

    q: [H, Lq, D]; k: [KV, Lk, D]; v: [KV, Lk, Dv] -> [Lq, H, Dv], Lq <= Lk: the queries are the
    sequence's last Lq positions (query i sits at position i + Lk - Lq). Query rows go in blocks
    whose float32 scores fit ``score_bytes`` (default ``FALLBACK_SCORE_BYTES``); each block reads
    only the keys it can see (causal, and the window), so a row's result does not depend on the
    blocking. ``sinks``: [H] attention-sink logits (see the module docstring), or None.
    """
    heads, length, _ = q.shape
    kv_heads, keys = k.shape[0], k.shape[1]
    if length > keys:
        raise ValueError(f"{length} queries but only {keys} keys: queries are the last positions of the keys")
    offset = keys - length  # position of query row 0
    groups = heads // kv_heads
    qg = q.unflatten(0, (kv_heads, groups))  # [KV, G, Lq, D]: query head h reads kv head h // G
    budget = FALLBACK_SCORE_BYTES if score_bytes is None else score_bytes  # read at call time
    rows = max(1, budget // (4 * heads * keys))  # float32 scores of one query row: heads x <= Lk keys
    out = q.new_empty(length, heads, v.shape[-1])  # [Lq, H, Dv]
    for q0 in range(0, length, rows):
        q1 = min(length, q0 + rows)
        p0, p1 = q0 + offset, q1 + offset  # the block's positions
        k0 = 0 if sliding_window is None else max(0, p0 - sliding_window + 1)  # first key the block's rows see
        scores = qg[:, :, q0:q1] @ k[:, None, k0:p1].transpose(-1, -2)  # [KV, G, Lq, Lk], model dtype
        scores = scores * scale  # after the matmul, as eager does
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = _allowed(p0, p1, k0, sliding_window, q.device)  # [Lq, Lk]
        # -inf instead of eager's additive finfo.min: both give exactly 0 after the softmax, and
        # every row keeps at least itself, so no row is all -inf.
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:  # the sink's column joins the softmax, then goes: its share of the probability is dropped
            sink = sinks.to(scores.dtype).view(kv_heads, groups, 1, 1).expand(-1, -1, q1 - q0, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)
            probs = probs[..., :-1].to(q.dtype)
        o = probs @ v[:, None, k0:p1]  # [KV, G, Lq, Dv]
        out[q0:q1] = o.flatten(0, 1).transpose(0, 1)  # [Lq, H, Dv]
    return out


def _allowed(q0: int, q1: int, k0: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """[Lq, Lk] bool: the query at position i in [q0, q1) may see the key at position j in [k0, q1).

    Same predicate as transformers' ``causal_mask_function`` and ``sliding_window_overlay``:
    j <= i, and j > i - w when a window w is set.
    """
    i = torch.arange(q0, q1, device=device)[:, None]
    j = torch.arange(k0, q1, device=device)[None, :]
    allowed = j <= i
    if sliding_window is not None:
        allowed &= j > i - sliding_window
    return allowed
