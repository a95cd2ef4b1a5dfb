"""TRL's GRPOTrainer with the reference served by logprob-service, against TRL with its own
in-process reference: the same GRPO steps give the same per-token reference log-probs and the
same loss at every step, and no reference model is loaded by the trainer.

Both runs start from the same policy checkpoint (builtin:tiny-llama saved to disk, which is also
what TRL loads its in-process reference from) and the same seed, so they sample the same
completions; the service serves ``builtin:tiny-llama`` itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

pytest.importorskip("trl", reason="trl is optional: pip install trl==1.16.0 (CI gets it via the dev extra)")

import trl.trainer.grpo_trainer as grpo_module
from datasets import Dataset
from logprob_client import LogprobClient
from logprob_client.integrations.trl import RemotePolicy, RemoteReference, RemoteReferenceGRPOTrainer
from logprob_service.models.builtin import build_builtin, tiny_llama_tokenizer
from trl import GRPOConfig, GRPOTrainer

from tests.helpers.metrics import value
from tests.helpers.models import ScoreReference, as_sequences
from tests.helpers.server import start, stop, test_settings

STEPS = 3
BETA = 0.1  # the KL coefficient
SEED = 1234


@dataclass
class Run:
    """What one training run did, step by step."""

    prompt_ids: list[torch.Tensor] = field(default_factory=list)
    prompt_mask: list[torch.Tensor] = field(default_factory=list)
    completion_ids: list[torch.Tensor] = field(default_factory=list)
    completion_mask: list[torch.Tensor] = field(default_factory=list)
    ref_logps: list[torch.Tensor] = field(default_factory=list)
    old_logps: list[torch.Tensor] = field(default_factory=list)  # with num_iterations > 1
    policies: list[dict[str, torch.Tensor]] = field(default_factory=list)  # the policy's weights at each generation
    losses: list[float] = field(default_factory=list)
    models_loaded: int = 0
    trainer: GRPOTrainer | None = None


def loss_tolerance(reference_atol: float) -> float:
    """How far the two runs' losses may be apart, their reference log-probs ``reference_atol`` apart.

    The reference enters GRPO's loss only through the mean over tokens of beta * k3 with
    k3 = e^(r - p) - (r - p) - 1, whose derivative in r is e^(r - p) - 1: at most e - 1 < 2 while
    policy and reference stay within a nat, as in these few steps. The losses then differ by at
    most beta * 2 * (the sum of both runs' reference errors) <= beta * 2 * 2 * reference_atol.
    (The policies do not drift apart: both see the same samples and gradients that differ by as
    little.)"""
    return BETA * 4 * reference_atol


def low_id_reward(completion_ids: list[list[int]], **_) -> list[float]:
    """A toy reward that a random policy feels at once: the share of its tokens in the lower half
    of the vocabulary. (With no reward signal the two runs would drift apart for a reason that is
    not the reference: Adam turns float32 rounding in a zero gradient into full-size steps.)"""
    return [sum(t < 2048 for t in ids) / max(len(ids), 1) for ids in completion_ids]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:tiny-llama as a checkpoint, with 1 token in 10 ending a completion, so that
    completions have different lengths (and some are truncated, then masked out entirely)."""
    path = tmp_path_factory.mktemp("policy")
    model = build_builtin("tiny-llama")
    model.generation_config.eos_token_id = list(range(2, 2 + model.config.vocab_size // 10))
    model.save_pretrained(path)
    return path


def grpo_args(output_dir: Path, iterations: int = 1, learning_rate: float = 3e-3) -> GRPOConfig:
    return GRPOConfig(
        num_iterations=iterations,  # > 1: each batch serves several optimizer steps; TRL scores the old policy
        output_dir=str(output_dir),
        beta=BETA,
        temperature=0.9,  # not 1: the reference must be scored at the sampling temperature, as TRL does
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=12,
        mask_truncated_completions=True,
        max_steps=STEPS,
        learning_rate=learning_rate,  # 3e-3: large, so the policy leaves the reference and the KL term matters
        logging_steps=1,
        seed=SEED,
        bf16=False,  # float32 on the CPU: the comparison is about the reference, not about autocast
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )


def train(
    trainer_cls: type[GRPOTrainer],
    policy_dir: Path,
    output_dir: Path,
    iterations: int = 1,
    learning_rate: float = 3e-3,
    **kwargs,
) -> Run:
    """Train for STEPS steps, recording each step's batch, reference log-probs and loss, and how
    many models TRL loaded."""
    run = Run()
    load = grpo_module.create_model_from_path

    def counting_load(*args, **kw):
        run.models_loaded += 1
        return load(*args, **kw)

    prompts = ["The cat", "Once upon a time", "x", "Hello, world and"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpo_module, "create_model_from_path", counting_load)
        trainer = trainer_cls(
            model=str(policy_dir),
            reward_funcs=low_id_reward,
            args=grpo_args(output_dir, iterations, learning_rate),
            train_dataset=Dataset.from_dict({"prompt": prompts * 4}),
            processing_class=tiny_llama_tokenizer(),
            **kwargs,
        )
    generate, compute_loss = trainer._generate_and_score_completions, trainer.compute_loss

    def recording_generate(inputs):
        policy = trainer.accelerator.unwrap_model(trainer.model)
        run.policies.append({name: t.detach().clone() for name, t in policy.state_dict().items()})
        out = generate(inputs)
        if "old_per_token_logps" in out:
            run.old_logps.append(out["old_per_token_logps"].clone())
        run.prompt_ids.append(out["prompt_ids"].clone())
        run.prompt_mask.append(out["prompt_mask"].clone())
        run.completion_ids.append(out["completion_ids"].clone())
        run.completion_mask.append(out["completion_mask"].clone())
        run.ref_logps.append(out["ref_per_token_logps"].clone())
        return out

    def recording_compute_loss(*args, **kw):
        loss = compute_loss(*args, **kw)
        run.losses.append(loss.item())
        return loss

    trainer._generate_and_score_completions = recording_generate
    trainer.compute_loss = recording_compute_loss
    transformers.set_seed(SEED)  # both runs sample from the same RNG state
    trainer.train()
    run.trainer = trainer
    return run


def scored_rows(run: Run, generation: int) -> tuple[list[int], list]:
    """The rows of a generated batch with a completion token, and their unpadded sequences."""
    mask = run.completion_mask[generation].bool()
    rows = [i for i in range(len(mask)) if mask[i].any()]
    prompts = [run.prompt_ids[generation][i][run.prompt_mask[generation][i].bool()].tolist() for i in rows]
    return rows, as_sequences(prompts, [run.completion_ids[generation][i][mask[i]].tolist() for i in rows])


async def test_remote_reference_matches_in_process_reference(gemma_checkpoint, policy_dir, tmp_path):
    local = await asyncio.to_thread(train, GRPOTrainer, policy_dir, tmp_path / "local")
    running = await start(test_settings(gemma_checkpoint, models={"default": "builtin:tiny-llama"}))
    shared_before = value("logprob_prompt_tokens_shared_total", model="default")
    try:
        # 3 rows per RPC: each step's reference scoring goes as several RPCs in flight, and a group
        # of 4 completions is cut (its prompt then sent, and run, once per part).
        with LogprobClient(running.target, max_sequences_per_rpc=3) as client:
            remote = await asyncio.to_thread(
                train,
                RemoteReferenceGRPOTrainer,
                policy_dir,
                tmp_path / "remote",
                reference=RemoteReference(client, model="default"),
            )
    finally:
        await stop(running)

    assert local.models_loaded == 2 and remote.models_loaded == 1  # the remote run loaded only the policy
    # TRL lays a prompt's 4 completions out in consecutive rows: the client sent them as groups.
    assert value("logprob_prompt_tokens_shared_total", model="default") > shared_before
    assert not isinstance(remote.trainer.ref_model, torch.nn.Module) and remote.trainer.beta == 0.1
    assert len(local.ref_logps) == len(remote.ref_logps) == STEPS
    assert len(local.losses) == len(remote.losses) == STEPS
    saw_padding = saw_masked_row = False
    for step in range(STEPS):
        assert torch.equal(local.completion_ids[step], remote.completion_ids[step]), f"step {step}: other samples"
        mask = remote.completion_mask[step].bool()
        assert torch.equal(local.completion_mask[step].bool(), mask)
        saw_padding |= bool((~mask).any())
        saw_masked_row |= bool((~mask.any(-1)).any())
        # Both runs' reference log-probs against the exact answer: each is a float32 forward of the
        # model (TRL's on a padded batch), as exact as the model's own on unpadded sequences.
        rows, sequences = scored_rows(remote, step)
        reference = ScoreReference(build_builtin("tiny-llama"), sequences, temperature=grpo_args(tmp_path).temperature)
        for run in (remote, local):
            reference.check([run.ref_logps[step][i][mask[i]].numpy() for i in rows])
        assert abs(remote.losses[step] - local.losses[step]) <= loss_tolerance(reference.atol), step
    assert saw_padding and saw_masked_row, "the batches should exercise padding and fully masked rows"
    kl = [h["kl"] for h in remote.trainer.state.log_history if "kl" in h]
    assert len(kl) == STEPS and kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 0  # policy left the reference


@pytest.fixture
async def tiny_and_gemma(gemma_checkpoint):
    running = await start(test_settings(gemma_checkpoint))
    yield running
    await stop(running)


@pytest.mark.parametrize(
    "served,match",
    [
        ("nope", "reference.model='nope': the service serves no such model"),
        ("gemma", "vocabulary of 517 tokens but the policy's config has 4096"),
    ],
)
async def test_served_model_is_checked_at_construction(tiny_and_gemma, policy_dir, tmp_path, served, match):
    def build():
        with LogprobClient(tiny_and_gemma.target) as client:
            RemoteReferenceGRPOTrainer(
                model=str(policy_dir),
                reward_funcs=low_id_reward,
                args=grpo_args(tmp_path),
                train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}),
                processing_class=tiny_llama_tokenizer(),
                reference=RemoteReference(client, model=served),
            )

    with pytest.raises(ValueError, match=match):
        await asyncio.to_thread(build)


OLD_POLICY_LR = 1e-4  # one optimizer step moves the policy's log-probs by hundredths of a nat


def old_policy_loss_tolerance(old_error: float, reference_atol: float) -> float:
    """How far the two runs' losses may be apart when their old-policy log-probs are ``old_error``
    apart (and their reference ones as in ``loss_tolerance``). The old policy enters GRPO's loss per
    token as -A e^(p - o) (unclipped): its derivative in o is A e^(p - o), with |A| <= (G - 1) / sqrt(G)
    = 1.5 for groups of 4 (normalized by the std with Bessel's correction) and e^(p - o) < 1.5 while
    one optimizer step moves the policy by much less than half a nat (learning rate OLD_POLICY_LR):
    at most 2.25 * old_error."""
    return 2.25 * old_error + loss_tolerance(reference_atol)


async def test_old_policy_logps_scored_by_the_service_match_trl_s_own(gemma_checkpoint, policy_dir, tmp_path):
    """num_iterations=2: TRL scores the old policy while generating. With ``old_policy``, the
    service does, after the trainer pushed the policy's weights (a delta after the first push)."""
    run = {"iterations": 2, "learning_rate": OLD_POLICY_LR}
    local = await asyncio.to_thread(train, GRPOTrainer, policy_dir, tmp_path / "local", **run)
    models = {"default": "builtin:tiny-llama", "policy": str(policy_dir)}
    running = await start(test_settings(gemma_checkpoint, models=models))
    try:
        with LogprobClient(running.target) as client:
            old_policy = RemotePolicy(client, model="policy")
            remote = await asyncio.to_thread(
                train,
                RemoteReferenceGRPOTrainer,
                policy_dir,
                tmp_path / "remote",
                reference=RemoteReference(client, model="default"),
                old_policy=old_policy,
                **run,
            )
        served = running.service.device_side.registry.get("policy").info
    finally:
        await stop(running)

    generations = len(remote.old_logps)
    assert generations == len(local.old_logps) >= 2 and len(remote.losses) == len(local.losses) == STEPS
    # One push per generation (the first: the starting weights, dense; then deltas).
    assert served.version == old_policy.served.version == generations
    temperature = grpo_args(tmp_path).temperature
    old_error, reference_atol = [], []
    for g in range(generations):
        assert torch.equal(local.completion_ids[g], remote.completion_ids[g]), f"generation {g}: other samples"
        mask = remote.completion_mask[g].bool()
        rows, sequences = scored_rows(remote, g)
        policy = build_builtin("tiny-llama")
        policy.load_state_dict(remote.policies[g])  # the weights that generated the batch
        exact = ScoreReference(policy, sequences, temperature=temperature)
        # The service's old-policy log-probs are as exact as the policy's own float32 forward;
        # TRL's (a padded batch in float32) are what they are: their error is measured, not bounded.
        exact.check([remote.old_logps[g][i][mask[i]].numpy() for i in rows])
        trl_error = max(
            float(np.abs(local.old_logps[g][i][mask[i]].numpy() - want).max())
            for i, (want, _) in zip(rows, exact.exact, strict=True)
        )
        old_error.append(exact.atol + trl_error)
        if g:  # the tolerance's premise: two optimizer steps moved these log-probs by under half a nat
            before = build_builtin("tiny-llama")
            before.load_state_dict(remote.policies[g - 1])
            earlier = ScoreReference(before, sequences, temperature=temperature).exact
            moved = max(float(np.abs(a - b).max()) for (a, _), (b, _) in zip(exact.exact, earlier, strict=True))
            assert 0 < moved < 0.5, moved
        reference_atol.append(ScoreReference(build_builtin("tiny-llama"), sequences, temperature=temperature).atol)
    for step in range(STEPS):
        g = step // 2  # num_iterations=2: each generation serves two optimizer steps
        tolerance = old_policy_loss_tolerance(old_error[g], reference_atol[g])
        assert abs(remote.losses[step] - local.losses[step]) <= tolerance, (
            step,
            remote.losses[step],
            local.losses[step],
        )
