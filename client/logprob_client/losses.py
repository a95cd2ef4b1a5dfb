"""Trainer-side helpers: PPO / GRPO arithmetic on per-token log-probs (ratios, the clipped
surrogate, aggregation, KL estimators, reward shaping and group-relative advantages). The client
itself imports nothing here; trainers do (``docs/client.md``, "Loss and KL helpers").

Every per-token tensor is ``(B, T)``, aligned with the completion tokens: the layout that
``LogprobClient.score`` returns for the dense trainer layout. ``mask`` is ``(B, T)``, 1 (or True)
where a real completion token is. Notation, at completion token t of sequence i (sampled from the
policy being trained):

    logp = log pi_theta(y_t)   the policy being trained (requires grad)
    old  = log pi_old(y_t)     the policy that generated the batch
    ref  = log pi_ref(y_t)     the reference (e.g. scored by logprob-service)

Values at masked positions never reach a result, even when they are inf or NaN (the service
returns 0 there; a trainer's own padded forward may return anything).

Needs torch (the client's base install does not): ``pip install torch``.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    import torch
except ImportError as err:  # the client's base install has no torch
    raise ImportError("logprob_client.losses needs torch: pip install torch") from err

Tensor = torch.Tensor


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` where ``mask``, else 0; ``torch.where`` rather than a product so that inf/NaN
    at masked positions neither leak into sums nor into gradients."""
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


# Ratios ---------------------------------------------------------------------------------------


def log_ratio(logps: Tensor, old_logps: Tensor) -> Tensor:
    """``log r_t = logp_t - old_t``, the log of the importance ratio pi_theta / pi_old."""
    return logps - old_logps


def ratio(logps: Tensor, old_logps: Tensor) -> Tensor:
    """``r_t = exp(logp_t - old_t) = pi_theta(y_t) / pi_old(y_t)``.

    Computed in log space: the quotient of two probabilities underflows for long-tail tokens
    (both near 0), the exponent of their log difference does not.
    """
    return torch.exp(log_ratio(logps, old_logps))


# PPO clipped surrogate ------------------------------------------------------------------------


def clipped_surrogate(
    logps: Tensor, old_logps: Tensor, advantages: Tensor, *, clip_low: float = 0.2, clip_high: float | None = None
) -> Tensor:
    """PPO's clipped surrogate, per token, as a loss to minimize:

        r_t    = exp(logp_t - old_t)
        loss_t = -min(r_t * A, clip(r_t, 1 - clip_low, 1 + clip_high) * A)

    ``advantages``: ``(B,)`` one per sequence (GRPO) or ``(B, T)`` one per token (PPO with GAE).
    ``clip_high`` defaults to ``clip_low`` (PPO's symmetric epsilon); a larger one is DAPO's
    "clip-higher". Returns ``(B, T)``; aggregate it with ``per_sequence_then_batch_mean`` or
    ``all_tokens_mean``.
    """
    clip_high = clip_low if clip_high is None else clip_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # (B,) -> (B, 1): one advantage for all of a sequence's tokens
    r = ratio(logps, old_logps)
    return -torch.min(r * advantages, torch.clamp(r, 1.0 - clip_low, 1.0 + clip_high) * advantages)


# Aggregation ----------------------------------------------------------------------------------


def per_sequence_then_batch_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over each sequence's tokens, then mean over the sequences (GRPO's paper form):

        L = 1/|S| * sum_{i in S} ( sum_t m_it x_it / sum_t m_it ),   S = rows with at least one token

    Each sequence weighs the same whatever its length. Rows with no token are left out of the
    batch mean (TRL's ``loss_type="grpo"`` counts them as zeros instead, which dilutes the loss);
    with no token at all the result is 0 (and its gradient zero, never NaN).
    """
    counts = mask.bool().sum(-1)  # (B,)
    per_sequence = _masked(values, mask).sum(-1) / counts.clamp(min=1)
    has_tokens = counts > 0
    return _masked(per_sequence, has_tokens).sum() / has_tokens.sum().clamp(min=1)


def all_tokens_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over every token of the batch (DAPO's token-level form; TRL's ``"bnpo"``):

        L = sum_{i,t} m_it x_it / sum_{i,t} m_it

    Every token weighs the same, so long sequences weigh more. 0 when no token is unmasked.
    """
    return _masked(values, mask).sum() / mask.bool().sum().clamp(min=1)


# KL estimators (Schulman, "Approximating KL Divergence", 2020) --------------------------------
#
# Each estimates KL(pi_theta || pi_ref) = E_{y ~ pi_theta}[log pi_theta(y) - log pi_ref(y)] from one
# token sampled from pi_theta. With delta_t = ref_t - logp_t = log(pi_ref / pi_theta)(y_t):


def kl_k1(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """``k1 = -delta = logp - ref``: unbiased, high variance, negative for some tokens."""
    return logps - ref_logps


def kl_k2(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """``k2 = delta^2 / 2``: biased (its mean is close to the KL when the two policies are
    close), low variance, never negative."""
    return 0.5 * (ref_logps - logps) ** 2


def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """``k3 = exp(delta) - 1 - delta``: unbiased, low variance, never negative (the estimator of
    the GRPO paper and of TRL's GRPOTrainer)."""
    delta = ref_logps - logps
    return torch.exp(delta) - 1.0 - delta


# Rewards and advantages -----------------------------------------------------------------------


def shaped_rewards(
    scores: Tensor,
    logps: Tensor,
    ref_logps: Tensor,
    mask: Tensor,
    *,
    beta: float,
    kl: Callable[[Tensor, Tensor], Tensor] = kl_k1,
) -> Tensor:
    """Per-token rewards for PPO: the reward model's score at the final token, minus beta times the
    per-token KL to the reference everywhere (InstructGPT; TRL's PPOTrainer):

        reward_t = -beta * kl(logp_t, ref_t) + [t = T_i] * score_i,   T_i = the last t with m_it = 1

    ``scores``: ``(B,)``, one reward-model score per sequence. ``kl``: one of ``kl_k1`` (the
    default: summed over t it is beta times the sequence's log-ratio), ``kl_k2``, ``kl_k3``.
    Returns ``(B, T)``, 0 at masked positions; a row with no token is all 0 (nowhere to put its
    score). Pass detached log-probs: a reward is a constant to the policy gradient.
    """
    m = mask.bool()
    rewards = _masked(-beta * kl(logps, ref_logps), m)
    last = m.shape[-1] - 1 - m.flip(-1).int().argmax(-1)  # (B,) index of each row's last unmasked token
    at_last = torch.nn.functional.one_hot(last, m.shape[-1]).to(rewards.dtype)  # (B, T)
    credited = _masked(scores.to(rewards.dtype), m.any(-1))  # (B,) rows without a token get no score
    return rewards + at_last * credited.unsqueeze(-1)


def group_relative_advantages(rewards: Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """GRPO's advantages: each reward relative to the other completions of the same prompt.

        A_i = (r_i - mean_g) / (std_g + eps)     scale=True  (DeepSeekMath's GRPO; TRL's default)
        A_i =  r_i - mean_g                      scale=False (Dr. GRPO; TRL's scale_rewards="none")

    ``rewards``: ``(B,)`` with ``B = groups * group_size``, each group's completions adjacent (the
    order TRL's GRPOTrainer uses). ``std_g`` is the sample standard deviation of the group (with
    Bessel's correction, N - 1, as TRL); a group of one has no spread, so its std is taken as 0.
    ``eps`` (TRL's 1e-4) keeps a group whose rewards are all equal at A = 0 instead of 0 / 0.
    Returns ``(B,)``.
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.reshape(-1, group_size)  # (groups, G)
    centred = groups - groups.mean(-1, keepdim=True)
    if not scale:
        return centred.reshape(rewards.shape)
    std = groups.std(-1, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
    return (centred / (std + eps)).reshape(rewards.shape)
