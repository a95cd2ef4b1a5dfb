"""Top-k and candidate log-probs of both log-prob ops (the fused kernel and eager chunks) against a
float64 full-softmax reference, ties broken by the smaller id, and the fused kernel's batch invariance.

The fused kernel runs in Triton's CPU interpreter here (tests/conftest.py sets TRITON_INTERPRET=1),
on the GPU where there is one. Small tiles and explicit plans give several tiles, splits and groups.

Exactness: the op's float32 top-k log-probs are the float64 top-k's values within
``tolerances.OP_FP32``; its ids are the float64 ids wherever the float64 log-probs around them are
further apart than twice that (closer ones may swap in float32, as any float32 computation may).
"""

from __future__ import annotations

import math

import pytest
import torch
from logprob_service.domain import ScoreOptions
from logprob_service.ops.logprobs import LogitTransform, chunked_token_logprobs, key_ids, key_values, topk_keys

from tests.helpers import tolerances
from tests.helpers.op_reference import random_case, transformed_logits

pytestmark = pytest.mark.numerical

triton = pytest.importorskip("triton")

from logprob_service.ops.lm_head import fused_logprobs, plans, repair, selection, threshold, tiles  # noqa: E402
from logprob_service.ops.lm_head.fused_logprobs import fused_token_logprobs  # noqa: E402
from logprob_service.ops.lm_head.keys import ABOVE_NEG_INF, MIN_KEY  # noqa: E402
from logprob_service.ops.lm_head.plans import KernelConfig, LaunchPlan  # noqa: E402

from tests.helpers.topk_rounds import stage_one_needs, too_high  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = KernelConfig(block_n=16, block_v=32, block_k=16, num_warps=4, num_stages=2)
CHUNK = plans.chunk_width(SMALL.block_v)
TRANSFORMS = {
    "plain": LogitTransform(),
    "scale+softcap+temperature": LogitTransform(scale=0.25, softcap=4.0, temperature=1.7),
}


def fused(hidden, weight, targets, **kw):
    return fused_token_logprobs(hidden, weight, targets, config=SMALL, plan=LaunchPlan(3, 2), **kw)


def eager(hidden, weight, targets, **kw):
    return chunked_token_logprobs(hidden, weight, targets, chunk_bytes=4 * weight.shape[0] * 7, **kw)  # 7-row chunks


OPS = {"fused": fused, "eager": eager}


def assert_topk_matches(out, hidden, weight, bias, transform, k, atol=tolerances.OP_FP32):
    logp = transformed_logits(hidden, weight, bias, transform).log_softmax(-1)  # [N, V] float64
    ref_vals, ref_ids = torch.sort(logp, dim=-1, descending=True, stable=True)  # ties: smaller id first
    ids, lps = out.top_ids, out.top_logprobs
    assert ids.dtype == torch.int32 and lps.dtype == torch.float32 and ids.shape == lps.shape == (len(hidden), k)
    torch.testing.assert_close(lps.double(), ref_vals[:, :k], atol=atol, rtol=0)
    torch.testing.assert_close(lps.double(), logp.gather(1, ids.long()), atol=atol, rtol=0)
    assert (lps[:, 1:] <= lps[:, :-1]).all()  # descending
    # ids are the reference's wherever its log-probs around them are apart beyond float32's reach
    gaps = torch.nn.functional.pad(ref_vals[:, :-1] - ref_vals[:, 1:], (0, 1), value=float("inf"))  # [N, V]
    clear = torch.ones_like(ref_vals[:, :k], dtype=torch.bool)
    clear[:, 1:] &= gaps[:, : k - 1] > 2 * atol
    clear &= gaps[:, :k] > 2 * atol
    assert clear.float().mean() > 0.5  # the check below checks something
    assert (ids.long() == ref_ids[:, :k])[clear].all()
    assert (ids.long().sort(-1).values.diff(dim=-1) > 0).all()  # distinct


CASES = [  # (dtype, k, transform): k 100 is wider than SMALL's tiles
    (torch.float32, 1, "plain"),
    (torch.float32, 5, "scale+softcap+temperature"),
    (torch.float16, 32, "plain"),
    (torch.float32, 100, "scale+softcap+temperature"),
]


@pytest.mark.parametrize("op", list(OPS), ids=list(OPS))
@pytest.mark.parametrize("dtype,k,transform", CASES, ids=[f"{d}-{k}-{t}" for d, k, t in CASES])
def test_top_k_matches_float64(op, dtype, k, transform):
    transform = TRANSFORMS[transform]
    hidden, weight, targets, bias = random_case(21, 24, 301, dtype=dtype, bias=True, device=DEVICE)
    out = OPS[op](
        hidden, weight, targets, bias=bias, transform=transform, options=ScoreOptions(top_k=k, return_entropy=True)
    )
    assert_topk_matches(out, hidden, weight, bias, transform, k)
    # the log-probs of the targets are those of the same op without top-k
    plain = OPS[op](hidden, weight, targets, bias=bias, transform=transform)
    torch.testing.assert_close(out.logprobs, plain.logprobs, atol=tolerances.OP_FP32, rtol=0)


@pytest.mark.parametrize("k", [5, 100])
def test_stage_one_by_rounds_matches_float64(k, monkeypatch):
    # These tests' H 16 takes stage 1's chunks at every K (plans.uses_chunks); with neither
    # limit met, the rounds over the tile's quarters (a 7B model's K 256) keep the keys instead
    monkeypatch.setattr(plans, "CHUNKS_MAX_K", 0)
    monkeypatch.setattr(plans, "CHUNKS_ANY_K_MAX_H", 0)
    assert not plans.uses_chunks(k, 16)
    transform = TRANSFORMS["scale+softcap+temperature"]
    hidden, weight, targets, bias = random_case(37, 16, 301, bias=True, device=DEVICE)
    out = fused(hidden, weight, targets, bias=bias, transform=transform, options=ScoreOptions(top_k=k))
    assert_topk_matches(out, hidden, weight, bias, transform, k)


@pytest.mark.parametrize("op", list(OPS), ids=list(OPS))
def test_top_k_of_the_whole_vocabulary_and_a_ragged_one(op):
    # K = V: every column survives; K = 3: some
    hidden, weight, targets, _ = random_case(9, 16, 70, device=DEVICE)
    for k in (70, 3):
        assert_topk_matches(
            OPS[op](hidden, weight, targets, options=ScoreOptions(top_k=k)), hidden, weight, None, LogitTransform(), k
        )


@pytest.mark.parametrize("op", list(OPS), ids=list(OPS))
def test_ties_go_to_the_smaller_id(op):
    hidden, weight, targets, _ = random_case(12, 16, 100, device=DEVICE)
    # ids 90 and 20 (different tiles and splits), and 7 and 8, have the same row: equal logits
    weight[90] = weight[20]
    weight[7] = weight[8]
    out = OPS[op](hidden, weight, targets, options=ScoreOptions(top_k=100))
    ids = out.top_ids.long()
    pos = {i: (ids == i).int().argmax(-1) for i in (7, 8, 20, 90)}
    assert (pos[20] + 1 == pos[90]).all() and (pos[7] + 1 == pos[8]).all()
    assert (out.top_logprobs.gather(1, pos[20][:, None]) == out.top_logprobs.gather(1, pos[90][:, None])).all()


@pytest.mark.parametrize("op", list(OPS), ids=list(OPS))
@pytest.mark.parametrize("transform", list(TRANSFORMS.values()), ids=list(TRANSFORMS))
def test_candidate_logprobs_match_float64(op, transform):
    hidden, weight, targets, bias = random_case(23, 40, 257, bias=True, device=DEVICE)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    candidates = torch.randint(0, 257, (23, 19), generator=g).to(DEVICE)
    candidates[:, 0] = targets  # a candidate that is the target: the same log-prob
    out = OPS[op](
        hidden, weight, targets, bias=bias, transform=transform, candidates=candidates, options=ScoreOptions(top_k=4)
    )
    logp = transformed_logits(hidden, weight, bias, transform).log_softmax(-1)
    assert out.candidate_logprobs.dtype == torch.float32 and out.candidate_logprobs.shape == (23, 19)
    torch.testing.assert_close(
        out.candidate_logprobs.double(), logp.gather(1, candidates), atol=tolerances.OP_FP32, rtol=0
    )
    torch.testing.assert_close(out.candidate_logprobs[:, 0], out.logprobs, atol=tolerances.OP_FP32, rtol=0)
    assert out.lse is None  # used inside, not asked for
    assert_topk_matches(out, hidden, weight, bias, transform, 4)


@pytest.mark.parametrize("op", list(OPS), ids=list(OPS))
def test_no_rows_and_no_candidates(op):
    hidden, weight, targets, _ = random_case(3, 16, 40, device=DEVICE)
    out = OPS[op](
        hidden[:0],
        weight,
        targets[:0],
        options=ScoreOptions(top_k=5),
        candidates=torch.zeros((0, 4), dtype=torch.int64),
    )
    assert out.top_ids.shape == (0, 5) and out.candidate_logprobs.shape == (0, 4)
    out = OPS[op](hidden, weight, targets, candidates=torch.zeros((3, 0), dtype=torch.int64))
    assert out.candidate_logprobs.shape == (3, 0) and out.top_ids is None


@pytest.mark.parametrize("op", list(OPS), ids=list(OPS))
def test_bad_arguments_are_refused(op):
    hidden, weight, targets, _ = random_case(3, 16, 40, device=DEVICE)
    with pytest.raises(ValueError, match="top_k 41 must lie in"):
        OPS[op](hidden, weight, targets, options=ScoreOptions(top_k=41))
    with pytest.raises(ValueError, match=r"candidates must be \[3, Kc\]"):
        OPS[op](hidden, weight, targets, candidates=torch.zeros((2, 4), dtype=torch.int64))


def test_fused_top_k_is_batch_invariant():
    # a row's top-k and candidates, bit for bit, whatever rows share its launch (invariant plan)
    hidden, weight, targets, _ = random_case(40, 32, 200, device=DEVICE)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    candidates = torch.randint(0, 200, (40, 9), generator=g).to(DEVICE)
    kw = {"options": ScoreOptions(top_k=7), "invariant": True, "config": SMALL}
    whole = fused_token_logprobs(hidden, weight, targets, candidates=candidates, **kw)
    part = fused_token_logprobs(hidden[5:8], weight, targets[5:8], candidates=candidates[5:8], **kw)
    assert torch.equal(whole.top_ids[5:8], part.top_ids)
    assert torch.equal(whole.top_logprobs[5:8], part.top_logprobs)
    assert torch.equal(whole.candidate_logprobs[5:8], part.candidate_logprobs)


def test_keys_order_by_value_then_id():
    x = torch.tensor([[1.0, -2.0, 1.0, float("-inf"), 0.0, -0.5, 3.0, -2.0]])
    order = key_ids(torch.sort(topk_keys(x), descending=True).values)
    assert order.tolist() == [[6, 0, 2, 4, 5, 1, 7, 3]]


# The fused top-k by threshold and compaction (ops.lm_head): the sampled threshold, the repair
# rounds on the device, row chunks. New features: none of these paths existed in the kernel of running lists.


def sampled_case(n, k, *, stride=plans.MAX_SAMPLE_STRIDE, h=16, dtype=torch.float32):
    """A vocabulary wide enough that the threshold samples one column in ``stride``."""
    v = 16 * k * stride + 15  # v // (16 k) == stride
    assert plans.sample_stride(v, k) == stride
    return random_case(n, h, v, dtype=dtype, device=DEVICE)


def no_threshold(hidden, weight, bias, k, pre, post, softcap):
    """Every finite key survives stage 1 (its thresholds stay above -inf), every key a repair round
    (the exact top-k of the kernel's own values, the slow way)."""
    n = hidden.shape[0]
    finite = torch.full((n,), ABOVE_NEG_INF << 32, dtype=torch.int64, device=hidden.device)
    return finite, torch.full((n,), MIN_KEY, dtype=torch.int64, device=hidden.device)


def counting(monkeypatch, name):
    """Count the calls of ``fused_logprobs.<name>`` (still calling it)."""
    calls = []
    real = getattr(fused_logprobs, name)
    monkeypatch.setattr(fused_logprobs, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("k", [1, 2])
def test_a_sampled_threshold_keeps_the_whole_top_k(k, monkeypatch):
    # one column in 32 sampled; the rows never overflow their slots, and the answer is bit for bit
    # the one without any threshold (every key a survivor, all V slots)
    hidden, weight, targets, _ = sampled_case(9, k)
    needs = stage_one_needs(monkeypatch)
    out = fused(hidden, weight, targets, options=ScoreOptions(top_k=k))
    assert_topk_matches(out, hidden, weight, None, LogitTransform(), k)
    assert len(needs) == 1 and not needs[0].any() and not out.top_k_incomplete
    monkeypatch.setattr(fused_logprobs, "sample_thresholds", no_threshold)
    monkeypatch.setattr(fused_logprobs, "capacity", lambda v, k: v)
    exact = fused(hidden, weight, targets, options=ScoreOptions(top_k=k))
    assert torch.equal(out.top_ids, exact.top_ids) and torch.equal(out.top_logprobs, exact.top_logprobs)


def test_the_margin_covers_values_closer_than_rounding(monkeypatch):
    # The row's top values on sampled columns, a few ulps of the logit apart: W rows equal but for
    # their first element, fp16 steps apart (larger on the sampled columns), which a small first
    # hidden component scales to about an ulp of the logit. The threshold is then torch's value of
    # a column near the kernel's K-th (the K-th largest group maximum; most often the kernel's K-th
    # itself): without the margin, the kernel's value, rounded otherwise, falls below it in some
    # rows, fewer than K keys survive and the row runs again.
    hidden, weight, targets, _ = random_case(16, 64, 64 * 3 * 32 + 5, dtype=torch.float16, device=DEVICE)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    stride = plans.sample_stride(weight.shape[0], 3)
    weight[:] = weight[0].clone()
    steps = torch.randint(-300, 0, (weight.shape[0],), generator=g, dtype=torch.int16)
    steps[::stride] = torch.randint(100, 200, steps[::stride].shape, generator=g, dtype=torch.int16)
    half = torch.tensor(0.5, dtype=torch.float16).view(torch.int16)  # steps of 2^-11 from 0.5 up to 0.6
    weight[:, 0] = (half + steps.to(DEVICE)).view(torch.float16)
    hidden[:, 0] = 2.0**-5
    pre, post = tiles.transform_constants(LogitTransform())
    thr, fallback = threshold.sample_thresholds(hidden, weight, None, 3, pre, post, False)
    assert plans.sample_rank(weight.shape[0], 3) == 3 and torch.equal(thr, fallback)  # stride 1
    z = (hidden.double() @ weight.double().T) * pre  # float64 z
    kth = threshold.sample_ranks(z.float(), 3, 3, 1.0, 1.0, False)[:, 1].double()  # the threshold column's z
    t_hi = (thr >> 32).to(torch.int32)
    t = torch.where(t_hi < 0, t_hi ^ 0x7FFFFFFF, t_hi).view(torch.float32).double()
    assert (t < kth).all() and ((kth - t) < 1e-3 * (kth.abs() + 1)).all()  # below, by a few rounding errors
    needs = stage_one_needs(monkeypatch)
    out = fused(hidden, weight, targets, options=ScoreOptions(top_k=3))
    assert len(needs) == 1 and not needs[0].any()
    monkeypatch.setattr(fused_logprobs, "sample_thresholds", no_threshold)
    monkeypatch.setattr(fused_logprobs, "capacity", lambda v, k: v)
    exact = fused(hidden, weight, targets, options=ScoreOptions(top_k=3))
    assert torch.equal(out.top_ids, exact.top_ids) and torch.equal(out.top_logprobs, exact.top_logprobs)


@pytest.mark.parametrize("k", [1, 4])
def test_rows_that_overflow_their_slots_run_again(k, monkeypatch):
    # 2 K + 1 slots a row for about 8 K survivors: rows overflow and run again in the device's
    # repair rounds, which leave the partials (log-probs, entropies) of stage 1 as they were
    hidden, weight, targets, _ = sampled_case(13, k, stride=8)
    want = fused(hidden, weight, targets, options=ScoreOptions(top_k=k, return_entropy=True))
    monkeypatch.setattr(fused_logprobs, "capacity", lambda v, k: 2 * k + 1)
    monkeypatch.setattr(repair, "REPAIR_ROUNDS", 8)  # each leaves about K / CAP of the survivors
    needs = stage_one_needs(monkeypatch)
    out = fused(hidden, weight, targets, options=ScoreOptions(top_k=k, return_entropy=True))
    assert needs[0].any() and not out.top_k_incomplete
    assert_topk_matches(out, hidden, weight, None, LogitTransform(), k)
    for field in ("top_ids", "top_logprobs", "logprobs", "entropies"):
        assert torch.equal(getattr(out, field), getattr(want, field)), field


def test_rows_with_fewer_finite_logits_than_k_get_the_smallest_ids_at_minus_inf(monkeypatch):
    # a bias of -inf on all but 3 tokens: stage 1's threshold stays above -inf (which also keeps the
    # tiles' masked columns out), so 3 survive, and the rows run again with their fallback; the
    # answer: the 3 finite tokens by value, then the smallest ids, at -inf
    hidden, weight, targets, _ = sampled_case(7, 5, stride=8)
    bias = torch.full((weight.shape[0],), float("-inf"), device=DEVICE)
    finite = torch.tensor([3, 400, weight.shape[0] - 1], device=DEVICE)
    bias[finite] = 0.0
    needs = stage_one_needs(monkeypatch)
    out = fused(hidden, weight, targets, bias=bias, options=ScoreOptions(top_k=5))
    assert needs[0].all() and not out.top_k_incomplete
    logits = (hidden.double() @ weight.double().T)[:, finite]
    order = logits.argsort(dim=1, descending=True, stable=True)
    assert out.top_ids[:, :3].long().tolist() == finite[order].tolist()
    torch.testing.assert_close(
        out.top_logprobs[:, :3].double(), logits.log_softmax(1).gather(1, order), atol=tolerances.OP_FP32, rtol=0
    )
    others = [i for i in range(5) if i not in finite.tolist()][:2]
    assert out.top_ids[:, 3:].tolist() == [others] * 7
    assert (out.top_logprobs[:, 3:] == float("-inf")).all()


def test_the_sample_rank_is_the_smallest_whose_miss_chance_is_small_enough():
    # R: the smallest rank with P(Binomial(K, 1 / stride) >= R) <= SAMPLE_MISS_RATE, in exact
    # rational arithmetic, or K where none is; K at stride 1
    from fractions import Fraction

    rate = Fraction(plans.SAMPLE_MISS_RATE)
    for v in (70, 4096, 32000, 151936, 262144):
        for k in (1, 2, 20, 128, 256):
            if k > v:
                continue
            stride, rank = plans.sample_stride(v, k), plans.sample_rank(v, k)
            if stride == 1:
                assert rank == k
                continue
            p = Fraction(1, stride)

            def tail(r, k=k, p=p):
                return sum(math.comb(k, j) * p**j * (1 - p) ** (k - j) for j in range(r, k + 1))

            # R = K never misses (a sample's K-th largest is at most its row's), whatever the tail
            assert (rank == k or tail(rank) <= rate) and (rank == 1 or tail(rank - 1) > rate), (v, k, rank)
    assert plans.sample_rank(151936, 20) == 8 and plans.sample_rank(151936, 256) == 25


def test_rows_whose_top_k_the_sample_holds_are_repaired_by_their_fallback_in_one_round(monkeypatch):
    # The columns left out of the sample scaled by 1/20: each row's top K lie on sampled columns,
    # more than R of them, so stage 1's threshold (the sample's R-th largest) lets fewer than K
    # keys survive in every row. One repair round with the fallbacks (the sample's K-th largest)
    # gives the exact answer. (float16: fp32 operands' margin covers TF32, wider than some gaps
    # between a row's R-th and K-th values.)
    hidden, weight, targets, _ = sampled_case(4, 8, dtype=torch.float16)
    stride = plans.sample_stride(weight.shape[0], 8)
    assert plans.sample_rank(weight.shape[0], 8) == 6
    weight[torch.arange(weight.shape[0], device=DEVICE) % stride != 0] /= 20
    monkeypatch.setattr(repair, "REPAIR_ROUNDS", 1)
    needs = stage_one_needs(monkeypatch)
    out = fused(hidden, weight, targets, options=ScoreOptions(top_k=8))
    assert needs[0].all() and not out.top_k_incomplete
    assert_topk_matches(out, hidden, weight, None, LogitTransform(), 8)


@pytest.mark.parametrize("cap", [None, 9], ids=["slots", "overflow"])
def test_rows_of_equal_values_give_the_smallest_ids(cap, monkeypatch):
    # a zero hidden state: every logit 0, the top-k is ids 0..K-1 at -log V; with 9 slots, the
    # reruns still end (each raises the threshold key past kept ids)
    hidden, weight, targets, _ = random_case(6, 16, 200, device=DEVICE)
    hidden[2] = 0
    hidden[4] = 0
    if cap is not None:
        monkeypatch.setattr(fused_logprobs, "capacity", lambda v, k: cap)
    out = fused(hidden, weight, targets, options=ScoreOptions(top_k=7))
    for row in (2, 4):
        assert out.top_ids[row].tolist() == list(range(7))
        torch.testing.assert_close(
            out.top_logprobs[row].double(), torch.full((7,), -math.log(200), dtype=torch.float64, device=DEVICE)
        )
    rest = [0, 1, 3, 5]  # the other rows: as alone
    alone = fused(hidden[rest], weight, targets[rest], options=ScoreOptions(top_k=7))
    assert torch.equal(out.top_ids[rest], alone.top_ids)
    assert_topk_matches(alone, hidden[rest], weight, None, LogitTransform(), 7)


def test_a_missed_row_takes_its_fallback_and_a_failed_fallback_no_threshold(monkeypatch):
    # Rows 1 and 4: stage 1's threshold above every key. Their fallbacks as computed: one round
    # ends it. Both too high (a failed margin): the round after runs them with no threshold, one
    # round is not enough (the flag says so) and two are (as below). (K 10 of 301: stride 1, and
    # 298 slots, fewer than V.)
    hidden, weight, targets, _ = random_case(6, 16, 301, device=DEVICE)
    want = fused(hidden, weight, targets, options=ScoreOptions(top_k=10))
    monkeypatch.setattr(repair, "REPAIR_ROUNDS", 1)
    monkeypatch.setattr(fused_logprobs, "sample_thresholds", too_high([1, 4], fallbacks_too=False))
    out = fused(hidden, weight, targets, options=ScoreOptions(top_k=10))
    assert not out.top_k_incomplete
    assert torch.equal(out.top_ids, want.top_ids) and torch.equal(out.top_logprobs, want.top_logprobs)
    monkeypatch.setattr(fused_logprobs, "sample_thresholds", too_high([1, 4]))
    assert fused(hidden, weight, targets, options=ScoreOptions(top_k=10)).top_k_incomplete


def test_rows_with_too_few_survivors_are_repaired_on_the_device(monkeypatch):
    # No key of rows 1, 4 and 20 survives stage 1 (3 row blocks; the third has no row in need). The
    # repair rounds run them with no threshold (all 301 keys survive, past their 298 slots), then
    # with the K-th of the keys they kept: bit for bit the normal answer, the partials unchanged.
    hidden, weight, targets, bias = random_case(37, 16, 301, bias=True, device=DEVICE)
    kw = {"bias": bias, "options": ScoreOptions(top_k=10, return_entropy=True)}
    want = fused(hidden, weight, targets, **kw)
    assert plans.sample_stride(301, 10) == 1 and plans.capacity(301, 10) == 298
    monkeypatch.setattr(fused_logprobs, "sample_thresholds", too_high([1, 4, 20]))
    needs = stage_one_needs(monkeypatch)
    out = fused(hidden, weight, targets, **kw)
    assert needs[0].nonzero().squeeze(1).tolist() == [1, 4, 20]
    assert out.top_k_incomplete is not None and not out.top_k_incomplete
    for field in ("top_ids", "top_logprobs", "logprobs", "entropies"):
        assert torch.equal(getattr(out, field), getattr(want, field)), field


@pytest.mark.parametrize("rounds", [0, 1])
def test_rows_left_in_need_flag_the_scores(rounds, monkeypatch):
    # Row 4 needs two rounds (above). With fewer the scores say their top-k is incomplete; in row
    # chunks (13 rows in equal chunks of at most 5: 5, 5 and 3; row 4 of each chunk in need: the
    # third has none) the flag is any chunk's. With two rounds, no flag.
    hidden, weight, targets, _ = random_case(13, 16, 301, device=DEVICE)
    monkeypatch.setattr(fused_logprobs, "sample_thresholds", too_high([4]))
    monkeypatch.setattr(repair, "REPAIR_ROUNDS", rounds)
    flag = fused(hidden, weight, targets, options=ScoreOptions(top_k=10)).top_k_incomplete
    assert flag.dtype == torch.bool and flag.shape == () and flag
    monkeypatch.setattr(plans, "TOPK_CHUNK_BYTES", 5 * plans.topk_row_bytes(301, 10, 3, CHUNK, True))
    assert fused(hidden, weight, targets, options=ScoreOptions(top_k=10)).top_k_incomplete
    assert not fused(
        hidden[10:], weight, targets[10:], options=ScoreOptions(top_k=10)
    ).top_k_incomplete  # the third chunk alone
    monkeypatch.setattr(repair, "REPAIR_ROUNDS", 2)
    assert not fused(hidden, weight, targets, options=ScoreOptions(top_k=10)).top_k_incomplete


def test_repaired_rows_are_batch_invariant(monkeypatch):
    # 2 K + 1 slots: rows overflow and are repaired; a row's top-k bit for bit the same in a batch
    # and alone (invariant plan), and as with the normal slots
    hidden, weight, targets, _ = sampled_case(12, 4, stride=8)
    kw = {"options": ScoreOptions(top_k=4), "invariant": True, "config": SMALL}
    want = fused_token_logprobs(hidden, weight, targets, **kw)
    monkeypatch.setattr(fused_logprobs, "capacity", lambda v, k: 2 * k + 1)
    monkeypatch.setattr(repair, "REPAIR_ROUNDS", 8)  # each leaves about K / CAP of the survivors
    needs = stage_one_needs(monkeypatch)
    whole = fused_token_logprobs(hidden, weight, targets, **kw)
    part = fused_token_logprobs(hidden[5:8], weight, targets[5:8], **kw)
    assert needs[0][5:8].any() and not whole.top_k_incomplete and not part.top_k_incomplete
    for field in ("top_ids", "top_logprobs"):
        assert torch.equal(getattr(whole, field), getattr(want, field)), field
        assert torch.equal(getattr(whole, field)[5:8], getattr(part, field)), field


def test_row_chunks_give_the_same_answer(monkeypatch):
    # a budget of a few rows' slots: 5-row chunks, each its own launches; bit for bit the one launch's
    hidden, weight, targets, bias = random_case(23, 16, 301, bias=True, device=DEVICE)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    candidates = torch.randint(0, 301, (23, 4), generator=g).to(DEVICE)
    kw = {
        "bias": bias,
        "options": ScoreOptions(top_k=6, return_entropy=True),
        "candidates": candidates,
        "return_lse": True,
    }
    whole = fused(hidden, weight, targets, **kw)
    monkeypatch.setattr(plans, "TOPK_CHUNK_BYTES", 5 * plans.topk_row_bytes(301, 6, 3, CHUNK, True))
    assert plans.topk_chunk_rows(301, 6, 3, CHUNK, True) == 5
    launches = counting(monkeypatch, "sample_thresholds")
    chunked = fused(hidden, weight, targets, **kw)
    assert len(launches) == 5  # 23 rows in chunks of 5
    for field in ("logprobs", "entropies", "lse", "top_ids", "top_logprobs", "candidate_logprobs"):
        assert torch.equal(getattr(chunked, field), getattr(whole, field)), field


def test_slots_and_sample_sizes():
    # the module doc's bounds: stride V / (16 K) in [1, MAX_SAMPLE_STRIDE], the sample >= K columns, slots above
    # the expected K stride survivors, at most V, and O(K) per row at a given vocabulary
    for v in (70, 301, 4096, 151936, 262144):
        for k in (1, 20, 70, 128, 256):
            if k > v:
                continue
            stride = plans.sample_stride(v, k)
            assert 1 <= stride <= plans.MAX_SAMPLE_STRIDE and -(-v // stride) >= k
            rank, cap = plans.sample_rank(v, k), plans.capacity(v, k)
            assert cap == v or rank * stride + 256 < cap <= rank * stride * 9 + 256 + 8 * stride or cap == k
            assert cap >= k


@pytest.mark.parametrize("width,k", [(5000, 20), (5000, 256), (300, 7), (100, 60), (9, 3), (1000, 1)])
def test_the_sample_ranks_are_those_of_group_maxima(width, k):
    # G = sample_groups(S, K) interleaved groups (g, g + G, ...), each a column's value; the R-th
    # and K-th largest of their maxima (repeats counted), at most the sample's own R-th and K-th
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    z = torch.randn(6, width, generator=g)
    z[:2] = torch.randint(-3, 4, (2, width), generator=g).float()  # many equal values
    z[2, ::3] = float("inf")
    z[3] = float("-inf")
    z[3, :k] = torch.randn(k, generator=g)  # as many finite values as K
    groups = threshold.sample_groups(width, k)
    assert groups == min(triton.next_power_of_2(max(256, 2 * k)), triton.next_power_of_2(width))
    padded = torch.nn.functional.pad(z, (0, -width % groups), value=float("-inf"))
    maxima = padded.view(6, -1, groups).amax(dim=1)  # [6, G]
    for r in sorted({1, max(1, k // 3), k}):
        want = maxima.topk(k, dim=1).values[:, [r - 1, k - 1]]
        got = threshold.sample_ranks(z.to(DEVICE), r, k, 1.0, 1.0, False).cpu()  # z = x
        assert torch.equal(got, want), r
        assert (got <= z.topk(k, dim=1).values[:, [r - 1, k - 1]]).all()
    # the kernel's transform on the way: a softcap (its own tanh, within a few ulps of torch's)
    x = torch.randn(6, width, generator=g) * 20
    scale, cap, temperature = 0.5, 4.0, 1.3
    pre, post = scale / cap, cap * math.log2(math.e) / temperature
    z = torch.tanh(x.double() * pre) * post
    want = threshold.sample_ranks(z.float().to(DEVICE), 1, k, 1.0, 1.0, False).cpu()
    got = threshold.sample_ranks(x.to(DEVICE), 1, k, pre, post, True).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_the_sample_kernel_keeps_each_groups_largest_z(transform):
    # sample_maxima: the sampled columns' z (every stride-th token: 9 at V 3,001 and K 20), in
    # G = 256 interleaved groups (a group past the sample empty), each group's largest as
    # ordered_bits; against the float64 logits' (their fp32 dots differ in order: a few ulps)
    transform = TRANSFORMS[transform]
    hidden, weight, _, bias = random_case(70, 24, 3001, bias=True, device=DEVICE)
    k, vocab = 20, 3001
    stride = plans.sample_stride(vocab, k)
    width = -(-vocab // stride)
    groups = threshold.sample_groups(width, k)
    assert (stride, groups) == (9, 256) and width > groups  # two tiles of groups, the second partial
    pre, post = tiles.transform_constants(transform)
    got = threshold.sample_maxima(hidden, weight, bias, stride, groups, pre, post, transform.softcap is not None)
    got = (got ^ ((got >> 31) & 0x7FFFFFFF)).view(torch.float32).double().cpu()  # ordered_bits is its own inverse
    z = transformed_logits(hidden, weight, bias, transform)[:, ::stride].cpu() * math.log2(math.e)
    padded = torch.nn.functional.pad(z, (0, -width % groups), value=float("-inf"))
    want = padded.view(70, -1, groups).amax(dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# (slots, K, expected survivors): the kernel (its rows with at most 2 x expected survivors reading
# only those, the others all their slots; (100, 60): twice the expected is past the slots); the
# sorted kernel past K 64 or 2,048 slots; torch.topk past 4,096 slots
STAGE_TWO = [
    (1, 1, 1),
    (50, 50, 40),
    (100, 60, 60),
    (300, 7, 20),
    (300, 256, 100),  # the sorted kernel: past K 64
    (2336, 256, 800),  # K 256's slots at a 152K vocabulary
    (3000, 20, 500),  # past 2,048 slots
    (5000, 100, 900),  # torch.topk: past 4,096 slots
]


@pytest.mark.parametrize("cap,k,expected", STAGE_TWO)
def test_stage_two_gives_the_largest_keys_in_order(cap, k, expected):
    # distinct keys (any value, any id) filling each row's first slots (as the compaction does),
    # from K up to all of them, equal values among them (other ids)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    values = torch.randn(9, cap, generator=g) * 30
    values[:, ::5] = torch.randint(-2, 3, values[:, ::5].shape, generator=g).float()
    ids = torch.stack([torch.randperm(100_000, generator=g)[:cap] for _ in range(9)])
    keys = topk_keys(values, ids)
    counts = torch.randint(k, cap + 1, (9,), generator=g, dtype=torch.int32)
    counts[0], counts[-1] = k, cap
    if k < cap:  # a row past its slots (the compaction counts what it cannot write): its CAP keys
        counts[1] = cap + 5
    keys[torch.arange(cap) >= counts[:, None].long()] = MIN_KEY  # slots past the row's survivors
    keys, counts = keys.to(DEVICE), counts.to(DEVICE)
    lse2 = (torch.randn(9, generator=g) * 10).to(DEVICE)
    got_ids, got_lps = selection.select_top_k(keys, counts, lse2, k, expected)
    top = torch.topk(keys, k, dim=1).values
    assert torch.equal(got_ids, key_ids(top).int())
    want = (key_values(top) - lse2[:, None]) * math.log(2)
    assert torch.equal(got_lps, want)
