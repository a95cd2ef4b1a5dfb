"""The embedded default model: a small Llama-architecture model with seeded random weights.

Made locally from a fixed config and a fixed seed, so a machine with no network can serve and
test, and every machine gets the same weights (tests pin their fingerprint). Its tokenizer is
made locally too (character-level), for trainers that need text in and out (TRL's GRPOTrainer).
"""

from __future__ import annotations

import math

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

BUILTIN_PREFIX = "builtin:"
SEED = 20261121


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@torch.no_grad()
def seeded_init_(model: PreTrainedModel, seed: int = SEED) -> PreTrainedModel:
    """Overwrite every parameter from one CPU generator, in sorted name order.

    Norm scales (1-D) are ones; embeddings are N(0, 1); linear weights are N(0, 1/fan_in), so
    activations stay O(1) and the logits have a spread like a trained model's (std ~1), which
    makes log-prob tests meaningful (near-uniform outputs would hide errors).
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for _, param in sorted(model.named_parameters()):
        if param.dim() == 1:
            param.fill_(1.0)
            continue
        values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        std = 1.0 if param is model.get_input_embeddings().weight else 1.0 / math.sqrt(param.shape[1])
        param.copy_(values * std)
    return model


BUILTIN_MODELS = {"tiny-llama": tiny_llama_config}

# Ids 0, 1, 2 are the config's pad, bos and eos; 3 stands for any character not in the vocabulary.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def tiny_llama_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer covering the whole vocabulary of ``builtin:tiny-llama``.

    Printable ASCII and newline are one token each; the remaining ids up to ``vocab_size`` are
    placeholders (``<#17>``, no letters in them) so that every id the model can sample decodes to something.
    """
    vocab_size = tiny_llama_config().vocab_size
    chars = ["\n", *(chr(c) for c in range(32, 127))]
    fillers = [f"<#{i}>" for i in range(vocab_size - len(SPECIAL_TOKENS) - len(chars))]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars, *fillers])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # One piece per character; in Oniguruma (the regex engine of `tokenizers`) (?m) lets "." match a newline.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m:.)"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # characters join without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def build_builtin(name: str) -> PreTrainedModel:
    """Build ``builtin:<name>`` in float32 on the CPU."""
    try:
        make_config = BUILTIN_MODELS[name]
    except KeyError:
        known = ", ".join(BUILTIN_PREFIX + k for k in BUILTIN_MODELS)
        raise ValueError(f"unknown builtin model {BUILTIN_PREFIX + name!r}; known: {known}") from None
    model = LlamaForCausalLM(make_config())
    model.set_attn_implementation("sdpa")
    return seeded_init_(model).eval()
