"""Stage 1 of the top-k: inside the fused pass's partials kernel, right after a tile's z is computed,
each row's elements whose key is at or above its threshold key survive, kept one of two ways.

* As chunks (``flag_chunks``; up to K 64, and at any K up to H 2,048: ``plans.uses_chunks``): a
  thread's values of an eighth of the tile for a row, written whole to that (row, split, thread)'s
  region when one of them reaches the threshold. The counter lives in the thread's registers (no
  atomic, no rounds), and the stores are inline PTX in the accumulator's own layout. After the
  kernel, ``gather_survivors`` turns each row's chunks into keys in its slots.
* As keys (``compact_survivors``; otherwise, and in the repair rounds): each row reserves slots
  with one atomic add, and a tile's survivors go in, largest first, over four parts of the tile.

Either way a row's slots hold the first CAP keys at or above its threshold, counted all. Why, and
the layouts: docs/how-it-works.md, "Stage 1: the survivors".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logprob_service.ops.lm_head.keys import TAKEN, keys_of, ordered_bits
from logprob_service.ops.lm_head.tiles import split_columns


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
    threshold key to the row's slots (how-it-works, "Stage 1: the survivors"). The tile is compared
    as int32 ``ordered_bits`` and ids (the key order without an int64 tile in registers). Then its columns
    go in four parts (``split_columns``: even and odd, each split again on bit 3 of the column),
    and each part's survivors are taken largest first, one max over the part each, as many rounds
    as the part's fullest row has: rows have about a quarter of a tile's survivors in a part, so
    the rounds, which dominate the compaction's time, cover fewer columns in all (about 1.5 rounds
    of a quarter against 2.8 of the whole tile for K 20 at a 152K vocabulary).
    Without ``ANY_LOW_WORD`` (stage 1) a threshold's low word is 0, so a key is >= it exactly when
    its high word is >= the threshold's, whatever its id: the ids are not compared; and the
    threshold is above -inf (``threshold.sample_thresholds``), so the masked columns (z = -inf)
    never pass."""
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
    """Stage 1's compaction by chunks: a [R, V] tile of z (columns v0 + [0, V)) in eight
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
    CH: tl.constexpr,  # values a chunk (``plans.chunk_width``)
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
    counts [n, R]) to each row's ``counts`` and ``slots`` [n, CAP]."""
    values, columns, per_region = chunks
    n, regions, capq, ch = values.shape
    if n:
        _gather_kernel[(n,)](
            values, columns, per_region, thresholds, counts, slots, vocab, regions, capq, slots.shape[1],
            CH=ch, RP=triton.next_power_of_2(regions), J=8, num_warps=4,
        )  # fmt: skip
