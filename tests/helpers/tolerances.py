"""Tolerances of the numerical tests, each derived from the error of the path it checks.

u = 2^-24 is float32's unit roundoff (half its machine epsilon); a float32 result of magnitude m
carries a rounding error up to u * m, and a sum of K terms of magnitude m up to about
sqrt(K) * u * m when the roundings are independent (K * u * m in the worst case).

Every scoring tolerance compares against the exact answer (a float64 forward of the same
weights, ``tests.helpers.models.reference_scores``), never against another float32 computation whose own
error would hide or add to the error under test. The numbers quoted as measured come from
sweeps of that many models at the test shapes; ``make test-sweep`` (200 seeds per test) must pass.
"""

from __future__ import annotations

U32 = 2.0**-24

# Scores of a float32 model (the CPU path: packed exact attention + float32 lm_head) against
# float64. A float32 path cannot be more exact than the float32 model: its logits (|x|/T up to
# ~20 here) carry the rounding of every layer, and its log-sum-exp and entropy sums over the
# vocabulary round too. The model's own float32 computation (forward, log-softmax and entropy, as
# a trainer does it) misses the float64 answer by up to 1.1e-5 nats on the test models. The
# served path sums in other orders (packed attention, chunked or fused lm_head), so its error is
# of the same size but not the same: at most 2x the model's own, plus a floor for when the own
# error happens to be tiny. Measured over 800 models x 9 sequences at T = 0.7 and 1.9: ratio
# median 1.18, max 2.12; largest excess over 2x the own error 1.9e-7 (the floor, 2e-6, is ~30
# float32 ulps of a log-prob near 1).
# A bfloat16 model (GPU tests) the same way: the served path against the model's own bfloat16
# computation, both measured against float64; bf16 keeps 8 bits, so the floor is a few bf16 ulps
# of a log-prob near 1 (2^-8 = 3.9e-3): 2e-2, as the GPU attention tests use.
OWN_FACTOR = 2.0
SCORES_FLOOR = {"float32": 2e-6, "bfloat16": 2e-2}


def scores(own_error: float, dtype: str = "float32") -> float:
    """Absolute tolerance (nats) for a served path's scores, given the model's own computation's
    error in the same dtype (both against the float64 answer)."""
    return OWN_FACTOR * own_error + SCORES_FLOOR[dtype]


# The log-prob op alone (hidden states and lm_head weight in, log-probs out) against float64 on
# the same inputs: a float32 logit is an H-term dot product of magnitude up to ~15 (std 3, H <= 64
# in the CPU tests), rounded by <~ sqrt(H) u |x| = 8 * 6e-8 * 15 = 7e-6; the log-sum-exp adds
# ~u |lse|; x_y - lse at most doubles that: 1.5e-5. Half-precision inputs are rounded before both
# sides see them, so what is left is the same float32 accumulation.
OP_FP32 = 2e-5


def op_fp32_scaled(max_abs_logit: float) -> float:
    """The op's tolerance for logits far larger than the tests' usual ~15 (e.g. 1e4, to check
    overflow): a float32 logit of magnitude m rounds by u m; lse and x_y each, so 2 u m, x 4 margin."""
    return max(OP_FP32, 8 * U32 * max_abs_logit)


# Packed attention: hidden states of a packed row against each sequence's own forward, both float32.
# The final norm's outputs are O(1) (RMS-normalized, largest ~4); two layers of width 64 summing in
# other orders move each by <~ layers * sqrt(H) * u * 4 = 2 * 8 * 6e-8 * 4 = 4e-6.
PACKED_HIDDEN_FP32 = 1e-5
