"""The fused lm_head pass's top-k and candidate log-probs (Triton pieces of ``fused_logprobs``).

**Keys.** A logit and its token id are packed into one int64 whose signed order is "larger logit
first, then smaller id first": with b the float32 bits of z (the logit in the kernel's base-2
transformed units, the same z the log-sum-exp sums),

    o   = b            if b >= 0        (non-negative floats order as their bits)
        = b ^ 0x7FFFFFFF if b < 0        (negative floats: reverse the magnitude bits)
    key = o << 32 | (2^31 - 1 - id)     (ids < 2^31; the smaller id has the larger low word)

so every key is distinct, and "the K largest keys" is the top-k with ties broken by id: a
deterministic selection whatever order the candidates are merged in. (``logprobs.topk_keys``
builds the same keys in torch for the eager path; -0.0 sorts just below +0.0.)

**Stage 1, per program** (a row block x one vocabulary split, ``_partials_kernel``): a running
list R of the KP largest keys per row (KP: K rounded up to a power of two), sorted descending,
starts at the smallest int64. Each [BLOCK_N, BLOCK_V] tile of z, once its log-sum-exp update is
done, gives its keys; when some row of the block has a key above its list's smallest (the
running K-th value), the tile's own top KP T (``tl.topk``: a bitonic top-k network) merge into R:

    R' = bitonic_merge(max(R, flip(T)))

(R descending, flip(T) ascending: the element-wise max is the KP largest of the 2 KP, as a
bitonic sequence, which log2(KP) compare-exchange steps sort). Once R holds large keys, few of a
tile's beat its K-th: a row block where no row has one skips the tile; where every row has at
most ``FEW``, T is built from those few alone, one tile max each, instead of the network (log2(KP)
(log2(KP) + 1) / 2 compare-exchange steps over the tile); both give the same R'. The program
writes its R: [splits, N, KP] int64 partials, 8 KP bytes per row per split. The list lives in
registers, with the tile's int64 keys where the network runs: ``topk_config`` sizes the tiles.

**Stage 2** (``_combine_kernel``): the splits' lists merge the same way, in split order (the
result does not depend on the order: keys are distinct and the merge exact); the first K keys
decode to ids and to log-probs ln2 (z - lse2) with the final log-sum-exp.

**Candidates** (``_candidates_kernel``, after stage 2): the logit of candidate id c of row i is
one fp32 dot h_i . W_c (+ b_c), as the target logit in stage 2 (N Kc H work, W rows gathered;
no [N, V]), transformed alike, minus the row's log-sum-exp. A program takes one row and
BLOCK_C candidates; each candidate's dot is reduced in the same order whatever the other
candidates and rows, so the results are batch-invariant bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A key below every logit's (the smallest int64): the empty running list.
MIN_KEY = -(2**63)


@triton.jit
def to_log2_units(x, pre, post, SOFTCAP: tl.constexpr):
    """z = x' log2(e) (``fused_logprobs``, which uses it too). With softcap, pre = scale / c and
    post = c log2(e) / T; else pre = scale log2(e) / T."""
    if SOFTCAP:
        u = x * pre
        # tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|) <= 1: never overflows.
        e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(u))
        th = (1.0 - e) / (1.0 + e)
        return tl.where(u < 0, -th, th) * post
    return x * pre


@triton.jit
def ordered_bits(z):
    """The high word of ``pack_keys``: float32 ``z``'s bits as an int32 of the same order."""
    b = z.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def keys_of(ordered, ids):
    """int64 keys from ``ordered_bits`` and int ``ids`` (broadcastable)."""
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - ids.to(tl.int64))


@triton.jit
def pack_keys(z, ids):
    """int64 keys of float32 ``z`` (any shape) and int ``ids`` (broadcastable); see the module doc."""
    return keys_of(ordered_bits(z), ids)


@triton.jit
def key_values(keys):
    """The float32 z of ``pack_keys``'s keys."""
    hi = (keys >> 32).to(tl.int32)
    return tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)


@triton.jit
def key_ids(keys):
    """The token ids of ``pack_keys``'s keys, as int32."""
    return (0x7FFFFFFF - (keys & 0x7FFFFFFF)).to(tl.int32)


@triton.jit
def merge_topk(run, other):
    """The KP largest of two [R, KP] key lists, each sorted descending; sorted descending."""
    return tl.bitonic_merge(tl.maximum(run, tl.flip(other, 1)), descending=True)


# At most this many keys of a tile above a row's running K-th are extracted one by one instead of
# through the tile's whole top-k network (``tile_into_topk``).
FEW = 8


@triton.jit
def tile_into_topk(run, z, cols, KP: tl.constexpr):
    """Merge a [R, BLOCK_V] tile of z (masked columns -inf) at token ids ``cols`` into the running
    list ``run`` ([R, KP], descending). Only the tile's keys above a row's running K-th can enter:
    none in any row, nothing to do; at most FEW (or KP) in every row, they are taken one by one,
    largest first (a max over the tile each), into an otherwise empty list that merges into
    ``run``; more, the tile's own top KP (``tl.topk``) merges. Until that last case, the tile is
    compared as int32 ``ordered_bits`` and ids, the key order without an int64 tile in registers."""
    o = ordered_bits(z)  # [R, BLOCK_V] int32
    ids = cols[None, :]
    kth = tl.min(run, axis=1)
    k_o = (kth >> 32).to(tl.int32)[:, None]  # the K-th key's high word, and its id
    k_id = (0x7FFFFFFF - (kth & 0x7FFFFFFF)).to(tl.int32)[:, None]
    above = (o > k_o) | ((o == k_o) & (ids < k_id))
    most = tl.max(tl.sum(above.to(tl.int32), axis=1), axis=0)
    if most > min(FEW, KP):
        run = merge_topk(run, tl.topk(keys_of(o, ids), KP))
    elif most > 0:
        slots = tl.arange(0, KP)[None, :]
        few = tl.full(run.shape, MIN_KEY, tl.int64)
        for j in range(0, most):
            best = tl.max(o, axis=1)[:, None]  # the largest high word, then its smallest id
            at = tl.min(tl.where(o == best, ids, 0x7FFFFFFF), axis=1)[:, None]
            few = tl.where(slots == j, keys_of(best, at), few)
            o = tl.where(ids == at, -2147483648, o)  # taken: below every float's bits
        run = merge_topk(run, few)
    return run


@triton.jit
def _candidates_kernel(
    h_ptr,  # [N, H]
    w_ptr,  # [V, H]
    b_ptr,  # [V] fp32 or dummy
    c_ptr,  # [N, Kc] int64 candidate ids
    lse_ptr,  # [N] fp32: each row's log-sum-exp (natural units)
    out_ptr,  # [N, Kc] fp32 out: log-probs of the candidates
    Kc,
    H,
    stride_h,
    stride_w,
    pre,
    post,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cs < Kc
    ids = tl.load(c_ptr + row * Kc + cs, mask=c_ok, other=0)
    w_rows = w_ptr + ids.to(tl.int64)[:, None] * stride_w
    ks = tl.arange(0, BLOCK_K)
    x = tl.zeros([BLOCK_C], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + ks) < H
        a = tl.load(h_ptr + row * stride_h + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        b = tl.load(w_rows + (k0 + ks)[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x += tl.sum(a[None, :] * b, axis=1)
    if HAS_BIAS:
        x += tl.load(b_ptr + ids, mask=c_ok, other=0.0)
    z = to_log2_units(x, pre, post, SOFTCAP)
    lse = tl.load(lse_ptr + row)
    tl.store(out_ptr + row * Kc + cs, z * 0.6931471805599453 - lse, mask=c_ok)


def padded_k(k: int) -> int:
    """The running lists' length for a top-``k``: the power of two at or above it (at least 2)."""
    return max(2, triton.next_power_of_2(k))
