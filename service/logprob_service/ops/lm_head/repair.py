"""Repair rounds: the top-k's rows whose slots do not hold their top K, run again with a new threshold.

A row needs repair when stage 1 left it more than CAP survivors (its threshold was low) or fewer
than K (the sample missed, a margin was too small, or NaN logits). Each round, ``_repair_kernel``
gives every such row a higher threshold (the K-th largest of the keys it kept) or a lower one (its
fallback, else none), and stage 1 runs again for those rows alone. A fixed number of rounds is
queued whatever the rows need, so nothing waits for the device; a row still in need after them
sets ``TokenScores.top_k_incomplete``, which the caller turns into an error rather than a wrong
answer. Why each round makes progress and why five are enough: docs/how-it-works.md, "Repair
rounds".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from logprob_service.ops.lm_head.keys import KEY_MAX, KEY_MIN

# Repair rounds after stage 1, each run whether or not a row needs it: enough for a missed sample or
# an overflow of stage 1 with three to spare, and for a failed margin (how-it-works, "Repair
# rounds"); a row still in need after them sets ``top_k_incomplete``. Each costs two near-empty
# launches when no row needs it.
REPAIR_ROUNDS = 5


@triton.jit
def _repair_kernel(
    cnt_ptr,  # [N] int32 in/out: each row's survivors; emptied for a row in need
    buf_ptr,  # [N, CAP] int64 in/out: the survivors' keys; emptied (MIN_KEY) for a row in need
    thr_ptr,  # [N] int64 in/out: the row's threshold key; the new one of a row in need
    fallback_ptr,  # [N] int64: the threshold for a row that got fewer than K (sample_thresholds)
    need_ptr,  # [N] int8 out: whether the row needs this round (stage 1's REPAIR reads it)
    CAP,
    K,
    BLOCK: tl.constexpr,
):
    """One row: whether it needs a repair round (more than CAP or fewer than K survivors); if so,
    its new threshold, an empty counter and empty slots. The new threshold: the K-th largest of
    its CAP slots; where fewer than K were written, its fallback if that is lower than the
    threshold that missed, else MIN_KEY (none). A row in no need reads its counter and stops."""
    row = tl.program_id(0)
    count = tl.load(cnt_ptr + row)
    need = (count > CAP) | (count < K)
    tl.store(need_ptr + row, need.to(tl.int8))
    if need:
        fallback = tl.load(fallback_ptr + row)
        missed = tl.load(thr_ptr + row)
        at = buf_ptr + row.to(tl.int64) * CAP
        offs = tl.arange(0, BLOCK)
        # The largest key t with at least K slots >= t, by bisection over the int64 keys: the
        # K-th largest slot. (lo + hi) / 2 rounded up without overflow: both halves, plus one
        # when either is odd.
        lo = tl.full([], KEY_MIN, tl.int64)
        hi = tl.full([], KEY_MAX, tl.int64)
        for _ in range(64):
            mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)
            at_least = tl.zeros([], tl.int32)
            for c0 in range(0, CAP, BLOCK):
                inside = (c0 + offs) < CAP
                keys = tl.load(at + c0 + offs, mask=inside, other=0)
                at_least += tl.sum(((keys >= mid) & inside).to(tl.int32), axis=0)
            ok = at_least >= K
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        lo = tl.where((count < K) & (fallback < missed), fallback, lo)  # lo is KEY_MIN when count < K
        # a region of stage 1's chunks overflowed (count -1): the same threshold, by keys this time
        lo = tl.where(count < 0, missed, lo)
        tl.store(thr_ptr + row, lo)
        tl.store(cnt_ptr + row, 0)
        for c0 in range(0, CAP, BLOCK):
            tl.store(at + c0 + offs, tl.full([BLOCK], KEY_MIN, tl.int64), mask=(c0 + offs) < CAP)


def rows_in_need(counts: torch.Tensor, cap: int, k: int) -> torch.Tensor:
    """[n] bool: rows whose slots do not hold their top-k (more than ``cap`` or fewer than ``k`` survivors)."""
    return (counts > cap) | (counts < k)


def repair_survivors(
    relaunch: Callable[[torch.Tensor], object],
    thresholds: torch.Tensor,
    fallbacks: torch.Tensor,
    counts: torch.Tensor,
    slots: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """``REPAIR_ROUNDS`` repair rounds, queued on the device without waiting for
    it: ``relaunch(need)`` runs stage 1 with REPAIR for the rows whose [n] int8 ``need`` is set,
    with ``thresholds`` [n] int64, ``counts`` [n] int32 and ``slots`` [n, CAP] int64 (updated in
    place); ``fallbacks`` [n] int64 (``threshold.sample_thresholds``). Returns a 0-dim bool tensor: whether
    some row still needs repair (its slots may not hold its top-k)."""
    n, cap = slots.shape
    need = torch.empty(n, dtype=torch.int8, device=slots.device)
    for _ in range(REPAIR_ROUNDS):
        _repair_kernel[(n,)](counts, slots, thresholds, fallbacks, need, cap, k, BLOCK=1024, num_warps=4)
        relaunch(need)
    return rows_in_need(counts, cap, k).any()
