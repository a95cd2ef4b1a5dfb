"""Log-probabilities of target tokens from hidden states, without materializing full logits.

For each row i (a hidden state h_i that predicts token y_i):

    x_i   = h_i W^T (+ b)                          # [V] logits, accumulated and kept in float32
    x_i   = x_i * scale                            # logit_scale (Cohere) or 1/logits_scaling (Granite)
    x_i   = c * tanh(x_i / c)                      # final-logit softcapping (Gemma 2), when c is set
    x_i   = x_i / T                                # sampling temperature
    lse_i = logsumexp(x_i)
    log p(y_i) = x_i[y_i] - lse_i
    H_i   = -sum_v p_v log p_v,  p = exp(x_i - lse_i)     # entropy, only when asked
    top-k_i = the K ids of largest x_i (ties: smaller id first), their x_i - lse_i   # when asked
    cand_ic = x_i[c] - lse_i for each candidate id c of row i                        # when asked
    rank_i  = #{v : x_iv >= x_i[y_i]}, y_i itself included (vLLM's rank)             # when asked

Rows are processed in chunks so that one chunk's (rows, V) float32 logit slab stays under a
byte budget: memory is O(budget), not O(N * V). The logits of a chunk are produced directly in
float32 (cuBLAS accumulates in fp32 and, with ``out_dtype``, writes fp32), so they are never
rounded to bf16 -- rounding them costs ~8e-3 nats of error at a 150K vocabulary. The top-k of a
chunk is ``torch.topk`` of int64 keys that order (logit descending, id ascending) (``topk_keys``,
the fused kernel's keys), so ties fall by id; it adds an int64 slab, counted in the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logprob_service.domain import DEFAULT_OPTIONS, ScoreOptions

DEFAULT_LM_HEAD_CHUNK_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class LogitTransform:
    """What a model's config does to its raw lm_head output, plus the request's temperature."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """Apply scale, softcap, then temperature to float32 ``logits`` in place, in that order."""
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        return logits


IDENTITY = LogitTransform()


@dataclass(frozen=True)
class TokenScores:
    logprobs: torch.Tensor  # [N] float32
    entropies: torch.Tensor | None  # [N] float32, or None when not asked for
    # [N] float32: each row's log-sum-exp of its transformed logits, when asked for (ops.vocab_parallel)
    lse: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None  # [N, K] int32: each row's K most likely ids, descending, ties by id
    top_logprobs: torch.Tensor | None = None  # [N, K] float32: their log-probs
    candidate_logprobs: torch.Tensor | None = None  # [N, Kc] float32: log-probs of the asked candidate ids
    # 0-dim bool, on the device: some row's top-k may be wrong, its repair rounds were not enough
    # (ops.lm_head.repair; the caller must check it, models.scorer.Launched.fetch does); None: complete
    top_k_incomplete: torch.Tensor | None = None
    # [N] int32: each target's rank, how many ids have a transformed logit at least its own (itself
    # included: 1 for the most likely), as vLLM counts a token's rank over its log-probs
    ranks: torch.Tensor | None = None


def check_topk_arguments(n_rows: int, vocab: int, top_k: int, candidates: torch.Tensor | None) -> None:
    """The op's own shape checks (ids in range are the caller's: checking them here would wait for
    the device); requests are checked with their names in ``engine.validation``."""
    if not 0 <= top_k <= vocab:
        raise ValueError(f"top_k {top_k} must lie in [0, {vocab}] (the vocabulary)")
    if candidates is not None and (candidates.dim() != 2 or candidates.shape[0] != n_rows):
        raise ValueError(f"candidates must be [{n_rows}, Kc] ids, not {list(candidates.shape)}")


def topk_keys(x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """int64 keys of float32 values ``x`` [n, V] at token ``ids`` (default: the column) whose order
    is (value descending, id ascending): the float's bits made monotonic as a signed int in the
    high word, 2^31 - 1 - id in the low word (``lm_head.keys.keys_of``)."""
    ordered = ordered_words(x).to(torch.int64)
    if ids is None:
        ids = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64)
    return (ordered << 32) | (0x7FFFFFFF - ids)


def ordered_words(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x``'s bits as int32s of the same order (a key's high word): negative floats'
    magnitude bits reversed."""
    bits = x.contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def key_ids(keys: torch.Tensor) -> torch.Tensor:
    """The token ids of ``topk_keys``' keys, as int64."""
    return 0x7FFFFFFF - (keys & 0x7FFFFFFF)


def key_values(keys: torch.Tensor) -> torch.Tensor:
    """The float32 values of ``topk_keys``' keys (``ordered_words`` undone: it is its own inverse)."""
    return ordered_words((keys >> 32).to(torch.int32).view(torch.float32)).view(torch.float32)


def rows_per_chunk(vocab_size: int, chunk_bytes: int) -> int:
    """How many rows fit in one (rows, V) float32 slab of at most ``chunk_bytes`` (at least 1)."""
    return max(1, chunk_bytes // (vocab_size * 4))


def logits_fp32(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """h: [n, H], weight: [V, H] -> [n, V] float32 logits (+ bias), never rounded to 16 bits."""
    if h.dtype == torch.float32:
        logits = h @ weight.T
    elif h.is_cuda:
        logits = torch.mm(h, weight.T, out_dtype=torch.float32)
    else:
        # The CPU has no 16-bit matmul with float32 output; the caller passed an fp32 weight.
        logits = h.float() @ weight.T
    if bias is not None:
        logits += bias
    return logits


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    options: ScoreOptions = DEFAULT_OPTIONS,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    return_lse: bool = False,
    candidates: torch.Tensor | None = None,
    chunk_bytes: int = DEFAULT_LM_HEAD_CHUNK_BYTES,
) -> TokenScores:
    """Log-prob of ``targets`` under ``hidden @ weight.T``, in row chunks under ``chunk_bytes``.

    hidden: [N, H] rows that predict the targets (any float dtype); weight: [V, H] (the lm_head,
    or the input embedding when tied); targets: [N] int64 in [0, V); bias: [V] or None;
    ``transform``: temperature included (``options.temperature`` is not read here).
    Returns float32 [N] log-probs (and log-sum-exps, with ``return_lse``; and what ``options``
    ask: entropies, each row's ``top_k`` most likely ids and their log-probs, each target's rank;
    with ``candidates`` [N, Kc], the log-probs of those ids).
    """
    return_entropy, top_k, return_ranks = options.return_entropy, options.top_k, options.return_ranks
    n, vocab = hidden.shape[0], weight.shape[0]
    check_topk_arguments(n, vocab, top_k, candidates)
    if not hidden.is_cuda and weight.dtype != torch.float32:
        weight = weight.float()
        bias = bias.float() if bias is not None else None
    elif bias is not None:
        bias = bias.float()
    logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
    entropies = torch.empty_like(logprobs) if return_entropy else None
    lses = torch.empty_like(logprobs) if return_lse else None
    top_ids = torch.empty((n, top_k), dtype=torch.int32, device=hidden.device) if top_k else None
    top_lps = torch.empty((n, top_k), dtype=torch.float32, device=hidden.device) if top_k else None
    cand_lps = None
    if candidates is not None:
        candidates = candidates.to(device=hidden.device, dtype=torch.int64)
        cand_lps = torch.empty(candidates.shape, dtype=torch.float32, device=hidden.device)
    ranks = torch.empty(n, dtype=torch.int32, device=hidden.device) if return_ranks else None
    # With top-k, each fp32 logit has an int64 key beside it: 12 bytes per element, not 4.
    step = rows_per_chunk(vocab, chunk_bytes // 3 if top_k else chunk_bytes)
    for start in range(0, n, step):
        end = min(start + step, n)
        x = transform.apply_(logits_fp32(hidden[start:end], weight, bias))  # [n, V] fp32
        lse = torch.logsumexp(x, dim=-1)  # [n]
        target = x.gather(1, targets[start:end, None])  # [n, 1]
        logprobs[start:end] = target.squeeze(1) - lse
        if ranks is not None:
            ranks[start:end] = (x >= target).sum(dim=1, dtype=torch.int32)
        if lses is not None:
            lses[start:end] = lse
        if top_ids is not None and top_lps is not None:
            ids = key_ids(torch.topk(topk_keys(x), top_k, dim=-1).values)  # [n, K], descending
            top_ids[start:end] = ids.to(torch.int32)
            top_lps[start:end] = x.gather(1, ids) - lse[:, None]
        if candidates is not None and cand_lps is not None:
            cand_lps[start:end] = x.gather(1, candidates[start:end]) - lse[:, None]
        if entropies is not None:
            # In place: x becomes p = exp(x - lse); entr(p) = -p log p, 0 at p = 0.
            x.sub_(lse[:, None]).exp_()
            entropies[start:end] = torch.special.entr(x).sum(dim=-1)
    return TokenScores(logprobs, entropies, lses, top_ids, top_lps, cand_lps, ranks=ranks)
