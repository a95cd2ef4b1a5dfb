"""A mixture-of-experts model over a tensor-parallel group of two CPU processes (gloo): attention
heads sharded by transformers' plan, the experts split by expert (``models.tensor_parallel``).

The tiny Qwen3-MoE is saved as a checkpoint (each expert's matrices apart, as real checkpoints keep
them); each rank reads its heads and its 4 of the 8 experts, scores packed rows (shared prompts, and a
long sequence in chunks) with routed experts, and rank 0 writes what it got. Checked against the
whole model: scores, routed experts equal to transformers' own router choices, the fingerprint the
whole model's (each sharded weight digested whole).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from logprob_service.domain import ScoreOptions, TokenSequence
from logprob_service.models.loading import ModelLoadError, expert_modules
from logprob_service.models.scorer import CausalLMScorer, ScoringOptions
from logprob_service.models.tensor_parallel import TensorParallel, body_plan, load_sharded_causal_lm
from logprob_service.models.weights import fingerprint, model_digests, model_fingerprint
from logprob_service.worker.packing import pack
from torch.distributed.device_mesh import DeviceMesh

from tests.helpers.models import VOCAB, reference_scores
from tests.helpers.moe import EXPERTS, hf_router_choices, make_moe_model
from tests.helpers.processes import leave_rank
from tests.models.test_moe import grouped_sequences

pytestmark = pytest.mark.numerical

WORLD = 2


def _rank(rank: int, directory: str, dtype: torch.dtype, sequences: list[list[TokenSequence]], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=WORLD)
    try:
        tp = TensorParallel(rank=rank, world=WORLD, mesh=DeviceMesh("cpu", list(range(WORLD))))
        model = load_sharded_causal_lm(f"{directory}/model", tp, device=torch.device("cpu"), dtype=dtype)
        print_ = fingerprint(model_digests(model))  # a collective: every rank calls it
        options = ScoringOptions(compile_layers="off", long_sequence_tokens=64, chunk_tokens=23)
        scorer = CausalLMScorer(model, options=options, tensor_parallel=tp)
        assert scorer.num_experts == EXPERTS  # the router's choices are capturable on every rank (ListModels)
        results = []
        for batch in sequences:
            launched = scorer.launch(pack(batch), ScoreOptions(return_routed_experts=True))
            results.append(([s.logprobs for s in launched.fetch()], launched.fetch_routed_experts()))
        held = [experts.gate_up_proj.to_local().shape[0] for experts in expert_modules(model.base_model)]
        if rank == 0:
            Path(out).write_bytes(pickle.dumps((print_, held, results)))
    finally:
        dist.destroy_process_group()
    leave_rank()


def sharded_run(
    tmp_path: Path, model: torch.nn.Module, batches: list[list[TokenSequence]]
) -> tuple[str, list[int], list]:
    model.save_pretrained(tmp_path / "model")
    out = tmp_path / "rank0.pkl"
    dtype = next(model.parameters()).dtype
    mp.start_processes(_rank, args=(str(tmp_path), dtype, batches, str(out)), nprocs=WORLD, start_method="spawn")
    return pickle.loads(out.read_bytes())


def test_an_moe_model_served_over_two_ranks_scores_and_routes_as_the_whole_model(tmp_path, rng, seed):
    """In float64, so that rounding cannot flip a router's top-k and the ids compare exactly; the
    scores (float32 out of the log-prob op) against the float64 forward to float32 rounding."""
    model = make_moe_model("qwen3_moe", seed=seed, dtype=torch.float64)
    seqs = grouped_sequences(rng)
    long = TokenSequence(rng.integers(0, VOCAB, 30), rng.integers(0, VOCAB, 50))
    got_print, held, results = sharded_run(tmp_path, model, [seqs, [long]])
    assert held == [EXPERTS // WORLD] * model.config.num_hidden_layers  # rank 0 holds half the experts
    assert got_print == model_fingerprint(model)
    logprobs = [lp for batch, _ in results for lp in batch]
    routed = [r for _, batch in results for r in batch]
    for i, (got, ids, seq) in enumerate(zip(logprobs, routed, [*seqs, long], strict=True)):
        want, _ = reference_scores(model, seq)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"sequence {i}")
        np.testing.assert_array_equal(ids, hf_router_choices(model, seq), err_msg=f"sequence {i}")


def test_experts_that_do_not_split_over_the_ranks_are_refused(seed):
    config = make_moe_model("qwen3_moe", seed=seed).config
    config.num_experts = 7
    with pytest.raises(ModelLoadError, match="num_experts = 7 does not split over 2 ranks"):
        body_plan(config, 2)


def test_a_model_whose_plan_shards_none_of_its_layers_is_refused(seed):
    config = make_moe_model("qwen3_moe", seed=seed).config
    config.base_model_tp_plan = {"embed_tokens": "embedding_rowwise"}  # as gpt-oss's own: the embedding only
    with pytest.raises(ModelLoadError, match="Qwen3MoeConfig has no tensor-parallel plan"):
        body_plan(config, 2)


def test_gpt_oss_gets_a_plan_for_its_attention(seed):
    """Its config plans only the embedding; its attention splits by head as Llama's (the sinks
    with the query heads: tests/models/test_quantized_tensor_parallel.py serves it so)."""
    plan = body_plan(make_moe_model("gpt_oss", seed=seed).config, 2)
    assert plan == {f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"} | {"layers.*.self_attn.o_proj": "rowwise"}
