"""Top-k and candidate log-probs of the fused kernel on the GPU, at real vocabulary sizes (issue 43).
Skipped without CUDA.

Criterion: the fused op's (tests/gpu/test_fused_logprobs_cuda.py): 1e-4 nats against float64 logits
of the same bf16 inputs; ids equal the float64 top-k's wherever its neighbouring log-probs are
further apart than twice that (``tests.helpers.topk.assert_top_k``). Batch invariance: a row's
top-k and candidates bit for bit the same alone and in a batch, with the invariant plan.
"""

from __future__ import annotations

import pytest
import torch
from logprob_service.domain import ScoreOptions
from logprob_service.ops.lm_head import fused_logprobs, plans, repair
from logprob_service.ops.lm_head.fused_logprobs import fused_token_logprobs
from logprob_service.ops.lm_head.keys import MIN_KEY
from logprob_service.ops.logprobs import IDENTITY, LogitTransform, chunked_token_logprobs

from tests.helpers.op_reference import transformed_logits
from tests.helpers.topk import assert_top_k
from tests.helpers.topk_rounds import stage_one_needs, too_high

TOL = 1e-4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_case(n, h, v, dtype=torch.bfloat16, *, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=g) * 3 / h**0.5).to(dtype)  # logits std ~3
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    candidates = torch.randint(0, v, (n, 256), device="cuda", generator=g)
    return hidden, weight, targets, candidates


def reference_logp(hidden, weight, transform=IDENTITY, rows=128):
    return transformed_logits(hidden[:rows], weight, None, transform).log_softmax(-1)


@pytest.mark.parametrize("k", [1, 20, 128, 256])
@pytest.mark.parametrize("n,h,v", [(1, 896, 151936), (1025, 3584, 152064), (300, 4096, 128256)])
def test_top_k_matches_float64(k, n, h, v, seed):
    hidden, weight, targets, candidates = cuda_case(n, h, v, seed=seed)
    out = fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=k), candidates=candidates)
    logp = reference_logp(hidden, weight)
    rows = len(logp)
    assert_top_k(out.top_ids[:rows].cpu().numpy(), out.top_logprobs[:rows].cpu().numpy(), logp.cpu().numpy(), k, TOL)
    want = logp.gather(1, candidates[:rows])
    assert (out.candidate_logprobs[:rows].double() - want).abs().max().item() < TOL
    plain = fused_token_logprobs(hidden, weight, targets)
    assert (out.logprobs - plain.logprobs).abs().max().item() < TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_and_softcap(dtype, seed):
    hidden, weight, targets, candidates = cuda_case(513, 2304, 256000, dtype, seed=seed)  # Gemma 2's vocabulary
    transform = LogitTransform(softcap=30.0, temperature=0.7)
    out = fused_token_logprobs(
        hidden, weight, targets, transform=transform, options=ScoreOptions(top_k=64), candidates=candidates[:, :17]
    )
    logp = reference_logp(hidden, weight, transform)
    rows = len(logp)
    assert_top_k(out.top_ids[:rows].cpu().numpy(), out.top_logprobs[:rows].cpu().numpy(), logp.cpu().numpy(), 64, TOL)
    assert (out.candidate_logprobs[:rows].double() - logp.gather(1, candidates[:rows, :17])).abs().max().item() < TOL


def test_eager_and_fused_agree(seed):
    hidden, weight, targets, candidates = cuda_case(2000, 896, 151936, seed=seed)
    fused = fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=20), candidates=candidates)
    eager = chunked_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=20), candidates=candidates)
    assert (fused.top_logprobs - eager.top_logprobs).abs().max().item() < TOL
    assert (fused.candidate_logprobs - eager.candidate_logprobs).abs().max().item() < TOL


@pytest.mark.parametrize("k", [20, 256])
def test_batch_invariant_bit_for_bit(k, seed):
    hidden, weight, targets, candidates = cuda_case(4099, 3584, 152064, seed=seed)
    kw = {"options": ScoreOptions(top_k=k), "invariant": True}
    whole = fused_token_logprobs(hidden, weight, targets, candidates=candidates, **kw)
    for rows in (slice(0, 1), slice(1000, 1003), slice(4000, 4099)):
        part = fused_token_logprobs(hidden[rows], weight, targets[rows], candidates=candidates[rows], **kw)
        assert torch.equal(whole.top_ids[rows], part.top_ids)
        assert torch.equal(whole.top_logprobs[rows], part.top_logprobs)
        assert torch.equal(whole.candidate_logprobs[rows], part.candidate_logprobs)
        assert torch.equal(whole.logprobs[rows], part.logprobs)


@pytest.mark.parametrize("k", [20, 256])
def test_memory_grows_as_n_times_k(k, seed):
    # 8,192 x 152K: the full logits alone are 4.6 GiB in fp32; the top-256 survivor slots are N x CAP x 8
    # bytes, top-20's also stage 1's chunk regions (about 60 KB a row), in row chunks of at most
    # plans.TOPK_CHUNK_BYTES (with the threshold's sample logits)
    hidden, weight, targets, _ = cuda_case(8192, 3584, 152064, seed=seed)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=k))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    full_logits = 8192 * 152064 * (2 + 4)  # bf16 logits and their fp32 copy, as full logits + topk holds them
    assert extra * 10 <= full_logits, extra / 2**30
    assert extra <= 2 * plans.TOPK_CHUNK_BYTES, extra / 2**30


def test_rows_that_overflow_run_again_on_the_gpu(seed, monkeypatch):
    # a few slots a row: the atomics and the compaction of a compiled kernel under reruns, bit for bit the
    # answer with the normal slots
    hidden, weight, targets, _ = cuda_case(300, 896, 151936, seed=seed)
    want = fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=20))
    monkeypatch.setattr(fused_logprobs, "capacity", lambda v, k: 2 * k + 1)
    # 41 slots for about 256 survivors: each round leaves about K / CAP of them, more rounds than the
    # real capacity's (ops.lm_head.repair)
    monkeypatch.setattr(repair, "REPAIR_ROUNDS", 8)
    out = fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=20))
    assert torch.equal(out.top_ids, want.top_ids) and torch.equal(out.top_logprobs, want.top_logprobs)
    assert not out.top_k_incomplete and not want.top_k_incomplete


@pytest.mark.parametrize("k", [20, 256])
def test_rows_with_too_few_survivors_are_repaired_on_the_gpu(k, seed, monkeypatch):
    # No key of some rows survives stage 1, nor with their fallbacks (thresholds above every key, a
    # failed margin): the compiled repair rounds run them with no threshold (all 151,936 keys
    # survive), then twice at most with the K-th of their kept keys (ops.lm_head.repair: the 5 rounds
    # cover it); bit for bit the normal answer
    hidden, weight, targets, _ = cuda_case(300, 896, 151936, seed=seed)
    want = fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=k, return_entropy=True))
    # row blocks with and without rows in need
    monkeypatch.setattr(fused_logprobs, "sample_thresholds", too_high([0, 1, 150, 299]))
    out = fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=k, return_entropy=True))
    assert not out.top_k_incomplete
    for field in ("top_ids", "top_logprobs", "logprobs", "entropies"):
        assert torch.equal(getattr(out, field), getattr(want, field)), field


def test_no_host_synchronization(seed, monkeypatch):
    # The op queues its work and returns (models.scorer.CausalLMScorer.launch relies on it): no
    # synchronizing CUDA call, also while rows overflow and the repair rounds have work. Slots for
    # the expected R stride survivors only (R the sample rank): about half the rows overflow, by a
    # little, and one round repairs them (ops.lm_head.repair); the answer is the normal slots'.
    hidden, weight, targets, candidates = cuda_case(1025, 3584, 152064, seed=seed)
    for k in (20, 256):
        kw = {"options": ScoreOptions(top_k=k), "candidates": candidates, "invariant": True}
        want = fused_token_logprobs(hidden, weight, targets, **kw)
        with monkeypatch.context() as patch:
            patch.setattr(fused_logprobs, "capacity", lambda v, k: plans.sample_rank(v, k) * plans.sample_stride(v, k))
            needs = stage_one_needs(patch)  # after stage 1, each launch's rows in need
            fused_token_logprobs(hidden, weight, targets, **kw)  # compiled outside the check
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = fused_token_logprobs(hidden, weight, targets, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert needs[-1].any() and not out.top_k_incomplete
        assert torch.equal(out.top_ids, want.top_ids) and torch.equal(out.top_logprobs, want.top_logprobs)


def test_the_compiled_compaction_keeps_distinct_keys(seed, monkeypatch):
    # The slots a row's survivors went to come from an atomic add whose old value every thread of the
    # row needs (Triton broadcasts it since triton-lang/triton#7460): a wrong base would overwrite or
    # repeat slots. Every row's written slots hold distinct keys, at least K, and their top K is the
    # eager chunks' top-k.
    hidden, weight, targets, _ = cuda_case(1025, 3584, 152064, seed=seed)
    seen = []
    real = fused_logprobs.select_top_k
    monkeypatch.setattr(fused_logprobs, "select_top_k", lambda keys, *a: seen.append(keys.clone()) or real(keys, *a))
    out = fused_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=20))
    (slots,) = seen
    written = slots != MIN_KEY
    assert (written.sum(1) >= 20).all()
    ordered = slots.sort(dim=1).values
    assert not ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != MIN_KEY)).any()
    eager = chunked_token_logprobs(hidden, weight, targets, options=ScoreOptions(top_k=20))
    assert (out.top_logprobs - eager.top_logprobs).abs().max().item() < TOL
