"""LoRA models that share their base model's weights: declared as ``NAME=BASE+ADAPTER_DIR``.

PEFT injects each adapter's layers into the base model in place, so the reference (the base)
and any number of LoRA policies hold one copy of the base weights on the device. Which one a
micro-batch scores with is switched on the device thread right before it is launched: the base
with every adapter layer disabled, a LoRA model with its own adapter active. Micro-batches never
mix models, so one switch per micro-batch is enough (and none when the model did not change).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel

from logprob_service.models.loading import ModelLoadError

# Defined in settings.sources, which checks that adapter directories exist before anything loads.
from logprob_service.settings.sources import split_lora_source as split_lora_source


class AdapterHost:
    """A base model with PEFT adapters injected into it; used from the device thread only."""

    def __init__(self, model: PreTrainedModel, *, model_dtype: bool = False) -> None:
        """``model_dtype``: hold the adapters in the base model's dtype. PEFT's default keeps a
        bf16/fp16 model's adapters in float32; float32 GEMMs have no split-K switch in torch, so
        a batch-invariant server (``--deterministic``, ops.determinism) holds them in the model's
        dtype, where its pin applies, and weight pushes to them must come in that dtype."""
        self.model = model
        self.autocast = not model_dtype
        self.peft = None  # peft.PeftModel wrapping ``model``, made with the first adapter
        self._active: str | None = None  # the adapter scoring runs with; None: the base alone

    def add(self, name: str, adapter_dir: str) -> None:
        """Inject the PEFT adapter saved in ``adapter_dir`` under ``name``."""
        from peft import PeftModel  # the server needs peft only when LoRA models are served

        if not (Path(adapter_dir) / "adapter_config.json").is_file():
            raise ModelLoadError(f"LoRA model {name!r}: {adapter_dir!r} is not a PEFT adapter directory")
        head = self.model.get_output_embeddings()
        try:
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(
                    self.model, adapter_dir, adapter_name=name, autocast_adapter_dtype=self.autocast
                )
            else:
                self.peft.load_adapter(adapter_dir, adapter_name=name, autocast_adapter_dtype=self.autocast)
        except Exception as err:  # peft raises ValueError/KeyError/... with useful text
            raise ModelLoadError(f"LoRA model {name!r}: could not load adapter {adapter_dir!r}: {err}") from err
        self.peft.eval()
        # Scoring reads the lm_head weight directly (the fused kernel), so an adapter on it, or one
        # that trains a full copy of modules (modules_to_save), would be silently ignored.
        config = self.peft.peft_config[name]
        if self.model.get_output_embeddings() is not head or getattr(config, "modules_to_save", None):
            raise ModelLoadError(
                f"LoRA model {name!r}: adapters on the lm_head or with modules_to_save are not supported "
                "(the lm_head is applied by the fused log-prob op)"
            )
        # Whatever PEFT left active after loading, the next micro-batch sets its own adapter.
        self.peft.base_model.disable_adapter_layers()
        self._active = None

    def activate(self, adapter: str | None) -> None:
        """Score with ``adapter`` (None: the base model alone) from the next micro-batch on."""
        if self.peft is None or adapter == self._active:
            return
        tuner = self.peft.base_model
        if adapter is None:
            tuner.disable_adapter_layers()
        else:
            tuner.enable_adapter_layers()
            tuner.set_adapter(adapter)
        self._active = adapter

    def adapter_weights(self, name: str) -> dict[str, torch.Tensor]:
        """The adapter's live tensors, named as in its PEFT state dict (``adapter_model.safetensors``)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.peft, adapter_name=name)
