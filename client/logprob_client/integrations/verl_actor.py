"""verl's old-policy log-probs scored by logprob-service: the actor's engine.

Old-policy log-probs (the actor's ``compute_log_prob``: ``old_log_probs`` and entropy) come from
the service with ``ServiceActorConfig`` as the actor's config class: its engine is verl's own
(FSDP) engine for training and weight export, wrapped by ``ServedActorEngine``, which sends the
forward-only log-prob batches to the served old-policy model instead, each with ``min_version``
the version the actor last pushed there (``verl_checkpoint``, a ``CheckpointEngine`` plugin): it
never scores with weights older than the actor's.

Override lines: docs/verl.md (with ``verl_checkpoint``'s). Checked against verl 0.9.1.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

try:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config.engine import FSDPEngineConfig
    from verl.workers.engine.base import BaseEngine, EngineRegistry
except ImportError as err:  # an optional dependency
    raise ImportError(
        "logprob_client.integrations.verl_actor needs verl and the [verl] extra's tensordict: "
        f"pip install verl==0.9.1 tensordict==0.10.0 ({err})"
    ) from err

from ..client import LogprobClient
from ._served import ServiceConfigError
from .verl import ServiceSettings, connect, nested_scores, service_settings

ACTOR_BACKEND = "logprob_service_actor"  # the actor's engine: verl's own, old log-probs served
ACTOR_PREFIX = "actor_rollout_ref.actor"

__all__ = ["ACTOR_BACKEND", "OLD_POLICY", "ServedActorEngine", "ServedActorEngineConfig", "ServiceActorConfig"]


class _OldPolicy:
    """What this process knows of the served old-policy model: where it is (set by the actor's
    engine at start-up) and the version the actor last pushed there (set by the checkpoint engine,
    ``verl_checkpoint.ServiceCheckpointEngine``, on every actor rank). Both live in the actor's
    worker process, which holds the actor's engine and its checkpoint engine side by side."""

    def __init__(self) -> None:
        self.settings: ServiceSettings | None = None
        self.version = 0  # 0: nothing pushed yet

    def pushed(self, version: int) -> None:
        """The live version after a push: the next old log-probs wait for it. (A restarted service
        counts again from its checkpoint's version; the push after it was dense, so the number
        names the actor's weights all the same.)"""
        self.version = version


OLD_POLICY = _OldPolicy()


@dataclass
class ServedActorEngineConfig(FSDPEngineConfig):
    """verl's FSDP engine config of the actor, plus the service's settings and the strategy of the
    engine that trains (``inner_strategy``: ``actor.strategy``, fsdp or fsdp2)."""

    service: ServiceSettings = field(default_factory=ServiceSettings)
    inner_strategy: str = "fsdp"


@dataclass
class ServiceActorConfig(FSDPActorConfig):
    """verl's FSDP actor config (every key of verl's ``actor`` yaml taken as is), plus ``service``:
    the served old-policy model. The actor trains with verl's own engine (``strategy``); its
    old log-probs come from the service."""

    service: Any = field(default_factory=ServiceSettings)

    def __post_init__(self) -> None:
        super().__post_init__()
        settings = service_settings(self.service, ACTOR_PREFIX)
        if "," in settings.address:
            raise ServiceConfigError(
                f"{ACTOR_PREFIX}.service.address={settings.address!r}: the old-policy model is one service "
                "(the actor pushes its weights there), not replicas"
            )
        object.__setattr__(self, "service", settings)
        fsdp = self.fsdp_config
        engine = ServedActorEngineConfig(
            **{f.name: getattr(fsdp, f.name) for f in fields(fsdp) if f.init},
            service=settings,
            inner_strategy=self.strategy,
        )
        object.__setattr__(engine, "strategy", ACTOR_BACKEND)
        self.engine = engine


def _delegated(name: str) -> Any:
    def method(self: ServedActorEngine, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


@EngineRegistry.register(model_type="language_model", backend=ACTOR_BACKEND, device=["cuda", "cpu", "npu"])
class ServedActorEngine(BaseEngine):
    """The actor's engine: verl's own (``inner``, built for ``inner_strategy``) for everything but
    the forward-only log-probs of ``compute_log_prob``, which the served old-policy model scores.

    Whatever else asks the engine for a forward goes to verl's engine as before: a loss, the
    reference of a LoRA actor (``disable_adapter``), ``sum_pi_squared``.
    """

    def __init__(self, model_config: Any, engine_config: ServedActorEngineConfig, *args: Any, **kwargs: Any) -> None:
        if not isinstance(engine_config, ServedActorEngineConfig):
            raise ServiceConfigError(
                f"the {ACTOR_BACKEND} engine needs "
                f"{ACTOR_PREFIX}._target_=logprob_client.integrations.verl_actor.ServiceActorConfig"
            )
        self.model_config = model_config
        self.engine_config = engine_config
        self.settings = engine_config.service
        inner_config = copy.copy(engine_config)  # as verl filled it in, for the engine that trains
        object.__setattr__(inner_config, "strategy", engine_config.inner_strategy)
        model_type = getattr(model_config, "model_type", None) or "language_model"
        self.inner: BaseEngine = EngineRegistry.new(
            model_type, engine_config.inner_strategy, model_config, inner_config, *args, **kwargs
        )
        self.client: LogprobClient | None = None
        self._adapter_disabled = False

    def __getattr__(self, name: str) -> Any:
        """What verl reads of its engine directly (``module``, its offload flags, ...): the inner's."""
        if name == "inner":  # not set yet (a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def initialize(self) -> None:
        """verl's engine, then the served model checked against the actor's model and dtype."""
        self.inner.initialize()
        if self.client is not None:
            self.client.close()
        dtype_setting = f"{ACTOR_PREFIX}.fsdp_config.dtype"
        self.client = connect(self.settings, self.model_config, self.engine_config.dtype, dtype_setting)
        OLD_POLICY.settings = self.settings

    @property
    def is_param_offload_enabled(self) -> bool:
        return self.inner.is_param_offload_enabled

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return self.inner.is_optimizer_offload_enabled

    @contextmanager
    def _without_adapter(self) -> Iterator[None]:
        self._adapter_disabled = True
        try:
            with self.inner.disable_adapter():
                yield
        finally:
            self._adapter_disabled = False

    def disable_adapter(self) -> Any:
        return self._without_adapter()

    def _served(self, data: TensorDict, loss_function: Any) -> bool:
        """Whether this forward is the old policy's log-probs (the served model's to score)."""
        return (
            loss_function is None
            and not self._adapter_disabled
            and not tu.get_non_tensor_data(data, "calculate_sum_pi_squared", False)
        )

    def infer_batch(self, data: TensorDict, loss_function: Any = None) -> Any:
        if not self._served(data, loss_function):
            return self.inner.infer_batch(data, loss_function=loss_function)
        if self.client is None:
            raise RuntimeError("the engine was not initialized (TrainingWorker.reset)")
        if OLD_POLICY.version == 0:
            raise RuntimeError(
                "no weights of the actor were pushed to the served old-policy model yet: set "
                "actor_rollout_ref.rollout.checkpoint_engine.backend=logprob_service (docs/verl.md); the "
                "service's own weights are not the actor's"
            )
        calculate_entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        output = nested_scores(
            self.client,
            self.settings.model,
            data,
            calculate_entropy=calculate_entropy,
            min_version=OLD_POLICY.version,
        )
        return {"model_output": output, "loss": [], "metrics": {}}


for _name, _ in inspect.getmembers(BaseEngine, inspect.isfunction):
    if not _name.startswith("_") and _name not in ServedActorEngine.__dict__:
        setattr(ServedActorEngine, _name, _delegated(_name))
ServedActorEngine.__abstractmethods__ = frozenset()
