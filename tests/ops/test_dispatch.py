"""Choosing the log-prob implementation: auto, forced, and what cannot run here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_service.domain import ScoreOptions
from logprob_service.ops.dispatch import LogprobOp, select_logprob_op
from logprob_service.ops.logprobs import LogitTransform

from tests.helpers import tolerances
from tests.helpers.op_reference import random_case, reference

pytestmark = pytest.mark.numerical


def test_auto_is_eager_on_the_cpu():
    assert select_logprob_op("auto", torch.device("cpu")).kernel == "eager"


def test_eager_can_be_forced_and_keeps_its_chunk_budget():
    op = select_logprob_op("eager", torch.device("cpu"), chunk_bytes=12345)
    assert op == LogprobOp("eager", chunk_bytes=12345)


def test_forcing_triton_on_the_cpu_without_the_interpreter_fails_clearly(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"logprob_kernel: 'triton' needs a CUDA device, and the device is cpu"):
        select_logprob_op("triton", torch.device("cpu"))


def test_forcing_triton_without_the_package_fails_clearly(monkeypatch):
    monkeypatch.setattr("logprob_service.ops.dispatch._triton_importable", lambda: False)
    with pytest.raises(ValueError, match="needs the triton package"):
        select_logprob_op("triton", torch.device("cuda"))
    assert select_logprob_op("auto", torch.device("cuda")).kernel == "eager"  # auto falls back


@pytest.mark.parametrize("kernel", ["eager", "triton"])
def test_both_implementations_answer_the_same(kernel, monkeypatch):
    if kernel == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    op = select_logprob_op(kernel, torch.device(device))
    assert op.kernel == kernel
    hidden, weight, targets, b = random_case(21, 40, 333, bias=True, device=device)
    transform = LogitTransform(scale=0.5, softcap=8.0, temperature=0.8)
    out = op(hidden, weight, targets, bias=b, transform=transform, options=ScoreOptions(return_entropy=True))
    ref_lp, ref_ent = reference(hidden, weight, targets, b, transform)
    torch.testing.assert_close(out.logprobs.double(), ref_lp, atol=tolerances.OP_FP32, rtol=0)
    torch.testing.assert_close(out.entropies.double(), ref_ent, atol=tolerances.OP_FP32, rtol=0)


@pytest.mark.parametrize("fused_top_k", [True, False], ids=["fused-top-k", "eager-top-k"])
def test_top_k_follows_the_fused_top_k_switch(fused_top_k, monkeypatch, rng):
    """``dispatch.FUSED_TOP_K`` on: a top-k call of the triton op runs the fused kernel; off, the
    eager chunks. Candidates alone and plain calls stay fused either way."""
    from logprob_service.ops import dispatch
    from logprob_service.ops.lm_head import fused_logprobs

    calls = []
    monkeypatch.setattr(
        fused_logprobs, "fused_token_logprobs", lambda h, w, t, options, **kw: calls.append(options) or "fused"
    )
    monkeypatch.setattr(dispatch, "FUSED_TOP_K", fused_top_k)
    hidden = torch.from_numpy(rng.standard_normal((5, 8)).astype(np.float32))
    weight = torch.from_numpy(rng.standard_normal((11, 8)).astype(np.float32))
    targets = torch.from_numpy(rng.integers(0, 11, 5))
    op = LogprobOp("triton")
    out = op(hidden, weight, targets, options=ScoreOptions(top_k=3))
    if fused_top_k:
        assert out == "fused" and calls[-1].top_k == 3
    else:
        assert not calls and out.top_ids.shape == (5, 3)  # the eager chunks answered
        assert torch.equal(out.top_ids[:, 0], (hidden @ weight.T).argmax(-1).to(out.top_ids.dtype))
    calls.clear()
    assert op(hidden, weight, targets) == "fused"
    assert op(hidden, weight, targets, candidates=targets[:, None]) == "fused"
    assert len(calls) == 2
