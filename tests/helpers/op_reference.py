"""Float64 reference for the log-prob ops, and random inputs for them (shared by CPU and GPU tests)."""

from __future__ import annotations

import torch
from logprob_service.domain import ScoreOptions
from logprob_service.ops.logprobs import IDENTITY, LogitTransform, TokenScores


def transformed_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, transform: LogitTransform = IDENTITY
) -> torch.Tensor:
    """Float64 [N, V] logits of the same inputs, scaled, softcapped and divided by the temperature."""
    x = hidden.double() @ weight.double().T
    if bias is not None:
        x = x + bias.double()
    x = x * transform.scale
    if transform.softcap is not None:
        x = transform.softcap * torch.tanh(x / transform.softcap)
    return x / transform.temperature


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 (log-probs, entropies) of ``targets`` from the full logits of the same inputs."""
    logp = transformed_logits(hidden, weight, bias, transform).log_softmax(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def reference_lse(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, transform: LogitTransform = IDENTITY
) -> torch.Tensor:
    """Float64 [N] log-sum-exp of each row's transformed logits."""
    return transformed_logits(hidden, weight, bias, transform).logsumexp(-1)


# What the ops return beside log-probs, all asked for where ``assert_matches_reference`` checks them.
ALL_OUTPUTS = {"options": ScoreOptions(return_entropy=True), "return_lse": True}


def assert_matches_reference(
    out: TokenScores,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    atol: float,
) -> None:
    """The op's float32 log-probs, entropies and log-sum-exps are within ``atol`` of float64's."""
    ref_lp, ref_ent = reference(hidden, weight, targets, bias, transform)
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == targets.shape
    torch.testing.assert_close(out.logprobs.double(), ref_lp, atol=atol, rtol=0)
    torch.testing.assert_close(out.entropies.double(), ref_ent, atol=atol, rtol=0)
    torch.testing.assert_close(out.lse.double(), reference_lse(hidden, weight, bias, transform), atol=atol, rtol=0)


def random_case(
    n: int,
    h: int,
    v: int,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
    seed: int | None = None,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """hidden [n, h], weight [v, h] (logits std ~3), targets [n], bias [v] or None.

    Without ``seed``, the case's seed is drawn from torch's global generator, which the test's
    ``seed`` fixture seeds (tests/conftest.py): every call in a test gives a new case, every run the same ones."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(1 << 30, ())))
    hidden = torch.randn(n, h, generator=g).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) * 3 / h**0.5).to(device, dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    b = torch.randn(v, generator=g).to(device, dtype) if bias else None
    return hidden, weight, targets, b
