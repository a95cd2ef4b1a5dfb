"""The fused lm_head pass: log-probs, entropies and ranks of the targets, and the top-k and the
candidates through the stages of this package, without an [N, V] logits tensor.

``fused_token_logprobs`` is the op (``ops.dispatch`` calls it on CUDA). Two kernels:

* ``_partials_kernel``, a 1-D grid over (row block, vocabulary split): each program streams its
  split's [BLOCK_N, BLOCK_V] tiles of the vocabulary (``tiles.tile_logits``: tensor-core dots
  into fp32 registers), transforms them to base-2 units z (``tiles.to_log2_units``) and keeps an
  online max, sum of 2^z and, for the entropy, sum of 2^z z: three floats a row a split. With a
  top-k it also keeps each row's survivors of the threshold (``survivors``); with ranks it counts
  the ids whose z is at least the target's.
* ``_combine_kernel``, one program a row block: merges the splits, adds the target's logit (one
  fp32 dot a row, ``_target_z``) and writes log p, the entropy and the log-sum-exp.

A top-k then runs its repair rounds and its selection (``repair``, ``selection``), all queued on
the device without a host read; candidates are one dot each after the combine (``candidates``).
The grid, tiles and row chunks come from ``plans``. The maths, the bounds and why each threshold
is safe: docs/how-it-works.md, "The lm_head kernels, stage by stage".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from logprob_service.domain import DEFAULT_OPTIONS, ScoreOptions
from logprob_service.ops.lm_head.candidates import candidate_logprobs
from logprob_service.ops.lm_head.keys import MIN_KEY, ordered_bits
from logprob_service.ops.lm_head.plans import (
    THREADS_A_ROW,
    KernelConfig,
    LaunchPlan,
    capacity,
    chunk_width,
    default_config,
    device_info,
    expected_survivors,
    invariant_plan,
    plan_launch,
    region_slots,
    topk_chunk_rows,
    uses_chunks,
)
from logprob_service.ops.lm_head.repair import repair_survivors
from logprob_service.ops.lm_head.selection import select_top_k
from logprob_service.ops.lm_head.survivors import compact_survivors, flag_chunks, gather_survivors
from logprob_service.ops.lm_head.threshold import sample_thresholds
from logprob_service.ops.lm_head.tiles import tile_logits, to_log2_units, transform_constants
from logprob_service.ops.logprobs import IDENTITY, LogitTransform, TokenScores, check_topk_arguments

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The batch's own sizes are not specialized on (Triton otherwise compiles a variant for each
# combination of them that is 1 or a multiple of 16): each variant of the top-k kernel costs seconds
# of compilation, which a server meets mid-traffic as its micro-batches' sizes vary.
BATCH_SIZES = ["N", "n_splits", "group_rows"]


@triton.jit(do_not_specialize=BATCH_SIZES)
def _partials_kernel(
    h_in,  # [N, H]: a TMA descriptor with [BLOCK_N, BLOCK_K] blocks when USE_TMA, else the tensor
    w_in,  # [V, H]: a TMA descriptor with [BLOCK_V, BLOCK_K] blocks when USE_TMA, else the tensor
    b_ptr,  # [V] fp32, or a dummy when HAS_BIAS is false
    m_ptr,  # [S, N] fp32 out: max of z over the split
    s_ptr,  # [S, N] fp32 out: sum 2^(z - m)
    t_ptr,  # [S, N] fp32 out: sum 2^(z - m) z (only when ENTROPY)
    thr_ptr,  # [N] int64: each row's threshold key (only when TOPK; threshold.sample_thresholds)
    cnt_ptr,  # [N] int32 in/out: each row's survivors so far (only when TOPK)
    buf_ptr,  # [N, CAP] int64 out: the survivors' keys, in any order (only when TOPK)
    reg_ptr,  # [N, S, 4, CAPQ, CHUNK] fp32 out: stage 1's chunks (only when TOPK and not REPAIR)
    regcol_ptr,  # [N, S, 4, CAPQ] int32 out: each chunk's first column
    regcnt_ptr,  # [N, S, 4] int32 out: chunks per region (past CAPQ: counted, not written)
    need_ptr,  # [N] int8: the rows that need this repair round (only when REPAIR; repair_survivors)
    y_ptr,  # [N] int64: the targets (only when RANK)
    zy_ptr,  # [N] fp32: the targets' z, as the combine computes it (only when RANK; _targets_kernel)
    above_ptr,  # [S, N] int32 out: the split's other ids with z at least the target's (only when RANK)
    N,
    V,
    H,
    stride_h,
    stride_w,
    n_splits,
    group_rows,  # row blocks per group: their hidden states stay in L2 while the group runs
    pre,
    post,
    CAP,  # slots per row of buf_ptr
    CAPQ,  # chunk slots per region
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 operands: exact fp32 dot, not TF32
    USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TOPK: tl.constexpr,  # also keep the keys at or above each row's threshold (survivors)
    REPAIR: tl.constexpr,  # a repair round (TOPK): only the keys of the rows in need; no partials
    CHUNKS: tl.constexpr,  # stage 1 (TOPK, not REPAIR) keeps chunks in regions, not keys (flag_chunks)
    CHUNK: tl.constexpr,  # values in a chunk (plans.chunk_width)
    PTX: tl.constexpr,  # compiled for the GPU (inline PTX allowed), not interpreted
    RANK: tl.constexpr,  # also count, per row, the other ids whose z is at least the target's
):
    # Program order: a group of `group_rows` row blocks x every split. Programs that run at the
    # same time then share a few W tiles and a few row blocks, both of which fit in L2, instead
    # of all reading different hidden states (which would stream from HBM once per W tile).
    pid = tl.program_id(0)
    row_blocks = tl.cdiv(N, BLOCK_N)
    group = pid // (group_rows * n_splits)
    first = group * group_rows
    rows_here = tl.minimum(row_blocks - first, group_rows)
    local = pid % (group_rows * n_splits)
    pid_n = first + local % rows_here
    pid_s = local // rows_here

    row0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    # The split's tiles: every n_splits-th from its own on. Interleaved, each split sees all of the
    # vocabulary's ranges, so a row's largest logits (the top-k's survivors) spread over the splits
    # evenly even where they gather in a range of ids (frequent tokens have small ids).
    n_tiles = tl.cdiv(tl.cdiv(V, BLOCK_V) - pid_s, n_splits)
    compact_ok = row_ok
    if REPAIR:  # only the rows in need get keys; a program with none of them runs no tile
        compact_ok = row_ok & (tl.load(need_ptr + rows, mask=row_ok, other=0) != 0)
        n_tiles = tl.where(tl.max(compact_ok.to(tl.int32), axis=0) > 0, n_tiles, 0)

    if CHUNKS:  # stage 1's chunks go to the regions of (row, this split, thread)
        t_o = (tl.load(thr_ptr + rows, mask=row_ok, other=0x7FFFFFFFFFFFFFFF) >> 32).to(tl.int32)
        t_z = ordered_bits(t_o).to(tl.float32, bitcast=True)  # a NaN (nothing passes) past the last row
        region = (rows.to(tl.int64)[:, None] * n_splits + pid_s) * 4 + tl.arange(0, 4)[None, :]
        vals_at = reg_ptr + region * (CAPQ * CHUNK)
        cols_at = regcol_ptr + region * CAPQ
        cnt_q = tl.zeros([BLOCK_N, 4], tl.int32)
    if RANK:
        y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
        zy = tl.load(zy_ptr + rows, mask=row_ok, other=float("inf"))
        above = tl.zeros([BLOCK_N], tl.int32)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    # Two nested loops (tiles, then k). Flattening them into one (tile, k) loop, so the pipeline
    # would prefetch across the softmax update, measured slower on an H200 (benchmarks/RESULTS.md).
    for tile in range(0, n_tiles):
        v0 = (tile * n_splits + pid_s) * BLOCK_V
        acc = tile_logits(
            h_in, w_in, row0, rows, row_ok, v0, V, 1, H, stride_h, stride_w,
            BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_K=BLOCK_K, IEEE=IEEE, USE_TMA=USE_TMA,
        )  # fmt: skip
        # The tile's logits are complete, in fp32 registers: online softmax update.
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0)[None, :]
        z = to_log2_units(acc, pre, post, SOFTCAP)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        if not REPAIR:  # a repair round's partials are stage 1's: not computed again
            m_new = tl.maximum(m, tl.max(z, axis=1))
            # a row all -inf so far (a -inf bias masks tokens): no -inf - -inf, its s and t stay 0
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_ref)
            p = tl.exp2(z - m_ref[:, None])  # 0 at masked columns and at z = -inf
            s = s * alpha + tl.sum(p, axis=1)
            if ENTROPY:
                t = t * alpha + tl.sum(tl.where(p > 0, p * z, 0.0), axis=1)  # no 0 * -inf
            m = m_new
            if RANK:  # vLLM's rank less the target itself: >=, ties counted
                other = col_ok[None, :] & (cols[None, :] != y[:, None])
                above += tl.sum((other & (z >= zy[:, None])).to(tl.int32), axis=1)
        if CHUNKS:
            cnt_q = flag_chunks(z, t_z, v0, cnt_q, vals_at, cols_at, row_ok, CAPQ, ASM=PTX)
        elif TOPK:
            compact_survivors(z, cols, col_ok, rows, compact_ok, thr_ptr, cnt_ptr, buf_ptr, CAP, ANY_LOW_WORD=REPAIR)

    if CHUNKS:
        tl.store(regcnt_ptr + region, cnt_q, mask=row_ok[:, None])
    if not REPAIR:
        out = pid_s.to(tl.int64) * N + rows
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(s_ptr + out, s, mask=row_ok)
        if ENTROPY:
            tl.store(t_ptr + out, t, mask=row_ok)
        if RANK:
            tl.store(above_ptr + out, above, mask=row_ok)


@triton.jit
def _target_z(h_ptr, w_ptr, b_ptr, y, rows, row_ok, H, stride_h, stride_w, pre, post,
              HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The targets' z: x_y = h . W_y as one fp32 dot from the same operands the tiles' dots use
    (a gathered row; N*H work, not N*V*H), transformed."""
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + y.to(tl.int64)[:, None] * stride_w
    ks = tl.arange(0, BLOCK_K)
    x_y = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mask = row_ok[:, None] & ((k0 + ks) < H)[None, :]
        a = tl.load(h_rows + (k0 + ks)[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(w_rows + (k0 + ks)[None, :], mask=mask, other=0.0).to(tl.float32)
        x_y += tl.sum(a * b, axis=1)
    if HAS_BIAS:
        x_y += tl.load(b_ptr + y, mask=row_ok, other=0.0)
    return to_log2_units(x_y, pre, post, SOFTCAP)


@triton.jit(do_not_specialize=["N"])
def _targets_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, zy_ptr, N, H, stride_h, stride_w, pre, post,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The targets' z before stage 1, which counts the ids at or above it (``return_ranks``): the
    combine's own ``_target_z``, launched alike, so the same bits as the log-prob's."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    y = tl.load(y_ptr + rows, mask=row_ok, other=0)
    z_y = _target_z(
        h_ptr, w_ptr, b_ptr, y, rows, row_ok, H, stride_h, stride_w, pre, post, HAS_BIAS, SOFTCAP, BLOCK_R, BLOCK_K
    )
    tl.store(zy_ptr + rows, z_y, mask=row_ok)


@triton.jit(do_not_specialize=["N", "n_splits"])
def _combine_kernel(
    h_ptr,  # [N, H]
    w_ptr,  # [V, H]
    b_ptr,  # [V] fp32 or dummy
    y_ptr,  # [N] int64 targets
    m_ptr,  # [S, N]
    s_ptr,
    t_ptr,
    logp_ptr,  # [N] fp32 out
    ent_ptr,  # [N] fp32 out (only when ENTROPY)
    lse_ptr,  # [N] fp32 out (only when LSE)
    lse2_ptr,  # [N] fp32 out: the log-sum-exp in log2 units, for the top-k (only when LSE2)
    N,
    H,
    stride_h,
    stride_w,
    n_splits,
    pre,
    post,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    LSE: tl.constexpr,
    LSE2: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N

    # Partials of split j for these rows sit at offset j * N + rows (pointer steps: 64-bit).
    big_m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    m_at = m_ptr + rows
    for _ in range(n_splits):
        big_m = tl.maximum(big_m, tl.load(m_at, mask=row_ok, other=0.0))
        m_at += N
    big_s = tl.zeros([BLOCK_R], tl.float32)
    big_t = tl.zeros([BLOCK_R], tl.float32)
    m_at, s_at, t_at = m_ptr + rows, s_ptr + rows, t_ptr + rows
    for _ in range(n_splits):
        scale = tl.exp2(tl.load(m_at, mask=row_ok, other=0.0) - big_m)
        big_s += scale * tl.load(s_at, mask=row_ok, other=1.0)
        if ENTROPY:
            big_t += scale * tl.load(t_at, mask=row_ok, other=0.0)
        m_at += N
        s_at += N
        t_at += N
    lse2 = big_m + tl.log2(big_s)

    y = tl.load(y_ptr + rows, mask=row_ok, other=0)
    z_y = _target_z(
        h_ptr, w_ptr, b_ptr, y, rows, row_ok, H, stride_h, stride_w, pre, post, HAS_BIAS, SOFTCAP, BLOCK_R, BLOCK_K
    )

    tl.store(logp_ptr + rows, (z_y - lse2) * 0.6931471805599453, mask=row_ok)
    if ENTROPY:
        tl.store(ent_ptr + rows, (lse2 - big_t / big_s) * 0.6931471805599453, mask=row_ok)
    if LSE:
        tl.store(lse_ptr + rows, lse2 * 0.6931471805599453, mask=row_ok)
    if LSE2:
        tl.store(lse2_ptr + rows, lse2, mask=row_ok)


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    options: ScoreOptions = DEFAULT_OPTIONS,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
    return_lse: bool = False,
    candidates: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    plan: LaunchPlan | None = None,
    invariant: bool = False,
) -> TokenScores:
    """Log-prob of ``targets`` under ``hidden @ weight.T`` with the fused kernels; see the module doc.

    hidden: [N, H] and weight: [V, H], both bf16, fp16 or fp32 (hidden is cast to weight's dtype);
    targets: [N] integer in [0, V); bias: [V] or None; ``transform``: temperature included
    (``options.temperature`` is not read here). Returns float32 [N] log-probs (and entropies, with
    ``options.return_entropy``, and each row's log-sum-exp of its transformed logits, with
    ``return_lse``). ``options.top_k``: each row's K most likely ids ([N, K] int32, descending, ties
    by id) and their log-probs ([N, K] float32), by the package's stages; ``candidates``: [N, Kc]
    ids whose log-probs to return ([N, Kc] float32); ``options.return_ranks``: each target's rank
    ([N] int32, ``TokenScores.ranks``), counted in stage 1 against the target's z from a pass before
    it (``_targets_kernel``). ``invariant``: each row's result bit for bit the same whatever the
    other rows (``invariant_plan``). ``config`` and ``plan`` override the tiles and the grid (tests
    use them to exercise several tiles, groups and splits at small shapes).
    """
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fused log-probs support {SUPPORTED_DTYPES} weights, not {weight.dtype}")
    if not weight.is_cuda and weight.dtype == torch.bfloat16:
        # Triton's CPU interpreter runs dots in numpy, which has no bfloat16: the results are wrong.
        raise NotImplementedError("the fused kernel on the CPU (Triton's interpreter) supports float16 and float32")
    return_entropy, top_k, return_ranks = options.return_entropy, options.top_k, options.return_ranks
    n, hdim = hidden.shape
    vocab = weight.shape[0]
    check_topk_arguments(n, vocab, top_k, candidates)
    config = config or default_config(weight.dtype)
    planner = invariant_plan if invariant else plan_launch

    def grid(rows: torch.Tensor) -> tuple[LaunchPlan, int]:
        """The plan of the partials kernel over ``rows`` and its vocabulary splits (none left empty)."""
        launch = plan or planner(rows.shape[0], hdim, vocab, weight.element_size(), config, device_info(rows.device))
        return launch, min(launch.splits, triton.cdiv(vocab, config.block_v))

    kw = {
        "bias": bias,
        "transform": transform,
        "return_entropy": return_entropy,
        "return_lse": return_lse,
        "return_ranks": return_ranks,
    }
    if top_k:
        # Row chunks (a row's results do not depend on its chunk): memory O(chunk x K), not O(N x K).
        # A chunk's splits follow its rows, and its rows its regions, which the splits size.
        step = n
        for _ in range(2):
            step = min(
                n,
                topk_chunk_rows(
                    vocab, top_k, grid(hidden[:step])[1], chunk_width(config.block_v), uses_chunks(top_k, hdim)
                ),
            )
        if step < n:
            step = triton.cdiv(n, triton.cdiv(n, step))  # equal chunks
            parts = [
                _fused_scores(
                    hidden[a : a + step],
                    weight,
                    targets[a : a + step],
                    top_k=top_k,
                    candidates=candidates[a : a + step] if candidates is not None else None,
                    config=config,
                    grid=grid,
                    **kw,
                )
                for a in range(0, n, step)
            ]
            columns = {f.name: [getattr(part, f.name) for part in parts] for f in dataclasses.fields(TokenScores)}
            incomplete = columns.pop("top_k_incomplete")  # 0-dim flags: any chunk's
            return TokenScores(
                **{name: None if col[0] is None else torch.cat(col) for name, col in columns.items()},
                top_k_incomplete=torch.stack(incomplete).any(),
            )
    return _fused_scores(hidden, weight, targets, top_k=top_k, candidates=candidates, config=config, grid=grid, **kw)


def _fused_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    return_entropy: bool,
    return_lse: bool,
    return_ranks: bool,
    top_k: int,
    candidates: torch.Tensor | None,
    config: KernelConfig,
    grid: Callable[[torch.Tensor], tuple[LaunchPlan, int]],
) -> TokenScores:
    """``fused_token_logprobs`` of one launch (no row chunks); ``grid(rows)``: the partials kernel's
    plan over ``rows`` and its vocabulary splits."""
    n, hdim = hidden.shape
    vocab = weight.shape[0]
    hidden = hidden.to(weight.dtype).contiguous()
    weight = weight.contiguous()
    targets = targets.to(torch.int64).contiguous()
    logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
    entropies = torch.empty_like(logprobs) if return_entropy else None
    # The candidates' log-probs subtract the row's log-sum-exp: asked for internally.
    lses = torch.empty_like(logprobs) if return_lse or candidates is not None else None
    lse2 = torch.empty_like(logprobs) if top_k else None  # the top-k's, in log2 units
    cand_lps = None
    if candidates is not None:
        candidates = candidates.to(device=hidden.device, dtype=torch.int64).contiguous()
        cand_lps = torch.empty(candidates.shape, dtype=torch.float32, device=hidden.device)
    ranks = torch.empty(n, dtype=torch.int32, device=hidden.device) if return_ranks else None
    if n == 0:
        top_ids = torch.empty((0, top_k), dtype=torch.int32, device=hidden.device) if top_k else None
        top_lps = torch.empty((0, top_k), dtype=torch.float32, device=hidden.device) if top_k else None
        return TokenScores(logprobs, entropies, lses if return_lse else None, top_ids, top_lps, cand_lps, ranks=ranks)
    bias32 = bias.float().contiguous() if bias is not None else None
    pre, post = transform_constants(transform)
    flags = {"HAS_BIAS": bias is not None, "SOFTCAP": transform.softcap is not None, "ENTROPY": return_entropy}
    block_r, block_k = 32, min(128, triton.next_power_of_2(hdim))  # the combine's, and the targets'
    target_z = None
    if return_ranks:
        target_z = torch.empty(n, dtype=torch.float32, device=hidden.device)
        _targets_kernel[(triton.cdiv(n, block_r),)](
            hidden, weight, bias32 if bias32 is not None else logprobs, targets, target_z,
            n, hdim, hidden.stride(0), weight.stride(0), pre, post,
            HAS_BIAS=bias is not None, SOFTCAP=transform.softcap is not None, BLOCK_R=block_r, BLOCK_K=block_k,
            num_warps=4,
        )  # fmt: skip

    def partials(
        rows: torch.Tensor,
        survivors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        need: torch.Tensor | None = None,
        chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ):
        """Stage 1 over ``rows`` ([r, H]); with ``survivors`` (thresholds, counters, slots), their
        top-k survivors too, as keys in the slots or, given stage 1's ``chunks`` (values, columns,
        counts of ``flag_chunks``' regions), as chunks. Returns the [splits, r] partials (m, s, t).
        With ``need`` ([r] int8), a repair round (``repair``): the survivors of the rows in
        need only, as keys, and no partials. With ``return_ranks`` (not in a repair round), also the
        [splits, r] counts of other ids at or above each target, else None."""
        r = rows.shape[0]
        launch, splits = grid(rows)
        if need is None:
            partial_m = torch.empty((splits, r), dtype=torch.float32, device=rows.device)
            partial_s = torch.empty_like(partial_m)
            partial_t = torch.empty_like(partial_m) if return_entropy else partial_m
        else:  # not written: dummy pointers
            partial_m = partial_s = partial_t = rows
        counting = target_z is not None and need is None
        above = torch.empty((splits, r), dtype=torch.int32, device=rows.device) if counting else None
        thr, cnt, buf = survivors or (partial_m, partial_m, partial_m)  # dummy pointers without top-k
        values, columns, per_region = chunks or (partial_m, partial_m, partial_m)
        # TMA needs 16-byte aligned rows (H a multiple of 8 in 16 bits); every real model has them.
        use_tma = (hdim * weight.element_size()) % 16 == 0 and rows.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
        h_in, w_in = rows, weight
        if use_tma:
            h_in = TensorDescriptor.from_tensor(rows, [config.block_n, config.block_k])
            w_in = TensorDescriptor.from_tensor(weight, [config.block_v, config.block_k])
        row_blocks = triton.cdiv(r, config.block_n)
        _partials_kernel[(row_blocks * splits,)](
            h_in, w_in, bias32 if bias32 is not None else partial_m, partial_m, partial_s, partial_t, thr, cnt, buf,
            values, columns, per_region, need if need is not None else thr,
            targets if counting else thr, target_z if counting else thr, above if above is not None else thr,
            r, vocab, hdim, rows.stride(0),
            weight.stride(0), splits, min(launch.group_rows, row_blocks), pre, post,
            buf.shape[1] if survivors else 0, values.shape[2] if chunks else 0,
            IEEE=weight.dtype == torch.float32, USE_TMA=use_tma,
            BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_K=config.block_k, TOPK=survivors is not None,
            REPAIR=need is not None, CHUNKS=chunks is not None, CHUNK=chunk_width(config.block_v), PTX=rows.is_cuda,
            RANK=counting, num_warps=config.num_warps, num_stages=config.num_stages, **flags,
        )  # fmt: skip
        return partial_m, partial_s, partial_t, above

    found = fallbacks = None  # the top-k survivors' (thresholds, counters, slots); sample_thresholds' fallbacks
    chunks = None  # stage 1's regions (``flag_chunks``): chunks of z, their first columns, counts
    if top_k:
        softcap = transform.softcap is not None
        thresholds, fallbacks = sample_thresholds(hidden, weight, bias32, top_k, pre, post, softcap)
        found = (
            thresholds,
            torch.zeros(n, dtype=torch.int32, device=hidden.device),
            torch.full((n, capacity(vocab, top_k)), MIN_KEY, dtype=torch.int64, device=hidden.device),
        )
        if uses_chunks(top_k, hdim):
            splits = grid(hidden)[1]
            regions, capq = THREADS_A_ROW * splits, region_slots(vocab, top_k, splits)
            chunks = (
                torch.empty((n, regions, capq, chunk_width(config.block_v)), dtype=torch.float32, device=hidden.device),
                torch.empty((n, regions, capq), dtype=torch.int32, device=hidden.device),
                torch.empty((n, regions), dtype=torch.int32, device=hidden.device),
            )
    partial_m, partial_s, partial_t, above = partials(hidden, found, chunks=chunks)
    if ranks is not None and above is not None:
        torch.add(above.sum(dim=0, dtype=torch.int32), 1, out=ranks)  # and the target itself
    _combine_kernel[(triton.cdiv(n, block_r),)](
        hidden, weight, bias32 if bias32 is not None else partial_m, targets, partial_m, partial_s, partial_t,
        logprobs, entropies if entropies is not None else logprobs, lses if lses is not None else logprobs,
        lse2 if lse2 is not None else logprobs,
        n, hdim, hidden.stride(0), weight.stride(0), partial_m.shape[0], pre, post,
        LSE=lses is not None, LSE2=lse2 is not None, BLOCK_R=block_r, BLOCK_K=block_k,
        num_warps=4, **flags,
    )  # fmt: skip
    top_ids = top_lps = incomplete = None
    if found is not None and fallbacks is not None:
        thresholds, counts, slots = found
        if chunks is not None:
            gather_survivors(chunks, thresholds, counts, slots, vocab)
        # Rows with more than CAP survivors run again with a higher threshold, rows with fewer than
        # K with a lower one, in a fixed number of rounds queued on the device (``repair``): nothing
        # here waits for the GPU, so the caller can queue its next work while the lm_head runs.
        # A row still in need after them sets ``incomplete``, which the caller checks with the results.
        incomplete = repair_survivors(
            lambda need: partials(hidden, found, need), thresholds, fallbacks, counts, slots, top_k
        )
        top_ids, top_lps = select_top_k(slots, counts, lse2, top_k, expected_survivors(vocab, top_k))
    scores = TokenScores(
        logprobs, entropies, lses if return_lse else None, top_ids, top_lps, cand_lps, incomplete, ranks=ranks
    )
    if candidates is not None:
        candidate_logprobs(hidden, weight, bias32, candidates, lses, cand_lps, pre, post, transform.softcap is not None)
    return scores
