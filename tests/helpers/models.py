"""Small random causal LMs of several architectures, and the float64 reference scorer."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from logprob_service.domain import TokenSequence
from logprob_service.models.compiled import eager_layers
from logprob_service.models.loading import attention_implementation, to_serving_dtype
from logprob_service.models.routed_llama4 import llama4_blocks
from logprob_service.models.scorer import model_body
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.helpers import tolerances

VOCAB = 517  # odd on purpose: no power-of-two assumptions
MAX_POSITIONS = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POSITIONS,  # the service refuses longer sequences; make_model can raise it
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _llama(tied: bool, common: dict) -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=tied))


def _qwen2(tied: bool, common: dict) -> PreTrainedModel:
    return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=tied))


def _gemma2(tied: bool, common: dict) -> PreTrainedModel:
    config = Gemma2Config(
        **common,
        head_dim=16,
        tie_word_embeddings=tied,
        final_logit_softcapping=3.0,  # low, so the cap really bends the logits
        attn_logit_softcapping=20.0,
        sliding_window=8,  # shorter than the test sequences, so the window matters
    )
    return Gemma2ForCausalLM(config)


def _cohere(tied: bool, common: dict) -> PreTrainedModel:
    return CohereForCausalLM(CohereConfig(**common, tie_word_embeddings=tied, logit_scale=0.5))


def _granite(tied: bool, common: dict) -> PreTrainedModel:
    return GraniteForCausalLM(GraniteConfig(**common, tie_word_embeddings=tied, logits_scaling=4.0))


# The families RL trains now (issue 42), each with the feature that sets its attention apart made to
# matter at the test lengths (windows and chunks shorter than the test sequences). Experts: a few,
# tiny; top-k of them per token.
ROUTER_SPREAD = 4.0  # router logits of std ~4: near-ties between experts' logits are rare
WINDOW = 8  # sliding windows and attention chunks: shorter than the test sequences (up to ~80 tokens)


def _llama3(tied: bool, common: dict) -> PreTrainedModel:
    # Llama 3.1's rope scaling, with its original context short enough that the scaled and the
    # smoothed frequency bands both occur at head_dim 16 (wavelengths 6 to 6e3 positions).
    rope = dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    return LlamaForCausalLM(LlamaConfig(**common, head_dim=16, tie_word_embeddings=tied, rope_parameters=rope))


def _qwen3(tied: bool, common: dict) -> PreTrainedModel:
    return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=tied))  # q/k RMS norms


def _qwen3_moe(tied: bool, common: dict) -> PreTrainedModel:
    config = Qwen3MoeConfig(
        **{"head_dim": 16, "moe_intermediate_size": 32, **common},  # dims may set either
        tie_word_embeddings=tied,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    return Qwen3MoeForCausalLM(config)


def _gemma3(tied: bool, common: dict) -> PreTrainedModel:
    config = Gemma3TextConfig(
        **common,
        head_dim=16,
        tie_word_embeddings=tied,
        query_pre_attn_scalar=24,  # its scaling is 24^-0.5, not head_dim^-0.5
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],  # local then global (5:1 in the real models)
    )
    return Gemma3ForCausalLM(config)


def _mistral(tied: bool, common: dict) -> PreTrainedModel:
    return MistralForCausalLM(MistralConfig(**common, head_dim=16, tie_word_embeddings=tied, sliding_window=WINDOW))


def _phi3(tied: bool, common: dict) -> PreTrainedModel:
    # Fused qkv and gate_up projections; Phi-3's sliding window (2047 in the mini model) made short.
    return Phi3ForCausalLM(Phi3Config(**common, tie_word_embeddings=tied, sliding_window=WINDOW + 3))


def _gpt_oss(tied: bool, common: dict) -> PreTrainedModel:
    config = GptOssConfig(
        **common,
        head_dim=16,
        tie_word_embeddings=tied,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],  # alternating, as in gpt-oss
        num_local_experts=4,
        num_experts_per_tok=2,
        # gpt-oss's YaRN, its original context a 32nd of the test's (as 4096 is of 131072)
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=common["max_position_embeddings"] // 32,
        ),
    )
    return GptOssForCausalLM(config)  # attention sinks: one learned logit per head (make_model sets them)


def _llama4(tied: bool, common: dict) -> PreTrainedModel:
    config = Llama4TextConfig(
        **common,
        head_dim=16,
        tie_word_embeddings=tied,
        intermediate_size_mlp=96,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,  # layer 0 dense, layer 1 MoE (with its shared expert)
        no_rope_layers=[1, 0],  # layer 0: rope, chunked attention; layer 1: NoPE, full attention
        attention_chunk_size=WINDOW,
        attn_temperature_tuning=True,
        floor_scale=4,  # NoPE queries scaled by position from position 3 on (8192 in the real models)
        attn_scale=0.1,
    )
    return Llama4ForCausalLM(config)


def _deepseek_v3(tied: bool, common: dict) -> PreTrainedModel:
    # MLA: queries and keys of 16 + 8 (rope) dims, values of 12; heads read no shared K/V.
    common = {**common, "num_key_value_heads": common["num_attention_heads"]}
    config = DeepseekV3Config(
        **common,
        tie_word_embeddings=tied,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
    )
    return DeepseekV3ForCausalLM(config)


ARCHITECTURES = {
    "llama": _llama,
    "qwen2": _qwen2,
    "gemma2": _gemma2,
    "cohere": _cohere,
    "granite": _granite,
    "llama3": _llama3,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gemma3": _gemma3,
    "mistral": _mistral,
    "phi3": _phi3,
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "deepseek_v3": _deepseek_v3,
}


def make_model(
    arch: str,
    *,
    tied: bool,
    seed: int,
    dtype: torch.dtype = torch.float32,
    max_positions: int = MAX_POSITIONS,
    dims: dict | None = None,
) -> PreTrainedModel:
    """A random model whose logits have a realistic spread (std ~1, not near-uniform).

    ``max_positions``: the longest sequence the service will score with it (the positions are
    rotary, so only the limit changes, not the model's maths). ``dims``: config sizes other than
    ``COMMON``'s (e.g. widths that are multiples of a quantization block)."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch](tied, {**COMMON, **(dims or {}), "max_position_embeddings": max_positions})
    model.set_attn_implementation(attention_implementation(model.config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
            elif p.dim() == 3:  # stacked experts [E, in, out] or [E, out, in]: the smaller dim is ~ the fan-in
                p.normal_(0.0, 1.0 / min(p.shape[1:]) ** 0.5)
            elif name.endswith(".sinks"):  # gpt-oss's sink logits, of the scores' size: a sink takes a real share
                p.normal_(0.0, 1.0)
        for module in model.modules():
            # Routers (Qwen3MoeTopKRouter, GptOssTopKRouter, Llama4Router, DeepseekV3TopkRouter) with a
            # spread that decides the top-k: rounding (float32 against float64) flips no choice, as in
            # tests/helpers/moe.py.
            if "router" in type(module).__name__.lower():
                module.weight.mul_(ROUTER_SPREAD)
        model.get_output_embeddings().weight.mul_(2.0)  # logits std ~2, like a trained LM's
    return to_serving_dtype(model, dtype).eval()  # buffers (RoPE frequencies) as transformers keeps them


def random_sequences(rng: np.random.Generator, n: int, vocab: int = VOCAB, max_len: int = 40) -> list[TokenSequence]:
    """Fresh random sequences of mixed lengths, including length-1 prompts and completions."""
    seqs = []
    for i in range(n):
        p = 1 if i == 0 else int(rng.integers(1, max_len))
        c = 1 if i == 1 else int(rng.integers(1, max_len))
        seqs.append(
            TokenSequence(
                prompt_ids=rng.integers(0, vocab, p, dtype=np.int64),
                completion_ids=rng.integers(0, vocab, c, dtype=np.int64),
            )
        )
    return seqs


_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stock_copy(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A copy of ``model`` on the CPU in ``dtype`` (default: its own) with its stock attention (sdpa,
    or eager for softcapped attention): the model's own forward, whatever the scorer switched it to.
    Made once per dtype and state of the weights (tensor version counters tell an in-place change)."""
    dtype = dtype or next(model.parameters()).dtype
    state = tuple(p._version for p in model.parameters())
    copies = _COPIES.setdefault(model, {})
    cached = copies.get(dtype)
    if cached is not None and cached[0] == state:
        return cached[1]
    body = model_body(model) if isinstance(model, PreTrainedModel) else getattr(model, "base_model", model)
    with eager_layers(body):  # a deep copy keeps compiled forwards' binding
        reference = copy.deepcopy(model).to("cpu", dtype).eval()
    for block in llama4_blocks(reference):  # transformers' all-experts forward, not the routed one
        block.__dict__.pop("forward", None)
    config = getattr(reference, "config", None)
    if config is not None and hasattr(reference, "set_attn_implementation"):
        reference.set_attn_implementation(attention_implementation(config))
        if dtype == torch.float64 and getattr(config, "_experts_implementation", None) not in (None, "eager"):
            # transformers' default experts (grouped_mm) run no float64: the reference loops over experts
            reference.set_experts_implementation("eager")
    copies[dtype] = (state, reference)
    return reference


@torch.no_grad()
def forward_scores(
    model: torch.nn.Module, seq: TokenSequence, temperature: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Log-probs and entropies of one unpadded sequence from ``model``'s full logits, every step in
    the model's dtype (as a trainer computes them)."""
    ids = torch.from_numpy(np.concatenate([seq.prompt_ids, seq.completion_ids]))[None]
    logits = model(input_ids=ids).logits[0] / temperature  # [L, V]
    p = len(seq.prompt_ids)
    logp = logits[p - 1 : -1].log_softmax(-1)  # rows predicting the completion tokens
    target = torch.from_numpy(seq.completion_ids)
    token_logp = logp.gather(1, target[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp.double().numpy(), entropy.double().numpy()


def reference_scores(
    model: torch.nn.Module, seq: TokenSequence, temperature: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """The exact answer, to float64 rounding: log-probs and entropies from a float64 forward of ``model``."""
    return forward_scores(stock_copy(model, torch.float64), seq, temperature)


class ScoreReference:
    """The exact scores of ``sequences`` under ``model``, and how close a float32 path must come.

    The error of a path's scores against the float64 forward (``reference_scores``) may be at most
    ``tolerances.scores(own_error)``, ``own_error`` being the largest error of the model's own
    computation in ``dtype`` on the same sequences (tests/helpers/tolerances.py says why)."""

    def __init__(
        self,
        model: torch.nn.Module,
        sequences: Sequence[TokenSequence],
        temperature: float = 1.0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.exact = [reference_scores(model, seq, temperature) for seq in sequences]
        own = [forward_scores(stock_copy(model, dtype), seq, temperature) for seq in sequences]
        self.own_error = max(
            float(np.abs(got - want).max()) for pair in zip(own, self.exact) for got, want in zip(*pair)
        )
        self.atol = tolerances.scores(self.own_error, str(dtype).removeprefix("torch."))

    def check(self, logprobs: Sequence[np.ndarray], entropies: Sequence[np.ndarray] | None = None) -> None:
        assert len(logprobs) == len(self.exact)
        for i, (got, (want, want_entropy)) in enumerate(zip(logprobs, self.exact)):
            got = np.asarray(got)
            assert got.dtype == np.float32 and got.shape == want.shape, (i, got.dtype, got.shape, want.shape)
            where = f"sequence {i} (the model's own float32 error: {self.own_error:.2e})"
            np.testing.assert_allclose(got, want, atol=self.atol, rtol=0, err_msg=where)
            if entropies is not None:
                np.testing.assert_allclose(entropies[i], want_entropy, atol=self.atol, rtol=0, err_msg=where)


def assert_scores_close(
    model: torch.nn.Module,
    sequences: Sequence[TokenSequence],
    logprobs: Sequence[np.ndarray],
    entropies: Sequence[np.ndarray] | None = None,
    temperature: float = 1.0,
) -> None:
    """Scores from a float32 path are as exact as ``model``'s own float32 computation (``ScoreReference``)."""
    ScoreReference(model, sequences, temperature).check(logprobs, entropies)


def as_sequences(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> list[TokenSequence]:
    """Lists of token ids as ``TokenSequence``s."""
    return [
        TokenSequence(np.asarray(p, dtype=np.int64), np.asarray(c, dtype=np.int64))
        for p, c in zip(prompts, completions)
    ]
