"""Small random causal LMs of several architectures, and the float64 reference scorer."""

from __future__ import annotations

import numpy as np
import torch
from logprob_service.jobs import TokenSequence
from logprob_service.models.loading import attention_implementation
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 517  # odd on purpose: no power-of-two assumptions
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _llama(tied: bool) -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=tied))


def _qwen2(tied: bool) -> PreTrainedModel:
    return Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=tied))


def _gemma2(tied: bool) -> PreTrainedModel:
    config = Gemma2Config(
        **COMMON,
        head_dim=16,
        tie_word_embeddings=tied,
        final_logit_softcapping=3.0,  # low, so the cap really bends the logits
        attn_logit_softcapping=20.0,
        sliding_window=8,  # shorter than the test sequences, so the window matters
    )
    return Gemma2ForCausalLM(config)


def _cohere(tied: bool) -> PreTrainedModel:
    return CohereForCausalLM(CohereConfig(**COMMON, tie_word_embeddings=tied, logit_scale=0.5))


def _granite(tied: bool) -> PreTrainedModel:
    return GraniteForCausalLM(GraniteConfig(**COMMON, tie_word_embeddings=tied, logits_scaling=4.0))


ARCHITECTURES = {"llama": _llama, "qwen2": _qwen2, "gemma2": _gemma2, "cohere": _cohere, "granite": _granite}


def make_model(arch: str, *, tied: bool, seed: int, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A random model whose logits have a realistic spread (std ~1, not near-uniform)."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch](tied)
    model.set_attn_implementation(attention_implementation(model.config))
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
        model.get_output_embeddings().weight.mul_(2.0)  # logits std ~2, like a trained LM's
    return model.to(dtype).eval()


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


@torch.no_grad()
def reference_scores(
    model: PreTrainedModel, seq: TokenSequence, temperature: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Float64 log-probs and entropies from the model's own full logits, one unpadded sequence."""
    ids = torch.from_numpy(np.concatenate([seq.prompt_ids, seq.completion_ids]))[None].to(model.device)
    logits = model(input_ids=ids).logits[0].double().cpu() / temperature  # [L, V]
    p = len(seq.prompt_ids)
    logp = logits[p - 1 : -1].log_softmax(-1)  # rows predicting the completion tokens
    target = torch.from_numpy(seq.completion_ids)
    token_logp = logp.gather(1, target[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp.numpy(), entropy.numpy()
