"""verl's reference worker with the ``logprob_service`` engine, against verl's own computation.

verl's ``ActorRolloutRefWorker`` (role "ref") is built from verl's own hydra config with the
documented override lines, in this process (no Ray: its ``Worker`` runs as a plain object on a
one-process gloo group), and called the way verl's trainers call it:

* the v0 trainer's path, padded: a ``DataProto`` of left-padded prompts and right-padded
  responses goes through ``RayPPOTrainer._compute_ref_log_prob`` itself (verl's
  ``left_right_2_no_padding``, the worker, ``no_padding_2_padding``);
* the v1 trainer's padding-free layout: nested ``input_ids``/``position_ids``/``response_mask``,
  the output cut by verl's ``response_from_nested``.

The answer is compared with verl's own log-prob function (``verl.utils.torch_functional.
logprobs_from_logits``, and ``entropy_from_logits``) on logits of the same model: the served
float32 scores must be within float32 rounding of its float64 result (``tests.helpers.
tolerances.scores``, from the error of verl's own float32 computation).

verl's trainer loop itself cannot run here: it needs a rollout engine (vLLM or SGLang) and Ray
workers on GPUs. The test is at the worker boundary, with verl's trainer code for the ref step.
Checked against verl 0.9.1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip(
    "verl", reason="verl is not installed: the framework tests run in .venv-frameworks (scripts/install-frameworks.sh)"
)

import verl
import verl.utils.torch_functional as verl_F
from hydra import compose, initialize_config_dir
from logprob_client.integrations.verl import CHECKED_VERL_VERSION, ServiceConfigError, padded_batch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.padding import response_from_nested

from tests.helpers import tolerances
from tests.helpers.models import VOCAB

pytestmark = pytest.mark.frameworks

TEMPERATURE = 0.7


def test_the_installed_verl_is_the_checked_version():
    assert verl.__version__ == CHECKED_VERL_VERSION


def verl_config(model_dir: Path, address: str, model: str = "ref", dtype: str = "float32"):
    """verl's GRPO trainer config (its ppo_trainer.yaml) with the override lines of docs/verl.md."""
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.load_tokenizer=False",  # the random checkpoint has no tokenizer
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        # the three lines that serve the reference:
        "actor_rollout_ref.ref._target_=logprob_client.integrations.verl.ServiceRefConfig",
        f"+actor_rollout_ref.ref.service.address={address}",
        f"+actor_rollout_ref.ref.service.model={model}",
        # the served model's dtype (verl's default ref dtype is bfloat16; this server runs float32)
        f"actor_rollout_ref.ref.fsdp_config.dtype={dtype}",
    ]
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def ref_worker(config) -> ActorRolloutRefWorker:
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="ref")
    worker.init_model()
    return worker


@pytest.fixture(scope="module")
def worker(process_group, qwen_dir, served) -> ActorRolloutRefWorker:
    return ref_worker(verl_config(qwen_dir, served.target))


def rollout(rng: np.random.Generator, prompts: int, n: int, max_prompt: int = 9, max_response: int = 11):
    """GRPO rows as verl's agent loop leaves them: ``n`` responses per prompt, each prompt's rows
    consecutive, then the rows shuffled (verl balances the batch by length before scoring).
    Prompts left-padded, responses right-padded; one response is empty (nothing to score)."""
    rows = []
    for _ in range(prompts):
        prompt = rng.integers(3, VOCAB, int(rng.integers(1, max_prompt + 1)))
        rows += [(prompt, rng.integers(3, VOCAB, int(rng.integers(1, max_response + 1)))) for _ in range(n)]
    rows[1] = (rows[1][0], rows[1][1][:0])
    rows = [rows[i] for i in rng.permutation(len(rows))]
    return rows


def padding_free(rows, temperature: float, calculate_entropy: bool) -> TensorDict:
    """The v1 trainer's batch: every per-token field nested, no padding anywhere."""
    nested = lambda parts: torch.nested.as_nested_tensor(parts, layout=torch.jagged)  # noqa: E731
    ids = [torch.from_numpy(np.concatenate([a, b])) for a, b in rows]
    data = tu.get_tensordict(
        {
            "input_ids": nested(ids),
            "position_ids": nested([torch.arange(len(x)) for x in ids]),
            "response_mask": nested([torch.ones(len(b), dtype=torch.long) for _, b in rows]),
        }
    )
    tu.assign_non_tensor(data, temperature=temperature, calculate_entropy=calculate_entropy, compute_loss=False)
    return data


class VerlReference:
    """verl's log-prob (and entropy) functions on logits of the checkpoint's own forward of each
    row (unpadded, positions 0..L-1), in float32 (verl's own computation) and float64 (exact)."""

    def __init__(self, model_dir: Path, rows, temperature: float) -> None:
        self.rows, self.temperature = rows, temperature
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.float32 = self._scores(model)
        self.exact = self._scores(model.double())
        errors = [float(np.abs(a - b).max()) for x, y in zip(self.float32, self.exact) for a, b in zip(x, y) if a.size]
        own = max(errors, default=0.0)
        self.atol = tolerances.scores(own)

    @torch.no_grad()
    def _scores(self, model) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for prompt, response in self.rows:
            if not len(response):
                out.append((np.zeros(0), np.zeros(0)))
                continue
            ids = torch.from_numpy(np.concatenate([prompt, response]))[None]
            logits = model(input_ids=ids).logits[0] / self.temperature  # [L, V]
            rows = logits[len(prompt) - 1 : -1]  # the rows that predict response tokens
            logp = verl_F.logprobs_from_logits(rows, torch.from_numpy(response))
            out.append((logp.double().numpy(), verl_F.entropy_from_logits(rows).double().numpy()))
        return out

    def check(self, logps, entropies=None) -> None:
        for i, (want, want_entropy) in enumerate(self.exact):
            got = np.asarray(logps[i])
            assert got.dtype == np.float32 and got.shape == want.shape, (i, got.dtype, got.shape, want.shape)
            np.testing.assert_allclose(got, want, atol=self.atol, rtol=0, err_msg=f"row {i}")
            if entropies is not None:
                np.testing.assert_allclose(entropies[i], want_entropy, atol=self.atol, rtol=0, err_msg=f"row {i}")


class Trainer:
    """What ``RayPPOTrainer._compute_ref_log_prob`` reads of the trainer: the ref worker group."""

    def __init__(self, worker: ActorRolloutRefWorker) -> None:
        self.ref_in_actor = False
        self.ref_policy_wg = worker


def sent_prompts(worker, monkeypatch) -> list[list[bytes]]:
    """Records the prompts of every scoring call the ref's engine makes, in the order sent."""
    client, calls = worker.ref.engine.client, []
    score = client.score

    def recording(prompts, completions, **kwargs):
        calls.append([np.asarray(p).tobytes() for p in prompts])
        return score(prompts, completions, **kwargs)

    monkeypatch.setattr(client, "score", recording)
    return calls


def test_grpo_groups_padded_through_verl_s_own_ref_step(worker, qwen_dir, rng, monkeypatch):
    rows = rollout(rng, prompts=3, n=4)
    calls = sent_prompts(worker, monkeypatch)
    out = RayPPOTrainer._compute_ref_log_prob(Trainer(worker), padded_batch(rows, TEMPERATURE))

    ref = out.batch["ref_log_prob"]  # verl's layout: [B, R] float32, right-padded like responses
    width = max(len(b) for _, b in rows)
    assert ref.shape == (len(rows), width) and ref.dtype == torch.float32
    VerlReference(qwen_dir, rows, TEMPERATURE).check([ref[i, : len(b)].numpy() for i, (_, b) in enumerate(rows)])
    for i, (_, b) in enumerate(rows):
        assert not ref[i, len(b) :].any(), f"row {i}: padding must stay 0"
    # One call for the whole batch, each prompt's rows (shuffled apart in the batch) sent next to
    # each other, so the client sends each GRPO group as one shared-prompt group.
    ((sent,),) = [calls]
    assert len(sent) == len(rows) - 1  # the empty response is not sent
    runs = [p for i, p in enumerate(sent) if i == 0 or sent[i - 1] != p]
    assert len(runs) == len(set(sent)) == 3, "a prompt's rows were sent apart"


@pytest.mark.parametrize("calculate_entropy", [False, True])
def test_single_sequences_padding_free_as_the_v1_trainer_passes_them(worker, qwen_dir, rng, calculate_entropy):
    rows = rollout(rng, prompts=5, n=1)
    output = worker.compute_ref_log_prob(padding_free(rows, TEMPERATURE, calculate_entropy))

    response_mask = padding_free(rows, TEMPERATURE, calculate_entropy)["response_mask"]
    logps = response_from_nested(tu.get(output, "log_probs"), response_mask)  # verl's own cut
    assert logps.values().dtype == torch.float32
    entropies = None
    if calculate_entropy:
        entropies = [e.numpy() for e in response_from_nested(tu.get(output, "entropy"), response_mask).unbind()]
    else:
        assert tu.get(output, "entropy") is None
    VerlReference(qwen_dir, rows, TEMPERATURE).check([x.numpy() for x in logps.unbind()], entropies)


def test_per_row_temperatures(worker, qwen_dir, rng):
    """verl allows a temperature per sample (a tensor): rows are scored at their own."""
    rows = rollout(rng, prompts=4, n=1)
    data = padding_free(rows, 1.0, False)
    temperatures = torch.tensor([0.5, 1.3, 0.5, 0.9])
    tu.assign_non_tensor(data, temperature=temperatures)
    data["temperature"] = temperatures
    response_mask = data["response_mask"]
    logps = response_from_nested(tu.get(worker.compute_ref_log_prob(data), "log_probs"), response_mask).unbind()
    for i, t in enumerate(temperatures.tolist()):
        VerlReference(qwen_dir, rows[i : i + 1], t).check([logps[i].numpy()])


@pytest.mark.parametrize(
    "setting,value,match",
    [
        (
            "address",
            "127.0.0.1:1",
            r"no logprob-service answers at actor_rollout_ref\.ref\.service\.address='127\.0\.0\.1:1'",
        ),
        ("model", "nope", r"actor_rollout_ref\.ref\.service\.model='nope': the service serves no such model"),
        (
            "model",
            "tiny",
            r"'tiny' has a vocabulary of 4096 tokens but actor_rollout_ref\.model\.path's config has 517",
        ),
        ("dtype", "bfloat16", r"'ref' is served in float32 but actor_rollout_ref\.ref\.fsdp_config\.dtype is bfloat16"),
    ],
    ids=["wrong-address", "unknown-model", "vocab-mismatch", "dtype-mismatch"],
)
def test_bad_configuration_fails_at_start_up_naming_the_setting(process_group, qwen_dir, served, setting, value, match):
    settings = {"address": served.target, "model": "ref", "dtype": "float32"} | {setting: value}
    with pytest.raises(ServiceConfigError, match=match):
        ref_worker(verl_config(qwen_dir, **settings))
