"""``deterministic``: on CUDA every sequence's log-probs and entropies are bit for bit those it gets
scored alone, whatever shares its micro-batch, request, connection or server process.

Models: two decoder layers of the real Llama-3.2-1B (hidden 2048, 32/8 heads, vocab 128256) and
Qwen2.5-0.5B (hidden 896, 14/2 heads, vocab 151936, tied) shapes in bf16, so the GEMMs have the
sizes at which cuBLAS would split K and the lm_head plan its real vocabulary. A pool of sequences
of 1 to 8192 tokens, some in groups sharing a prompt (scored with shared prompts on: a completion
scored in a group equals itself scored in another mix of groups, or alone).

* In-process: 200 random mixes of 1 to 64 of them, in random order, under three micro-batch
  budgets (so a sequence lands in different micro-batches, at different rows, beside different
  prompts), each compared with the sequence scored alone.
* Through gRPC: a base model and a LoRA model on it; concurrent clients send random mixes cut
  into random request splits; then the server restarts and scores every sequence alone again.
"""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch
from logprob_client import AsyncLogprobClient
from logprob_service.domain import TokenSequence
from logprob_service.models.scorer import ScoringOptions
from logprob_service.offline import OfflineScorer
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from tests.helpers.server import as_lists, new_seed, settings, start, stop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.numerical,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIXES = 200
BUDGETS = (4096, 16384, 65536)
LONGEST = 8192
SHAPES = {
    "llama": lambda: LlamaForCausalLM(
        LlamaConfig(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=LONGEST, tie_word_embeddings=False,
        )
    ),
    "qwen2": lambda: Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=2, num_attention_heads=14,
            num_key_value_heads=2, vocab_size=151936, max_position_embeddings=LONGEST, tie_word_embeddings=True,
        )
    ),
}  # fmt: skip


@pytest.fixture(autouse=True)
def restore_cublas_settings():
    """``deterministic`` pins cuBLAS for the whole process (ops.determinism): give the tests after
    this file the settings they started with."""
    matmul = torch.backends.cuda.matmul
    library = torch.backends.cuda.preferred_blas_library()
    bf16 = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction_split_k)
    fp16 = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction_split_k)
    yield
    matmul.allow_bf16_reduced_precision_reduction = bf16
    matmul.allow_fp16_reduced_precision_reduction = fp16
    torch.backends.cuda.preferred_blas_library(library)


def shape_model(arch: str, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    return SHAPES[arch]().to(torch.bfloat16).eval()


def pool(rng: np.random.Generator, vocab: int) -> list[TokenSequence]:
    """48 sequences: mostly short, a few long (up to 8192 tokens), and 4 prompts shared by 4 each."""
    seqs = []
    for _ in range(32):
        lengths = [rng.integers(2, 300), rng.integers(300, 2048), rng.integers(2048, LONGEST + 1)]
        total = int(rng.choice(lengths, p=[0.6, 0.3, 0.1]))
        prompt = int(rng.integers(1, total))
        seqs.append(TokenSequence(rng.integers(0, vocab, prompt), rng.integers(0, vocab, total - prompt)))
    for _ in range(4):
        prompt = rng.integers(0, vocab, int(rng.integers(1, 1500)))
        seqs += [TokenSequence(prompt.copy(), rng.integers(0, vocab, int(rng.integers(1, 600)))) for _ in range(4)]
    return seqs


def same_bits(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray], where: str) -> None:
    for field, a, b in zip(("logprobs", "entropies"), got, want, strict=True):
        assert a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32)), (
            f"{where}: {field} differ by up to {np.abs(a - b).max():.3g}"
        )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_sequence_scores_as_it_does_alone(arch, rng, seed):
    model = shape_model(arch, seed).cuda()
    seqs = pool(rng, model.config.vocab_size)
    options = ScoringOptions(deterministic=True)
    scorers = [OfflineScorer(model, options=options, max_batch_tokens=budget) for budget in BUDGETS]
    try:
        assert "bitwise batch-invariant" in scorers[0].scorer.determinism(), scorers[0].scorer.determinism()
        alone = [(s.logprobs, s.entropies) for seq in seqs for s in scorers[0].score([seq], return_entropy=True)]
        for mix in range(MIXES):
            size = int(rng.integers(1, 65))
            chosen = rng.choice(len(seqs), size=min(size, len(seqs)), replace=False)
            budget = int(rng.integers(len(BUDGETS)))
            out = scorers[budget].score([seqs[i] for i in chosen], return_entropy=True)
            for i, got in zip(chosen, out, strict=True):
                where = f"mix {mix} (budget {BUDGETS[budget]}): sequence {i}"
                same_bits((got.logprobs, got.entropies), alone[i], where)
    finally:
        for scorer in scorers:
            scorer.close()


async def score_alone(target: str, model: str, seqs: list[TokenSequence]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each sequence in its own request, one at a time: nothing else in its micro-batch."""
    async with AsyncLogprobClient(target, model=model) as client:
        out = []
        for seq in seqs:
            (logprobs,), (entropies,) = await client.score(*as_lists([seq]), return_entropy=True)
            out.append((logprobs, entropies))
        return out


async def test_through_grpc_with_lora_concurrent_clients_and_a_restart(tmp_path, rng):
    base = shape_model("qwen2", new_seed(rng))
    base.save_pretrained(tmp_path / "base")
    torch.manual_seed(new_seed(rng))
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    get_peft_model(copy.deepcopy(base), lora).save_pretrained(tmp_path / "adapter")
    models = {"ref": str(tmp_path / "base"), "policy": f"ref+{tmp_path / 'adapter'}"}
    config = settings(
        models, device="cuda", dtype="bfloat16", deterministic=True, max_batch_tokens=16384,
        max_tokens_per_request=65536, max_sequences_per_request=64,
    )  # fmt: skip
    seqs = pool(rng, base.config.vocab_size)

    async def client_mixes(model: str, client_seed: int) -> list[tuple[int, tuple[np.ndarray, np.ndarray]]]:
        """Random mixes, each one call cut into random request sizes, from one client."""
        local = np.random.default_rng(client_seed)
        answers = []
        split = int(local.integers(1, 17))
        async with AsyncLogprobClient(running.target, model=model, max_sequences_per_rpc=split) as client:
            for _ in range(6):
                chosen = local.choice(len(seqs), size=int(local.integers(1, 33)), replace=False)
                logprobs, entropies = await client.score(*as_lists([seqs[i] for i in chosen]), return_entropy=True)
                answers += list(zip(chosen.tolist(), zip(logprobs, entropies, strict=True), strict=True))
        return answers

    running = await start(config)
    try:
        alone = {model: await score_alone(running.target, model, seqs) for model in models}
        for model in models:
            clients = await asyncio.gather(*(client_mixes(model, new_seed(rng)) for _ in range(4)))
            for c, answers in enumerate(clients):
                for i, got in answers:
                    same_bits(got, alone[model][i], f"{model}, client {c}: sequence {i}")
    finally:
        await stop(running)
    running = await start(config)
    try:
        for model in models:
            after_restart = await score_alone(running.target, model, seqs)
            for i, got in enumerate(after_restart):
                same_bits(got, alone[model][i], f"{model} after a restart: sequence {i}")
    finally:
        await stop(running)
