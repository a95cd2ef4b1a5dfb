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

so no rank ever holds another's logits: 12 bytes per token cross, not 4 V. float32 is enough:
each rank's statistics are the op's own float32 results (the kernel accumulates in float32), and
the combination adds a few roundings of values of the size of lse (|lse| ~ 10-20: ~1e-6 each).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from logprob_service.ops.dispatch import LogprobOp
from logprob_service.ops.logprobs import IDENTITY, LogitTransform, TokenScores

# torch 2.13 renames all_gather_into_tensor (a FutureWarning on every call there) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    group: dist.ProcessGroup,
    op: LogprobOp,
    bias_shard: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    return_entropy: bool = False,
) -> TokenScores:
    """Log-probs of ``targets`` (ids of the whole vocabulary) under the lm_head whose rows
    ``vocab_start`` + [0, V_r) are ``weight_shard`` here and the rest on the other ranks of
    ``group``; every rank calls this with the same ``hidden`` and ``targets`` and gets the same
    result. hidden: [N, H]; weight_shard: [V_r, H]; targets: [N]."""
    rows = weight_shard.shape[0]
    local = targets - vocab_start
    mine = (local >= 0) & (local < rows)
    scores = op(
        hidden,
        weight_shard,
        local.clamp(0, rows - 1),  # a target of another rank's: any id of ours, its result masked
        bias=bias_shard,
        transform=transform,
        return_entropy=return_entropy,
        return_lse=True,
    )
    lse_r = scores.lse
    assert lse_r is not None
    z_r = torch.where(mine, scores.logprobs + lse_r, 0.0)
    e_r = lse_r - scores.entropies if scores.entropies is not None else torch.zeros_like(lse_r)
    stats = torch.stack([lse_r, z_r, e_r])  # [3, N]
    world = dist.get_world_size(group)
    gathered = torch.empty((world * 3, stats.shape[1]), dtype=stats.dtype, device=stats.device)
    _all_gather(gathered, stats, group=group)
    lse_all, z_all, e_all = gathered.view(world, 3, -1).unbind(1)  # each [world, N]
    lse = torch.logsumexp(lse_all, dim=0)
    logprobs = z_all.sum(dim=0) - lse
    entropies = None
    if return_entropy:
        entropies = lse - (torch.exp(lse_all - lse) * e_all).sum(dim=0)
    return TokenScores(logprobs=logprobs, entropies=entropies, lse=lse)
