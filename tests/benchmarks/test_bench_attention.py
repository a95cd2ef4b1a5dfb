"""benchmarks/bench_attention.py's fallback-cost section ((f) chunked attention, (g) MLA's values),
its non-timing parts on the CPU: the FLOPs it credits each call with, and that its calls run on
the shapes they are given (the exact backend, float32; the timing needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_attention as bench

CPU = torch.device("cpu")


def pairs_flops(heads: int, qk_dim: int, v_dim: int, pairs: float) -> float:
    return 2.0 * heads * (qk_dim + v_dim) * pairs


def test_chunked_flops_count_each_chunks_causal_pairs(seed: int) -> None:
    # Lengths 5 and 20, chunk 8: segments 5 | 8, 8, 4 (causal pairs L^2/2 each); plain: 5 | 20.
    case = bench.FallbackCase("(f) tiny", 4, 2, 16, 16, (5, 20), (5, 20))
    q, k, v = bench.packed_inputs(case, seed, CPU, torch.float32)
    chunked, plain, cut = bench.chunked_calls(case, q, k, v, chunk=8)
    assert chunked.flops == pairs_flops(4, 16, 16, (25 + 64 + 64 + 16) / 2)
    assert plain.flops == pairs_flops(4, 16, 16, (25 + 400) / 2)
    assert cut.flops is None and not plain.same_as_first  # sequence 2 crosses chunks: outputs differ
    assert chunked.fn().shape == plain.fn().shape == (25, 4, 16)


def test_chunked_calls_on_a_query_chunk_gather_its_chunks_keys(seed: int) -> None:
    # The last 6 of 20 positions, chunk 8: queries 14, 15 see keys 8..15; 16..19 see keys 16..19.
    case = bench.FallbackCase("(f) tiny", 4, 2, 16, 16, (6,), (20,))
    q, k, v = bench.packed_inputs(case, seed, CPU, torch.float32)
    chunked, plain, cut = bench.chunked_calls(case, q, k, v, chunk=8)
    assert chunked.flops == pairs_flops(4, 16, 16, 2 * 6 + 2 + 4 * 4 / 2)
    assert plain.flops == pairs_flops(4, 16, 16, 6 * 14 + 18)
    keys, values = cut.fn()
    assert torch.equal(keys, k[8:20]) and torch.equal(values, v[8:20])
    assert chunked.fn().shape == (6, 4, 16)


def test_chunked_equals_plain_when_no_sequence_crosses_a_chunk(seed: int) -> None:
    case = bench.FallbackCase("(f) tiny", 4, 2, 16, 16, (5, 7, 3), (5, 7, 3))
    q, k, v = bench.packed_inputs(case, seed, CPU, torch.float32)
    chunked, plain, _ = bench.chunked_calls(case, q, k, v, chunk=8)
    assert plain.same_as_first and chunked.flops == plain.flops
    assert bench.max_diff(plain.fn(), chunked.fn(), 16) == 0.0


def test_mla_calls_narrow_and_wide_values_agree(seed: int) -> None:
    case = bench.FallbackCase("(g) tiny", 4, 4, 24, 16, (5, 9), (5, 9))
    q, k, v = bench.packed_inputs(case, seed, CPU, torch.float32)
    narrow, wide, efficient_narrow, efficient_wide = bench.mla_calls(case, q, k, v)
    pairs = (25 + 81) / 2
    assert narrow.flops == pairs_flops(4, 24, 16, pairs) and wide.flops == pairs_flops(4, 24, 24, pairs)
    assert efficient_narrow.flops == narrow.flops and efficient_wide.flops == wide.flops
    out_narrow, out_wide = narrow.fn(), wide.fn()
    assert out_narrow.shape == (14, 4, 16) and out_wide.shape == (14, 4, 24)
    assert bench.max_diff(out_wide, out_narrow, 16) < 1e-5  # the zero columns change nothing
    assert out_wide[..., 16:].abs().max().item() == 0.0


def test_cost_figures_tolerate_a_refused_row() -> None:
    case = bench.fallback_cases(0)[3]  # (g) DeepSeek-V3
    rows = [
        bench.Row(case.name, "padded", 2.0, 100.0, 2.0, "reference"),
        bench.Row(case.name, "wide", 1.0, 200.0, 1.0, "0"),
        bench.Row(case.name, "efficient 128", None, None, None, "RuntimeError: refused"),
        bench.Row(case.name, "efficient 192", 1.0, 200.0, 1.0, "0"),
    ]
    (line,) = bench.cost_figures(case, rows)
    assert "ms 2.000 (the pad and slice)" in line and "Dv 128 ms -" in line and "1.20" in line


def test_only_selects_the_fallback_sections_alone() -> None:
    assert not any("(f)" in case.name or "(g)" in case.name for case in bench.cases(0))
    names = [case.name for case in bench.fallback_cases(0)]
    assert sum("(f)" in name for name in names) == 3 and sum("(g)" in name for name in names) == 2
