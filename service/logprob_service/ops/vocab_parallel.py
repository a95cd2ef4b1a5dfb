"""The log-prob stage over a vocabulary split between the ranks of a tensor-parallel group.

Rank r holds the lm_head rows of the token ids [start_r, stop_r). With x' a row's transformed
logits (scale, softcap, temperature: ``LogitTransform``), each rank runs the ordinary log-prob op
(the fused kernel, or eager chunks) on its rows alone and keeps three floats per token:

    lse_r = log sum_{v in r} exp(x'_v)                      (the op's ``return_lse``)
    z_r   = x'_y  if the target y is one of r's ids, else 0  (its log-prob + lse_r, the target
                                                              mapped into r's rows)
    e_r   = sum_{v in r} exp(x'_v - lse_r) x'_v = lse_r - H_r (H_r: the entropy it returns)

One all-gather of those [3, N] floats gives every rank all of them, and each combines:

    lse    = log sum_r exp(lse_r)
    log p  = sum_r z_r - lse                                 (one rank holds the target)
    H      = lse - sum_r exp(lse_r - lse) e_r

so no rank ever holds another's logits: 12 bytes per token cross, not 4 V. With a top-k, each
rank's own top K (its log-probs lp_r, relative to lse_r) cross too, 8 K bytes per token, and the
K largest of the world's K x ranks, at lp_r + lse_r - lse, with ties by the smaller global id,
are the top-k (the global top K are each within some rank's top K). A candidate's log-prob comes
from the rank that holds its id, as the target's does. float32 is enough:
each rank's statistics are the op's own float32 results (the kernel accumulates in float32), and
the combination adds a few roundings of values of the size of lse (|lse| ~ 10-20: ~1e-6 each).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from logprob_service.domain import DEFAULT_OPTIONS, ScoreOptions
from logprob_service.ops.dispatch import LogprobOp
from logprob_service.ops.logprobs import IDENTITY, LogitTransform, TokenScores, topk_keys

# torch 2.13 renames all_gather_into_tensor (a FutureWarning on every call there) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    options: ScoreOptions = DEFAULT_OPTIONS,
    *,
    vocab_start: int,
    group: dist.ProcessGroup,
    op: LogprobOp,
    bias_shard: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    candidates: torch.Tensor | None = None,
) -> TokenScores:
    """Log-probs of ``targets`` (ids of the whole vocabulary) under the lm_head whose rows
    ``vocab_start`` + [0, V_r) are ``weight_shard`` here and the rest on the other ranks of
    ``group``; every rank calls this with the same ``hidden`` and ``targets`` and gets the same
    result. hidden: [N, H]; weight_shard: [V_r, H]; targets: [N]; candidates: [N, Kc] global ids.
    ``options.return_ranks`` is not served over a split vocabulary (each rank would need the target's
    logit before its pass): ``ranks`` stays None, and the caller answers without them."""
    top_k = options.top_k
    rows = weight_shard.shape[0]
    local = targets - vocab_start
    mine = (local >= 0) & (local < rows)
    local_candidates = None
    if candidates is not None:
        local_candidates = candidates - vocab_start
        mine_c = (local_candidates >= 0) & (local_candidates < rows)
        local_candidates = local_candidates.clamp(0, rows - 1)  # another rank's: masked below
    scores = op(
        hidden,
        weight_shard,
        local.clamp(0, rows - 1),  # a target of another rank's: any id of ours, its result masked
        replace(options, top_k=min(top_k, rows), return_ranks=False),
        bias=bias_shard,
        transform=transform,
        return_lse=True,
        candidates=local_candidates,
    )
    lse_r = scores.lse
    assert lse_r is not None
    z_r = torch.where(mine, scores.logprobs + lse_r, 0.0)
    e_r = lse_r - scores.entropies if scores.entropies is not None else torch.zeros_like(lse_r)
    parts = [lse_r, z_r, e_r]
    if scores.top_k_incomplete is not None:  # a shard's fused top-k left unfinished: every rank's is
        parts.append(scores.top_k_incomplete.float().expand_as(lse_r))
    stats = torch.stack(parts)  # [3 or 4, N]
    world = dist.get_world_size(group)
    gathered = torch.empty((world * len(parts), stats.shape[1]), dtype=stats.dtype, device=stats.device)
    _all_gather(gathered, stats, group=group)
    lse_all, z_all, e_all, *flags = gathered.view(world, len(parts), -1).unbind(1)  # each [world, N]
    incomplete = (flags[0] > 0).any() if flags else None
    lse = torch.logsumexp(lse_all, dim=0)
    logprobs = z_all.sum(dim=0) - lse
    entropies = None
    if options.return_entropy:
        entropies = lse - (torch.exp(lse_all - lse) * e_all).sum(dim=0)
    top_ids = top_lps = cand_lps = None
    if top_k and scores.top_ids is not None and scores.top_logprobs is not None:
        # Every rank sends K (a shard of fewer ids pads with -inf), global ids in float32 slots,
        # bit for bit: one gather of [2, N, K].
        pad = top_k - scores.top_ids.shape[1]
        own_lp = torch.nn.functional.pad(scores.top_logprobs + (lse_r - lse)[:, None], (0, pad), value=-torch.inf)
        own_ids = torch.nn.functional.pad(scores.top_ids + vocab_start, (0, pad))
        own = torch.stack([own_lp, own_ids.view(torch.float32)])
        pieces = torch.empty((world * 2, *own.shape[1:]), dtype=own.dtype, device=own.device)
        _all_gather(pieces, own, group=group)
        values, ids = pieces.view(world, 2, len(lse), top_k).permute(1, 2, 0, 3).reshape(2, len(lse), -1)
        ids = ids.contiguous().view(torch.int32)  # [N, world K] each
        at = torch.topk(topk_keys(values, ids.long()), top_k, dim=-1).indices
        top_ids, top_lps = ids.gather(1, at), values.gather(1, at)
    if candidates is not None and scores.candidate_logprobs is not None:
        own_c = torch.where(mine_c, scores.candidate_logprobs + lse_r[:, None], 0.0)
        pieces = torch.empty((world * own_c.shape[0], own_c.shape[1]), dtype=own_c.dtype, device=own_c.device)
        _all_gather(pieces, own_c.contiguous(), group=group)
        cand_lps = pieces.view(world, *own_c.shape).sum(dim=0) - lse[:, None]
    return TokenScores(logprobs, entropies, lse, top_ids, top_lps, cand_lps, incomplete)
