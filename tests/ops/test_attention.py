"""Packed (padding-free) attention on the CPU: the exact per-sequence path.

Every test draws fresh random weights and tokens; the seed is in each failure message.
float32 throughout, so the packed forward must match each sequence's own forward to 1e-5.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from logprob_service.domain import TokenSequence
from logprob_service.models.loading import attention_implementation
from logprob_service.models.scorer import ScoringOptions
from logprob_service.offline import OfflineScorer
from logprob_service.ops import attention as attn
from logprob_service.ops.attention import (
    PACKED_ATTENTION,
    attention_implementation_name,
    describe_backends,
    exact,
    exact_packed_attention,
    flash,
    packed_attention_forward,
    packed_forward_kwargs,
    register_packed_attention,
    varlen_window_size,
)
from logprob_service.ops.attention.choice import chunk_segments, packed_attention
from logprob_service.ops.attention.common import apply_sinks
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import (
    AttentionMaskInterface,
    causal_mask_function,
    chunked_causal_mask_function,
    sliding_window_causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager_attention
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager_attention

from tests.helpers import tolerances
from tests.helpers.models import ARCHITECTURES, COMMON, VOCAB, ScoreReference, make_model
from tests.helpers.packed import own_hidden, packed_hidden

pytestmark = pytest.mark.numerical

SLIDING = 8  # gemma2's window in tests/models.py; lengths below go well past it


def _qwen2_sliding(tied: bool) -> PreTrainedModel:
    """Qwen2 with a sliding window on every layer: the window reaches attention as an argument
    without softcapping, which is the combination the CUDA fast path takes."""
    config = Qwen2Config(
        **COMMON, tie_word_embeddings=tied, use_sliding_window=True, sliding_window=SLIDING, max_window_layers=0
    )
    return Qwen2ForCausalLM(config)


def make_any(arch: str, *, seed: int, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """tests.helpers.models.make_model, plus ``qwen2-sliding`` initialized the same way."""
    if arch != "qwen2-sliding":
        return make_model(arch, tied=arch in ("gemma2", "qwen2"), seed=seed, dtype=dtype)
    torch.manual_seed(seed)
    model = _qwen2_sliding(tied=True)
    model.set_attn_implementation(attention_implementation(model.config))
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    return model.to(dtype).eval()


ALL_ARCHS = [*sorted(ARCHITECTURES), "qwen2-sliding"]


def random_lengths(rng: np.random.Generator, n: int = 7, max_len: int = 40) -> list[int]:
    """Mixed lengths: a 1 first and in the middle, and several longer than the sliding window."""
    lengths = [int(x) for x in rng.integers(1, max_len, n)]
    lengths[0] = 1
    lengths[n // 2] = 1
    lengths[1] = int(rng.integers(3 * SLIDING, max_len + 1))
    return lengths


def pack(rng: np.random.Generator, lengths: list[int]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Random token ids per sequence, and the packed row: input_ids, position_ids [1, T], cu_seqlens [n+1]."""
    seqs = [torch.from_numpy(rng.integers(0, VOCAB, n, dtype=np.int64)) for n in lengths]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    packed = {
        "input_ids": torch.cat(seqs)[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cu_seqlens": cu,
    }
    return seqs, packed


@pytest.fixture(autouse=True)
def _registered() -> None:
    register_packed_attention()


# --------------------------------------------------------------------------- whole models


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_packed_forward_matches_each_sequence_alone(arch, seed):
    rng = np.random.default_rng(seed)
    reference = make_any(arch, seed=seed)  # the model's normal implementation (sdpa, or eager for gemma2)
    packed_model = make_any(arch, seed=seed)
    packed_model.set_attn_implementation(PACKED_ATTENTION)
    assert reference.config._attn_implementation != PACKED_ATTENTION

    lengths = random_lengths(rng)
    seqs, packed = pack(rng, lengths)
    hidden = packed_hidden(packed_model, packed, max(lengths))
    assert hidden.shape == (sum(lengths), COMMON["hidden_size"])
    cu = packed["cu_seqlens"].tolist()
    for s, ids in enumerate(seqs):
        expected = own_hidden(reference, ids)
        assert expected.abs().max() > 0.1  # a real signal, not a degenerate model
        torch.testing.assert_close(
            hidden[cu[s] : cu[s + 1]],
            expected,
            atol=tolerances.PACKED_HIDDEN_FP32,
            rtol=0,
            msg=lambda m, s=s: f"sequence {s}: {m}",
        )


def test_packing_really_separates_sequences(seed):
    """Guard on the test above: the same row run as ONE sequence (positions 0..T-1, no boundaries)
    differs from the per-sequence forwards, so that comparison can fail."""
    rng = np.random.default_rng(seed)
    model = make_any("llama", seed=seed)
    lengths = [12, 15]
    seqs, packed = pack(rng, lengths)
    whole = own_hidden(model, packed["input_ids"][0])
    assert (whole[12:] - own_hidden(model, seqs[1])).abs().max() > 1e-2, f"seed {seed}"


def test_no_mask_is_built_and_attention_gets_none(monkeypatch, seed):
    rng = np.random.default_rng(seed)
    model = make_any("gemma2", seed=seed)  # has both full and sliding layers, so both mask kinds are asked for
    model.set_attn_implementation(PACKED_ATTENTION)
    masks_seen = []

    def spy_attention(module, query, key, value, attention_mask, **kwargs):
        masks_seen.append(attention_mask)
        return packed_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def no_dense_mask(*args, **kwargs):
        raise AssertionError("a dense mask function was called")

    monkeypatch.setitem(AttentionInterface._global_mapping, PACKED_ATTENTION, spy_attention)
    for name in ("sdpa", "eager"):
        monkeypatch.setitem(AttentionMaskInterface._global_mapping, name, no_dense_mask)
    assert PACKED_ATTENTION not in AttentionMaskInterface._global_mapping  # so transformers builds no mask

    lengths = random_lengths(rng)
    _, packed = pack(rng, lengths)
    packed_hidden(model, packed, max(lengths))
    assert len(masks_seen) == model.config.num_hidden_layers
    assert all(m is None for m in masks_seen)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_unpacked_call_treats_each_row_as_one_sequence(arch, seed):
    model = make_any(arch, seed=seed)
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, model.config.vocab_size, (3, 21)))
    with torch.no_grad():
        expected = model.base_model(input_ids=ids, use_cache=False).last_hidden_state  # its own sdpa/eager
        model.set_attn_implementation(PACKED_ATTENTION)
        got = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
    torch.testing.assert_close(got, expected, atol=tolerances.PACKED_HIDDEN_FP32, rtol=0)


def test_partial_boundaries_raise_a_clear_error(seed):
    rng = np.random.default_rng(seed)
    model = make_any("llama", seed=seed)
    model.set_attn_implementation(PACKED_ATTENTION)
    _, packed = pack(rng, [5, 7])
    partial = packed_forward_kwargs(packed["cu_seqlens"], 7)
    del partial["max_length_k"]
    with torch.no_grad(), pytest.raises(ValueError, match=r"max_length_k is missing.*packed_forward_kwargs"):
        model.base_model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False, **partial)


# --------------------------------------------------------------------------- conventions and the op


@pytest.mark.parametrize("preference", ["auto", "cudnn", "flash", "exact"])
def test_registration_is_idempotent_and_global(preference):
    register_packed_attention()
    register_packed_attention()
    name = attention_implementation_name(preference)
    assert name.startswith(PACKED_ATTENTION) and (name == PACKED_ATTENTION) == (preference == "auto")
    assert "flash" not in name  # transformers would take it for a FlashAttention build to import
    for registered in (ALL_ATTENTION_FUNCTIONS[name], AttentionInterface()[name]):  # every instance sees it
        assert registered.func is packed_attention_forward and registered.keywords == {"preference": preference}


def test_packed_forward_kwargs():
    cu = torch.tensor([0, 1, 9, 12])
    kwargs = packed_forward_kwargs(cu, 8)
    assert set(kwargs) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32 and kwargs["cu_seq_lens_q"].tolist() == [0, 1, 9, 12]
    assert kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 8
    with pytest.raises(ValueError, match="1-D"):
        packed_forward_kwargs(torch.tensor([3]), 3)
    with pytest.raises(ValueError, match="integers"):
        packed_forward_kwargs(torch.tensor([0.0, 3.0]), 3)


@pytest.mark.parametrize("window", [None, 1, 2, 3, 8, 64])
def test_varlen_window_matches_transformers_mask(window):
    """flash attention's inclusive (left, right) window, from varlen_window_size, keeps exactly the
    (query, key) pairs that transformers' own mask functions keep."""
    n = 40
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    hf = torch.tensor([[bool(mask_fn(0, 0, torch.tensor(a), torch.tensor(b))) for b in range(n)] for a in range(n)])
    left, right = varlen_window_size(window)
    flash = (j <= i + right) & ((j >= i - left) if left >= 0 else torch.ones(n, n, dtype=torch.bool))
    assert torch.equal(flash, hf)
    if window is not None:
        assert hf.sum(1).max() == min(window, n)  # w positions, the query's own included


def _fake_module(heads: int, kv_heads: int, head_dim: int) -> torch.nn.Module:
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = heads // kv_heads
    module.head_dim = head_dim
    return module.eval()


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 3.0), (5, 3.0), (1, None)])
# one block per sequence / 3-row blocks for the 17-token sequence / one row at a time
@pytest.mark.parametrize("score_bytes", [exact.FALLBACK_SCORE_BYTES, 4 * 6 * 17 * 3, 1])
def test_op_matches_transformers_eager_on_a_block_diagonal_mask(window, softcap, score_bytes, monkeypatch, seed):
    """The attention function against transformers' own eager attention (Gemma 2's, which has the
    softcap) run on the whole packed row with an explicit block-diagonal mask: GQA 6 query heads
    over 2 key/value heads, a non-default scale, softcap and window, small query blocks."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, d = 6, 2, 16
    lengths = [1, 11, 4, 1, 17]
    total = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)])
    q = torch.randn(1, heads, total, d, generator=g) * 2  # * 2: logits large enough for the softcap to bend
    k = torch.randn(1, kv_heads, total, d, generator=g) * 2
    v = torch.randn(1, kv_heads, total, d, generator=g)
    module = _fake_module(heads, kv_heads, d)
    scale = 0.37

    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    keep = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        keep &= pos[None, :] > pos[:, None] - window
    additive = torch.zeros(total, total).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]
    expected, _ = gemma2_eager_attention(module, q, k, v, additive, scaling=scale, softcap=softcap)

    monkeypatch.setattr(exact, "FALLBACK_SCORE_BYTES", score_bytes)  # the budget the attention function uses
    got, weights = packed_attention_forward(
        module, q, k, v, None, scaling=scale, dropout=0.0, softcap=softcap, sliding_window=window,
        **packed_forward_kwargs(cu, max(lengths)),
    )  # fmt: skip
    assert weights is None
    assert got.shape == (1, total, heads, d)
    torch.testing.assert_close(got, expected, atol=tolerances.PACKED_HIDDEN_FP32, rtol=0)
    direct = exact_packed_attention(
        q[0], k[0], v[0], cu.tolist(), scale=scale, sliding_window=window, softcap=softcap, score_bytes=score_bytes
    )
    torch.testing.assert_close(direct[None], expected, atol=tolerances.PACKED_HIDDEN_FP32, rtol=0)


def test_module_sliding_window_used_only_when_the_argument_is_absent(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
    module = _fake_module(2, 2, 8)
    module.sliding_window = 3
    kwargs = packed_forward_kwargs(torch.tensor([0, 20]), 20)
    windowed = exact_packed_attention(q[0], k[0], v[0], [0, 20], scale=8**-0.5, sliding_window=3, softcap=None)
    full = exact_packed_attention(q[0], k[0], v[0], [0, 20], scale=8**-0.5, sliding_window=None, softcap=None)
    from_attribute, _ = packed_attention_forward(module, q, k, v, None, **kwargs)
    explicit_none, _ = packed_attention_forward(module, q, k, v, None, sliding_window=None, **kwargs)
    torch.testing.assert_close(from_attribute[0], windowed, atol=0, rtol=0)
    torch.testing.assert_close(explicit_none[0], full, atol=0, rtol=0)
    assert (windowed - full).abs().max() > 1e-3, f"seed {seed}"


def test_unsupported_semantics_are_refused():
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    kwargs = packed_forward_kwargs(torch.tensor([0, 2, 6]), 4)
    module = _fake_module(2, 2, 8)
    with pytest.raises(NotImplementedError, match="causal only"):
        packed_attention_forward(module, q, k, v, None, is_causal=False, **kwargs)
    module.config, module.layer_idx = SimpleNamespace(layer_types=["bidirectional_attention"]), 0
    with pytest.raises(NotImplementedError, match="layer 0 is of type 'bidirectional_attention'"):
        packed_attention_forward(module, q, k, v, None, **kwargs)  # not run as plain causal attention
    del module.config
    with pytest.raises(ValueError, match="without a cache"):
        packed_attention_forward(module, q, k[:, :, :3], v[:, :, :3], None, **kwargs)
    with pytest.raises(ValueError, match="attention_mask"):
        packed_attention_forward(module, q, k, v, torch.zeros(1, 1, 6, 6), **kwargs)
    bad = packed_forward_kwargs(torch.tensor([0, 2, 5]), 3)  # ends at 5, the row has 6 tokens
    with pytest.raises(ValueError, match="T=6"):
        packed_attention_forward(module, q, k, v, None, **bad)


def test_cpu_never_reaches_the_varlen_kernel(monkeypatch, caplog):
    def boom():
        raise AssertionError("fast path taken on the CPU")

    monkeypatch.setattr(flash, "_varlen_attn", boom)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    with caplog.at_level("WARNING", logger=attn.__name__):
        out, _ = packed_attention_forward(
            _fake_module(2, 2, 8), q, k, v, None, **packed_forward_kwargs(torch.tensor([0, 6]), 6)
        )
    assert out.shape == (1, 6, 2, 8)
    assert not caplog.records  # the CPU path is the expected one there: no slow-path warning


# --------------------------------------------------------------------------- sinks, attention chunks


def _block_diagonal(lengths: list[int], window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """[T, T] bool: query row i may see key row j (same sequence, causal, the window, the chunk),
    the chunk by transformers' own ``chunked_causal_mask_function`` on in-sequence positions."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    keep = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        keep &= pos[None, :] > pos[:, None] - window
    if chunk is not None:
        in_chunk = chunked_causal_mask_function(chunk, torch.zeros(1, dtype=torch.long))
        keep &= in_chunk(0, 0, pos[:, None], pos[None, :])
    return keep


def _additive(keep: torch.Tensor) -> torch.Tensor:
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_match_gpt_oss_eager_on_a_block_diagonal_mask(window, seed):
    """gpt-oss's sinks (``s_aux``, one logit per query head, in every row's softmax) against
    transformers' own gpt-oss eager attention on the packed row with an explicit mask."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, d, lengths = 6, 2, 16, [1, 11, 4, 17]
    total, cu = sum(lengths), torch.tensor([0, *np.cumsum(lengths)])
    q, k, v = (torch.randn(1, n, total, d, generator=g) for n in (heads, kv_heads, kv_heads))
    module = _fake_module(heads, kv_heads, d)
    module.sinks = torch.nn.Parameter(torch.randn(heads, generator=g) * 2)  # some far above the scores, some below
    expected, _ = gpt_oss_eager_attention(module, q, k, v, _additive(_block_diagonal(lengths, window)), scaling=0.3)
    got, _ = packed_attention_forward(
        module, q, k, v, None, scaling=0.3, sliding_window=window, s_aux=module.sinks,
        **packed_forward_kwargs(cu, max(lengths)),
    )  # fmt: skip
    torch.testing.assert_close(got, expected, atol=tolerances.PACKED_HIDDEN_FP32, rtol=0)
    plain, _ = packed_attention_forward(
        module, q, k, v, None, scaling=0.3, sliding_window=window, **packed_forward_kwargs(cu, max(lengths))
    )
    assert (plain - got).abs().max() > 1e-2, f"seed {seed}: the sinks changed nothing"


def test_sinks_from_a_kernels_log_sum_exp(seed):
    """What the fast backends do (they return the log-sum-exp of the plain attention): scaling the
    plain output by sigmoid(lse - sink) gives the exact attention with sinks."""
    g = torch.Generator().manual_seed(seed)
    heads, length, d = 4, 23, 8
    q, k, v = (torch.randn(heads, length, d, generator=g) * 2 for _ in range(3))
    sinks = torch.randn(heads, generator=g) * 3
    kwargs = dict(scale=d**-0.5, sliding_window=None, softcap=None)
    plain = exact.sequence_attention(q, k, v, **kwargs)  # [L, H, D]
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    lse = scores.masked_fill(torch.ones(length, length).triu(1).bool(), float("-inf")).logsumexp(-1).T  # [L, H]
    with_sinks = exact.sequence_attention(q, k, v, **kwargs, sinks=sinks)
    torch.testing.assert_close(apply_sinks(plain, lse, sinks), with_sinks, atol=tolerances.PACKED_HIDDEN_FP32, rtol=0)


def test_chunked_layers_match_transformers_chunked_mask(seed):
    """Llama 4's chunked attention layer (its type read from config.layer_types): transformers' own
    eager attention under its chunked causal mask, on a packed row whose sequences span several
    chunks, start mid-chunk never (positions restart at 0) and end mid-chunk."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, d, chunk, lengths = 4, 2, 8, 5, [1, 13, 5, 4, 21]
    total, cu = sum(lengths), torch.tensor([0, *np.cumsum(lengths)])
    q, k, v = (torch.randn(1, n, total, d, generator=g) for n in (heads, kv_heads, kv_heads))
    module = _fake_module(heads, kv_heads, d)
    module.config = SimpleNamespace(layer_types=["full_attention", "chunked_attention"], attention_chunk_size=chunk)
    kwargs = dict(scaling=0.4, **packed_forward_kwargs(cu, max(lengths)))
    results = {}
    for layer, chunked in ((0, None), (1, chunk)):
        module.layer_idx = layer
        expected, _ = gemma2_eager_attention(
            module, q, k, v, _additive(_block_diagonal(lengths, chunk=chunked)), scaling=0.4
        )
        results[layer], _ = packed_attention_forward(module, q, k, v, None, **kwargs)
        torch.testing.assert_close(results[layer], expected, atol=tolerances.PACKED_HIDDEN_FP32, rtol=0)
    assert (results[0] - results[1]).abs().max() > 1e-2, f"seed {seed}: the chunks changed nothing"


def test_chunk_segments_of_queries_that_are_their_keys_last_positions(seed):
    """A completion over its shared prompt's keys, or a chunk of a long sequence: Lq < Lk queries,
    aligned bottom-right. Cut into chunk segments (keys gathered by the index where the segments'
    keys skip rows), each query still sees exactly the keys of its own chunk up to itself."""
    g = torch.Generator().manual_seed(seed)
    heads, d, chunk = 2, 8, 4
    queries, keys = [3, 1, 9, 6], [11, 1, 9, 13]  # sequence 0 starts mid-chunk, 1 is one token, 2 is whole
    cu_q = torch.tensor([0, *np.cumsum(queries)], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(keys)], dtype=torch.int32)
    q = torch.randn(sum(queries), heads, d, generator=g)
    k, v = (torch.randn(sum(keys), heads, d, generator=g) for _ in range(2))
    got = packed_attention(q, k, v, cu_q, cu_k, max(queries), max(keys), scale=0.5, attention_chunk=chunk)
    for s, (lq, lk) in enumerate(zip(queries, keys)):
        pos = torch.arange(lk - lq, lk)[:, None]  # the queries' positions
        j = torch.arange(lk)[None, :]
        keep = (j <= pos) & (j // chunk == pos // chunk)
        scores = torch.einsum("qhd,khd->hqk", q[cu_q[s] : cu_q[s + 1]], k[cu_k[s] : cu_k[s + 1]]) * 0.5
        probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        expected = torch.einsum("hqk,khd->qhd", probs, v[cu_k[s] : cu_k[s + 1]])
        torch.testing.assert_close(got[cu_q[s] : cu_q[s + 1]], expected, atol=tolerances.PACKED_HIDDEN_FP32, rtol=0)
    new_q, new_k, max_q, max_k, index, bounds = chunk_segments(cu_q, cu_k, chunk)
    assert index is not None and max_q <= chunk and max_k <= chunk  # keys before the first query chunk skipped
    # sequence 0: one chunk; 1: one; 2: 4 + 4 + 1 queries; 3: queries at positions 7 | 8-11 | 12
    assert new_q.tolist() == bounds[0] == [0, 3, 4, 8, 12, 13, 14, 18, 19] and new_k[-1] == len(index)
    assert new_k.tolist() == bounds[1]
    assert chunk_segments(cu_q, cu_k, chunk, (cu_q.tolist(), cu_k.tolist()))[5] == bounds  # from host bounds
    self_q, self_k, _, _, self_index, _ = chunk_segments(cu_k, cu_k, chunk)
    assert self_index is None and self_k is self_q  # self-attention: the chunks' keys are the queries' rows


def test_the_plan_names_what_each_feature_costs():
    """ListModels' attention string says how sinks, attention chunks and narrower value heads are served."""
    common = dict(heads=4, kv_heads=4, dtype=torch.float32, device=torch.device("cpu"), softcap=None)
    plain = describe_backends("auto", head_dim=16, **common)
    assert "attention sinks" not in plain and "chunked attention" not in plain and "window " not in plain
    featured = describe_backends(
        "auto", head_dim=24, value_head_dim=12, sliding_window=8, sinks=True, attention_chunk=8, **common
    )
    assert "window 8 layers, packed rows: exact" in featured
    assert "attention sinks applied from each kernel's log-sum-exp" in featured
    assert "chunked attention (8 positions)" in featured and "value heads of 12 (queries/keys 24)" in featured


@pytest.mark.parametrize("arch", ["llama4", "gemma2"])  # chunked layers; the exact loop (softcaps)
@pytest.mark.parametrize("share", [True, False])
def test_the_scorer_gives_host_side_paths_its_boundaries(arch, share, monkeypatch, rng, seed):
    """The attention paths that work on the host (cutting attention chunks, the exact loop) read the
    batch's boundaries from the scorer, never copy cu_seq_lens back from the device (a sync per
    layer on a GPU): packed rows, shared prompts and a long sequence in chunks."""

    def no_copy_back(*args):
        raise AssertionError("cu_seq_lens copied back to the host")

    monkeypatch.setattr(attn.choice, "_host_bounds", no_copy_back)
    model = make_model(arch, tied=False, seed=seed)
    prompt = rng.integers(0, VOCAB, 19)
    seqs = [TokenSequence(prompt.copy(), rng.integers(0, VOCAB, n)) for n in (3, 11, 1)]
    seqs.append(TokenSequence(rng.integers(0, VOCAB, 40), rng.integers(0, VOCAB, 90)))  # 130 > 100: chunked
    options = ScoringOptions(compile_layers="off", share_prompts=share, long_sequence_tokens=100, chunk_tokens=23)
    with OfflineScorer(model, options=options, max_batch_tokens=128) as offline:
        out = offline.score(seqs)
    ScoreReference(model, seqs).check([s.logprobs for s in out])
