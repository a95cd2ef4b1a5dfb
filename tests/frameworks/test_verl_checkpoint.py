"""verl's old-policy log-probs served, with the actor's weights pushed by the checkpoint-engine
plugin (``logprob_client.integrations.verl_checkpoint``), against verl's own computation.

verl's ``ActorRolloutRefWorker`` (role "actor") is built from verl's own hydra config with the
override lines of docs/verl.md, read from that page, in this process (no Ray; a one-process gloo
group), so verl itself builds the actor's engine (``ServiceActorConfig``) and, from
``rollout.checkpoint_engine``, the plugin (``custom_backend_module``). verl's FSDP engine does not
run on the CPU (it registers for cuda and npu only): the actor's training engine is a stand-in
registered as verl's fsdp engine for the cpu (``CpuActorEngine``), holding the checkpoint in
float32, whose weights the test changes as an optimizer step would; it refuses to score, so the
old log-probs can only come from the service.

Each step: ``ActorRolloutRefWorker.update_weights`` (what verl's manager calls on every actor rank)
hands the engine's ``get_per_tensor_param()`` to the plugin, which pushes the weights over gRPC
(deltas: the CPU's path) to the served ``policy``; then ``RayPPOTrainer._compute_old_log_prob``
(verl's own old-log-prob step) runs on verl's padded batch, or the worker on its padding-free one.
The answers must equal verl's log-prob function (``verl.utils.torch_functional``) on the changed
weights within float32 rounding. The trainer loop itself needs a rollout engine and Ray workers
on GPUs (see test_verl.py); ``ServiceCheckpointManager`` is tested with a stand-in worker group.
Checked against verl 0.9.1.
"""

from __future__ import annotations

import asyncio
import re
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip(
    "verl", reason="verl is not installed: the framework tests run in .venv-frameworks (scripts/install-frameworks.sh)"
)

import verl
from hydra import compose, initialize_config_dir
from logprob_client import LogprobClient
from logprob_client.errors import FailedPrecondition
from logprob_client.integrations import verl as served_verl
from logprob_client.integrations import verl_checkpoint
from logprob_client.integrations.verl import ServiceConfigError, padded_batch
from logprob_client.integrations.verl_actor import OLD_POLICY
from transformers import AutoModelForCausalLM
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils import tensordict_utils as tu
from verl.workers.config import CheckpointEngineConfig
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.padding import response_from_nested

from tests.frameworks.test_verl import VerlReference, padding_free, rollout
from tests.helpers.processes import free_port

pytestmark = pytest.mark.frameworks

ROOT = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.7


@EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")
class CpuActorEngine(BaseEngine):
    """verl's FSDP engine on the CPU, where verl registers none (cuda and npu only): the HF
    checkpoint in float32, its weights exported as verl's FSDP engine exports them
    (``get_per_tensor_param``: full tensors, HF names, float32 master weights)."""

    def __init__(self, model_config, engine_config, *args, **kwargs) -> None:
        self.model_config, self.engine_config = model_config, engine_config
        self.module = None

    def initialize(self) -> None:
        self.module = AutoModelForCausalLM.from_pretrained(self.model_config.local_path, dtype=torch.float32).eval()

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs):
        return BaseEngineCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return BaseEngineCtx(self, "eval", **kwargs)

    def infer_batch(self, data, loss_function=None):
        raise AssertionError("verl's engine was asked for old log-probs: they must come from the service")

    def get_per_tensor_param(self, **kwargs):
        return ((name, tensor) for name, tensor in self.module.state_dict().items()), None

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        pass

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_size(self) -> int:
        return 1

    def get_data_parallel_group(self):
        return None

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    def disable_adapter(self):
        return nullcontext()


def documented_lines() -> list[str]:
    """The override lines of docs/verl.md's old-policy section, as written there."""
    text = (ROOT / "docs" / "verl.md").read_text()
    section = text.split("## Old-policy log-probs and weight pushes", 1)[1]
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "checkpoint_engine" in b]
    return [line.strip().rstrip("\\").strip() for line in block.splitlines() if line.strip()]


@pytest.fixture
def fresh_old_policy():
    """Each worker here starts as a fresh actor process would: nothing pushed, no settings."""
    OLD_POLICY.settings, OLD_POLICY.version = None, 0
    yield OLD_POLICY
    OLD_POLICY.settings, OLD_POLICY.version = None, 0


def verl_config(model_dir: Path, address: str, model: str = "policy", dtype: str = "float32", extra=()):
    """verl's GRPO config with docs/verl.md's old-policy lines (its placeholders replaced)."""
    lines = [
        line.replace("old-host:50051", address).replace(".service.model=policy", f".service.model={model}")
        for line in documented_lines()
    ]
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "+actor_rollout_ref.model.load_tokenizer=False",  # the random checkpoint has no tokenizer
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        *lines,
        f"actor_rollout_ref.actor.fsdp_config.dtype={dtype}",  # the served float32 (verl's default: bfloat16)
        *extra,
    ]
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def actor_worker(config) -> ActorRolloutRefWorker:
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


@pytest.fixture
def worker(process_group, fresh_old_policy, qwen_dir, served):
    worker = actor_worker(verl_config(qwen_dir, served.target))
    yield worker
    worker.checkpoint_engine.close()


class Trainer:
    """What ``RayPPOTrainer._compute_old_log_prob`` reads of the trainer."""

    def __init__(self, worker, config) -> None:
        self.actor_rollout_wg, self.config = worker, config


def update_weights(worker, step: int) -> dict:
    """What verl's manager runs on every actor rank for the service (``mode=logprob_service``)."""
    return asyncio.run(worker.update_weights(global_steps=step, mode=verl_checkpoint.BACKEND))


def optimizer_step(worker, rng: np.random.Generator, scale: float = 0.05) -> None:
    """The actor's weights changed as a step would change them: some tensors, some elements."""
    with torch.no_grad():
        for name, p in worker.actor.engine.inner.module.named_parameters():
            if "layers.0" in name or "lm_head" in name:
                mask = torch.from_numpy(rng.random(p.shape) < 0.3)
                p.add_(torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32)) * scale * mask)


def served_version(target: str, model: str = "policy") -> int:
    with LogprobClient(target) as client:
        return {m.name: m.version for m in client.list_models()}[model]


class Local(VerlReference):
    """verl's log-prob and entropy functions on the actor's own (changed) weights, in process."""

    def __init__(self, worker, qwen_dir, rows, temperature) -> None:
        model = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32)
        model.load_state_dict(worker.actor.engine.inner.module.state_dict())
        self.rows, self.temperature = rows, temperature
        self.float32 = self._scores(model.eval())
        self.exact = self._scores(model.double())
        from tests.helpers import tolerances

        own = max(float(np.abs(a - b).max()) for x, y in zip(self.float32, self.exact) for a, b in zip(x, y) if a.size)
        self.atol = tolerances.scores(own)


def old_log_probs(worker, config, rows):
    """verl's old-log-prob step on verl's padded batch: old_log_probs and entropys, cut per row."""
    batch = padded_batch(rows, TEMPERATURE)
    batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(dim=-1).tolist()  # as fit() sets it
    out, _ = RayPPOTrainer._compute_old_log_prob(Trainer(worker, config), batch)
    logps, entropies = out.batch["old_log_probs"], out.batch["entropys"]
    width = max(len(b) for _, b in rows)
    assert logps.shape == entropies.shape == (len(rows), width) and logps.dtype == torch.float32
    for i, (_, b) in enumerate(rows):
        assert not logps[i, len(b) :].any(), f"row {i}: padding must stay 0"
    return [logps[i, : len(b)].numpy() for i, (_, b) in enumerate(rows)], [
        entropies[i, : len(b)].numpy() for i, (_, b) in enumerate(rows)
    ]


def test_old_log_probs_after_each_push_are_the_actor_s_padded_grpo_groups(worker, qwen_dir, served, rng):
    config = verl_config(qwen_dir, served.target)
    rows = rollout(rng, prompts=3, n=4)
    before = served_version(served.target)

    metrics = update_weights(worker, 0)  # verl's start-up sync
    assert served_version(served.target) == OLD_POLICY.version == metrics["logprob_service/version"] == before + 1
    first, _ = old_log_probs(worker, config, rows)

    for step in (1, 2):
        optimizer_step(worker, rng)
        update_weights(worker, step)
        assert served_version(served.target) == OLD_POLICY.version == before + 1 + step
        logps, entropies = old_log_probs(worker, config, rows)
        Local(worker, qwen_dir, rows, TEMPERATURE).check(logps, entropies)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(first, logps) if a.size)
    assert moved > 100 * Local(worker, qwen_dir, rows, TEMPERATURE).atol, "the steps did not move the log-probs"


def test_old_log_probs_padding_free_as_the_v1_trainer_passes_them(worker, qwen_dir, served, rng):
    update_weights(worker, 0)
    optimizer_step(worker, rng)
    update_weights(worker, 1)
    rows = rollout(rng, prompts=5, n=1)
    data = padding_free(rows, TEMPERATURE, calculate_entropy=True)
    output = worker.compute_log_prob(data)
    response_mask = padding_free(rows, TEMPERATURE, True)["response_mask"]
    logps = response_from_nested(tu.get(output, "log_probs"), response_mask).unbind()
    entropies = response_from_nested(tu.get(output, "entropy"), response_mask).unbind()
    Local(worker, qwen_dir, rows, TEMPERATURE).check([x.numpy() for x in logps], [e.numpy() for e in entropies])


def test_old_log_probs_are_asked_at_the_pushed_version(worker, qwen_dir, served, rng, monkeypatch):
    """The service scores only with weights at least as new as the actor's last push."""
    update_weights(worker, 0)
    client, asked = worker.actor.engine.client, []
    score = client.score

    def recording(prompts, completions, **kwargs):
        asked.append(kwargs["min_version"])
        return score(prompts, completions, **kwargs)

    monkeypatch.setattr(client, "score", recording)
    config = verl_config(qwen_dir, served.target)
    old_log_probs(worker, config, rollout(rng, prompts=2, n=2))
    assert asked == [OLD_POLICY.version] and OLD_POLICY.version == served_version(served.target)
    OLD_POLICY.version += 1  # a push the service has not seen (another host's, say)
    monkeypatch.setattr(client, "timeout", 1.0)
    with pytest.raises(FailedPrecondition, match="version"):
        old_log_probs(worker, config, rollout(rng, prompts=2, n=2))


def test_old_log_probs_before_any_push_fail_instead_of_scoring_the_service_s_weights(worker, qwen_dir, served, rng):
    with pytest.raises(RuntimeError, match="no weights of the actor were pushed"):
        old_log_probs(worker, verl_config(qwen_dir, served.target), rollout(rng, prompts=1, n=2))


def test_the_manager_pushes_then_syncs_the_colocated_rollout(monkeypatch):
    """``ServiceCheckpointManager.update_weights``: every actor rank pushes (mode=logprob_service),
    then verl's colocated sync (naive) runs; the push's metrics go to the trainer."""
    calls = []

    class ActorGroup:
        world_size = 2

        def update_weights(self, global_steps, mode):
            calls.append((global_steps, mode))
            return [{"logprob_service/version": 3.0}, {"logprob_service/version": 3.0}] if mode != "naive" else []

    monkeypatch.setattr(verl_checkpoint.ray, "get", lambda refs: refs)
    config = CheckpointEngineConfig(backend="logprob_service")
    manager = verl_checkpoint.ServiceCheckpointManager(config, ActorGroup(), [])
    assert manager.update_weights(7) == {"logprob_service/version": 3.0}
    assert calls == [(7, "logprob_service"), (7, "naive")]
    with pytest.raises(ServiceConfigError, match=r"needs actor_rollout_ref\.rollout\.checkpoint_engine\.backend"):
        verl_checkpoint.ServiceCheckpointManager(CheckpointEngineConfig(backend="nccl"), ActorGroup(), [])


def test_verl_s_stock_manager_path_is_refused_naming_the_setting(worker):
    with pytest.raises(ServiceConfigError, match=r"checkpoint_manager_class"):
        worker.checkpoint_engine.prepare()


@pytest.mark.parametrize(
    "settings,extra,match",
    [
        (
            {"address": "127.0.0.1:1"},
            (),
            r"no logprob-service answers at actor_rollout_ref\.actor\.service\.address='127\.0\.0\.1:1'",
        ),
        ({"model": "nope"}, (), r"actor_rollout_ref\.actor\.service\.model='nope': the service serves no such model"),
        ({"model": "tiny"}, (), r"'tiny' has a vocabulary of 4096 tokens but actor_rollout_ref\.model\.path's config"),
        (
            {"dtype": "bfloat16"},
            (),
            r"'policy' is served in float32 but actor_rollout_ref\.actor\.fsdp_config\.dtype is bfloat16",
        ),
        (
            {},
            ("+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.logprob_service.transport=rdma",),
            r"engine_kwargs\.logprob_service\.transport='rdma': it is one of auto, ipc, nccl, grpc",
        ),
        (
            {},
            ("+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.logprob_service.transport=nccl",),
            r"transport=nccl needs actor_rollout_ref\.rollout\.checkpoint_engine\.engine_kwargs\."
            r"logprob_service\.master_port",
        ),
        (
            {},
            ("+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.logprob_service.adress=x",),
            r"engine_kwargs\.logprob_service has unknown settings \['adress'\]",
        ),
    ],
    ids=["wrong-address", "unknown-model", "vocab-mismatch", "dtype-mismatch", "bad-transport", "nccl-no-port", "typo"],
)
def test_bad_configuration_fails_at_start_up_naming_the_setting(
    process_group, fresh_old_policy, qwen_dir, served, settings, extra, match
):
    arguments = {"address": served.target, "model": "policy", "dtype": "float32"} | settings
    with pytest.raises(ServiceConfigError, match=match):
        actor_worker(verl_config(qwen_dir, **arguments, extra=extra))


@pytest.mark.skipif(torch.cuda.is_available(), reason="IPC is possible where CUDA is")
def test_ipc_without_cuda_fails_at_start_up(process_group, fresh_old_policy, qwen_dir, served):
    extra = ("+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.logprob_service.transport=ipc",)
    with pytest.raises(ServiceConfigError, match=r"logprob_service\.transport=ipc hands over CUDA tensors"):
        actor_worker(verl_config(qwen_dir, served.target, extra=extra))


def test_the_plugin_without_the_served_actor_fails_at_start_up(process_group, fresh_old_policy, qwen_dir, served):
    """The checkpoint engine alone (the actor's stock config) would push weights nobody scores with."""
    lines = [line for line in documented_lines() if line.startswith("actor_rollout_ref.rollout.checkpoint_engine")]
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        config = compose(
            "ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={qwen_dir}",
                "+actor_rollout_ref.model.load_tokenizer=False",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                *lines,
            ],
        )
    with pytest.raises(ServiceConfigError, match=r"set actor_rollout_ref\.actor\._target_=.*ServiceActorConfig"):
        actor_worker(config)


def test_pushed_by_broadcast_through_the_service_s_weight_update_group(
    process_group, fresh_old_policy, qwen_dir, served, rng
):
    """``transport=nccl``: the service joins a weight-update group hosted by rank 0 (gloo for
    the CPU's tensors, NCCL for CUDA ones) and the tensors are broadcast through it."""
    kwargs = "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.logprob_service"
    extra = (f"{kwargs}.transport=nccl", f"{kwargs}.master_port={free_port()}")
    config = verl_config(qwen_dir, served.target, extra=extra)
    worker = actor_worker(config)
    try:
        update_weights(worker, 0)
        optimizer_step(worker, rng)
        update_weights(worker, 1)
        assert served_version(served.target) == OLD_POLICY.version
        rows = rollout(rng, prompts=2, n=3)
        logps, entropies = old_log_probs(worker, config, rows)
        Local(worker, qwen_dir, rows, TEMPERATURE).check(logps, entropies)
    finally:
        worker.checkpoint_engine.close()


def test_a_rank_other_than_0_drains_the_weights_pushes_nothing_and_takes_rank_0_s_version(
    fresh_old_policy, served, monkeypatch
):
    """On ranks other than 0 (verl's FSDP gathers each tensor on every rank), the engine reads
    every tensor, pushes nothing, and takes the version rank 0 broadcasts over the actor's group."""
    OLD_POLICY.settings = served_verl.ServiceSettings(address=served.target, model="policy")
    engine = verl_checkpoint.ServiceCheckpointEngine(is_master=False)
    assert engine.pusher is None
    broadcast = []

    def from_rank_0(box, src):
        broadcast.append((list(box), src))
        box[0] = 41  # what rank 0 pushed

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", from_rank_0)
    read = []
    weights = ((name, read.append(name) or torch.zeros(2)) for name in ("a", "b", "c"))
    before = served_version(served.target)
    metrics = asyncio.run(engine.send_weights(weights, global_steps=3))
    assert read == ["a", "b", "c"] and broadcast == [([0], 0)]
    assert OLD_POLICY.version == metrics["logprob_service/version"] == 41
    assert served_version(served.target) == before, "only rank 0 pushes"
