"""Spies and stand-ins for the fused top-k's stages (``ops.lm_head``): which rows needed repair
after stage 1, and thresholds that let no key of chosen rows survive it. (Imports Triton: for the
test modules that run the fused op.)"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from logprob_service.ops.lm_head import fused_logprobs, repair


def stage_one_needs(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Per launch, the [n] bool rows that needed repair after stage 1 (recorded as
    ``fused_logprobs.repair_survivors`` is called, before its rounds)."""
    needs = []
    real = fused_logprobs.repair_survivors

    def spy(relaunch, thresholds, fallbacks, counts, slots, k):
        needs.append(repair.rows_in_need(counts, slots.shape[1], k))
        return real(relaunch, thresholds, fallbacks, counts, slots, k)

    monkeypatch.setattr(fused_logprobs, "repair_survivors", spy)
    return needs


def too_high(rows: Sequence[int], fallbacks_too: bool = True) -> Callable:
    """``sample_thresholds``, but a threshold above every key for ``rows`` (where a launch has them):
    none of their keys survives stage 1; their fallbacks too (a failed margin), or as computed."""
    real = fused_logprobs.sample_thresholds

    def thresholds(hidden, *args):
        t, fallback = real(hidden, *args)
        high = [r for r in rows if r < len(t)]
        t[high] = 2**63 - 1
        if fallbacks_too:
            fallback[high] = 2**63 - 1
        return t, fallback

    return thresholds
