"""``logprob_client.losses``: hand-computed values, masks and edge cases (an all-masked row, one
token, inf/NaN under the mask), and random inputs against plain-Python float64 loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from logprob_client import losses as L


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


def rand_mask(rng: np.random.Generator, b: int, t: int) -> torch.Tensor:
    """Right-padded rows of random lengths, with one all-masked row and one single-token row."""
    lengths = rng.integers(1, t + 1, b)
    lengths[0], lengths[1] = 0, 1
    return torch.from_numpy(np.arange(t)[None, :] < lengths[:, None])


# Ratios and the clipped surrogate --------------------------------------------------------------


def test_ratio_is_exp_of_the_log_difference():
    old = rand(1, 2)
    logps = old + torch.tensor([[0.5, -1.0]], dtype=torch.float64)
    torch.testing.assert_close(L.log_ratio(logps, old), torch.tensor([[0.5, -1.0]], dtype=torch.float64))
    torch.testing.assert_close(
        L.ratio(logps, old), torch.tensor([[math.exp(0.5), math.exp(-1.0)]], dtype=torch.float64)
    )


def test_ratio_of_long_tail_tokens_does_not_underflow():
    old = torch.tensor([-800.0])  # exp(-800) is 0 in float64: a quotient of probabilities would be 0/0
    torch.testing.assert_close(L.ratio(old + 0.25, old), torch.tensor([math.exp(0.25)]))


def test_clipped_surrogate_by_hand():
    # Ratios 1.5 and 0.5 against advantages +1 and -1, epsilon 0.2:
    #   r=1.5, A=+1: min(1.5, 1.2) = 1.2  -> loss -1.2   (clipped: no incentive past 1 + eps)
    #   r=0.5, A=+1: min(0.5, 0.8) = 0.5  -> loss -0.5   (unclipped: pessimistic side)
    #   r=1.5, A=-1: min(-1.5, -1.2) = -1.5 -> loss 1.5  (unclipped)
    #   r=0.5, A=-1: min(-0.5, -0.8) = -0.8 -> loss 0.8  (clipped)
    old = rand(2, 2)
    logps = old + torch.log(torch.tensor([[1.5, 0.5], [1.5, 0.5]], dtype=torch.float64))
    advantages = torch.tensor([1.0, -1.0], dtype=torch.float64)  # (B,): one per sequence
    expected = torch.tensor([[-1.2, -0.5], [1.5, 0.8]], dtype=torch.float64)
    torch.testing.assert_close(L.clipped_surrogate(logps, old, advantages, clip_low=0.2), expected)


def test_clip_higher_is_asymmetric():
    old = rand(1, 2)
    logps = old + torch.log(torch.tensor([[1.25, 0.7]], dtype=torch.float64))
    # eps_low 0.2, eps_high 0.28, A = +2: r=1.25 stays under 1.28 -> -2.5; r=0.7 -> min(1.4, 1.6) -> -1.4
    out = L.clipped_surrogate(logps, old, torch.tensor([2.0], dtype=torch.float64), clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(out, torch.tensor([[-2.5, -1.4]], dtype=torch.float64))


def test_clipped_surrogate_random_against_a_loop():
    b, t = 5, 7
    logps, old, adv_tok = rand(b, t), rand(b, t) * 0.3, rand(b, t)
    logps = old + 0.3 * logps  # ratios on both sides of the clip range
    for advantages in (adv_tok, adv_tok[:, 0]):
        got = L.clipped_surrogate(logps, old, advantages, clip_low=0.1, clip_high=0.15)
        for i in range(b):
            for j in range(t):
                a = float(advantages[i, j] if advantages.dim() == 2 else advantages[i])
                r = math.exp(float(logps[i, j] - old[i, j]))
                want = -min(r * a, min(max(r, 0.9), 1.15) * a)
                assert got[i, j].item() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_clipped_surrogate_gradient_is_zero_where_clipped():
    old = torch.zeros(1, 2, dtype=torch.float64)
    logps = torch.log(torch.tensor([[1.5, 1.1]], dtype=torch.float64)).requires_grad_()
    L.clipped_surrogate(logps, old, torch.tensor([1.0], dtype=torch.float64)).sum().backward()
    # d(-r)/d logp = -r where unclipped (r=1.1); 0 where clipped (r=1.5 > 1.2)
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, -1.1]], dtype=torch.float64))


# Aggregation -----------------------------------------------------------------------------------


def test_aggregations_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 has no token
    # Per sequence: (1 + 2) / 2 = 1.5 and 4 / 1 = 4; row 2 is left out: (1.5 + 4) / 2 = 2.75.
    assert L.per_sequence_then_batch_mean(values, mask).item() == pytest.approx(2.75)
    # Over all tokens: (1 + 2 + 4) / 3.
    assert L.all_tokens_mean(values, mask).item() == pytest.approx(7 / 3)


def test_one_token():
    values, mask = torch.tensor([[-0.75]]), torch.tensor([[True]])
    assert L.per_sequence_then_batch_mean(values, mask).item() == pytest.approx(-0.75)
    assert L.all_tokens_mean(values, mask).item() == pytest.approx(-0.75)


@pytest.mark.parametrize("aggregate", [L.per_sequence_then_batch_mean, L.all_tokens_mean])
def test_all_masked_is_zero_with_zero_gradient(aggregate):
    values = rand(3, 4).requires_grad_()
    out = aggregate(values, torch.zeros(3, 4, dtype=torch.bool))
    out.backward()
    assert out.item() == 0.0 and torch.equal(values.grad, torch.zeros_like(values))


@pytest.mark.parametrize("aggregate", [L.per_sequence_then_batch_mean, L.all_tokens_mean])
def test_inf_and_nan_under_the_mask_do_not_leak(aggregate):
    values = rand(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    clean = aggregate(values, mask)
    dirty = values.clone()
    dirty[0, 2], dirty[1, 1], dirty[1, 2] = float("inf"), float("nan"), float("-inf")
    dirty.requires_grad_()
    out = aggregate(dirty, mask)
    out.backward()
    torch.testing.assert_close(out, clean)
    assert torch.isfinite(dirty.grad).all() and (dirty.grad[mask == 0] == 0).all()


def test_aggregations_random_against_loops(rng):
    b, t = 6, 9
    values, mask = rand(b, t), rand_mask(rng, b, t)
    rows = [[float(values[i, j]) for j in range(t) if mask[i, j]] for i in range(b)]
    seq_means = [sum(r) / len(r) for r in rows if r]
    tokens = [x for r in rows for x in r]
    assert L.per_sequence_then_batch_mean(values, mask).item() == pytest.approx(sum(seq_means) / len(seq_means))
    assert L.all_tokens_mean(values, mask).item() == pytest.approx(sum(tokens) / len(tokens))


# KL estimators ---------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    # logp = -1, ref = -2: delta = ref - logp = -1
    logps, ref = torch.tensor([-1.0], dtype=torch.float64), torch.tensor([-2.0], dtype=torch.float64)
    assert L.kl_k1(logps, ref).item() == pytest.approx(1.0)  # -delta
    assert L.kl_k2(logps, ref).item() == pytest.approx(0.5)  # delta^2 / 2
    assert L.kl_k3(logps, ref).item() == pytest.approx(math.exp(-1.0))  # e^-1 - 1 + 1
    # Equal policies: every estimator is 0.
    same = rand(3)
    for kl in (L.kl_k1, L.kl_k2, L.kl_k3):
        assert torch.equal(kl(same, same), torch.zeros(3, dtype=torch.float64))


def test_k1_and_k3_are_unbiased_estimators_of_the_kl(seed):
    """Sampled from pi_theta, the means of k1 and k3 converge to the exact KL(pi_theta || pi_ref)."""
    gen = torch.Generator().manual_seed(seed)
    logits_p, logits_q = (torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(2))
    logp_all, logq_all = logits_p.log_softmax(-1), logits_q.log_softmax(-1)
    exact = float((logp_all.exp() * (logp_all - logq_all)).sum())
    samples = torch.multinomial(logp_all.exp(), 200_000, replacement=True, generator=gen)
    logps, ref = logp_all[samples], logq_all[samples]
    for kl in (L.kl_k1, L.kl_k3):
        estimates = kl(logps, ref)
        stderr = float(estimates.std()) / math.sqrt(len(samples))
        assert abs(float(estimates.mean()) - exact) < 6 * stderr, kl.__name__
    assert (L.kl_k3(logps, ref) >= 0).all() and (L.kl_k2(logps, ref) >= 0).all()


# Reward shaping --------------------------------------------------------------------------------


def test_shaped_rewards_by_hand():
    # k1 per token = logp - ref = [[0.5, -0.25, 1.0], [2.0, 0.0, 0.0], [...]]; beta = 0.1
    ref = rand(3, 3)
    logps = ref + torch.tensor([[0.5, -0.25, 1.0], [2.0, 3.0, 4.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    scores = torch.tensor([2.0, -1.0, 5.0], dtype=torch.float64)
    expected = torch.tensor(
        [
            [-0.05, 0.025, -0.1 + 2.0],  # the score lands on the last token
            [-0.2 + -1.0, 0.0, 0.0],  # one token: KL penalty and score on it; padding stays 0
            [0.0, 0.0, 0.0],  # no token: nowhere to put the score
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(L.shaped_rewards(scores, logps, ref, mask, beta=0.1), expected)


def test_shaped_rewards_random_against_a_loop(rng):
    b, t, beta = 5, 8, 0.05
    logps, ref, scores, mask = rand(b, t), rand(b, t), rand(b), rand_mask(rng, b, t)
    mask[2, 3] = False  # a hole (a masked tool-output token): the score still goes to the last real token
    got = L.shaped_rewards(scores, logps, ref, mask, beta=beta, kl=L.kl_k3)
    for i in range(b):
        real = [j for j in range(t) if mask[i, j]]
        for j in range(t):
            d = float(ref[i, j] - logps[i, j])
            want = -beta * (math.exp(d) - 1 - d) if mask[i, j] else 0.0
            if real and j == real[-1]:
                want += float(scores[i])
            assert got[i, j].item() == pytest.approx(want, rel=1e-12, abs=1e-12)


# Group-relative advantages ---------------------------------------------------------------------


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0], dtype=torch.float64)  # two groups of 2
    # Group 1: mean 2, sample std sqrt(((1-2)^2 + (3-2)^2) / (2-1)) = sqrt(2). Group 2: all equal -> 0.
    s = math.sqrt(2.0) + 1e-4
    expected = torch.tensor([-1 / s, 1 / s, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(L.group_relative_advantages(rewards, 2), expected)
    centred = torch.tensor([-1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(L.group_relative_advantages(rewards, 2, scale=False), centred)


def test_group_of_one_has_zero_advantage():
    out = L.group_relative_advantages(rand(3), 1)
    assert torch.equal(out, torch.zeros(3, dtype=torch.float64))


def test_group_advantages_random_against_numpy():
    g, groups = 8, 5
    rewards = rand(g * groups)
    grouped = rewards.numpy().reshape(groups, g)
    want = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + 1e-3)
    np.testing.assert_allclose(L.group_relative_advantages(rewards, g, eps=1e-3).numpy(), want.reshape(-1), rtol=1e-12)


def test_group_size_must_divide_the_batch():
    with pytest.raises(ValueError, match="groups of 4"):
        L.group_relative_advantages(rand(6), 4)
