"""Trainer-side helpers: PPO / GRPO arithmetic on per-token log-probs (ratios, the clipped
surrogate, aggregation, KL estimators, reward shaping and group-relative advantages), and
distillation from a teacher the service scores (reverse KL on the student's samples; top-k
forward KL and GKD's generalized JSD from the teacher's top-k). The client
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

import math
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


# Distillation from a teacher the service scores ------------------------------------------------
#
# On the student's own samples (on-policy distillation; GKD with lambda = 1), at completion token t:
#
#     logp    = log pi_S(y_t)          the student being trained (requires grad)
#     teacher = log pi_T(y_t)          the teacher's log-prob of the same token (``client.score``)
#     top_ids, top_logps: (B, T, K)    the teacher's K most likely ids and their log-probs
#                                      (``client.score(..., top_k=K)``: ``TeacherScores``)
#     student_logps: (B, T, V)         the student's log-softmax over the vocabulary


def reverse_kl_advantages(logps: Tensor, teacher_logps: Tensor) -> Tensor:
    """Per-token advantages of on-policy distillation by reverse KL:

        A_t = teacher_t - logp_t = -(log pi_S(y_t) - log pi_T(y_t))

    minus the one-sample (k1) estimate of KL(pi_S || pi_T) at each sampled token, detached. As
    ``clipped_surrogate``'s ``(B, T)`` advantages (a discount of 0: each token is its own
    return), the policy gradient lowers the student's reverse KL to the teacher, from the
    teacher's log-prob of the sampled tokens alone (no top-k needed). Returns ``(B, T)``.
    """
    return (teacher_logps - logps).detach()


def reverse_kl_loss(logps: Tensor, teacher_logps: Tensor) -> Tensor:
    """A ``(B, T)`` surrogate whose gradient, in expectation over the student's own samples, is
    that of the reverse KL (the score-function estimator, on-policy, no ratio):

        loss_t = (logp_t - teacher_t).detach() * logp_t
        E_{y ~ pi_S}[grad loss_t] = E[(log pi_S - log pi_T) grad log pi_S] = grad KL(pi_S || pi_T)

    (the term E[grad log pi_S] = 0 drops). Its value is not the KL: log ``kl_k1(logps,
    teacher_logps)`` for that. Aggregate with ``per_sequence_then_batch_mean`` or ``all_tokens_mean``.
    """
    return (logps - teacher_logps).detach() * logps


def top_k_teacher(top_logps: Tensor) -> tuple[Tensor, Tensor]:
    """The teacher's top-k renormalized over its K ids, and the probability mass it leaves out:

        q(v_k) = pi_T(v_k) / S,   S = sum_k pi_T(v_k),   tail = 1 - S

    ``top_logps``: ``(B, T, K)``. Returns ``(log q (B, T, K), tail (B, T))``; the tail is what the
    renormalized losses ignore (report it: at K = 20 it is typically a few percent of the mass)."""
    log_s = torch.logsumexp(top_logps, dim=-1)
    return top_logps - log_s.unsqueeze(-1), (-torch.expm1(log_s)).clamp(min=0.0)


def _top_k_pair(student_logps: Tensor, top_ids: Tensor, top_logps: Tensor, tail: str) -> tuple[Tensor, Tensor]:
    """(student, teacher) log-distributions over the teacher's top-k support: renormalized over
    the K ids, or over K + 1 outcomes (the K ids, and the tail bucket "any other id")."""
    student_at = student_logps.gather(-1, top_ids.long())  # (B, T, K)
    if tail == "renormalize":
        return (
            student_at - torch.logsumexp(student_at, dim=-1, keepdim=True),
            top_logps - torch.logsumexp(top_logps, dim=-1, keepdim=True),
        )
    if tail != "bucket":
        raise ValueError(f"tail must be 'renormalize' or 'bucket', got {tail!r}")

    def with_tail(at: Tensor) -> Tensor:
        # log(1 - sum exp(at)), kept finite where the K ids hold all the mass (a tail of ~0)
        rest = (-torch.expm1(torch.logsumexp(at, dim=-1, keepdim=True))).clamp(min=torch.finfo(at.dtype).tiny)
        return torch.cat([at, rest.log()], dim=-1)

    return with_tail(student_at), with_tail(top_logps)


def _kl(p_log: Tensor, q_log: Tensor) -> Tensor:
    """KL(p || q) over the last dimension, 0 log 0 = 0 (and no NaN gradient from it)."""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), torch.zeros((), dtype=p.dtype, device=p.device)).sum(-1)


def top_k_generalized_jsd(
    student_logps: Tensor, top_ids: Tensor, top_logps: Tensor, *, beta: float = 0.0, tail: str = "renormalize"
) -> Tensor:
    """GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024; TRL's
    ``generalized_jsd_loss``), per token, on the teacher's top-k support:

        beta = 0: KL(T || S) (forward)    beta = 1: KL(S || T) (reverse)
        else:     beta KL(T || M) + (1 - beta) KL(S || M),   M = beta T + (1 - beta) S

    with T and S the teacher's and student's distributions restricted to that support:
    ``tail="renormalize"`` both renormalized over the K ids (the teacher's left-out mass,
    ``top_k_teacher``'s tail, is ignored); ``tail="bucket"`` over K + 1 outcomes, the K ids and
    one bucket for every other id (1 - their mass, for each model): never more than the
    divergence of the full distributions (merging outcomes cannot raise a KL), and equal to it at
    K = V. ``student_logps``: ``(B, T, V)``; ``top_ids``, ``top_logps``: ``(B, T, K)``. Returns
    ``(B, T)``; aggregate with a mask (``all_tokens_mean``).
    """
    s, t = _top_k_pair(student_logps, top_ids, top_logps, tail)
    if beta == 0.0:
        return _kl(t, s)
    if beta == 1.0:
        return _kl(s, t)
    mixture = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log1p(-beta)]), dim=0)
    return beta * _kl(t, mixture) + (1 - beta) * _kl(s, mixture)


def top_k_forward_kl(student_logps: Tensor, top_ids: Tensor, top_logps: Tensor, *, tail: str = "renormalize") -> Tensor:
    """Forward KL(T || S) on the teacher's top-k support (``top_k_generalized_jsd`` at beta 0):

        renormalize: sum_k q(v_k) [log q(v_k) - log s(v_k)],  q, s renormalized over the K ids
        bucket:      sum_k T(v_k) [log T(v_k) - log S(v_k)] + tail_T log(tail_T / tail_S)

    Returns ``(B, T)``."""
    return top_k_generalized_jsd(student_logps, top_ids, top_logps, beta=0.0, tail=tail)
