"""The models a server holds, by name: each as one replica per device (data parallel), in the
order of the scheduler's lanes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from logprob_service.engine.interfaces import ServedModel
from logprob_service.errors import ModelNotFound


class ModelRegistry:
    """Name -> served model (its replica on the first device) and its replicas on every device.
    Filled before the server reports SERVING; read by every layer above."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}
        self._replicas: dict[str, tuple[ServedModel, ...]] = {}

    def add(self, served: ServedModel, replicas: Sequence[ServedModel] = ()) -> None:
        """``served`` on the first device, and ``replicas`` of it on the others, lane by lane."""
        self._models[served.info.name] = served
        self._replicas[served.info.name] = (served, *replicas)

    def get(self, name: str) -> ServedModel:
        try:
            return self._models[name]
        except KeyError:
            served = ", ".join(sorted(self._models)) or "none"
            raise ModelNotFound(f"model: {name!r} is not served here; served models: {served}") from None

    def replicas(self, name: str) -> tuple[ServedModel, ...]:
        """``name`` on every device, in lane order (the first is ``get(name)``)."""
        self.get(name)
        return self._replicas[name]

    def lora_models_of(self, base: str) -> list[str]:
        """Names of the LoRA models sharing ``base``'s weights."""
        return [name for name, served in self._models.items() if served.info.base_model == base]

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(tuple(self._models.values()))  # a snapshot: models may be added meanwhile

    def __len__(self) -> int:
        return len(self._models)
