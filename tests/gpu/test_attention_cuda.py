"""Packed (padding-free) attention on CUDA: the varlen fast path and the exact fallback.

Tolerances:
* float32 models: varlen flash attention runs fp16/bf16 only, so fp32 takes the exact fallback;
  it must match each sequence's own forward (sdpa, or eager for gemma2) to 1e-4 (TF32 off).
* bf16 models: packed and reference forwards each round every intermediate to bf16 (8 bits of
  mantissa: an ulp is 1.6e-2 at the final norm's largest outputs, ~4), and different kernels
  (varlen flash vs sdpa's) accumulate in different orders, so the two differ element-wise by a
  few ulps (0.04-0.055 measured on an H200). So each bf16 test measures both against a float32
  forward of the same (bf16-rounded) weights: the packed path's mean error must stay within
  1.25x the model's own bf16 forward's (+1e-3), and its max error within 2x (+2e-2). A wrong
  window or head mapping moves whole attention rows and fails that by orders of magnitude.
"""

from __future__ import annotations

import copy
import functools

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
    choice,
    cudnn,
    exact_packed_attention,
    flash,
    packed_attention_forward,
    packed_forward_kwargs,
    register_packed_attention,
    sdpa_cudnn,
)
from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from tests.helpers.models import ARCHITECTURES, COMMON, MAX_POSITIONS, VOCAB, ScoreReference, make_model
from tests.helpers.packed import own_hidden, packed_hidden

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLIDING = 8


def make_any(arch: str, *, seed: int, dtype: torch.dtype, max_positions: int = MAX_POSITIONS) -> PreTrainedModel:
    """tests.helpers.models.make_model, plus ``qwen2-sliding`` (a window of 8 on every layer, no softcap:
    the only way the varlen fast path meets a sliding window here), on CUDA."""
    if arch != "qwen2-sliding":
        tied = arch in ("gemma2", "qwen2")
        return make_model(arch, tied=tied, seed=seed, dtype=dtype, max_positions=max_positions).cuda()
    torch.manual_seed(seed)
    config = Qwen2Config(
        **{**COMMON, "max_position_embeddings": max_positions},
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=SLIDING,
        max_window_layers=0,
    )
    model = Qwen2ForCausalLM(config)
    model.set_attn_implementation(attention_implementation(model.config))
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    return model.to(dtype).eval().cuda()


def random_lengths(rng: np.random.Generator, n: int = 12) -> list[int]:
    """Mixed lengths up to the models' max positions, with 1s and a full-length sequence."""
    lengths = [int(x) for x in rng.integers(1, MAX_POSITIONS, n)]
    lengths[0] = lengths[n // 2] = 1
    lengths[1] = MAX_POSITIONS
    return lengths


def packed_row(rng: np.random.Generator, lengths: list[int]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    seqs = [torch.from_numpy(rng.integers(0, VOCAB, n, dtype=np.int64)).cuda() for n in lengths]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    row = {
        "input_ids": torch.cat(seqs)[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None].cuda(),
        "cu_seqlens": cu.cuda(),
    }
    return seqs, row


def count_varlen_calls(monkeypatch: pytest.MonkeyPatch, *, hide_enable_gqa: bool = False) -> list[int]:
    """Wrap the varlen kernel; each call appends the number of key heads it was given.

    ``hide_enable_gqa``: a wrapper whose signature lacks ``enable_gqa`` (as torch 2.11's
    varlen_attn), which forces the repeat-heads path even on a torch that has native GQA.
    """
    real = flash._varlen_attn()
    assert real is not None, f"torch {torch.__version__} has no torch.nn.attention.varlen on this GPU image"
    calls: list[int] = []

    def counting(q, k, v, *args, **kwargs):
        calls.append(k.shape[1])
        return real(q, k, v, *args, **kwargs)

    wrapper = counting if hide_enable_gqa else functools.wraps(real)(counting)
    monkeypatch.setattr(flash, "_varlen_attn", lambda: wrapper)
    return calls


@pytest.fixture(autouse=True)
def _setup(monkeypatch: pytest.MonkeyPatch) -> None:
    register_packed_attention()
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(choice, "_warned", set())  # each test sees its own slow-path warnings


def compare_bf16(
    arch: str, seed: int, monkeypatch: pytest.MonkeyPatch, preference: str = "flash", **count_kwargs
) -> tuple[list[int], int]:
    """Packed bf16 forward vs the model's own bf16 forward, per sequence (see the module doc).
    Returns (varlen calls, number of layers)."""
    rng = np.random.default_rng(seed)
    reference = make_any(arch, seed=seed, dtype=torch.bfloat16)
    exact32 = copy.deepcopy(reference).float()  # same bf16-rounded weights, float32 compute
    packed_model = make_any(arch, seed=seed, dtype=torch.bfloat16)
    packed_model.set_attn_implementation(attention_implementation_name(preference))
    calls = count_varlen_calls(monkeypatch, **count_kwargs)

    lengths = random_lengths(rng)
    seqs, row = packed_row(rng, lengths)
    hidden = packed_hidden(packed_model, row, max(lengths))
    cu = row["cu_seqlens"].tolist()
    err_packed, err_own = [], []
    for s, ids in enumerate(seqs):
        got, own, exact = hidden[cu[s] : cu[s + 1]], own_hidden(reference, ids), own_hidden(exact32, ids)
        err_packed.append((got.float() - exact).abs().flatten())
        err_own.append((own.float() - exact).abs().flatten())
    packed_err, own_err = torch.cat(err_packed), torch.cat(err_own)
    # As accurate as the model's own bf16 forward, against the same float32 truth: on average,
    # and at worst (a few bf16 ulps either way; measured 0.04-0.055 apart element-wise at |x|~4).
    mean_packed, mean_own = packed_err.mean().item(), own_err.mean().item()
    assert mean_packed <= 1.25 * mean_own + 1e-3, f"seed {seed}: packed {mean_packed:.2e} vs own bf16 {mean_own:.2e}"
    max_packed, max_own = packed_err.max().item(), own_err.max().item()
    assert max_packed <= 2 * max_own + 2e-2, f"seed {seed}: packed max {max_packed:.2e} vs own bf16 {max_own:.2e}"
    return calls, packed_model.config.num_hidden_layers


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2-sliding"])
def test_bf16_fast_path_matches_the_models_own_forward(arch, monkeypatch, caplog, seed):
    with caplog.at_level("WARNING", logger=attn.__name__):
        calls, layers = compare_bf16(arch, seed, monkeypatch)
    assert len(calls) == layers, "the varlen kernel ran once per layer"
    assert not [r for r in caplog.records if r.name == attn.__name__], "no slow-path warning on the fast path"


def test_bf16_fast_path_with_repeated_kv_heads(monkeypatch, seed):
    """The path torch 2.11 takes (no enable_gqa): key/value heads repeated to the query heads."""
    calls, layers = compare_bf16("llama", seed, monkeypatch, hide_enable_gqa=True)
    assert calls == [COMMON["num_attention_heads"]] * layers


def test_bf16_gemma2_takes_the_exact_path_and_says_why(monkeypatch, caplog, seed):
    with caplog.at_level("WARNING", logger=attn.__name__):
        calls, _ = compare_bf16("gemma2", seed, monkeypatch)
    assert calls == [], "softcapping cannot go through varlen flash attention"
    messages = [r.getMessage() for r in caplog.records if r.name == attn.__name__]
    assert len(messages) == 1 and "attention softcapping" in messages[0], messages  # once, not once per layer


@pytest.mark.parametrize("arch", [*sorted(ARCHITECTURES), "qwen2-sliding"])
def test_float32_takes_the_exact_path_and_matches_each_sequence(arch, monkeypatch, caplog, seed):
    rng = np.random.default_rng(seed)
    reference = make_any(arch, seed=seed, dtype=torch.float32)
    packed_model = make_any(arch, seed=seed, dtype=torch.float32)
    packed_model.set_attn_implementation(PACKED_ATTENTION)
    calls = count_varlen_calls(monkeypatch)

    lengths = random_lengths(rng)
    seqs, row = packed_row(rng, lengths)
    with caplog.at_level("WARNING", logger=attn.__name__):
        hidden = packed_hidden(packed_model, row, max(lengths))
    cu = row["cu_seqlens"].tolist()
    for s, ids in enumerate(seqs):
        torch.testing.assert_close(
            hidden[cu[s] : cu[s + 1]], own_hidden(reference, ids), atol=1e-4, rtol=0,
            msg=lambda m, s=s: f"seed {seed} seq {s}: {m}",
        )  # fmt: skip
    assert calls == []
    messages = [r.getMessage() for r in caplog.records if r.name == attn.__name__]
    reason = "attention softcapping" if arch == "gemma2" else "dtype torch.float32"
    assert len(messages) == 1 and reason in messages[0], messages


@pytest.mark.parametrize("window", [None, 1, 5, 64])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 128), (6, 1, 32)])
@pytest.mark.parametrize("hide_enable_gqa", [False, True], ids=["native-gqa-if-any", "repeat-kv"])
def test_varlen_op_matches_exact_attention(window, heads, kv_heads, head_dim, hide_enable_gqa, monkeypatch, seed):
    """The attention function's fast path on random bf16 q/k/v against the exact fallback in
    float32 on the same (bf16) values: checks the window convention (w - 1, 0), the scale and
    the query-head -> key-head mapping on the real kernel. Outputs are averages of N(0, 1)
    values rounded to bf16 once (half an ulp <= 8e-3 below 4), so 2e-2 absolute."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [1, 300, 7, 1, 64, 129, 2]
    total = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)], device="cuda")
    q = torch.randn(1, heads, total, head_dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, kv_heads, total, head_dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, kv_heads, total, head_dim, device="cuda", generator=g).bfloat16()
    module = torch.nn.Module().eval()
    module.is_causal = True
    scale = 1.7 * head_dim**-0.5  # not the default, so a dropped scale shows
    calls = count_varlen_calls(monkeypatch, hide_enable_gqa=hide_enable_gqa)

    got, _ = packed_attention_forward(
        module, q, k, v, None, scaling=scale, sliding_window=window, preference="flash",
        **packed_forward_kwargs(cu, max(lengths)),
    )  # fmt: skip
    expected = exact_packed_attention(
        q[0].float(), k[0].float(), v[0].float(), cu.tolist(), scale=scale, sliding_window=window, softcap=None
    )
    assert len(calls) == 1
    assert got.dtype == torch.bfloat16 and got.shape == (1, total, heads, head_dim)
    torch.testing.assert_close(got[0].float(), expected, atol=2e-2, rtol=0, msg=lambda m: f"seed {seed}: {m}")
    if window == 1:  # each token sees only itself: the output is its own value row
        own_v = v[0].repeat_interleave(heads // kv_heads, dim=0).transpose(0, 1)  # [T, H, D]
        torch.testing.assert_close(got[0], own_v, atol=0, rtol=0)


# --------------------------------------------------------------------------- the backends auto picks

needs_cudnn = pytest.mark.skipif(not cudnn.available(), reason="nvidia-cudnn-frontend is not installed")


@pytest.mark.parametrize("preference", ["auto", pytest.param("cudnn", marks=needs_cudnn)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2-sliding"])
def test_bf16_packed_rows_on_every_backend_match_the_models_own_forward(arch, preference, monkeypatch, seed):
    calls, _ = compare_bf16(arch, seed, monkeypatch, preference=preference)
    assert calls == [] or not cudnn.available(), "cuDNN's ragged kernel serves packed rows before FA2"


def spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls ``ops.attention.choice`` makes of a backend function."""
    owner = cudnn if name == "cudnn_varlen_attention" else sdpa_cudnn
    real, calls = getattr(owner, name), []

    def counting(q, *args, **kwargs):
        calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


@needs_cudnn
def test_auto_takes_sdpa_cudnn_for_one_sequence_and_cudnn_for_packed_rows(monkeypatch, seed):
    model = make_any("qwen2", seed=seed, dtype=torch.bfloat16)
    model.set_attn_implementation(attention_implementation_name("auto"))
    sdpa, ragged = spy(monkeypatch, "sdpa_cudnn_attention"), spy(monkeypatch, "cudnn_varlen_attention")
    rng = np.random.default_rng(seed)
    _, one = packed_row(rng, [200])
    packed_hidden(model, one, 200)
    assert sdpa == [200] * model.config.num_hidden_layers and ragged == []
    sdpa.clear()
    _, several = packed_row(rng, [50, 1, 120])
    packed_hidden(model, several, 120)
    assert ragged == [171] * model.config.num_hidden_layers and sdpa == []


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_bf16_long_sequence_in_chunks_is_as_exact_as_the_models_own_forward(arch, seed):
    """A sequence longer than the chunk threshold, scored layer by layer in chunks (the 1M-token
    path, at a size a float64 reference can check): as exact as the model's own bf16 forward
    (tests/helpers/tolerances.py), and not further from the unchunked service than that allows."""
    rng = np.random.default_rng(seed)
    seq = TokenSequence(rng.integers(0, VOCAB, 500), rng.integers(0, VOCAB, 2500))
    model = make_any(arch, seed=seed, dtype=torch.bfloat16, max_positions=seq.num_tokens)
    reference = ScoreReference(model, [seq], dtype=torch.bfloat16)
    for options in (
        ScoringOptions(long_sequence_tokens=10**9),
        ScoringOptions(long_sequence_tokens=1024, chunk_tokens=700),
    ):
        with OfflineScorer(model, options=options) as scorer:
            reference.check([scorer.score([seq])[0].logprobs])
