"""Plans: the shape of each launch, fixed on the host from the problem's sizes before any kernel runs.

* The plain pass: ``KernelConfig`` (tiles, warps, stages; ``default_config`` by dtype) and
  ``LaunchPlan`` (vocabulary splits, programs grouped so their hidden states stay in L2:
  ``plan_launch``; ``invariant_plan`` for batch-invariant results).
* The top-k: the threshold's sample (``sample_stride``, ``sample_rank``), the survivors' slots a row
  (``capacity``), whether stage 1 keeps chunks (``uses_chunks``) and its regions' slots
  (``region_slots``, ``chunk_width``), and the row chunks a top-k runs in (``topk_chunk_rows``).

Why each size is enough, and what a miss costs: docs/how-it-works.md, "The
plain pass" and "Sizes: slots, regions, row chunks".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch shape of the partials kernel."""

    block_n: int = 128
    block_v: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


# Hand-picked on an H200 with benchmarks/bench_logprobs.py --sweep (the table is in
# benchmarks/RESULTS.md): best or within 2% at every measured shape. fp32 operands take twice
# the shared memory per element, hence narrower tiles (checked for correctness, not tuned).
HOPPER_16BIT = KernelConfig()
HOPPER_FP32 = KernelConfig(block_n=128, block_v=128, block_k=32, num_warps=8, num_stages=3)


def default_config(dtype: torch.dtype) -> KernelConfig:
    return HOPPER_FP32 if dtype == torch.float32 else HOPPER_16BIT


@dataclass(frozen=True)
class LaunchPlan:
    """How the partials grid covers (row blocks x vocabulary): ``splits`` ranges of the vocabulary,
    programs ordered in groups of ``group_rows`` row blocks."""

    splits: int
    group_rows: int


@dataclass(frozen=True)
class DeviceInfo:
    num_sms: int
    l2_bytes: int


# The interpreter has no device: small figures so that small test shapes get several groups.
INTERPRETER_DEVICE = DeviceInfo(num_sms=4, l2_bytes=64 * 1024)


def device_info(device: torch.device) -> DeviceInfo:
    if device.type != "cuda":
        return INTERPRETER_DEVICE
    props = torch.cuda.get_device_properties(device)
    return DeviceInfo(num_sms=props.multi_processor_count, l2_bytes=props.L2_cache_size)


def plan_launch(n_rows: int, hdim: int, vocab: int, itemsize: int, config: KernelConfig, dev: DeviceInfo) -> LaunchPlan:
    """Group and split sizes that keep operands in L2 and fill the GPU's last wave.

    * A group's hidden states (group_rows x BLOCK_N x H) take a third of L2, leaving room for
      the W tiles the group streams.
    * The programs running at once (one per SM) should be one group's: at least
      num_sms / group_rows splits, so together they read only that many W tiles at a time.
    * With P programs, the last wave runs P mod num_sms of them: efficiency P / (ceil(P / num_sms)
      num_sms). Add splits until it reaches 95% (a split costs 12 bytes per row of partials).
    """
    row_blocks = triton.cdiv(n_rows, config.block_n)
    v_tiles = triton.cdiv(vocab, config.block_v)
    block_bytes = config.block_n * hdim * itemsize
    group_rows = max(1, min(row_blocks, dev.l2_bytes // 3 // block_bytes))
    splits = min(v_tiles, triton.cdiv(dev.num_sms, group_rows))
    while splits < v_tiles:
        programs = row_blocks * splits
        if programs / (math.ceil(programs / dev.num_sms) * dev.num_sms) >= 0.95:
            break
        splits += 1
    return LaunchPlan(splits=splits, group_rows=group_rows)


# Rows of the batch whose plan's vocabulary splits a batch-invariant launch uses for every batch.
INVARIANT_PLAN_ROWS = 8192


def invariant_plan(
    n_rows: int, hdim: int, vocab: int, itemsize: int, config: KernelConfig, dev: DeviceInfo
) -> LaunchPlan:
    """A plan whose results do not depend on ``n_rows``: the vocabulary splits are those planned for
    ``INVARIANT_PLAN_ROWS`` rows, whatever the batch, so every row is reduced over the same ranges in
    the same order (within a split the tiles run in order; the combine merges splits in order; a
    row's dot products do not depend on which rows share its block). Only the program order (the
    groups) follows the batch: it changes the schedule, not the arithmetic."""
    fixed = plan_launch(INVARIANT_PLAN_ROWS, hdim, vocab, itemsize, config, dev)
    return LaunchPlan(
        splits=fixed.splits, group_rows=plan_launch(n_rows, hdim, vocab, itemsize, config, dev).group_rows
    )


MAX_SAMPLE_STRIDE = 32


def sample_stride(vocab: int, k: int) -> int:
    """Every how many columns the threshold's sample takes one: V / (16 K), within [1, 32]."""
    return min(MAX_SAMPLE_STRIDE, max(1, vocab // (16 * k)))


# How often stage 1's threshold may miss a row's top-k, at most, for top values placed independently
# of the sample's columns (how-it-works, "The threshold"): such a row costs one repair round of its
# row block.
SAMPLE_MISS_RATE = 1e-6


@functools.cache
def sample_rank(vocab: int, k: int) -> int:
    """R: stage 1's threshold is the R-th largest of the sample's group maxima, at most its R-th
    largest value (how-it-works, "The threshold"). The smallest R with P(Binomial(K, 1 / stride)
    >= R) <= ``SAMPLE_MISS_RATE``: the chance that R of a row's top K lie on sampled columns. K
    where no smaller R does (K never misses: a sample's K-th largest is at most its row's), as at
    stride 1."""
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
    how-it-works, "Sizes: slots, regions, row chunks")."""
    return sample_rank(vocab, k) * sample_stride(vocab, k)


def capacity(vocab: int, k: int) -> int:
    """Slots per row for the survivors of a top-``k``: the ``expected_survivors``, room for 8
    standard deviations (sqrt(R) stride each) and 256 more; at least K, never more than ``vocab``
    (how-it-works, "Sizes: slots, regions, row chunks")."""
    stride, rank = sample_stride(vocab, k), sample_rank(vocab, k)
    return min(vocab, max(k, expected_survivors(vocab, k) + 8 * math.isqrt(rank - 1) * stride + 8 * stride + 256))


# Stage 1 keeps survivors as chunks (``flag_chunks``) up to this K, and at any K up to this hidden
# size; otherwise as keys by rounds (``compact_survivors``): a K 256 row's chunk regions take about
# three times its slots' and sample's memory (110-120 KB a row at a 152K vocabulary), which only a
# short matmul, whose time the rounds' epilogue outweighs, pays back (measured on an H100:
# benchmarks/RESULTS.md).
CHUNKS_MAX_K = 64
CHUNKS_ANY_K_MAX_H = 2048


def uses_chunks(k: int, hdim: int) -> bool:
    """Whether stage 1 of a top-``k`` at hidden size ``hdim`` keeps chunks, not keys (how-it-works,
    "Stage 1: the survivors")."""
    return k <= CHUNKS_MAX_K or hdim <= CHUNKS_ANY_K_MAX_H


# Regions a (row, split) has: one per thread of a row in the accumulator layout
# (``survivors.flag_chunks``).
THREADS_A_ROW = 4


def region_slots(vocab: int, k: int, splits: int) -> int:
    """CAPQ, the chunks a region (row, split, thread) holds. A row's survivors number about R stride
    (``expected_survivors``), spread like stride times a Gamma(R) (how-it-works, "Sizes: slots,
    regions, row chunks"); regions are sized for 6 of its standard deviations (sqrt(R) stride) more, at most the row's
    ``capacity``, spread evenly over its 4 x splits regions (the splits interleave the
    vocabulary's tiles): mu a region, each kept chunk holding at least one, and 4.5 Poisson
    standard deviations (sqrt(mu)) more. Over that Gamma, a row's regions overflow about once in
    5 to 10 million rows (K 20 at a 152K vocabulary, 2 to 16 splits), each costing its row a
    repair round (``repair``)."""
    stride, rank = sample_stride(vocab, k), sample_rank(vocab, k)
    most = min(capacity(vocab, k), expected_survivors(vocab, k) + 6 * math.sqrt(rank) * stride)
    mu = most / (THREADS_A_ROW * splits)
    return math.ceil(mu + 4.5 * math.sqrt(mu))


def chunk_width(block_v: int) -> int:
    """Values in one chunk of ``survivors.flag_chunks`` for tiles BLOCK_V wide."""
    return block_v // 4 if block_v < 64 else block_v // 32


# Top-k runs in row chunks whose survivor slots, stage 1's chunk regions and threshold sample stay
# under about this many bytes (``topk_row_bytes``).
TOPK_CHUNK_BYTES = 1024**3


def topk_row_bytes(vocab: int, k: int, splits: int, chunk: int, chunked: bool) -> int:
    """Bytes a row of a top-k takes: ``capacity`` int64 slots, the threshold's fp32 sample logits
    (V / stride), its threshold, fallback and counter; with stage 1's chunks (``uses_chunks``),
    its regions (``region_slots`` chunks of ``chunk`` fp32 and a column each, and a counter, per
    region)."""
    per_row = 8 * capacity(vocab, k) + 4 * triton.cdiv(vocab, sample_stride(vocab, k)) + 20
    if chunked:
        per_row += THREADS_A_ROW * splits * (region_slots(vocab, k, splits) * (4 * chunk + 4) + 4)
    return per_row


def topk_chunk_rows(vocab: int, k: int, splits: int, chunk: int, chunked: bool) -> int:
    """Rows per top-k chunk (``TOPK_CHUNK_BYTES``), at least 1; ``splits``: the plan's."""
    return max(1, TOPK_CHUNK_BYTES // topk_row_bytes(vocab, k, splits, chunk, chunked))
