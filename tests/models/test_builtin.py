"""The embedded default model is the same everywhere: fixed config, seeded weights, pinned
fingerprint; its tokenizer is made locally and covers its whole vocabulary."""

from __future__ import annotations

import string

import pytest
import torch
from logprob_service.models.builtin import build_builtin, tiny_llama_config, tiny_llama_tokenizer
from logprob_service.models.weights import model_fingerprint

# blake2b over the float32 weights' byte digests (models/weights.py, ops/digest.py); if this
# changes, every user's builtin model (or the digest, as on 2026-11-23) changed with it.
TINY_LLAMA_FINGERPRINT = "c9ba0c43b8765c83084854e6615f6c6d"


def test_builtin_is_deterministic_and_pinned():
    a, b = build_builtin("tiny-llama"), build_builtin("tiny-llama")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    fingerprint = model_fingerprint(a)
    assert fingerprint == TINY_LLAMA_FINGERPRINT


def test_fingerprint_changes_with_any_weight():
    model = build_builtin("tiny-llama")
    before = model_fingerprint(model)
    with torch.no_grad():
        model.model.layers[2].mlp.up_proj.weight[3, 5] += 1e-3
    assert model_fingerprint(model) != before


def test_builtin_logits_are_spread_like_a_trained_model():
    model = build_builtin("tiny-llama")
    ids = torch.randint(0, 4096, (1, 64))
    with torch.no_grad():
        logits = model(ids).logits
    assert 0.5 < logits.std().item() < 5  # neither near-uniform nor saturated


def test_unknown_builtin():
    with pytest.raises(ValueError, match=r"builtin:nope.*builtin:tiny-llama"):
        build_builtin("nope")


def test_builtin_tokenizer_covers_the_vocabulary_and_round_trips_text(rng):
    config = tiny_llama_config()
    tokenizer = tiny_llama_tokenizer()
    assert len(tokenizer) == config.vocab_size
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        config.pad_token_id,
        config.bos_token_id,
        config.eos_token_id,
    )
    text = "".join(rng.choice(list(string.printable[:-5] + "\n"), 200))  # printable ASCII and newline
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text  # one token per character
    assert tokenizer("é")["input_ids"] == [tokenizer.unk_token_id]
    # Every id the model can sample decodes; placeholders carry no letters (toy rewards count letters).
    placeholders = tokenizer.convert_ids_to_tokens(list(range(100, config.vocab_size)))
    assert all(p.startswith("<#") and not any(ch.isalpha() for ch in p) for p in placeholders)
