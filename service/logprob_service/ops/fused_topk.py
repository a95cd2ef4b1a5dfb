"""The fused lm_head pass's top-k and candidate log-probs (pieces of ``fused_logprobs``).

**Keys.** A logit and its token id are packed into one int64 whose signed order is "larger logit
first, then smaller id first": with b the float32 bits of z (the logit in the kernel's base-2
transformed units, the same z the log-sum-exp sums),

    o   = b            if b >= 0        (non-negative floats order as their bits)
        = b ^ 0x7FFFFFFF if b < 0        (negative floats: reverse the magnitude bits)
    key = o << 32 | (2^31 - 1 - id)     (ids < 2^31; the smaller id has the larger low word)

so every key is distinct, and "the K largest keys" is the top-k with ties broken by id: a
deterministic selection whatever order the candidates come in. (``logprobs.topk_keys`` builds the
same keys in torch for the eager path; -0.0 sorts just below +0.0.)

**Top-k by a threshold and compaction.** No running list is kept in registers (lists of K keys per
row shrank the kernel's tiles and cost 4-22x its time on an H200). Instead, per row i:

1. *Threshold* (``sample_thresholds``, before the kernel). Take the S columns j * stride (stride
   ``sample_stride(V, K)``, fixed by V and K, not by the batch), their logits (fp32 dots)
   transformed into z units as the kernel does; put them in G = max(256, 2 K) interleaved groups
   (``sample_groups``) and let s_i = the K-th largest of the groups' maxima (``sample_ranks``: one
   Triton kernel bisects the G maxima). Up to G 256 (K <= 128) one Triton kernel takes the dots,
   a tile of G columns at a time, and keeps each group's running maximum (``sample_maxima``: no
   [n, S] logits in memory; at H 896 the cuBLAS fp32-output matmul alone ran at a third of the
   tensor cores' rate); above, an fp32 matmul writes the [n, S] logits and ``sample_ranks`` reads
   each row once. The maxima are K distinct columns' values, so s_i is at most the K-th
   largest of the sample, itself at most the K-th largest of the whole row: s_i would be a lower
   bound on the row's K-th largest z, if both computations rounded alike. They do not (another
   summation order), so t_i = s_i - margin_i, with margin_i above the difference for any sampled
   column:

       |z_kernel - z_torch| <= |pre post| |x_kernel - x_torch| + 2^-16 (|z| + |post|)

   where x is the dot h_i . W_c (+ b_c). Products of 16-bit operands are exact in fp32, and an
   fp32 sum of H terms, rounded or truncated at each add, errs by at most H 2^-23 sum_h |h W_c|;
   two such sums differ by at most H 2^-22 sum |h W_c| <= H 2^-22 ||h_i|| max_c ||W_c||
   (Cauchy-Schwarz; c over the sampled columns). fp32 operands may go through TF32 in torch
   (each operand rounded to 11 bits: 2^-10 relative per product): 2^-9 more. The transform's
   derivative is at most |pre post| (tanh' <= 1), and the second term covers the transform's
   own few roundings (a handful of ulps of |z| or of the softcap's scale, far below 2^-16). The
   K sampled columns above s_i then have kernel values >= t_i, so every true top-K element has
   z >= t_i. (t_i is stepped one float down in key order, which also covers its own rounding to
   fp32 and -0.0 below +0.0.) As a key, t_i is (ordered(t_i) << 32): every key of z >= t_i is
   above it. That t_i is row i's *fallback*.

   Stage 1 takes a higher threshold: the same from the R-th largest group maximum, R =
   ``sample_rank(V, K)`` <= K, at most the sample's R-th largest value. It keeps the row's top K
   unless R of them lie on sampled columns (then the R-th largest sampled value is one of the top
   K, and the top K below it may fall under the threshold). For top values placed independently of
   the sample's columns, the number of them that are sampled is Binomial(K, 1 / stride), and R is
   the smallest rank whose tail P(X >= R) is at most ``SAMPLE_MISS_RATE`` (1e-6): R = 8 for K 20
   and 25 for K 256 at stride 32, K at stride 1. The survivors drop from about K stride to about R
   stride (640 -> 256 for K 20, 8,192 -> 800 for K 256 at a 152K vocabulary; a few more where two
   of the sample's R largest share a group), and with them the compaction's rounds (2.) and the
   slots. Stage 1's threshold is also kept above -inf (``ABOVE_NEG_INF``): the tiles' masked
   columns (z = -inf) never pass it, and a row with fewer than K finite logits runs again (4.). A
   row it misses runs again with its fallback (4.: one round, two for K 256); a vocabulary whose
   top ids favour the sampled columns costs such rounds, not exactness.

   Exactness does not rest on either bound: the survivors, the keys >= a threshold key, are
   always the row's largest keys, so a row with at least K survivors has its exact top K among
   them. A row with fewer (the sample missed, a margin too small, or NaN logits) runs again (4.).
   Tests check each.

2. *Stage 1* (``_partials_kernel`` with TOPK): after a tile's z is computed (the same z the
   log-sum-exp sums), the elements whose key is >= the row's threshold key survive.

   *Up to K 64, and at any K up to H 2,048* (``uses_chunks``; ``flag_chunks``) survivors are
   kept as chunks. In the
   tensor-core accumulator's layout one of a row's 4 threads holds two adjacent columns in every
   eight; the tile is cut, along register bits only (``split_columns``: no data moves), into
   eight pieces, and a thread's values of a piece for a row, CH = BLOCK_V / 32 of them, are a
   chunk. A chunk whose largest z reaches the row's threshold (compared as floats: with the
   threshold's low word 0, a superset of the keys >= it, -0.0 aside) goes whole, with its first
   column, to the next slot of its region, one per (row, split, thread): each region's counter
   lives in its thread's registers, so there is no atomic, no reduction across threads, no
   rounds; the stores are inline PTX in the registers' own layout (``tl.store`` would first move
   the chunk through shared memory into a layout of Triton's choosing, in every tile). A region
   holds ``region_slots`` chunks; past them chunks are counted, not written. After the kernel,
   ``gather_survivors`` (one program a row) takes the keys >= the threshold out of the row's
   chunks into its [CAP] int64 slots, counted (all) and kept (the first CAP) as the rounds below
   leave them; a row one of whose regions overflowed gets the count -1, and its repair round (4.)
   runs it again with the same threshold, by keys.

   *Otherwise*, and in the repair rounds, survivors are kept as keys: when some survive in the
   row block, each row reserves as many slots as it has survivors with one atomic add on its
   int32 counter, and its survivors go to its [CAP] int64 slots from the reserved base on
   (``compact_survivors``): the tile's columns in four parts, whose bits a thread holds
   (``split_columns``), each part's survivors taken largest first, a max over the part each.
   Slots past CAP are counted, not written. A K 256 row's chunks take about three times its
   slots' and sample's memory, which only a short matmul pays back, hence the split.

   The buffer's order does not matter: keys are distinct. (Stage 1's thresholds and the fallbacks
   have a low word of 0, so the survivors there are the elements whose high word is >= the
   threshold's: one int32 compare an element.)

3. *Stage 2* (``select_top_k``): the K largest of each row's CAP keys (slots never written hold
   MIN_KEY), by ``_select_kernel`` (K maxima over the slots, one warp a row) up to K 64; above,
   up to 4,096 slots, by ``_select_sorted_kernel`` (the K-th largest by bisection, the K keys
   above it gathered and sorted); beyond, ``torch.topk``; decoded to ids and z; log-probs
   ln2 (z - lse2) with the row's log-sum-exp in log2 units from the combine kernel.

4. *Repair rounds* (``repair_survivors``, on the device, no host reads): a row "needs repair"
   when it has more than CAP survivors (its threshold was low: a row whose top values avoid the
   sampled columns, or many equal values) or fewer than K (the sample missed, a margin too
   small, NaN logits). ``REPAIR_ROUNDS`` times, whatever the rows: ``_repair_kernel`` (one
   program a row: a row in no need stops at its counter; one in need bisects the int64 keys, 64
   passes over its CAP slots) gives each row in need a new threshold, the K-th largest of the CAP
   keys it kept (when it kept fewer than K: its fallback if that is below the threshold that
   missed, else MIN_KEY, no threshold), and empties its counter and slots; then
   stage 1 runs again with REPAIR, where a program whose
   rows need nothing loops over no tile, and the others compact only their rows in need (the
   rest keep their slots) and write no partials (the log-sum-exp is stage 1's). Nothing waits
   for the device: a round with no row in need costs two near-empty launches.

   The kept keys are kernel keys of the row, so their K-th largest is a lower bound on the
   row's K-th key: at least K survivors, and strictly above the old threshold (CAP > K
   distinct keys), so each round drops at least the CAP - K kept keys below it. For keys that
   arrive in an order unrelated to their values (the kept ones about a random CAP of the c
   survivors) a round leaves about K c / CAP of them: an overflow of stage 1 (c a little past
   CAP, which has 8 standard deviations of room) fits after one round. A row the sample missed
   runs with its fallback: about K stride survivors, which fit K 20's 1,280 slots at a 152K
   vocabulary (640, 4.5 standard deviations below), and fit K 256's 2,336 after one more round
   (8,192 -> 898). A row with fewer than K after its fallback (a failed margin, which its bound
   rules out) runs with MIN_KEY (all V survive), then needs about log(V / CAP) / log(CAP / K)
   more rounds: two for K 20 and for K 256 at a 152K vocabulary (152K -> 2.4K -> 37; 152K ->
   16.7K -> 1.8K survivors), three for K 256 of a 32K vocabulary (stride 7, CAP 1,222: 32K ->
   6.9K -> 1.4K -> 0.3K). Hence 5 rounds: a missed sample or an overflow with three to spare,
   a failed margin at these shapes. Rows that may need more: those whose keys arrive in an
   order that defeats the rounds (many equal values, as NaN logits or a zero hidden state, where
   the kept keys are the ids that arrived first). Such a row is not answered wrong:
   ``top_k_incomplete`` (TokenScores) is a device flag, set when a row still needs repair after
   the rounds, that the scorer copies with the results and turns into an error for the
   micro-batch (``models.scorer.Launched.fetch``).

Survivors per row: the R-th largest group maximum (most often the sample's R-th largest) is about
the (R stride)-th largest of the row (for top values spread over the vocabulary independently of
the stride), give or take about sqrt(R) stride, plus the few within the margin. ``capacity`` gives
room for that and 8 standard deviations more: CAP = R stride + 8 floor(sqrt(R - 1)) stride + 8
stride + 256 slots (at least K, at most V). The stride is V / (16 K), within [1, MAX_SAMPLE_STRIDE
= 32] (``sample_stride``): the sample costs 1/stride of the matmul and of its top-k (3% for K 20
and K 256 at a 152K vocabulary), and a [BLOCK_N, 256] tile has about 256 R stride / V <= 16
survivors per row (0.43 for K 20, 1.35 for K 256 at 152K), a quarter of that in each of the
compaction's parts, so its rounds (the most survivors of a row of the block in a part) are few:
about 1.5 a part for K 20. (With stage 1 at the R-th largest, a stride of 32 rather than 16
measured 1.49x against 1.64x the plain kernel for K 20 at 8,192 x 3,584, and 32 rather than 9 or 7
for K 256 1.70x against 1.81x there and 1.71x against 2.50x at 65,536 x 4,096, on an H100; 8 was
slower: benchmarks/RESULTS.md, session 20. The rounds over quarters of the tile rather than the
whole of it: 1.29x against 1.37x for K 20 there, 1.24x against 1.32x at 65,536 x 4,096, session
21. Where stage 1 keeps chunks instead, there are no rounds: K 20 at 1.09x rather than 1.34x at
8,192 x 3,584, K 256 at 1.52x rather than 2.09x at 24,576 x 896, session 22.) Memory per row: CAP
int64 slots (8 CAP <= 256 K + 2048 ceil(sqrt K) + 4096 bytes); with chunks, 4 x splits regions
of ``region_slots`` chunks (4 CH + 4 bytes each: about 60 KB for K 20 at a 152K vocabulary);
and, while the threshold is taken above K 128 or H 2,048, S = V / stride <= max(32 K, V / 32) + 1
fp32 sample logits: O(K) bytes for a given vocabulary, O(N K) in all;
``fused_logprobs`` runs top-k in row chunks that stay under ``TOPK_CHUNK_BYTES``.

In the rounds, the reserved base comes back from a tensor atomic add to every thread that holds the row (a
[BLOCK_N] vector is replicated across the threads of a row); Triton broadcasts it from the thread
that did the add since triton-lang/triton#7460 (Triton 3.5). tests/gpu/test_topk_cuda.py checks
the compiled kernel's slots (distinct keys, at least K a row).

**Batch invariance.** The returned keys come only from the kernel's z values (and the lse from
the invariant plan), and the top K of a row's survivors are its top K whatever the threshold
was: the threshold may change with the batch (the sample's matmul may pick other kernels for
other row counts), the answer does not.

**Candidates** (``_candidates_kernel``, after stage 2): the logit of candidate id c of row i is
one fp32 dot h_i . W_c (+ b_c), as the target logit in stage 2 (N Kc H work, W rows gathered;
no [N, V]), transformed alike, minus the row's log-sum-exp. A program takes one row and
BLOCK_C candidates; each candidate's dot is reduced in the same order whatever the other
candidates and rows, so the results are batch-invariant bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from logprob_service.ops.logprobs import _logits_fp32, key_ids, key_values, ordered_words

# A key below every logit's (the smallest int64): empty slots, and "no threshold".
MIN_KEY = -(2**63)
LN2 = 0.6931471805599453
# Below every ``ordered_bits`` of a float but -NaN's: an element already taken (``compact_survivors``).
# (Kernels read only constexpr globals: the interpreter reads any, so only a compiled kernel tells.)
TAKEN = tl.constexpr(-(2**31))
# ``ordered_bits`` of -FLT_MAX: one above -inf's.
ABOVE_NEG_INF = -2139095040
KEY_MIN = tl.constexpr(MIN_KEY)
KEY_MAX = tl.constexpr(2**63 - 1)


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
def tile_logits(
    h_in,
    w_in,
    row0,
    rows,
    row_ok,
    c0,
    n_cols,
    row_step,
    H,
    stride_h,
    stride_w,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """x = h[rows] . W[(c0 + j) row_step]^T for the columns j < BLOCK_V with c0 + j < n_cols, a
    [BLOCK_N, BLOCK_V] tile in fp32 registers: a K-loop of tensor-core dots. With USE_TMA,
    ``h_in`` and ``w_in`` are TMA descriptors read at [row0, k] and [c0, k] (``w_in``'s rows
    already every row_step-th of W; out-of-bounds rows, columns and k zero-filled by the TMA
    unit); else the tensors, masked. IEEE: fp32 operands, an exact fp32 dot rather than TF32.
    (``fused_logprobs``' partials kernel and ``_sample_maxima_kernel``.)"""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for ki in range(0, tl.cdiv(H, BLOCK_K)):
        k0 = ki * BLOCK_K
        if USE_TMA:
            a = h_in.load([row0, k0])
            b = w_in.load([c0, k0]).T
        else:
            k_ok = (k0 + ks) < H
            cols = c0 + tl.arange(0, BLOCK_V)
            a_ptrs = h_in + rows.to(tl.int64)[:, None] * stride_h + (k0 + ks)[None, :]
            b_ptrs = w_in + (cols.to(tl.int64) * row_step)[None, :] * stride_w + (k0 + ks)[:, None]
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & (cols < n_cols)[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def ordered_bits(z):
    """The high word of a key: float32 ``z``'s bits as an int32 of the same order."""
    b = z.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)  # b ^ 0x7FFFFFFF where b < 0: a shift and one logic op


@triton.jit
def keys_of(ordered, ids):
    """int64 keys from ``ordered_bits`` and int ``ids`` (broadcastable)."""
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - ids.to(tl.int64))


@triton.jit
def split_columns(x, STEP: tl.constexpr):
    """x [R, V] -> the columns whose index has the bit of value STEP clear, and those where it is set
    (each [R, V / 2], in order). For STEP 1 on a tile and STEP 4 on either half, that bit is a
    register bit of the tensor-core accumulator layouts (a thread holds both columns): no data moves."""
    R: tl.constexpr = x.shape[0]
    V: tl.constexpr = x.shape[1]
    clear, set_ = tl.split(tl.permute(tl.reshape(x, [R, V // (2 * STEP), 2, STEP]), (0, 1, 3, 2)))
    return tl.reshape(clear, [R, V // 2]), tl.reshape(set_, [R, V // 2])


@triton.jit
def _take_survivors(o, ids, count, most, base, at_row, row_ok, CAP):
    """Store each row's ``count`` survivors of a part of the tile (``ordered_bits`` o, TAKEN where
    none; token ``ids``) to its slots from ``base`` on, largest first: one max over the part each,
    ``most`` rounds (the part's fullest row's count; the last one takes nothing out)."""
    for j in range(0, most):
        best = tl.max(o, axis=1)  # the largest high word, then its smallest id
        at = tl.min(tl.where(o == best[:, None], ids, 0x7FFFFFFF), axis=1)
        pos = base + j
        tl.store(at_row + pos, keys_of(best, at), mask=row_ok & (j < count) & (pos < CAP))
        if j + 1 < most:
            o = tl.where(ids == at[:, None], TAKEN, o)


@triton.jit
def compact_survivors(z, cols, col_ok, rows, row_ok, thr_ptr, cnt_ptr, buf_ptr, CAP, ANY_LOW_WORD: tl.constexpr):
    """Append the keys of a [R, BLOCK_V] tile of z (token ids ``cols``) that are >= their row's
    threshold key to the row's slots (see the module doc). The tile is compared as int32
    ``ordered_bits`` and ids (the key order without an int64 tile in registers). Then its columns
    go in four parts (``split_columns``: even and odd, each split again on bit 3 of the column),
    and each part's survivors are taken largest first, one max over the part each, as many rounds
    as the part's fullest row has: rows have about a quarter of a tile's survivors in a part, so
    the rounds, which dominate the compaction's time, cover fewer columns in all (about 1.5 rounds
    of a quarter against 2.8 of the whole tile for K 20 at a 152K vocabulary).
    Without ``ANY_LOW_WORD`` (stage 1) a threshold's low word is 0, so a key is >= it exactly when
    its high word is >= the threshold's, whatever its id: the ids are not compared; and the
    threshold is above -inf (``sample_thresholds``), so the masked columns (z = -inf) never pass."""
    thr = tl.load(thr_ptr + rows, mask=row_ok, other=0x7FFFFFFFFFFFFFFF)  # no row: nothing survives
    t_o = (thr >> 32).to(tl.int32)[:, None]  # the threshold's high word
    o = ordered_bits(z)
    ids = cols[None, :]
    if ANY_LOW_WORD:
        t_id = (0x7FFFFFFF - (thr & 0x7FFFFFFF)).to(tl.int32)[:, None]  # the threshold's id
        keep = ((o > t_o) | ((o == t_o) & (ids <= t_id))) & col_ok[None, :]
    else:
        keep = o >= t_o
    even, odd = split_columns(tl.where(keep, o, TAKEN), 1)
    o0, o1 = split_columns(even, 4)
    o2, o3 = split_columns(odd, 4)
    ids_even, ids_odd = split_columns(ids, 1)
    ids0, ids1 = split_columns(ids_even, 4)
    ids2, ids3 = split_columns(ids_odd, 4)
    n0 = tl.sum((o0 != TAKEN).to(tl.int32), axis=1)
    n1 = tl.sum((o1 != TAKEN).to(tl.int32), axis=1)
    n2 = tl.sum((o2 != TAKEN).to(tl.int32), axis=1)
    n3 = tl.sum((o3 != TAKEN).to(tl.int32), axis=1)
    count = n0 + n1 + n2 + n3
    # each part's fullest row, in one reduction over the block (one exchange between warps, not 4)
    parts = tl.reshape(tl.join(tl.join(n0, n2), tl.join(n1, n3)), [n0.shape[0], 4])  # [R, 4]: n0 n1 n2 n3
    most = tl.max(parts, axis=0)
    which = tl.arange(0, 4)
    if tl.max(most, axis=0) > 0:
        base = tl.atomic_add(cnt_ptr + rows, count, mask=row_ok & (count > 0), sem="relaxed")
        at_row = buf_ptr + rows.to(tl.int64) * CAP
        _take_survivors(o0, ids0, n0, tl.sum(tl.where(which == 0, most, 0)), base, at_row, row_ok, CAP)
        base += n0
        _take_survivors(o1, ids1, n1, tl.sum(tl.where(which == 1, most, 0)), base, at_row, row_ok, CAP)
        base += n1
        _take_survivors(o2, ids2, n2, tl.sum(tl.where(which == 2, most, 0)), base, at_row, row_ok, CAP)
        base += n2
        _take_survivors(o3, ids3, n3, tl.sum(tl.where(which == 3, most, 0)), base, at_row, row_ok, CAP)


@triton.jit
def _store_where(at, value, put, ASM: tl.constexpr):
    """``value`` (fp32 or int32) stored at the pointers ``at`` where ``put``. With ASM, one PTX
    store an element, in the registers' own layout: ``tl.store`` would first move the tensor
    through shared memory into the layout Triton picks for a store, a tensor-core tile's whole
    chunk in every tile whether it is kept or not. (The interpreter runs no PTX.)"""
    if ASM:
        if value.dtype == tl.float32:
            op: tl.constexpr = "st.global.f32 [$1], $2;"
            kind: tl.constexpr = "f"
        else:
            op: tl.constexpr = "st.global.b32 [$1], $2;"
            kind: tl.constexpr = "r"
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p " + op + " mov.b32 $0, 0; }",
            "=r,l," + kind + ",r",
            [at.to(tl.int64, bitcast=True), value, put.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(at, value, mask=put)


@triton.jit
def _flag_piece(z, t_z, col0, cnt, vals_at, cols_at, rows_ok, CAPQ, ASM: tl.constexpr):
    """One [R, W] piece of a tile (its columns col0 + 8 j + 2 q + e, the thread-held layout of the
    tensor-core accumulator: e and j in a thread's registers, q over the 4 threads of a row):
    for each (row, q), the piece's W / 4 values whose q it is form a chunk; a chunk whose largest
    z reaches its row's ``t_z`` goes whole to the (row, q) region's next slot, with its first
    column in ``cols_at``. Returns the regions' counters, each chunk counted (past CAPQ too, not
    written)."""
    R: tl.constexpr = z.shape[0]
    W: tl.constexpr = z.shape[1]
    CH: tl.constexpr = W // 4
    x = tl.reshape(tl.permute(tl.reshape(z, [R, W // 8, 4, 2]), (0, 2, 1, 3)), [R, 4, CH])
    flag = (tl.max(x, axis=2) >= t_z[:, None]) & rows_ok[:, None]
    put = flag & (cnt < CAPQ)
    _store_where((vals_at + cnt * CH)[:, :, None] + tl.arange(0, CH)[None, None, :], x, put[:, :, None], ASM)
    _store_where(cols_at + cnt, col0 + 2 * tl.arange(0, 4)[None, :], put, ASM)
    return cnt + flag.to(tl.int32)


@triton.jit
def flag_chunks(z, t_z, v0, cnt, vals_at, cols_at, rows_ok, CAPQ, ASM: tl.constexpr):
    """Stage 1's compaction (module doc, 2.): a [R, V] tile of z (columns v0 + [0, V)) in eight
    pieces of V / 8 columns (``split_columns`` on the column's top three bits, register bits of
    the accumulator: no data moves), each through ``_flag_piece``. Returns the counters."""
    V: tl.constexpr = z.shape[1]
    if V < 64:  # a narrow tile (the interpreter's tests): one piece
        cnt = _flag_piece(z, t_z, v0, cnt, vals_at, cols_at, rows_ok, CAPQ, ASM)
    else:
        W: tl.constexpr = V // 8
        lo, hi = split_columns(z, V // 2)
        a, b = split_columns(lo, V // 4)
        c, d = split_columns(hi, V // 4)
        p0, p1 = split_columns(a, W)
        p2, p3 = split_columns(b, W)
        p4, p5 = split_columns(c, W)
        p6, p7 = split_columns(d, W)
        cnt = _flag_piece(p0, t_z, v0, cnt, vals_at, cols_at, rows_ok, CAPQ, ASM)
        cnt = _flag_piece(p1, t_z, v0 + W, cnt, vals_at, cols_at, rows_ok, CAPQ, ASM)
        cnt = _flag_piece(p2, t_z, v0 + 2 * W, cnt, vals_at, cols_at, rows_ok, CAPQ, ASM)
        cnt = _flag_piece(p3, t_z, v0 + 3 * W, cnt, vals_at, cols_at, rows_ok, CAPQ, ASM)
        cnt = _flag_piece(p4, t_z, v0 + 4 * W, cnt, vals_at, cols_at, rows_ok, CAPQ, ASM)
        cnt = _flag_piece(p5, t_z, v0 + 5 * W, cnt, vals_at, cols_at, rows_ok, CAPQ, ASM)
        cnt = _flag_piece(p6, t_z, v0 + 6 * W, cnt, vals_at, cols_at, rows_ok, CAPQ, ASM)
        cnt = _flag_piece(p7, t_z, v0 + 7 * W, cnt, vals_at, cols_at, rows_ok, CAPQ, ASM)
    return cnt


def chunk_width(block_v: int) -> int:
    """Values in one chunk of ``flag_chunks`` for tiles BLOCK_V wide."""
    return block_v // 4 if block_v < 64 else block_v // 32


@triton.jit(do_not_specialize=["Kc"])  # the batch's widest candidate row (fused_logprobs.BATCH_SIZES)
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


MAX_SAMPLE_STRIDE = 32


def sample_stride(vocab: int, k: int) -> int:
    """Every how many columns the threshold's sample takes one: V / (16 K), within [1, 32]."""
    return min(MAX_SAMPLE_STRIDE, max(1, vocab // (16 * k)))


# How often stage 1's threshold may miss a row's top-k (module doc, 1.), at most, for top values
# placed independently of the sample's columns: such a row costs one repair round of its row block.
SAMPLE_MISS_RATE = 1e-6


@functools.cache
def sample_rank(vocab: int, k: int) -> int:
    """R: stage 1's threshold is the R-th largest of the sample's group maxima (module doc, 1.), at
    most its R-th largest value. The smallest R with P(Binomial(K, 1 / stride) >= R) <=
    ``SAMPLE_MISS_RATE``: the chance that R of a row's top K lie on sampled columns. K where no
    smaller R does (K never misses: a sample's K-th largest is at most its row's), as at stride 1."""
    stride = sample_stride(vocab, k)
    if stride == 1:
        return k
    p = 1.0 / stride
    tail = 1.0  # P(X >= r), from r = 0 up
    for r in range(1, k + 1):
        tail -= math.comb(k, r - 1) * p ** (r - 1) * (1 - p) ** (k - r + 1)
        if tail <= SAMPLE_MISS_RATE:
            return r
    return k


def expected_survivors(vocab: int, k: int) -> int:
    """About how many keys of a row pass stage 1's threshold: R stride (R the ``sample_rank``;
    module doc, Survivors per row)."""
    return sample_rank(vocab, k) * sample_stride(vocab, k)


def capacity(vocab: int, k: int) -> int:
    """Slots per row for the survivors of a top-``k`` (module doc): the ``expected_survivors``, room
    for 8 standard deviations (sqrt(R) stride each) and 256 more; at least K, never more than
    ``vocab``."""
    stride, rank = sample_stride(vocab, k), sample_rank(vocab, k)
    return min(vocab, max(k, expected_survivors(vocab, k) + 8 * math.isqrt(rank - 1) * stride + 8 * stride + 256))


# Stage 1 keeps survivors as chunks (``flag_chunks``) up to this K, and at any K up to this hidden
# size; otherwise as keys by rounds (``compact_survivors``): a K 256 row's chunk regions take about
# three times its slots' and sample's memory (110-120 KB a row at a 152K vocabulary), which only a
# short matmul, whose time the rounds' epilogue outweighs, pays back (K 256 at H 896 on an H100:
# 2.09x the plain pass by rounds; at H 3,584-4,096, 1.34-1.38x).
CHUNKS_MAX_K = 64
CHUNKS_ANY_K_MAX_H = 2048


def uses_chunks(k: int, hdim: int) -> bool:
    """Whether stage 1 of a top-``k`` at hidden size ``hdim`` keeps chunks (module doc, 2.)."""
    return k <= CHUNKS_MAX_K or hdim <= CHUNKS_ANY_K_MAX_H


# Regions a (row, split) has: one per thread of a row in the accumulator layout (``_flag_piece``).
THREADS_A_ROW = 4


def region_slots(vocab: int, k: int, splits: int) -> int:
    """CAPQ, the chunks a region (row, split, thread) holds. A row's survivors number about R stride
    (``expected_survivors``), spread like stride times a Gamma(R) (module doc, Survivors per row);
    regions are sized for 6 of its standard deviations (sqrt(R) stride) more, at most the row's
    ``capacity``, spread evenly over its 4 x splits regions (the splits interleave the
    vocabulary's tiles): mu a region, each kept chunk holding at least one, and 4.5 Poisson
    standard deviations (sqrt(mu)) more. Over that Gamma, a row's regions overflow about once in
    5 to 10 million rows (K 20 at a 152K vocabulary, 2 to 16 splits), each costing its row a
    repair round (module doc, 4.)."""
    stride, rank = sample_stride(vocab, k), sample_rank(vocab, k)
    most = min(capacity(vocab, k), expected_survivors(vocab, k) + 6 * math.sqrt(rank) * stride)
    mu = most / (THREADS_A_ROW * splits)
    return math.ceil(mu + 4.5 * math.sqrt(mu))


@triton.jit
def _gather_kernel(
    reg_ptr,  # [n, REGIONS, CAPQ, CH] fp32: stage 1's chunks of z
    regcol_ptr,  # [n, REGIONS, CAPQ] int32: each chunk's first column
    regcnt_ptr,  # [n, REGIONS] int32: chunks each region counted (those past CAPQ were not written)
    thr_ptr,  # [n] int64: the row's stage 1 threshold key (low word 0)
    cnt_ptr,  # [n] int32 out: the row's survivors; -1 where a region overflowed
    buf_ptr,  # [n, CAP] int64 out: the survivors' keys (slots past them are left as they were)
    V,
    REGIONS,
    CAPQ,
    CAP,
    CH: tl.constexpr,  # values a chunk (``chunk_width``)
    RP: tl.constexpr,  # next_power_of_2(REGIONS)
    J: tl.constexpr,  # chunk slots of every region taken a step
):
    """One row: the keys >= its threshold among its regions' chunks, to its slots (as
    ``compact_survivors`` leaves them: the first CAP, counted all). A chunk's values are those of
    columns col0 + 8 (i // 2) + i % 2 (``_flag_piece``)."""
    row = tl.program_id(0).to(tl.int64)
    t_o = (tl.load(thr_ptr + row) >> 32).to(tl.int32)
    regions = tl.arange(0, RP)
    n = tl.load(regcnt_ptr + row * REGIONS + regions, mask=regions < REGIONS, other=0)
    overflow = tl.max(n, axis=0) > CAPQ
    most = tl.minimum(tl.max(n, axis=0), CAPQ)
    js = tl.arange(0, J)
    i = tl.arange(0, CH)
    offset = (i // 2) * 8 + i % 2
    at = buf_ptr + row * CAP
    count = tl.zeros([], tl.int32)
    for j0 in range(0, most, J):
        ok = (j0 + js)[None, :] < tl.minimum(n, CAPQ)[:, None]  # [RP, J]
        chunk = (row * REGIONS + regions)[:, None] * CAPQ + (j0 + js)[None, :]
        col0 = tl.load(regcol_ptr + chunk, mask=ok, other=0)
        z = tl.load(reg_ptr + chunk[:, :, None] * CH + i[None, None, :], mask=ok[:, :, None], other=0.0)
        cols = col0[:, :, None] + offset[None, None, :]
        o = ordered_bits(z)
        keep = tl.reshape((ok[:, :, None] & (o >= t_o) & (cols < V)).to(tl.int32), [RP * J * CH])
        pos = count + tl.cumsum(keep, axis=0) - 1
        keys = tl.reshape(keys_of(o, cols), [RP * J * CH])
        tl.store(at + pos, keys, mask=(keep != 0) & (pos < CAP))
        count += tl.sum(keep, axis=0)
    tl.store(cnt_ptr + row, tl.where(overflow, -1, count))


def gather_survivors(
    chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    thresholds: torch.Tensor,
    counts: torch.Tensor,
    slots: torch.Tensor,
    vocab: int,
) -> None:
    """Stage 1's kept chunks (``flag_chunks``: values [n, R, CAPQ, CH], first columns [n, R, CAPQ],
    counts [n, R]) to each row's ``counts`` and ``slots`` [n, CAP] (module doc, 2.)."""
    values, columns, per_region = chunks
    n, regions, capq, ch = values.shape
    if n:
        _gather_kernel[(n,)](
            values, columns, per_region, thresholds, counts, slots, vocab, regions, capq, slots.shape[1],
            CH=ch, RP=triton.next_power_of_2(regions), J=8, num_warps=4,
        )  # fmt: skip


def sample_thresholds(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    pre: float,
    post: float,
    softcap: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's [n] int64 threshold keys (from the R-th largest of the sample's group maxima, R the
    ``sample_rank``) and the fallbacks of the rows they miss (from its K-th largest: each below
    its row's K-th largest key in the kernel); module doc, 1.

    hidden [n, H] and weight [V, H] as the kernel gets them; bias fp32 or None; (pre, post,
    softcap): ``to_log2_units``' constants."""
    vocab = weight.shape[0]
    stride = sample_stride(vocab, k)
    sampled = weight[::stride]  # a strided view: no copy
    groups = sample_groups(sampled.shape[0], k)
    if groups <= SAMPLE_GROUPS and (hidden.shape[1] <= SAMPLE_KERNEL_MAX_H or not hidden.is_cuda):
        # One kernel takes the sample's dots and their group maxima: no [n, S] logits in memory.
        maxima = sample_maxima(hidden, weight, bias, stride, groups, pre, post, softcap)
        s = sample_ranks(maxima, sample_rank(vocab, k), k, pre, post, softcap, maxima=True).double()
    else:
        if not hidden.is_cuda:
            sampled = sampled.float()  # the CPU has no 16-bit matmul with an fp32 output
        x = _logits_fp32(hidden, sampled, bias[::stride] if bias is not None else None)  # [n, S] fp32
        # the R-th and K-th largest group maxima of z, transformed as the kernel does
        s = sample_ranks(x, sample_rank(vocab, k), k, pre, post, softcap).double()
    margin = threshold_margin(hidden, sampled, s.abs().amax(dim=1), pre, post, weight.dtype == torch.float32)
    ordered = ordered_words((s - margin[:, None]).float()).to(torch.int64) - 1  # one float down
    # Stage 1's at -FLT_MAX at least: no z = -inf passes it (the kernel's masked columns; a row with
    # fewer than K finite logits gets its fallback, which is not raised)
    ordered[:, 0].clamp_(min=ABOVE_NEG_INF)
    keys = ordered << 32  # low word 0: every id of a z >= t is above
    return keys[:, 0].contiguous(), keys[:, 1].contiguous()


# The sample's columns go in at least this many groups (and 2 K), whose maxima the thresholds come from.
SAMPLE_GROUPS = 256
# ``sample_maxima`` takes the sample up to this hidden size; above it, cuBLAS's fp32-output matmul
# and ``sample_ranks`` (H100, K 20, stride 32: at H 896 0.61 against 1.17 ms for 24,576 rows; at
# H 3,584 and 4,096 1.68 against 0.94 ms for 16,384 rows, and 1.34 against 0.64 for 10,923; the
# crossover between was not measured). The interpreter always takes the kernel: the tests run it.
SAMPLE_KERNEL_MAX_H = 2048


def sample_groups(width: int, k: int) -> int:
    """G, a power of 2: max(256, 2 K) rounded up, at most ``width`` rounded up (groups past the
    sample's width are empty)."""
    return min(triton.next_power_of_2(max(SAMPLE_GROUPS, 2 * k)), triton.next_power_of_2(width))


@triton.jit
def _sample_ranks_kernel(
    x_ptr,  # [n, S] fp32: the sample's logits x; with MAXIMA, [n, G] int32: its group maxima's ordered bits
    out_ptr,  # [n, 2] fp32 out: the R-th and K-th largest of the row's G group maxima of z
    S,
    R,
    K,
    pre,
    post,
    SOFTCAP: tl.constexpr,
    G: tl.constexpr,
    MAXIMA: tl.constexpr,
):
    """One row: z = ``to_log2_units`` of its logits (the kernel's own transform), the maxima of its G
    interleaved groups of columns (group g: g, g + G, g + 2 G, ...; a group past S is empty, below
    every value), then their R-th and K-th largest by bisection over
    ``ordered_bits`` (the floats' order): the largest t such that at least R maxima have bits >= t
    is the R-th largest's bits. The row is read once (coalesced, G columns a step); the 32 passes of
    the bisection are over G values in registers. With MAXIMA, the row is the maxima already
    (``_sample_maxima_kernel``)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, G)
    if MAXIMA:
        maxima = tl.load(x_ptr + row * G + offs)
    else:
        at = x_ptr + row * S
        maxima = tl.full([G], TAKEN, tl.int32)
        for c0 in range(0, S, G):
            inside = (c0 + offs) < S
            z = to_log2_units(tl.load(at + c0 + offs, mask=inside, other=0.0), pre, post, SOFTCAP)
            maxima = tl.maximum(maxima, tl.where(inside, ordered_bits(z), TAKEN))
    lo_r = tl.full([], -(2**31), tl.int64)  # every value's bits are >= the smallest int32
    hi_r = tl.full([], 2**31 - 1, tl.int64)
    lo_k, hi_k = lo_r, hi_r
    for _ in range(32):
        mid_r = (lo_r + hi_r + 1) >> 1  # int64: no overflow
        mid_k = (lo_k + hi_k + 1) >> 1
        n_r = tl.sum((maxima >= mid_r.to(tl.int32)).to(tl.int32), axis=0)
        n_k = tl.sum((maxima >= mid_k.to(tl.int32)).to(tl.int32), axis=0)
        lo_r, hi_r = tl.where(n_r >= R, mid_r, lo_r), tl.where(n_r >= R, hi_r, mid_r - 1)
        lo_k, hi_k = tl.where(n_k >= K, mid_k, lo_k), tl.where(n_k >= K, hi_k, mid_k - 1)
    # ordered_bits is its own inverse
    tl.store(out_ptr + row * 2, ordered_bits(lo_r.to(tl.int32)).to(tl.float32, bitcast=True))
    tl.store(out_ptr + row * 2 + 1, ordered_bits(lo_k.to(tl.int32)).to(tl.float32, bitcast=True))


def sample_ranks(
    x: torch.Tensor, r: int, k: int, pre: float, post: float, softcap: bool, *, maxima: bool = False
) -> torch.Tensor:
    """[n, 2] float32: the ``r``-th and ``k``-th largest (r <= k <= S) of the ``sample_groups`` group
    maxima of each row's z, ``to_log2_units`` of ``x`` [n, S] float32 logits (``_sample_ranks_kernel``):
    module doc, 1. With ``maxima``, ``x`` is [n, G] int32, the maxima's ``ordered_bits``
    (``sample_maxima``)."""
    n, width = x.shape
    out = torch.empty((n, 2), dtype=torch.float32, device=x.device)
    if n:
        groups = width if maxima else sample_groups(width, k)
        _sample_ranks_kernel[(n,)](
            x.contiguous(), out, width, r, k, pre, post, SOFTCAP=softcap, G=groups, MAXIMA=maxima, num_warps=1
        )
    return out


@triton.jit
def _sample_maxima_kernel(
    h_in,  # [n, H]: a TMA descriptor with [BLOCK_M, BLOCK_K] blocks when USE_TMA, else the tensor
    w_in,  # the sample's [S, H] rows of W (every stride-th): a TMA descriptor with [G, BLOCK_K] blocks, or W
    b_ptr,  # [V] fp32, or a dummy when HAS_BIAS is false
    out_ptr,  # [n, G] int32 out: each group's largest z, as ``ordered_bits``
    N,
    S,
    H,
    stride_h,
    stride_w,  # W's row stride
    stride,  # the sample's: column c of the sample is token c stride
    pre,
    post,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """BLOCK_M rows: the sample's logits a tile of G columns at a time (a K-loop of tensor-core dots,
    as the partials kernel's), transformed to z, and the elementwise max over the tiles: column c
    goes to group c mod G, the interleaved groups ``sample_ranks`` takes the maxima of."""
    row0 = tl.program_id(0) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    maxima = tl.full([BLOCK_M, G], TAKEN, tl.int32)
    for c0 in range(0, S, G):
        acc = tile_logits(
            h_in, w_in, row0, rows, row_ok, c0, S, stride, H, stride_h, stride_w,
            BLOCK_N=BLOCK_M, BLOCK_V=G, BLOCK_K=BLOCK_K, IEEE=IEEE, USE_TMA=USE_TMA,
        )  # fmt: skip
        cols = c0 + tl.arange(0, G)
        col_ok = cols < S
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols.to(tl.int64) * stride, mask=col_ok, other=0.0)[None, :]
        z = to_log2_units(acc, pre, post, SOFTCAP)
        maxima = tl.maximum(maxima, tl.where(col_ok[None, :], ordered_bits(z), TAKEN))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * G + tl.arange(0, G)[None, :], maxima, mask=row_ok[:, None])


def sample_maxima(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: int,
    groups: int,
    pre: float,
    post: float,
    softcap: bool,
) -> torch.Tensor:
    """[n, G] int32: the ``ordered_bits`` of the largest z of each of the G interleaved groups of the
    sample's columns (token ids 0, stride, 2 stride, ...), by ``_sample_maxima_kernel``; hidden [n, H]
    and weight [V, H] as the partials kernel gets them, bias fp32 or None."""
    n, hdim = hidden.shape
    width = triton.cdiv(weight.shape[0], stride)
    out = torch.empty((n, groups), dtype=torch.int32, device=hidden.device)
    if not n:
        return out
    fp32 = weight.dtype == torch.float32
    block_m, block_k = 64, 32 if fp32 else 64
    row_bytes = hdim * weight.element_size()
    use_tma = row_bytes % 16 == 0 and hidden.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
    h_in, w_in = hidden, weight
    if use_tma:
        h_in = TensorDescriptor.from_tensor(hidden, [block_m, block_k])
        w_in = TensorDescriptor(weight, [width, hdim], [stride * weight.stride(0), 1], [groups, block_k])
    _sample_maxima_kernel[(triton.cdiv(n, block_m),)](
        h_in, w_in, bias if bias is not None else out, out, n, width, hdim, hidden.stride(0), weight.stride(0),
        stride, pre, post, HAS_BIAS=bias is not None, SOFTCAP=softcap, IEEE=fp32, USE_TMA=use_tma,
        BLOCK_M=block_m, G=groups, BLOCK_K=block_k, num_warps=8, num_stages=3,
    )  # fmt: skip
    return out


def threshold_margin(
    hidden: torch.Tensor, sampled: torch.Tensor, s: torch.Tensor, pre: float, post: float, fp32: bool
) -> torch.Tensor:
    """[n] float64: how far the kernel's z of a sampled column may lie below torch's (module doc):
    H 2^-22 ||h|| max ||W_c|| bounds the two dots' difference (2^-9 more for TF32 with fp32
    operands), times |pre post|; plus 2^-16 (|z| + |post|) for the transform's own roundings."""
    eps = hidden.shape[1] * 2.0**-22 + (2.0**-9 if fp32 else 0.0)
    h_norm = torch.linalg.vector_norm(hidden, dim=1, dtype=torch.float32).double()
    w_norm = torch.linalg.vector_norm(sampled, dim=1, dtype=torch.float32).max().double()
    # (1 + 2^-8): the norms' own fp32 rounding
    return eps * abs(pre * post) * h_norm * w_norm * (1 + 2.0**-8) + 2.0**-16 * (s.abs() + abs(post))


# Repair rounds after stage 1, each run whether or not a row needs it (module doc, 4.): enough for
# a missed sample or an overflow of stage 1 with three to spare, and for a failed margin; a row
# still in need after them sets ``top_k_incomplete``. Each costs two near-empty launches when no
# row needs it.
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
    """``REPAIR_ROUNDS`` repair rounds (module doc, 4.), queued on the device without waiting for
    it: ``relaunch(need)`` runs stage 1 with REPAIR for the rows whose [n] int8 ``need`` is set,
    with ``thresholds`` [n] int64, ``counts`` [n] int32 and ``slots`` [n, CAP] int64 (updated in
    place); ``fallbacks`` [n] int64 (``sample_thresholds``). Returns a 0-dim bool tensor: whether
    some row still needs repair (its slots may not hold its top-k)."""
    n, cap = slots.shape
    need = torch.empty(n, dtype=torch.int8, device=slots.device)
    for _ in range(REPAIR_ROUNDS):
        _repair_kernel[(n,)](counts, slots, thresholds, fallbacks, need, cap, k, BLOCK=1024, num_warps=4)
        relaunch(need)
    return rows_in_need(counts, cap, k).any()


# Stage 2 in ``_select_kernel`` (one warp a row, its slots in registers) up to this K and this many
# slots a row; beyond, torch.topk, which measured faster there (8,192 rows of 152K-vocabulary slots on
# an H100, before the kernel read only the filled slots: K 8 0.10 against 0.65 ms, K 20 0.25 against
# 0.66, K 64 0.76 against 0.86, K 100 1.19 against 0.88; the kernel's time grows as K x slots read,
# torch.topk's little with K).
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
