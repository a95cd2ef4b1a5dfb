"""A verl ``CheckpointEngine`` plugin that pushes the actor's weights to the service's old-policy
model after each update, so that verl's old log-probs (``compute_log_prob``) come from the service
(``verl_actor.ServiceActorConfig``) with the actor's current weights.

How verl 0.9.1 moves weights (``verl/checkpoint_engine/base.py``, ``verl/workers/engine_workers.py``):
the trainer calls ``CheckpointEngineManager.update_weights(global_steps)`` at start-up and after
every actor update; the manager makes every actor rank run ``ActorRolloutRefWorker.update_weights``,
which, for a backend other than ``naive``, hands the actor engine's ``get_per_tensor_param()``
generator to its checkpoint engine's ``send_weights`` (the sender side); a rollout process's
``CheckpointEngineWorker`` runs ``receive_weights`` and loads what comes into vLLM/SGLang (the
receiver side). The engine class is looked up in ``CheckpointEngineRegistry`` by
``rollout.checkpoint_engine.backend``, after ``custom_backend_module`` is imported in every
process that builds one.

``ServiceCheckpointEngine`` (backend ``logprob_service``) is a sender only: ``send_weights`` drains
the generator on every rank (FSDP gathers each tensor collectively), and rank 0 pushes the tensors
to the served old-policy model (``_push.WeightPusher``: CUDA IPC on the service's host, NCCL
broadcast, or sparse deltas over gRPC; ``transport``, ``auto`` by default), then tells every rank
the version that went live; the actor's engine asks the service for old log-probs with that
``min_version``. ``receive_weights`` does not apply: the service receives pushes through its own
gRPC/IPC/NCCL receivers, not through a verl rollout process.

The rollout still needs the actor's weights: ``ServiceCheckpointManager`` (verl's
``rollout.checkpoint_manager_class``) runs both on every update, the push to the service first
(while the colocated rollout sleeps), then verl's own colocated sync (``naive``). Colocated
(hybrid) rollouts only: a disaggregated rollout's transfer (verl's nccl/nixl/... backends) is not
combined with the push yet.

Override lines (with ``verl_actor.ServiceActorConfig``'s; docs/verl.md)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=logprob_service
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=logprob_client.integrations.verl_checkpoint
    +actor_rollout_ref.rollout.checkpoint_manager_class=logprob_client.integrations.verl_checkpoint.ServiceCheckpointManager

Optional: ``+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.logprob_service.transport=``
``auto|ipc|nccl|grpc`` (and ``.master_address``/``.master_port`` for nccl, ``.timeout_s``).

Checked against verl 0.9.1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

try:
    import ray
    import torch
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
    from verl.utils.ray_utils import auto_await
except ImportError as err:  # an optional dependency
    raise ImportError(
        "logprob_client.integrations.verl_checkpoint needs verl and the [verl] extra's tensordict: "
        f"pip install verl==0.9.1 tensordict==0.10.0 ({err})"
    ) from err

from ..client import LogprobClient
from ._push import WeightPusher
from ._served import Expected, ServiceConfigError, check_served_model
from .verl import BACKEND
from .verl_actor import ACTOR_PREFIX, OLD_POLICY

ENGINE_PREFIX = "actor_rollout_ref.rollout.checkpoint_engine"
KWARGS_PREFIX = f"{ENGINE_PREFIX}.engine_kwargs.{BACKEND}"
MANAGER_SETTING = "+actor_rollout_ref.rollout.checkpoint_manager_class"
MANAGER = "logprob_client.integrations.verl_checkpoint.ServiceCheckpointManager"

__all__ = ["ServiceCheckpointEngine", "ServiceCheckpointManager"]


async def _pairs(weights: Any) -> AsyncIterator[tuple[str, Any]]:
    """verl's weights, a generator or an async one."""
    if hasattr(weights, "__aiter__"):
        async for pair in weights:
            yield pair
    else:
        for pair in weights:
            yield pair


def _agreed(version: int) -> int:
    """Rank 0's version, on every rank of the actor's process group."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return version
    box = [version]
    torch.distributed.broadcast_object_list(box, src=0)
    return int(box[0])


def _stock_manager_path() -> ServiceConfigError:
    return ServiceConfigError(
        f"{ENGINE_PREFIX}.backend={BACKEND} is driven by its own manager: set {MANAGER_SETTING}={MANAGER} "
        "(verl's stock manager would treat the service as a disaggregated rollout)"
    )


@CheckpointEngineRegistry.register(BACKEND)
class ServiceCheckpointEngine(CheckpointEngine):
    """The actor's sender of weights to the served old-policy model (its settings are the
    actor's ``service``: ``verl_actor.ServiceActorConfig``). Built by verl in every actor rank's
    ``init_model`` with ``is_master`` on rank 0 and ``engine_kwargs.logprob_service``."""

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool = False,
        *,
        transport: str = "auto",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        timeout_s: float = 600.0,
        **unknown: Any,
    ) -> None:
        if unknown:
            known = ["master_address", "master_port", "timeout_s", "transport"]
            raise ServiceConfigError(f"{KWARGS_PREFIX} has unknown settings {sorted(unknown)}; known: {known}")
        settings = OLD_POLICY.settings
        if settings is None:
            raise ServiceConfigError(
                f"{ENGINE_PREFIX}.backend={BACKEND} pushes the actor's weights to the model its old log-probs are "
                f"served by: set {ACTOR_PREFIX}._target_=logprob_client.integrations.verl_actor.ServiceActorConfig "
                f"with +{ACTOR_PREFIX}.service.address and .model (docs/verl.md)"
            )
        self.is_master = is_master
        self.pusher: WeightPusher | None = None
        if is_master:  # rank 0 pushes; the others only learn the version
            client = LogprobClient(settings.address, timeout=timeout_s, model=settings.model)
            try:
                info = check_served_model(
                    client,
                    Expected(
                        model=settings.model,
                        model_setting=f"{ACTOR_PREFIX}.service.model",
                        address_setting=f"{ACTOR_PREFIX}.service.address={settings.address!r}",
                    ),
                    timeout=min(timeout_s, 30.0),
                )
                self.pusher = WeightPusher(
                    client,
                    settings.model,
                    info.dtype,
                    transport=transport,
                    master_address=master_address,
                    master_port=master_port,
                    timeout_s=timeout_s,
                    setting=KWARGS_PREFIX,
                )
            except BaseException:
                client.close()
                raise

    # verl's stock manager calls these four around a disaggregated rollout's transfer; the
    # service is no verl rollout, and ServiceCheckpointManager never calls them.
    def prepare(self) -> dict[str, Any]:
        raise _stock_manager_path()

    @classmethod
    def build_topology(cls, *args: Any, **kwargs: Any) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        raise _stock_manager_path()

    def init_process_group(self, **kwargs: Any) -> None:
        raise _stock_manager_path()

    def finalize(self) -> None:
        raise _stock_manager_path()

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Push every tensor of ``weights`` to the served old-policy model (rank 0), then record the
        live version on every rank; the actor's next old log-probs wait for it."""
        start = time.perf_counter()
        staged: list[tuple[str, Any]] = []
        transport = ""
        async for name, tensor in _pairs(weights):  # every rank: each tensor is gathered collectively
            if self.pusher is not None:
                transport = transport or self.pusher.resolve(tensor)
                staged.append((name, self.pusher.stage(tensor, transport)))
        version = 0
        if self.pusher is not None:
            pusher = self.pusher
            result = await asyncio.to_thread(pusher.push_staged, staged, transport)
            version = result.version
        version = _agreed(version)
        OLD_POLICY.pushed(version)
        return {"logprob_service/push_s": time.perf_counter() - start, "logprob_service/version": float(version)}

    async def receive_weights(self, global_steps: int | None = None) -> Any:
        raise NotImplementedError(
            "the service receives pushed weights through its own receivers (gRPC, CUDA IPC, NCCL), "
            "not through a verl rollout process: there is nothing to receive on verl's side"
        )

    def close(self) -> None:
        if self.pusher is not None:
            self.pusher.close()
            self.pusher.client.close()


class ServiceCheckpointManager(CheckpointEngineManager):
    """verl's checkpoint-engine manager for ``backend=logprob_service``: on every update (start-up
    and after each actor step), every actor rank pushes its weights to the served old-policy model,
    then verl's colocated sync (``naive``) loads them into the rollout."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any]) -> None:
        if config.backend != BACKEND:
            raise ServiceConfigError(
                f"{MANAGER_SETTING}={MANAGER} pushes to the service: it needs {ENGINE_PREFIX}.backend={BACKEND}, "
                f"not {config.backend!r}"
            )
        super().__init__(config, actor_wg, replicas)

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, float]:
        metrics: dict[str, float] = {}
        pushed: Iterable[Any] = ray.get(self.actor_wg.update_weights(global_steps=global_steps, mode=BACKEND))
        for result in pushed:
            if isinstance(result, dict):
                metrics.update(result)
        ray.get(self.actor_wg.update_weights(global_steps=global_steps, mode="naive"))
        return metrics
