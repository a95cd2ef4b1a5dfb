"""Mixture-of-experts models on the CPU: how their experts run, exactness, batch invariance of the
routing, and ``routed_experts`` against transformers' own router outputs.

Models: ``tests.helpers.moe`` (tiny Qwen3-MoE and gpt-oss, 8 experts, 2 per token). The service
runs the experts with transformers' own per-expert loop on the CPU and its grouped GEMMs on CUDA
(``models.loading.EXPERTS_IMPLEMENTATIONS``; tests/gpu/test_moe_cuda.py checks the CUDA side).
Expert ids are compared exactly on float64 models, whose rounding cannot flip a router's top-k.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logprob_service.domain import ScoreOptions, TokenSequence
from logprob_service.models.compiled import fusable_modules
from logprob_service.models.loading import expert_modules, load_causal_lm, use_experts_implementation
from logprob_service.models.routing import RoutedExperts, RoutingUnsupported, expert_count
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.served import serve_model
from logprob_service.worker.packing import pack

from tests.helpers.models import VOCAB, ScoreReference, make_model, random_sequences
from tests.helpers.moe import EXPERTS, MOE_ARCHITECTURES, TOP_K, hf_router_choices, make_moe_model

pytestmark = pytest.mark.numerical

EAGER = ScoringOptions(compile_layers="off")


def grouped_sequences(rng: np.random.Generator) -> list[TokenSequence]:
    """Mixed lengths (a 1-token prompt and a 1-token completion among them), and 3 completions of
    one prompt (a shared-prompt group when scored with ``share_prompts``)."""
    seqs = random_sequences(rng, 6)
    prompt = rng.integers(0, VOCAB, 17)
    seqs += [TokenSequence(prompt.copy(), rng.integers(0, VOCAB, int(rng.integers(1, 20)))) for _ in range(3)]
    return seqs


def scorer_for(model: torch.nn.Module, **options: object) -> CausalLMScorer:
    """A CPU scorer; skips gpt-oss while the packed attention lacks its sinks (issue 42, item 1)."""
    scorer = CausalLMScorer(model, options=ScoringOptions(compile_layers="off", **options))  # type: ignore[arg-type]
    try:
        scorer.launch(pack([TokenSequence(np.arange(1, 4), np.arange(4, 6))])).fetch()
    except NotImplementedError as err:
        if "sink" not in str(err):
            raise
        pytest.skip(f"packed attention: {err}")
    return scorer


def test_experts_run_the_models_own_loop_on_the_cpu_and_grouped_gemms_on_cuda_in_bf16(seed):
    model = make_moe_model("qwen3_moe", seed=seed, dtype=torch.bfloat16)
    model.set_experts_implementation("grouped_mm")
    assert len(expert_modules(model)) == model.config.num_hidden_layers
    assert use_experts_implementation(model, torch.device("cpu")) == "eager"
    assert model.config._experts_implementation == "eager"
    assert use_experts_implementation(model, torch.device("cuda")) == "grouped_mm"  # only reads the device type
    assert model.config._experts_implementation == "grouped_mm"
    # torch documents its CUDA grouped GEMM for bf16: a float32 model runs the loop there too.
    assert use_experts_implementation(model.float(), torch.device("cuda")) == "eager"
    dense = make_model("llama", tied=False, seed=seed)
    assert expert_modules(dense) == [] and use_experts_implementation(dense, torch.device("cuda")) is None


def test_the_scorer_reports_the_experts_path(seed):
    scorer = scorer_for(make_moe_model("qwen3_moe", seed=seed))
    assert scorer.experts == "eager"
    assert serve_model("m", "test", scorer).info.determinism.endswith("; experts: eager")
    dense = CausalLMScorer(make_model("llama", tied=False, seed=seed), options=EAGER)
    assert dense.experts is None and "experts" not in dense.determinism()


def test_a_checkpoint_loads_and_runs_in_float64_on_the_cpu(tmp_path, rng, seed):
    """transformers' default, grouped_mm, has no float64 CPU kernel: a float64 load used to fail
    at its first forward."""
    make_moe_model("qwen3_moe", seed=seed).save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path), device=torch.device("cpu"), dtype=torch.float64)
    assert model.config._experts_implementation == "eager"
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(rng.integers(0, VOCAB, (1, 12)))).logits
    assert logits.dtype == torch.float64 and torch.isfinite(logits).all()


def test_an_moe_block_is_not_compiled_whole_but_its_grouped_gemm_experts_are(seed):
    """The router stays eager (transformers' ops choose, routing hooks see it); the expert bank is
    compiled where it runs as grouped GEMMs (static shapes), never as the exact loop."""
    model = make_moe_model("gpt_oss", seed=seed)
    fused = {type(m).__name__ for m in fusable_modules(model.base_model)}
    assert fused == {"GptOssRMSNorm"}, fused  # the CPU's loop: GptOssMLP and its experts stay eager
    model.set_experts_implementation("grouped_mm")
    fused = {type(m).__name__ for m in fusable_modules(model.base_model)}
    assert fused == {"GptOssRMSNorm", "GptOssExperts"}, fused


@pytest.mark.parametrize("share_prompts", [True, False])
def test_moe_scores_are_exact_packed_and_with_shared_prompts(share_prompts, rng, seed):
    model = make_moe_model("qwen3_moe", seed=seed)
    seqs = grouped_sequences(rng)
    launched = scorer_for(model, share_prompts=share_prompts).launch(
        pack(seqs, share_prompts=share_prompts), ScoreOptions(return_entropy=True)
    )
    scores = launched.fetch()
    ScoreReference(model, seqs).check([s.logprobs for s in scores], [s.entropies for s in scores])


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_routed_experts_are_the_models_own_router_choices(arch, rng, seed):
    """Packed rows with shared prompts, and one long sequence run in chunks (each router called
    once a chunk), against transformers' forward of each sequence alone."""
    model = make_moe_model(arch, seed=seed, dtype=torch.float64)
    seqs = grouped_sequences(rng)
    long = TokenSequence(rng.integers(0, VOCAB, 30), rng.integers(0, VOCAB, 50))
    scorer = scorer_for(model, long_sequence_tokens=64, chunk_tokens=23)
    routed = scorer.launch(pack(seqs), ScoreOptions(return_routed_experts=True)).fetch_routed_experts()
    routed += scorer.launch(pack([long]), ScoreOptions(return_routed_experts=True)).fetch_routed_experts()
    for i, (got, seq) in enumerate(zip(routed, [*seqs, long], strict=True)):
        want = hf_router_choices(model, seq)
        assert got.dtype == np.int16 and got.shape == (len(seq.completion_ids), 2, TOP_K), (i, got.shape)
        np.testing.assert_array_equal(got, want, err_msg=f"sequence {i}")


def test_llama4_routed_experts_are_its_routers_choices(rng, seed):
    """Llama 4's router returns (scores, logits), no ids: the capture takes the top-k of the logits
    as the router does. Its blocks run on the routed rows (models.routed_llama4); its causal LM
    class names no routers (its text model does)."""
    model = make_model("llama4", tied=False, seed=seed, dtype=torch.float64)
    seqs = grouped_sequences(rng)
    scorer = scorer_for(model)
    assert scorer.num_experts == model.config.num_local_experts
    routed = scorer.launch(pack(seqs), ScoreOptions(return_routed_experts=True)).fetch_routed_experts()
    for i, (got, seq) in enumerate(zip(routed, seqs, strict=True)):
        assert got.shape == (len(seq.completion_ids), 1, 1), (i, got.shape)  # one MoE layer, top-1
        np.testing.assert_array_equal(got, hf_router_choices(model, seq), err_msg=f"sequence {i}")


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_the_capture_reads_what_output_router_logits_reads(arch, rng, seed):
    """The hooks on the model's own (unpacked) forward, gpt-oss included while the scorer cannot run it."""
    model = make_moe_model(arch, seed=seed, dtype=torch.float64)
    seq = TokenSequence(rng.integers(0, VOCAB, 9), rng.integers(0, VOCAB, 14))
    ids = torch.from_numpy(np.concatenate([seq.prompt_ids, seq.completion_ids]))[None]
    with RoutedExperts(model) as capture, torch.no_grad():
        model(input_ids=ids)
    rows = torch.arange(len(seq.prompt_ids) - 1, ids.shape[1] - 1)
    np.testing.assert_array_equal(capture.ids(rows).numpy(), hf_router_choices(model, seq))


def test_routing_and_scores_do_not_depend_on_the_micro_batch(rng, seed):
    """Each sequence's routed experts, alone and in random mixes (random order, with and without
    shared prompts), are identical; its scores agree to float64 rounding. (Bitwise equality of
    the scores is a CUDA property: tests/gpu/test_moe_cuda.py.)"""
    model = make_moe_model("qwen3_moe", seed=seed, dtype=torch.float64)
    seqs = grouped_sequences(rng)
    scorers = {share: scorer_for(model, share_prompts=share) for share in (True, False)}

    def run(chosen: list[int], share: bool) -> list[tuple[np.ndarray, np.ndarray]]:
        batch = [seqs[i] for i in chosen]
        launched = scorers[share].launch(pack(batch, share_prompts=share), ScoreOptions(return_routed_experts=True))
        return [(s.logprobs, r) for s, r in zip(launched.fetch(), launched.fetch_routed_experts(), strict=True)]

    alone = [run([i], True)[0] for i in range(len(seqs))]
    for mix in range(6):
        chosen = [int(i) for i in rng.permutation(len(seqs))[: int(rng.integers(2, len(seqs) + 1))]]
        share = bool(mix % 2)
        for i, (logprobs, routed) in zip(chosen, run(chosen, share), strict=True):
            np.testing.assert_array_equal(routed, alone[i][1], err_msg=f"mix {mix}: sequence {i}")
            np.testing.assert_allclose(logprobs, alone[i][0], rtol=0, atol=1e-5, err_msg=f"mix {mix}: sequence {i}")


def test_routed_experts_of_a_dense_model_or_of_a_launch_without_them_are_refused(rng, seed):
    dense = CausalLMScorer(make_model("llama", tied=False, seed=seed), options=EAGER)
    seqs = random_sequences(rng, 2)
    with pytest.raises(RoutingUnsupported, match="LlamaForCausalLM has no mixture-of-experts router"):
        dense.launch(pack(seqs), ScoreOptions(return_routed_experts=True))
    moe = scorer_for(make_moe_model("qwen3_moe", seed=seed))
    with pytest.raises(ValueError, match="launched without return_routed_experts"):
        moe.launch(pack(seqs)).fetch_routed_experts()


@pytest.mark.parametrize(
    ("arch", "experts"), [("qwen3_moe", EXPERTS), ("gpt_oss", EXPERTS), ("llama", 0), ("llama4", 4)]
)
def test_listmodels_num_experts_says_whose_routing_can_be_returned(arch, experts, seed):
    """A model whose routers give their top-k ids counts its experts (Llama 4's from its logits);
    a dense model 0: the engine then refuses return_routed_experts by name instead of failing in
    the launch."""
    model = make_moe_model(arch, seed=seed) if arch in MOE_ARCHITECTURES else make_model(arch, tied=False, seed=seed)
    assert expert_count(model) == experts
    scorer = CausalLMScorer(model, options=EAGER)
    assert scorer.num_experts == experts and serve_model("m", "test", scorer).info.num_experts == experts
