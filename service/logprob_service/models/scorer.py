"""Score completion tokens with a loaded causal LM, without computing full logits.

The model body (``model.base_model``: embeddings, decoder layers, final norm) runs to hidden
states; only the rows that predict completion tokens are kept and sent through the lm_head by
the chunked log-prob op. ``.logits`` of the whole model is never computed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from ..jobs import SequenceScores, TokenSequence
from ..ops.logprobs import DEFAULT_CHUNK_BYTES, LogitTransform, chunked_token_logprobs
from ..packing import PaddedBatch, pad_right, plan_padded_batches


def config_logit_transform(config: object) -> LogitTransform:
    """The scale and softcap a model's config applies to its lm_head output.

    Cohere multiplies by ``logit_scale``; Granite divides by ``logits_scaling``; Gemma 2 (and
    others) softcap with ``final_logit_softcapping``.
    """
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    scaling = getattr(config, "logits_scaling", None)
    if scaling:
        scale /= float(scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(scale=scale, softcap=float(softcap) if softcap else None)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """blake2b over every parameter's name, dtype, shape and bytes, in name order.

    Tied parameters are counted once (``named_parameters`` de-duplicates them).
    """
    digest = hashlib.blake2b(digest_size=16)
    for name, param in sorted(model.named_parameters()):
        tensor = param.detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class CausalLMScorer:
    """Scores sequences with one model; called from the executor's worker thread only."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_batch_tokens: int = 16384,
        max_batch_sequences: int = 64,
    ) -> None:
        self.model = model
        self.body = model.base_model
        head = model.get_output_embeddings()
        self.head_weight: torch.Tensor = head.weight  # [V, H]; the input embedding when tied
        self.head_bias: torch.Tensor | None = getattr(head, "bias", None)
        self.transform = config_logit_transform(model.config)
        self.chunk_bytes = chunk_bytes
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_sequences = max_batch_sequences

    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    @torch.inference_mode()
    def score(
        self,
        sequences: Sequence[TokenSequence],
        *,
        temperature: float = 1.0,
        return_entropy: bool = False,
    ) -> list[SequenceScores]:
        """Per-sequence float32 log-probs (and entropies) of every completion token, in order."""
        transform = LogitTransform(self.transform.scale, self.transform.softcap, temperature)
        results: list[SequenceScores | None] = [None] * len(sequences)
        plan = plan_padded_batches(
            [s.num_tokens for s in sequences],
            max_batch_tokens=self.max_batch_tokens,
            max_batch_sequences=self.max_batch_sequences,
        )
        for indices in plan:
            batch = pad_right([sequences[i] for i in indices]).to(self.device)
            for i, scores in zip(indices, self._score_batch(batch, transform, return_entropy)):
                results[i] = scores
        return results  # type: ignore[return-value]  # every index is in exactly one batch

    def _score_batch(self, batch: PaddedBatch, transform: LogitTransform, return_entropy: bool) -> list[SequenceScores]:
        out = self.body(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        hidden = out.last_hidden_state  # [B, L, H]
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.rows)  # [N, H]
        del out, hidden  # free the [B, L, H] states before the lm_head slabs are allocated
        token_scores = chunked_token_logprobs(
            rows,
            self.head_weight,
            batch.targets,
            bias=self.head_bias,
            transform=transform,
            return_entropy=return_entropy,
            chunk_bytes=self.chunk_bytes,
        )
        return _split(token_scores.logprobs, token_scores.entropies, batch.completion_lengths)


def _split(logprobs: torch.Tensor, entropies: torch.Tensor | None, lengths: list[int]) -> list[SequenceScores]:
    logprobs_np = np.split(logprobs.cpu().numpy(), np.cumsum(lengths)[:-1])
    if entropies is None:
        return [SequenceScores(logprobs=lp) for lp in logprobs_np]
    entropies_np = np.split(entropies.cpu().numpy(), np.cumsum(lengths)[:-1])
    return [SequenceScores(logprobs=lp, entropies=e) for lp, e in zip(logprobs_np, entropies_np)]
