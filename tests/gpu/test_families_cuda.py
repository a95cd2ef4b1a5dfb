"""The model families of issue 42 on CUDA at bf16: every one scores as exactly as its own bf16 forward.

Each tiny family of ``tests.helpers.models`` (Llama 3's rope scaling, Qwen3's q/k norms, Qwen3-MoE,
Gemma 3's local/global layers, Mistral's and Phi-3's sliding windows, gpt-oss's sinks and
alternating windows, Llama 4's attention chunks and NoPE layers, DeepSeek-V3's MLA) runs through
the service's packed path on the backend the service picks, and through each backend preference:
packed rows, prompts shared by several completions, and a long sequence scored in chunks. The scores
must be as exact as the model's own bf16 forward against a float64 forward of the same weights
(``ScoreReference``, tests/helpers/tolerances.py: twice its error plus 2e-2 nats).

Mixture-of-experts families run here with every expert a copy of the first: bf16 rounding flips
the top-k choice of near-tied router logits, in the model's own bf16 forward as much as in the
service's but on different tokens (their sums run in other orders), and with distinct random
experts a flipped token moved by up to ~3 nats (measured on the CPU at bf16: 5 seeds x 4 MoE
families, max errors 0.1-2.8 nats on both paths), past any criterion that still catches an attention
error. With identical experts and routing weights that sum to a constant (normalized top-k; Llama 4's
top-1 sigmoid is continuous at a tie), a flip moves nothing, while routing, the tokens' gather and
scatter and the grouped GEMMs all still run. Which expert a token reaches is checked on the CPU in
float32 (tests/models), where flips take a near-tie of 1e-7.

None of these features may send a layer to the exact fallback: each backend computes sinks (from
its log-sum-exp), attention chunks (as segments) and MLA's narrower values (zero-padded) itself.
The test records the backend each attention call took and fails on an exact one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from logprob_service.domain import TokenSequence
from logprob_service.models.scorer import ScoringOptions, model_body
from logprob_service.offline import OfflineScorer
from logprob_service.ops.attention import choice, cudnn

from tests.helpers.models import MAX_POSITIONS, VOCAB, ScoreReference, make_model, random_sequences

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FAMILIES = ["llama3", "qwen3", "qwen3_moe", "gemma3", "mistral", "phi3", "gpt_oss", "llama4", "deepseek_v3"]
needs_cudnn = pytest.mark.skipif(not cudnn.available(), reason="nvidia-cudnn-frontend is not installed")
# auto (deterministic): the ragged cuDNN kernel for every row; auto (not): torch's cuDNN SDPA for a
# lone sequence; flash: FlashAttention-2 varlen. Layers eager: compiling is checked in test_compiled_cuda.
PREFERENCES = [
    pytest.param(ScoringOptions(compile_layers="off"), id="auto-deterministic"),
    pytest.param(ScoringOptions(compile_layers="off", deterministic=False), id="auto"),
    pytest.param(
        ScoringOptions(attention_backend="cudnn", compile_layers="off", deterministic=False),
        id="cudnn",
        marks=needs_cudnn,
    ),
    pytest.param(ScoringOptions(attention_backend="flash", compile_layers="off", deterministic=False), id="flash"),
]


def family_model(arch: str, seed: int, max_positions: int = MAX_POSITIONS) -> torch.nn.Module:
    """The family's tiny model in bf16 on CUDA, its routed experts all copies of expert 0."""
    model = make_model(arch, tied=False, seed=seed, dtype=torch.bfloat16, max_positions=max_positions)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:  # stacked [E, ...] weights and biases of the routed experts (not shared ones)
                p.copy_(p[:1].expand_as(p))
    return model.cuda()


def backends_taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The backend ``choice.packed_attention`` picks for each call, from now on."""
    real, taken = choice.choose_backend, []

    def recording(*args, **kwargs):
        backend, reasons = real(*args, **kwargs)
        taken.append(backend)
        return backend, reasons

    monkeypatch.setattr(choice, "choose_backend", recording)
    return taken


def shared_prompt_mix(rng: np.random.Generator) -> list[TokenSequence]:
    """Two prompts (longer than the windows and chunks) with 3 and 2 completions, and one alone."""
    a, b = rng.integers(0, VOCAB, 37), rng.integers(0, VOCAB, 21)
    prompts = [a, b, a, rng.integers(0, VOCAB, 9), b, a]
    return [TokenSequence(p.copy(), rng.integers(0, VOCAB, int(rng.integers(1, 30)))) for p in prompts]


@pytest.mark.parametrize("options", PREFERENCES)
@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_family_scores_packed_and_shared_within_the_bf16_criterion(arch, options, monkeypatch, rng, seed):
    model = family_model(arch, seed)
    packed = random_sequences(rng, 9, max_len=60)
    shared = shared_prompt_mix(rng)
    taken = backends_taken(monkeypatch)
    with OfflineScorer(model, options=options, max_batch_tokens=160, max_batch_sequences=6) as offline:
        plan = offline.scorer.attention_plan()
        out = offline.score(packed, return_entropy=True)
        out_shared = offline.score(shared, return_entropy=True)
    ScoreReference(model, packed, dtype=torch.bfloat16).check([s.logprobs for s in out], [s.entropies for s in out])
    ScoreReference(model, shared, dtype=torch.bfloat16).check(
        [s.logprobs for s in out_shared], [s.entropies for s in out_shared]
    )
    assert taken and "exact" not in taken, (set(taken), plan)
    assert "exact" not in plan.split(" (faster")[0], plan  # ListModels' attention string names the fast backends
    if arch == "gpt_oss":
        assert "attention sinks" in plan
    if arch == "llama4":
        assert "chunked attention (8 positions)" in plan
    if arch == "deepseek_v3":
        assert "value heads of 12 (queries/keys 24) zero-padded to 24" in plan


@pytest.mark.parametrize("options", PREFERENCES[:2])
@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_family_long_sequence_in_chunks_within_the_bf16_criterion(arch, options, monkeypatch, rng, seed):
    """A sequence scored layer by layer in chunks of 97 tokens (keys of earlier chunks read from the
    layer's buffers): windows, attention chunks and sinks across the chunk borders."""
    seq = TokenSequence(rng.integers(0, VOCAB, 150), rng.integers(0, VOCAB, 450))
    model = family_model(arch, seed, max_positions=seq.num_tokens)
    taken = backends_taken(monkeypatch)
    chunked = dataclasses.replace(options, long_sequence_tokens=256, chunk_tokens=97)
    rows_seen = []
    norm = model_body(model).layers[0].input_layernorm
    hook = norm.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[1]))
    with OfflineScorer(model, options=chunked) as offline:
        out = offline.score([seq], return_entropy=True)
    hook.remove()  # before the reference's forwards (of copies of the model, hooks included)
    ScoreReference(model, [seq], dtype=torch.bfloat16).check([out[0].logprobs], [out[0].entropies])
    assert max(rows_seen) == 97, rows_seen  # it did run in chunks
    assert taken and "exact" not in taken, set(taken)


@pytest.mark.parametrize("preference", ["auto", pytest.param("cudnn", marks=needs_cudnn), "flash"])
@pytest.mark.parametrize("lengths", [[300], [1, 300, 7, 1, 64, 129]], ids=["one-sequence", "packed"])
@pytest.mark.parametrize(
    "feature",
    ["sinks", "sinks-window", "chunk", "mla"],
)
def test_each_backend_computes_the_feature_as_the_exact_path(feature, lengths, preference, monkeypatch, seed):
    """Each fast backend on random bf16 q/k/v against the exact path in float32 on the same values:
    sinks (from its log-sum-exp), attention chunks of 48 (segments), values of 96 dims under
    queries/keys of 128 (zero-padded). Outputs are averages of N(0, 1) values rounded to bf16 once:
    2e-2 absolute, as tests/gpu/test_attention_cuda.py's op test; with sinks twice (the kernel's
    output, then scaled by the sink's share): 3e-2."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    heads, kv_heads, d = 8, 2, 128
    dv = 96 if feature == "mla" else d
    total = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)], device="cuda", dtype=torch.int32)
    q = torch.randn(total, heads, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(total, kv_heads, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(total, kv_heads, dv, device="cuda", generator=g).bfloat16()
    kwargs = dict(scale=1.3 * d**-0.5)
    if feature.startswith("sinks"):
        kwargs["sinks"] = torch.randn(heads, device="cuda", generator=g).bfloat16() * 2
    if feature == "sinks-window":
        kwargs["sliding_window"] = 37
    if feature == "chunk":
        kwargs["attention_chunk"] = 48
    taken = backends_taken(monkeypatch)
    got = choice.packed_attention(q, k, v, cu, cu, max(lengths), max(lengths), preference=preference, **kwargs)
    expected = choice.packed_attention(
        q.float(), k.float(), v.float(), cu, cu, max(lengths), max(lengths), preference="exact",
        **{name: value.float() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()},
    )  # fmt: skip
    assert taken[0] != "exact", taken
    assert got.dtype == torch.bfloat16 and got.shape == (total, heads, dv)
    atol = 3e-2 if feature.startswith("sinks") else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=0, msg=lambda m: f"seed {seed}: {m}")
