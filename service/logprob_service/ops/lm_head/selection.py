"""Stage 2 of the top-k: the K largest keys of each row's slots, decoded to ids and log-probs.

After stage 1 and the repair rounds, a row's [CAP] int64 slots hold every key at or above its
threshold (at least K of them; empty slots hold MIN_KEY). Keys are distinct, so the K largest are
one answer whatever the slots' order: ``_select_kernel`` (K maxima, one warp a row) up to K 64,
``_select_sorted_kernel`` (the K-th largest by bisection, the K keys above it sorted) up to 4,096
slots, ``torch.topk`` beyond. Log-probs are ln2 (z - lse2), with the row's log-sum-exp in log2
units from the combine kernel (docs/how-it-works.md, "Stage 2: the selection").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logprob_service.ops.lm_head.keys import KEY_MAX, KEY_MIN, ordered_bits
from logprob_service.ops.lm_head.tiles import LN2
from logprob_service.ops.logprobs import key_ids, key_values

# Stage 2 in ``_select_kernel`` (one warp a row, its slots in registers) up to this K and this many
# slots a row: its time grows as K x slots read, torch.topk's little with K, and past K 64 torch.topk
# measured faster on an H100 (benchmarks/RESULTS.md).
SELECT_MAX_K = 64
SELECT_MAX_BLOCK = 2048
# Beyond them, ``_select_sorted_kernel`` up to this many slots a row (K 256 has 2,336 at a 152K
# vocabulary); beyond, torch.topk.
SORT_MAX_BLOCK = 4096


@triton.jit
def _emit_largest(keys, lse2, ids_at, lps_at, K):
    """The K largest of ``keys`` (distinct), largest first: a max each, then taken out; decoded to
    ids and log-probs ln2 (z - lse2) at ``ids_at`` / ``lps_at`` + j."""
    for j in range(0, K):
        best = tl.max(keys, axis=0)
        keys = tl.where(keys == best, KEY_MIN, keys)
        z = ordered_bits((best >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
        tl.store(ids_at + j, (0x7FFFFFFF - (best & 0x7FFFFFFF)).to(tl.int32))
        tl.store(lps_at + j, (z - lse2) * 0.6931471805599453)


@triton.jit(do_not_specialize=["K"])
def _select_kernel(
    buf_ptr,  # [n, CAP] int64: each row's survivors' keys (distinct; empty slots MIN_KEY)
    cnt_ptr,  # [n] int32: each row's survivors (its slots past them are empty)
    lse2_ptr,  # [n] fp32: each row's log-sum-exp in log2 units
    ids_ptr,  # [n, K] int32 out
    lps_ptr,  # [n, K] fp32 out
    CAP,
    K,
    BLOCK: tl.constexpr,  # next_power_of_2(CAP)
    FILLED: tl.constexpr,  # a power of 2 that most rows' survivors fit (twice the expected count)
):
    """One row: its K largest keys, largest first, decoded (``_emit_largest``). The compaction
    fills a row's slots from the first on, so a row with at most FILLED survivors reads only those
    slots (each max then covers FILLED keys, not BLOCK); a fuller one reads them all. Keys are
    distinct: the answer does not depend on the slots' order."""
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(cnt_ptr + row)
    lse2 = tl.load(lse2_ptr + row)
    at = buf_ptr + row * CAP
    if count <= FILLED:
        first = tl.arange(0, FILLED)
        # (a row past its CAP slots, which the repair rounds flag, reads no further than them)
        keys = tl.load(at + first, mask=(first < count) & (first < CAP), other=KEY_MIN)
        _emit_largest(keys, lse2, ids_ptr + row * K, lps_ptr + row * K, K)
    else:
        every = tl.arange(0, BLOCK)
        _emit_largest(
            tl.load(at + every, mask=every < CAP, other=KEY_MIN), lse2, ids_ptr + row * K, lps_ptr + row * K, K
        )


@triton.jit(do_not_specialize=["K"])
def _select_sorted_kernel(
    buf_ptr,  # [n, CAP] int64: each row's survivors' keys (distinct; empty slots MIN_KEY)
    lse2_ptr,  # [n] fp32: each row's log-sum-exp in log2 units
    ids_ptr,  # [n, K] int32 out
    lps_ptr,  # [n, K] fp32 out
    tmp_ptr,  # [n, KB] int64: scratch, each row's K largest before their sort
    CAP,
    K,
    BLOCK: tl.constexpr,  # next_power_of_2(CAP)
    KB: tl.constexpr,  # next_power_of_2(K)
):
    """One row: the K-th largest of its slots, the largest t with at least K keys >= t, by
    bisection over the int64 keys (64 passes over the slots, in registers); the keys at or above
    it (K of them: keys are distinct) to the scratch, each at its place among them (a cumsum);
    then those K sorted (bitonic, KB keys) and decoded, largest first. (A row with fewer than K
    survivors, which the repair rounds flag, takes empty slots, as torch.topk would.)"""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    keys = tl.load(buf_ptr + row * CAP + offs, mask=offs < CAP, other=KEY_MIN)
    lo = tl.full([], KEY_MIN, tl.int64)
    hi = tl.full([], KEY_MAX, tl.int64)
    for _ in range(64):
        mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)  # (lo + hi) / 2 rounded up, without overflow
        ok = tl.sum((keys >= mid).to(tl.int32), axis=0) >= K
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    take = keys >= lo
    place = tl.cumsum(take.to(tl.int32), axis=0) - 1
    at = tmp_ptr + row * KB
    tl.store(at + place, keys, mask=take & (place < K))
    tl.debug_barrier()  # the scratch, written by every thread of the program, read back by others
    ks = tl.arange(0, KB)
    top = tl.sort(tl.load(at + ks, mask=ks < K, other=KEY_MIN), descending=True)
    z = ordered_bits((top >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
    lse2 = tl.load(lse2_ptr + row)
    tl.store(ids_ptr + row * K + ks, (0x7FFFFFFF - (top & 0x7FFFFFFF)).to(tl.int32), mask=ks < K)
    tl.store(lps_ptr + row * K + ks, (z - lse2) * 0.6931471805599453, mask=ks < K)


def select_top_k(
    keys: torch.Tensor, counts: torch.Tensor, lse2: torch.Tensor, k: int, expected: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: the K largest of each row's [n, CAP] keys, descending, as ([n, K] int32 ids,
    [n, K] float32 log-probs ln2 (z - lse2)) with ``counts`` [n] int32 the rows' survivors (their
    slots from the first on), ``lse2`` [n] their log-sum-exps in log2 units and ``expected`` the
    survivors a row is expected to have. ``_select_kernel`` for K <= ``SELECT_MAX_K`` where a row's
    slots fit one warp's registers, else ``_select_sorted_kernel`` up to ``SORT_MAX_BLOCK`` slots,
    else ``torch.topk``; all give the same answer."""
    n, cap = keys.shape
    block = triton.next_power_of_2(cap)
    if block > SORT_MAX_BLOCK:
        top = torch.topk(keys, k, dim=1).values  # distinct keys: one answer, whatever the slots' order
        return key_ids(top).to(torch.int32), (key_values(top) - lse2[:, None]) * LN2
    ids = torch.empty((n, k), dtype=torch.int32, device=keys.device)
    lps = torch.empty((n, k), dtype=torch.float32, device=keys.device)
    if not (n and k):
        return ids, lps
    if k <= SELECT_MAX_K and block <= SELECT_MAX_BLOCK:
        filled = min(block, triton.next_power_of_2(2 * expected))
        _select_kernel[(n,)](keys, counts, lse2, ids, lps, cap, k, BLOCK=block, FILLED=filled, num_warps=1)
    else:
        scratch = torch.empty((n, triton.next_power_of_2(k)), dtype=torch.int64, device=keys.device)
        _select_sorted_kernel[(n,)](
            keys, lse2, ids, lps, scratch, cap, k, BLOCK=block, KB=scratch.shape[1], num_warps=4
        )  # fmt: skip
    return ids, lps
