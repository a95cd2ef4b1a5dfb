"""``logprob_client.losses``' distillation helpers against float64 loops over the whole
vocabulary: the reverse-KL surrogate's expected gradient, the top-k divergences at K = V (the full
divergence, and TRL's ``generalized_jsd_loss``), the tail bucket's bound below it, and finite
values and gradients where the service returns zeros (masked positions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_client import losses as L

V = 11


def distributions(b: int = 2, t: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Student logits (requires grad) and teacher log-probs, (b, t, V) float64."""
    student = torch.randn(b, t, V, dtype=torch.float64, requires_grad=True)
    teacher = (torch.randn(b, t, V, dtype=torch.float64) * 2).log_softmax(-1)
    return student, teacher


def top_k(teacher: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = teacher.topk(k, dim=-1)
    return ids.to(torch.int32), values


def full_kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def test_reverse_kl_advantages_are_the_detached_log_ratio():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -0.5]])
    adv = L.reverse_kl_advantages(logps, teacher)
    assert torch.equal(adv, torch.tensor([[-0.5, 1.5]])) and not adv.requires_grad


def test_reverse_kl_loss_has_the_reverse_kl_gradient_in_expectation():
    student, teacher = distributions(1, 1)
    s = student.log_softmax(-1)[0, 0]
    t = teacher[0, 0]
    # E_{y ~ pi_S}[grad loss(y)], every y of the vocabulary weighed by its probability
    expected = sum(
        s[y].exp().detach() * torch.autograd.grad(L.reverse_kl_loss(s[y], t[y]), student, retain_graph=True)[0]
        for y in range(V)
    )
    want = torch.autograd.grad(full_kl(s, t), student)[0]
    torch.testing.assert_close(expected, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tail", ["renormalize", "bucket"])
def test_at_k_equal_v_the_top_k_forward_kl_is_the_full_one(tail):
    student, teacher = distributions()
    ids, values = top_k(teacher, V)
    s = student.log_softmax(-1)
    got = L.top_k_forward_kl(s, ids, values, tail=tail)
    torch.testing.assert_close(got, full_kl(teacher, s), rtol=0, atol=1e-10)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_generalized_jsd_at_k_equal_v_is_trls(beta):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    student, teacher = distributions()
    ids, values = top_k(teacher, V)
    got = L.top_k_generalized_jsd(student.log_softmax(-1), ids, values, beta=beta)
    want = gkd.GKDTrainer.generalized_jsd_loss(student, teacher, beta=beta, reduction="none").sum(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_renormalized_top_k_and_its_tail():
    student, teacher = distributions()
    k = 4
    ids, values = top_k(teacher, k)
    log_q, tail = L.top_k_teacher(values)
    torch.testing.assert_close(log_q.exp().sum(-1), torch.ones_like(tail))
    torch.testing.assert_close(tail, 1 - values.exp().sum(-1))
    s = student.log_softmax(-1)
    # renormalize: a float64 loop over the K ids
    want = torch.zeros(tail.shape, dtype=torch.float64)
    for b, t in np.ndindex(*tail.shape):
        s_k = s[b, t, ids[b, t].long()]
        s_k = s_k - s_k.logsumexp(-1)
        want[b, t] = sum(log_q[b, t, j].exp() * (log_q[b, t, j] - s_k[j]) for j in range(k))
    torch.testing.assert_close(L.top_k_forward_kl(s, ids, values), want, rtol=0, atol=1e-12)
    # the bucket merges outcomes: never above the full forward KL
    assert (L.top_k_forward_kl(s, ids, values, tail="bucket") <= full_kl(teacher, s) + 1e-12).all()


@pytest.mark.parametrize("tail", ["renormalize", "bucket"])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_zeros_at_masked_positions_give_finite_values_and_gradients(tail, beta):
    student, teacher = distributions()
    ids, values = top_k(teacher, 3)
    ids[0, 1], values[0, 1] = 0, 0.0  # what the service's dense answer holds where the mask is 0
    mask = torch.ones(ids.shape[:2], dtype=torch.bool)
    mask[0, 1] = False
    per_token = L.top_k_generalized_jsd(student.log_softmax(-1), ids, values, beta=beta, tail=tail)
    L.all_tokens_mean(per_token, mask).backward()
    assert torch.isfinite(per_token).all() and torch.isfinite(student.grad).all()
    assert not student.grad[0, 1].any()


def test_bad_tail_is_refused():
    student, teacher = distributions()
    with pytest.raises(ValueError, match="tail must be"):
        L.top_k_forward_kl(student.log_softmax(-1), *top_k(teacher, 2), tail="drop")
