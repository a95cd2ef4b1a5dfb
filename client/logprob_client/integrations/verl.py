"""verl's reference log-probs scored by logprob-service, through verl's own engine plug-in point.

In verl 0.9.1 the reference is a ``TrainingWorker`` inside ``ActorRolloutRefWorker``
(``verl/workers/engine_workers.py``): ``compute_ref_log_prob(data)`` calls
``TrainingWorker.infer_batch``, which runs the engine that ``EngineRegistry`` holds for the ref's
``engine_config.strategy``. This module registers an engine, ``logprob_service``, that scores
the batch with the service instead of loading a model, and a config class for the ref that
selects it. verl's workers, dispatch, padding conversions and trainer loop run unchanged; the
trainer's GPUs hold no reference model.

The three override lines of a verl GRPO recipe (hydra, on ``python -m verl.trainer.main_ppo``)::

    actor_rollout_ref.ref._target_=logprob_client.integrations.verl.ServiceRefConfig
    +actor_rollout_ref.ref.service.address=ref-host:50051    # or h1:50051,h2:50051 (replicas)
    +actor_rollout_ref.ref.service.model=ref

(``+actor_rollout_ref.ref.service.timeout_s``, ``.max_sequences_per_rpc`` and
``.max_tokens_per_rpc`` are optional.) hydra imports this module in every process that builds
the ref's config, which registers the engine there. At start-up (the ref worker's ``reset``), the
service must answer at the address, serve the model, with the policy's vocabulary
(``actor_rollout_ref.model.path``'s config) and in the ref's dtype
(``actor_rollout_ref.ref.fsdp_config.dtype``); otherwise the worker fails naming the setting.

What the engine receives is verl's padding-free batch (``left_right_2_no_padding`` in the v0
trainer, the TransferQueue batch in the v1 one): nested ``input_ids`` (prompt + response, valid
tokens only), the response lengths (a nested ``response_mask``, or the dense ``prompts`` /
``attention_mask`` that the v0 trainer keeps), ``temperature`` (a float, or one per row) and
``calculate_entropy``. It returns what verl's FSDP engine returns: nested ``log_probs`` (and
``entropy``) over each whole sequence, position t holding the log-prob of token t + 1, float32;
verl's ``no_padding_2_padding`` / ``response_from_nested`` then cut out the response columns.
Positions that predict no response token hold 0. All of a rank's rows go in one scoring call
(its RPCs in flight together, spread over the replicas), rows with one prompt (a GRPO group)
sent as one shared-prompt group, whatever order verl's length balancing left them in.

Old-policy log-probs: ``verl_actor`` (the actor's engine) and ``verl_checkpoint`` (the weight pushes).

Checked against verl 0.9.1 (``CHECKED_VERL_VERSION``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Any

try:
    import torch
    from tensordict import TensorDict
    from verl import DataProto
    from verl.base_config import BaseConfig
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.engine import EngineConfig
    from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
except ImportError as err:  # an optional dependency
    raise ImportError(
        "logprob_client.integrations.verl needs verl and the [verl] extra's tensordict: "
        f"pip install verl==0.9.1 tensordict==0.10.0 ({err})"
    ) from err

import numpy as np

from ..client import LogprobClient
from ..split import DEFAULT_MAX_SEQUENCES_PER_RPC, DEFAULT_MAX_TOKENS_PER_RPC
from ._served import Expected, ServiceConfigError, check_served_model, score_rows, targets, warn_untested_version

CHECKED_VERL_VERSION = "0.9.1"
warn_untested_version("verl", CHECKED_VERL_VERSION)  # at start-up: every verl module of ours imports this one
BACKEND = "logprob_service"
REF_PREFIX = "actor_rollout_ref.ref"

__all__ = [
    "BACKEND",
    "CHECKED_VERL_VERSION",
    "ServiceConfigError",
    "ServiceEngine",
    "ServiceEngineConfig",
    "ServiceRefConfig",
    "ServiceSettings",
    "nested_scores",
    "padded_batch",
    "service_settings",
]


@dataclass
class ServiceSettings(BaseConfig):
    """Where the served model is: ``address`` ("host:port", a gRPC target such as
    "dns:///name:port", or replicas "h1:port,h2:port"), ``model`` (its served name), the calls'
    ``timeout_s``, and how large one RPC may be (a rank's batch goes as several RPCs in flight)."""

    address: str = ""
    model: str = "default"
    timeout_s: float = 120.0
    max_sequences_per_rpc: int = DEFAULT_MAX_SEQUENCES_PER_RPC
    max_tokens_per_rpc: int = DEFAULT_MAX_TOKENS_PER_RPC
    setting_prefix: str = REF_PREFIX  # how the settings are spelled in verl's config, for messages


def service_settings(value: Any, prefix: str) -> ServiceSettings:
    if isinstance(value, ServiceSettings):
        return value
    if not isinstance(value, Mapping):
        raise ServiceConfigError(f"{prefix}.service must be a mapping (address, model, ...), got {value!r}")
    known = {f.name for f in fields(ServiceSettings)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ServiceConfigError(f"{prefix}.service has unknown settings {unknown}; known: {sorted(known)}")
    return ServiceSettings(**{"setting_prefix": prefix, **dict(value)})


@dataclass
class ServiceEngineConfig(EngineConfig):
    """The ref's engine config with the service's settings; ``strategy`` selects ``ServiceEngine``."""

    service: ServiceSettings = field(default_factory=ServiceSettings)


@dataclass
class ServiceRefConfig(FSDPActorConfig):
    """verl's FSDP ref config (every key of verl's ``ref`` yaml is taken as is), plus ``service``;
    its engine is the service's. ``fsdp_config.dtype`` stays the dtype the served model must have."""

    service: Any = field(default_factory=ServiceSettings)

    def __post_init__(self) -> None:
        super().__post_init__()
        settings = service_settings(self.service, REF_PREFIX)
        object.__setattr__(self, "service", settings)
        self.engine = ServiceEngineConfig(
            strategy=BACKEND, dtype=self.fsdp_config.dtype, forward_only=True, service=settings
        )


def _response_lengths(data: TensorDict, sequence_lengths: torch.Tensor) -> torch.Tensor:
    """Each row's number of response tokens, from whichever layout verl passed."""
    response_mask = data.get("response_mask", None)
    if response_mask is not None and response_mask.is_nested:  # v1 trainer: padding-free throughout
        return response_mask.offsets().diff()
    prompts = data.get("prompts", None)
    attention_mask = data.get("attention_mask", None)
    if prompts is not None and prompts.is_nested:
        return data["responses"].offsets().diff()
    if prompts is not None and attention_mask is not None:  # v0 trainer: left_right_2_no_padding's output
        return attention_mask[:, prompts.shape[1] :].sum(dim=1)
    responses = data.get("responses", None)
    if responses is not None and responses.is_nested:
        return responses.offsets().diff()
    raise ValueError(
        "the batch says nothing of where responses start: it needs a nested response_mask, or prompts with "
        f"attention_mask (keys: {sorted(data.keys())})"
    )


def _temperatures(data: TensorDict, rows: int) -> np.ndarray:
    temperature = tu.get(data, "temperature", None)
    if temperature is None:
        raise ValueError("the batch has no temperature (verl's trainer sets it from actor_rollout_ref.rollout)")
    if isinstance(temperature, torch.Tensor):
        values = temperature.detach().float().cpu().reshape(-1).numpy()
        return np.broadcast_to(values, (rows,)) if values.size == 1 else values
    return np.full(rows, float(temperature), dtype=np.float32)


def nested_scores(
    client: LogprobClient, model: str, data: TensorDict, *, calculate_entropy: bool, min_version: int = 0
) -> dict[str, torch.Tensor]:
    """verl's model output for ``data`` (its padding-free batch), scored by the service: nested
    ``log_probs`` (and ``entropy``) laid out as verl's FSDP engine lays them out."""
    input_ids = data["input_ids"]
    if not input_ids.is_nested:
        raise ValueError("input_ids must be verl's nested (padding-free) layout")
    offsets = input_ids.offsets().cpu()
    ids = input_ids.values().cpu().numpy()  # [total_nnz]
    lengths = offsets.diff()
    responses = _response_lengths(data, lengths).cpu()
    temperatures = _temperatures(data, len(lengths))
    starts, ends = offsets[:-1].tolist(), offsets[1:].tolist()
    prompt_lengths = (lengths - responses).tolist()
    scored = [i for i, r in enumerate(responses.tolist()) if r > 0]
    for i in scored:
        if prompt_lengths[i] <= 0:
            raise ValueError(f"row {i} has no prompt token (length {int(lengths[i])}, response {int(responses[i])})")
    logps = np.zeros(ids.shape[0], dtype=np.float32)
    entropies = np.zeros(ids.shape[0], dtype=np.float32) if calculate_entropy else None
    for temperature in np.unique(temperatures[scored]) if scored else []:
        rows = [i for i in scored if temperatures[i] == temperature]
        prompts = [ids[starts[i] : starts[i] + prompt_lengths[i]] for i in rows]
        completions = [ids[starts[i] + prompt_lengths[i] : ends[i]] for i in rows]
        row_logps, row_entropies = score_rows(
            client,
            model,
            prompts,
            completions,
            temperature=float(temperature),
            return_entropy=calculate_entropy,
            min_version=min_version,
        )
        for k, i in enumerate(rows):
            # position t predicts token t + 1: the last prompt token predicts the first response token
            at = slice(starts[i] + prompt_lengths[i] - 1, ends[i] - 1)
            logps[at] = row_logps[k]
            if entropies is not None:
                entropies[at] = row_entropies[k]
    device = input_ids.values().device
    out = {"log_probs": torch.nested.nested_tensor_from_jagged(torch.from_numpy(logps).to(device), offsets.to(device))}
    if entropies is not None:
        out["entropy"] = torch.nested.nested_tensor_from_jagged(
            torch.from_numpy(entropies).to(device), offsets.to(device)
        )
    return out


def connect(settings: ServiceSettings, model_config: Any, dtype: str | None, dtype_setting: str) -> LogprobClient:
    """A client of the served model, once the service answers at ``settings.address`` and serves
    ``settings.model`` with the vocabulary of verl's model (``model_config``) in ``dtype``; else
    ``ServiceConfigError`` naming the setting (start-up, before any training)."""
    prefix = settings.setting_prefix
    client = LogprobClient(
        targets(settings.address, f"{prefix}.service.address"),
        timeout=settings.timeout_s,
        model=settings.model,
        max_sequences_per_rpc=settings.max_sequences_per_rpc,
        max_tokens_per_rpc=settings.max_tokens_per_rpc,
    )
    hf_config = getattr(model_config, "hf_config", None)
    text_config = hf_config.get_text_config() if hf_config is not None else None
    try:
        check_served_model(
            client,
            Expected(
                model=settings.model,
                model_setting=f"{prefix}.service.model",
                address_setting=f"{prefix}.service.address={settings.address!r}",
                vocab_size=getattr(text_config, "vocab_size", None),
                vocab_setting="actor_rollout_ref.model.path's config",
                dtype=dtype,
                dtype_setting=dtype_setting,
            ),
            timeout=min(settings.timeout_s, 30.0),
        )
    except BaseException:
        client.close()
        raise
    return client


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "cpu", "npu"])
class ServiceEngine(BaseEngine):
    """A forward-only verl engine whose model lives in logprob-service.

    Every rank is its own data-parallel rank (verl's dispatch gives each its share of the batch)
    and sends its share to the service; there is no model, optimizer or collective here.
    """

    def __init__(self, model_config: Any, engine_config: ServiceEngineConfig, *_: Any, **__: Any) -> None:
        if not isinstance(engine_config, ServiceEngineConfig):
            raise ServiceConfigError(
                f"the {BACKEND} engine needs {REF_PREFIX}._target_=logprob_client.integrations.verl.ServiceRefConfig"
            )
        self.model_config = model_config
        self.engine_config = engine_config
        self.settings = engine_config.service
        self.client: LogprobClient | None = None
        self.mode: str | None = None

    def initialize(self) -> None:
        """Connect and check the served model against verl's settings (start-up, ``reset``)."""
        if self.client is not None:
            self.client.close()
        self.client = connect(
            self.settings,
            self.model_config,
            self.engine_config.dtype,
            f"{self.settings.setting_prefix}.fsdp_config.dtype",
        )

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def eval_mode(self, **kwargs: Any) -> BaseEngineCtx:
        return BaseEngineCtx(self, "eval", **kwargs)

    def train_mode(self, **kwargs: Any) -> Any:
        raise NotImplementedError("a served reference is not trained: the logprob_service engine is forward-only")

    def infer_batch(self, data: TensorDict, loss_function: Any = None) -> dict[str, Any]:
        if loss_function is not None:
            raise NotImplementedError("the logprob_service engine computes log-probs, not a loss")
        if tu.get_non_tensor_data(data, "calculate_sum_pi_squared", False):
            raise NotImplementedError("the service returns log-probs and entropies, not sum_pi_squared")
        if self.client is None:
            raise RuntimeError("the engine was not initialized (TrainingWorker.reset)")
        calculate_entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        output = nested_scores(self.client, self.settings.model, data, calculate_entropy=calculate_entropy)
        return {"model_output": output, "loss": [], "metrics": {}}

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Nothing is held on the device to move."""

    def get_data_parallel_rank(self) -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def get_data_parallel_size(self) -> int:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    def get_data_parallel_group(self) -> None:
        return None  # no collective: each rank's results are its own

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    def disable_adapter(self) -> Any:
        return nullcontext()

    def get_per_tensor_param(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the served reference's weights live in the service")


def padded_batch(rows: Sequence[tuple[Any, Any]], temperature: float) -> DataProto:
    """verl's padded rollout batch (what its v0 trainer passes to the ref and old-log-prob steps)
    of ``(prompt_ids, response_ids)`` rows: prompts left-padded, responses right-padded, with
    ``attention_mask``, ``position_ids``, ``response_mask`` and the temperature in the meta info."""
    p, r = max(len(a) for a, _ in rows), max(len(b) for _, b in rows)
    prompts = torch.zeros(len(rows), p, dtype=torch.long)
    responses = torch.zeros(len(rows), r, dtype=torch.long)
    pmask, rmask = torch.zeros_like(prompts), torch.zeros_like(responses)
    for i, (a, b) in enumerate(rows):
        prompts[i, p - len(a) :], pmask[i, p - len(a) :] = torch.as_tensor(a, dtype=torch.long), 1
        responses[i, : len(b)], rmask[i, : len(b)] = torch.as_tensor(b, dtype=torch.long), 1
    attention_mask = torch.cat([pmask, rmask], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": rmask,
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": temperature})
