"""Each target's vocabulary rank (``return_ranks``) from both log-prob ops, the fused kernel and
eager chunks, against float64: how many ids have a transformed logit at least the target's, itself
included, as vLLM counts a token's rank (``vllm/v1/sample/ops/logprobs.py``,
``batched_count_greater_than``: ``(x >= values).sum(-1)``). The fused kernel runs in Triton's CPU
interpreter here (tests/conftest.py sets TRITON_INTERPRET=1); small tiles and an explicit plan
give several tiles and splits, so the count is summed over both.
"""

from __future__ import annotations

import pytest
import torch
from logprob_service.domain import ScoreOptions
from logprob_service.ops.logprobs import LogitTransform, chunked_token_logprobs

from tests.helpers.op_reference import random_case, transformed_logits

pytestmark = pytest.mark.numerical
triton = pytest.importorskip("triton")

from logprob_service.ops.lm_head.fused_logprobs import fused_token_logprobs  # noqa: E402
from logprob_service.ops.lm_head.plans import KernelConfig, LaunchPlan  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = KernelConfig(block_n=16, block_v=32, block_k=16, num_warps=4, num_stages=2)


def fused(hidden, weight, targets, **kw):
    return fused_token_logprobs(hidden, weight, targets, config=SMALL, plan=LaunchPlan(3, 2), **kw)


def eager(hidden, weight, targets, **kw):
    return chunked_token_logprobs(hidden, weight, targets, chunk_bytes=4 * weight.shape[0] * 7, **kw)  # 7-row chunks


OPS = {"fused": fused, "eager": eager}


def reference_ranks(hidden, weight, targets, bias, transform) -> torch.Tensor:
    x = transformed_logits(hidden, weight, bias, transform)  # [N, V] float64
    return (x >= x.gather(1, targets[:, None].long())).sum(dim=1)


@pytest.mark.parametrize("op", list(OPS), ids=list(OPS))
@pytest.mark.parametrize(
    "top_k,transform", [(0, LogitTransform()), (3, LogitTransform(scale=0.25, softcap=4.0, temperature=1.7))]
)
def test_ranks_match_float64(op, top_k, transform):
    hidden, weight, targets, bias = random_case(37, 33, 250, bias=True, device=DEVICE)
    targets[::3] = transformed_logits(hidden, weight, bias, transform)[::3].argmax(dim=1).to(targets)  # rank 1
    out = OPS[op](
        hidden, weight, targets, bias=bias, transform=transform, options=ScoreOptions(top_k=top_k, return_ranks=True)
    )
    assert out.ranks.dtype == torch.int32
    assert out.ranks.cpu().tolist() == reference_ranks(hidden, weight, targets, bias, transform).cpu().tolist()
    assert (out.ranks[::3] == 1).all()
    plain = OPS[op](hidden, weight, targets, bias=bias, transform=transform, options=ScoreOptions(top_k=top_k))
    assert plain.ranks is None and torch.equal(plain.logprobs, out.logprobs)  # counting changes no log-prob


@pytest.mark.parametrize("op", list(OPS), ids=list(OPS))
def test_tied_logits_count_as_vllm_counts_them(op):
    """Integer-valued operands make every dot exact, so ties are exact ties: each id tied with the
    target counts, as ``>=`` counts it (the target itself too)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randint(-3, 4, (20, 16), generator=g).float().to(DEVICE)
    weight = torch.randint(-2, 3, (200, 16), generator=g).float().to(DEVICE)
    targets = torch.randint(0, 200, (20,), generator=g).to(DEVICE)
    out = OPS[op](hidden, weight, targets, options=ScoreOptions(return_ranks=True))
    expected = reference_ranks(hidden, weight, targets, None, LogitTransform())
    x = hidden.double() @ weight.double().T
    assert ((x == x.gather(1, targets[:, None])).sum(1) > 1).float().mean() > 0.5  # ties are there
    assert out.ranks.cpu().tolist() == expected.cpu().tolist()


def test_ranks_of_top_k_chunks_and_no_rows(monkeypatch):
    """A top-k over row chunks (``TOPK_CHUNK_BYTES``) concatenates the chunks' ranks; no rows, none."""
    from logprob_service.ops.lm_head import plans

    hidden, weight, targets, _ = random_case(6, 32, 128, device=DEVICE)
    monkeypatch.setattr(plans, "TOPK_CHUNK_BYTES", 1)  # one row a chunk: six chunks
    out = fused(hidden, weight, targets, options=ScoreOptions(top_k=2, return_ranks=True))
    expected = reference_ranks(hidden, weight, targets, None, LogitTransform())
    assert out.ranks.cpu().tolist() == expected.cpu().tolist()
    empty = fused(hidden[:0], weight, targets[:0], options=ScoreOptions(return_ranks=True))
    assert empty.ranks.shape == (0,)
