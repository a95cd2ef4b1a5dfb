"""Score completion tokens with a loaded causal LM, without computing full logits.

The model body (``model.base_model``: embeddings, decoder layers, final norm) runs on one packed,
padding-free row of sequences (``worker.packing.pack``, attention confined to each sequence by
``ops.attention``); only the rows that predict completion tokens are kept and sent through the
lm_head by the log-prob op (``ops.dispatch``: the fused Triton kernel on CUDA, eager chunks
elsewhere). ``.logits`` of the whole model is never computed.

Scoring is split in two so a device thread can keep the GPU busy: ``launch`` enqueues the work
and an asynchronous copy of the results to host memory and returns at once; ``Launched.fetch``
waits for that copy. The thread can launch the next micro-batch before fetching this one.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Literal, overload

import numpy as np
import torch
from transformers import PreTrainedModel

from logprob_service.domain import DEFAULT_OPTIONS, ScoreOptions, SequenceScores
from logprob_service.errors import LogprobError
from logprob_service.models.chunked import CHUNK_KWARG, install_chunking
from logprob_service.models.compiled import compile_layers, layers_compiled, uncompile_layers
from logprob_service.models.loading import use_experts_implementation
from logprob_service.models.routing import RoutedExperts, expert_count
from logprob_service.models.tensor_parallel import TensorParallel, VocabParallelOp, head_shard
from logprob_service.ops.attention import (
    AttentionBackend,
    attention_implementation_name,
    describe_backends,
    packed_forward_kwargs,
    register_packed_attention,
)
from logprob_service.ops.determinism import pin_matmul_reductions
from logprob_service.ops.dispatch import LogprobOp, select_logprob_op
from logprob_service.ops.logprobs import LogitTransform
from logprob_service.settings.model import DEFAULT_CHUNK_TOKENS, DEFAULT_LONG_SEQUENCE_TOKENS, Settings

log = logging.getLogger(__name__)

CompileLayers = Literal["auto", "on", "off"]
InputEmbeddings = Literal["device", "host"]


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


def model_body(model: PreTrainedModel) -> torch.nn.Module:
    """The model's body (embeddings, decoder layers, final norm): ``base_model``, except where the
    class's ``base_model_prefix`` names no attribute of it (Llama 4's text model: "language_model",
    its body being ``.model``) and ``base_model`` is the whole model."""
    body = model.base_model
    if body is model and isinstance(getattr(model, "model", None), torch.nn.Module):
        body = model.model
    return body


@dataclass(frozen=True)
class ScoringOptions:
    """How a scorer runs its model's body (the settings of the same names)."""

    attention_backend: AttentionBackend = "auto"
    # A micro-batch of one sequence longer than this runs layer by layer in chunks (models.chunked).
    long_sequence_tokens: int = DEFAULT_LONG_SEQUENCE_TOKENS
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # torch.compile the layers' norms and MLPs (models.compiled): auto = on cuda, eager if it fails.
    compile_layers: CompileLayers = "auto"
    # Sequences of a micro-batch with identical prompts run the prompt once (worker.packing).
    share_prompts: bool = True
    # Bitwise batch-invariant scores on CUDA (ops.determinism): one attention kernel for every row.
    deterministic: bool = True
    # An untied input embedding in pinned host memory on a GPU (``CausalLMScorer._embedding_on_host``).
    input_embeddings: InputEmbeddings = "device"


def scoring_options(settings: Settings) -> ScoringOptions:
    """The scoring options the server's settings name."""
    return ScoringOptions(
        settings.attention_backend,
        settings.long_sequence_tokens,
        settings.chunk_tokens,
        settings.compile_layers,
        settings.share_prompts,
        settings.deterministic,
        settings.input_embeddings,
    )


# With ``deterministic``, the preference "auto" becomes this one: the ragged kernel for lone
# sequences too, not torch's SDPA, so a sequence alone runs the kernel it runs when packed.
INVARIANT_ATTENTION: dict[AttentionBackend, AttentionBackend] = {"auto": "cudnn"}


@dataclass(frozen=True)
class SharedKeys:
    """Where each query segment of a packed row finds its keys, when segments share a prompt.

    A prompt that several sequences share is one segment of the row; each completion is a segment
    of its own whose keys are its prompt's rows followed by its own (``worker.packing``)."""

    index: np.ndarray  # [Tk] int64: rows of the packed row whose keys/values, gathered, segment by segment
    cu_seqlens: np.ndarray  # [m + 1] int32: query segment s's keys are gathered rows cu[s]:cu[s + 1]
    max_seqlen: int  # the most keys of one segment


@dataclass(frozen=True)
class PackedBatch:
    """A micro-batch as one packed, padding-free row (built by ``worker.packing.pack``)."""

    input_ids: np.ndarray  # [T] int64: all segments back to back
    position_ids: np.ndarray  # [T] int64: each token's position in its own sequence
    cu_seqlens: np.ndarray  # [m + 1] int32: segment s (its queries) is tokens cu_seqlens[s]:cu_seqlens[s + 1]
    max_seqlen: int  # longest segment, for the attention kernel's launch
    rows: np.ndarray  # [N] int64: indices into [T] of the rows that predict completion tokens
    targets: np.ndarray  # [N] int64: the completion tokens those rows predict
    completion_lengths: list[int]  # to split the N results back per sequence
    # None: every segment is a whole sequence, its keys its own rows (self-attention).
    shared_keys: SharedKeys | None = None
    # [N, Kc] int64: candidate ids whose log-probs to return, row for row with ``rows`` (each
    # sequence's own width, then padding); None when no sequence has any.
    candidates: np.ndarray | None = None
    candidate_widths: list[int] | None = None  # each sequence's own Kc (0: none asked), with ``candidates``

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


INT16_EXPERTS = 2**15
"""Routed expert ids of a model with at most this many experts per layer are int16 (the wire's
``RoutedExperts.ids``), else int32."""


@dataclass
class Launched:
    """Scores of one micro-batch, copying to host memory; ``fetch`` waits for them."""

    logprobs: torch.Tensor  # [N] float32, host (pinned on CUDA)
    entropies: torch.Tensor | None
    completion_lengths: list[int]
    ready: torch.cuda.Event | None  # recorded after the copies; None on the CPU (already done)
    top_ids: torch.Tensor | None = None  # [N, K] int32
    top_logprobs: torch.Tensor | None = None  # [N, K] float32
    candidate_logprobs: torch.Tensor | None = None  # [N, Kc] float32, padded (PackedBatch.candidates)
    candidate_widths: list[int] | None = None
    # [N, MoE layers, top_k] int16 (int32 past INT16_EXPERTS experts), host: each completion
    # token's routed experts (models.routing)
    routed_experts: torch.Tensor | None = None
    top_k_incomplete: torch.Tensor | None = None  # 0-dim bool, host (TokenScores.top_k_incomplete)
    ranks: torch.Tensor | None = None  # [N] int32 (TokenScores.ranks)

    def fetch(self) -> list[SequenceScores]:
        """Each sequence's scores, once the device has them. Raises ``LogprobError`` (INTERNAL) for a
        micro-batch whose fused top-k is not exact (``ops.lm_head.repair``): its requests fail rather
        than get a wrong top-k."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.top_k_incomplete is not None and bool(self.top_k_incomplete):
            k = self.top_ids.shape[1] if self.top_ids is not None else 0
            raise LogprobError(
                f"the fused lm_head's top-{k} did not finish some rows of this micro-batch of "
                f"{len(self.completion_lengths)} sequences within its repair rounds (rows of many "
                "equal or NaN logits); its requests fail rather than get a wrong top-k "
                "(logprob_kernel 'eager' computes it without rounds)"
            )
        split_at = np.cumsum(self.completion_lengths)[:-1]

        def per_sequence(tensor: torch.Tensor | None) -> list[np.ndarray | None]:
            if tensor is None:
                return [None] * len(self.completion_lengths)
            return np.split(tensor.numpy(), split_at)

        candidates = per_sequence(self.candidate_logprobs)
        if self.candidate_widths is not None:  # each sequence's own columns; None where it asked none
            candidates = [c[:, :w] if w else None for c, w in zip(candidates, self.candidate_widths)]
        return [
            SequenceScores(
                logprobs=lp,
                entropies=e,
                top_ids=ti,
                top_logprobs=tl,
                candidate_logprobs=c,
                routed_experts=r,
                ranks=rk,
            )
            for lp, e, ti, tl, c, r, rk in zip(
                per_sequence(self.logprobs),
                per_sequence(self.entropies),
                per_sequence(self.top_ids),
                per_sequence(self.top_logprobs),
                candidates,
                per_sequence(self.routed_experts),
                per_sequence(self.ranks),
            )
        ]

    def fetch_routed_experts(self) -> list[np.ndarray]:
        """Per sequence, [C, MoE layers, top_k]: the experts each MoE layer routed the row that
        predicts completion token t to (the row of the token before it), as the model chose them
        (``fetch``'s ``SequenceScores.routed_experts``)."""
        if self.routed_experts is None:
            raise ValueError("this micro-batch was launched without return_routed_experts")
        return [scores.routed_experts for scores in self.fetch()]  # type: ignore[misc]  # all set


class CausalLMScorer:
    """Scores packed micro-batches with one model; used from the executor's device thread only.
    (Any number of sequences, in micro-batches, in this process: ``logprob_service.offline``.)"""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        logprob_op: LogprobOp | None = None,
        options: ScoringOptions | None = None,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        """``tensor_parallel``: ``model`` is one rank's shards (``models.tensor_parallel``); every
        rank of the group builds its scorer, and launches the same micro-batches, in the same order."""
        register_packed_attention()
        options = options or ScoringOptions()
        self.options = options
        self.tensor_parallel = tensor_parallel
        model.set_attn_implementation(attention_implementation_name(self.attention_preference))
        self.model = model
        self.body = model_body(model)
        install_chunking(self.body)
        head = model.get_output_embeddings()
        self.vocab_size: int = head.weight.shape[0]
        # [V, H]: the lm_head's rows (the input embedding when tied); this rank's slice under TP
        self.head_weight: torch.Tensor = head.weight
        self.head_bias: torch.Tensor | None = getattr(head, "bias", None)
        vocab_start = 0
        if tensor_parallel is not None:
            self.head_weight, self.head_bias, vocab_start = head_shard(model, tensor_parallel)
        self.transform = config_logit_transform(model.config)
        # A mixture-of-experts model's experts: grouped GEMMs on CUDA, the exact loop on the CPU.
        self.experts: str | None = use_experts_implementation(model, self.device)
        self.num_experts: int = expert_count(model)  # 0: no routers, no routed experts to return
        if self.experts is not None:
            log.info("mixture-of-experts layers: experts_implementation=%s", self.experts)
        op = logprob_op or select_logprob_op("auto", self.head_weight.device, invariant=options.deterministic)
        self.logprob_op = op if tensor_parallel is None else VocabParallelOp(op, tensor_parallel, vocab_start)
        self._host_embedding = self._embedding_on_host(model) if options.input_embeddings == "host" else None
        self._matmuls_pinned = None
        if options.deterministic and self.device.type == "cuda":
            self._matmuls_pinned = pin_matmul_reductions()
        self._compile_layers(options.compile_layers)

    def _embedding_on_host(self, model: PreTrainedModel) -> torch.nn.Module | None:
        """The input embedding moved to pinned host memory, or None where it stays: on the CPU,
        under tensor parallel (each rank's shard is its own), and when tied (its weight is the
        lm_head's, which the fused lm_head reads on the device). A lookup copies rows exactly, so
        the scores are bitwise those with the table on the device; weight updates write it where
        it lives (``models.weights``)."""
        embedding = model.get_input_embeddings()
        where = (
            "the model runs on the CPU"
            if self.device.type != "cuda"
            else "tensor parallel"
            if self.tensor_parallel is not None
            else "it is tied to the lm_head"
            if embedding.weight.data_ptr() == self.head_weight.data_ptr()
            else None
        )
        if where is not None:
            log.info("input_embeddings=host: the input embedding stays on %s (%s)", self.device, where)
            return None
        embedding.to("cpu")
        for parameter in embedding.parameters():
            parameter.data = parameter.data.pin_memory()  # so each micro-batch's rows copy up asynchronously
        torch.cuda.empty_cache()
        log.info(
            "input embedding held in host memory: %.2f GiB of %s freed",
            sum(p.nbytes for p in embedding.parameters()) / 2**30,
            self.device,
        )
        return embedding

    def _token_inputs(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        """The body's inputs for the packed token ids [T]: the ids on the device, or, with the
        input embedding on the host, their rows [1, T, H] gathered there and copied up."""
        if self._host_embedding is None:
            return {"input_ids": self._to_device(ids)[None]}
        rows = self._host_embedding(torch.from_numpy(ids))
        return {"inputs_embeds": rows.pin_memory().to(self.device, non_blocking=True)[None]}

    @property
    def attention_preference(self) -> AttentionBackend:
        """The attention backend setting as this scorer applies it (``INVARIANT_ATTENTION``)."""
        backend = self.options.attention_backend
        return INVARIANT_ATTENTION.get(backend, backend) if self.options.deterministic else backend

    def determinism(self) -> str:
        """What ``--deterministic`` guarantees for this model on this device, for ``ListModels``
        (with, for a mixture-of-experts model, how its experts run)."""
        experts = "" if self.experts is None else f"; experts: {self.experts}"
        return self._determinism() + experts

    def _determinism(self) -> str:
        if not self.options.deterministic:
            return "off: a sequence's scores may move (by float rounding) with what shares its micro-batch"
        if self.device.type != "cuda":
            return "on, but on the CPU only run to run: matmul kernels follow the micro-batch's size"
        if self._matmuls_pinned is not None:
            return f"on, but not batch-invariant: {self._matmuls_pinned}"
        if self.logprob_op.kernel != "triton":
            return "on, but not batch-invariant: the lm_head runs in eager chunks (cuBLAS by chunk size)"
        return (
            "bitwise batch-invariant on this GPU model and software: fixed lm_head splits, "
            "no split-K GEMMs, one attention kernel for every row"
        )

    @property
    def layers_compiled(self) -> bool:
        """Whether the body's norms and MLPs run compiled (read from the modules themselves)."""
        return layers_compiled(self.body)

    def _compile_layers(self, setting: CompileLayers) -> None:
        """Compile the layers' norms and MLPs as the setting says; compiles now, on a short probe
        row, so that a failure shows here and not in the first request."""
        if setting == "off" or (setting == "auto" and self.device.type != "cuda"):
            return
        compile_layers(self.body)
        try:
            self._probe()
        except Exception as err:
            uncompile_layers(self.body)
            # Under tensor parallel a failure is fatal even for auto: the probe may have stopped
            # between two collectives on this rank only, and the ranks would part.
            if setting == "on" or self.tensor_parallel is not None:
                raise RuntimeError(f"compile_layers={setting}: compiling the decoder layers failed: {err}") from err
            log.warning("decoder layers left eager: compiling them failed: %s", err)

    def run_layers_eagerly(self, why: str) -> None:
        """Undo ``compile_layers`` for good (a LoRA base: PEFT's layers are not traced)."""
        if self.layers_compiled:
            uncompile_layers(self.body)
            log.info("decoder layers run eagerly from now on: %s", why)

    @torch.inference_mode()
    def _probe(self) -> None:
        lengths = np.array([0, 5, 16], dtype=np.int32)  # two sequences, so the packed attention path runs
        tokens = int(lengths[-1])
        ids = np.arange(1, tokens + 1) % self.vocab_size
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in np.diff(lengths)])).to(self.device)
        self.body(
            **self._token_inputs(ids),
            position_ids=positions[None],
            use_cache=False,
            **packed_forward_kwargs(torch.from_numpy(lengths).to(self.device), int(np.diff(lengths).max())),
        )

    def attention_plan(self) -> str:
        """Which attention backend serves which kind of row on this device, for ``ListModels`` and logs."""
        config = self.model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        value_head_dim = getattr(config, "v_head_dim", None)
        if value_head_dim is not None:  # MLA (DeepSeek): queries and keys of nope + rope dims, every head its own K/V
            head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        ranks = self.tensor_parallel.world if self.tensor_parallel is not None else 1
        layer_types = set(getattr(config, "layer_types", None) or ())
        window = getattr(config, "sliding_window", None)
        return describe_backends(
            self.attention_preference,
            heads=heads // ranks,
            kv_heads=(heads if value_head_dim else getattr(config, "num_key_value_heads", None) or heads) // ranks,
            head_dim=head_dim,
            dtype=self.head_weight.dtype,
            device=self.device,
            softcap=getattr(config, "attn_logit_softcapping", None),
            value_head_dim=value_head_dim,
            # a window where a layer has one: every layer unless the config types its layers
            sliding_window=window if window and (not layer_types or "sliding_attention" in layer_types) else None,
            sinks=any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in self.body.modules()),
            attention_chunk=getattr(config, "attention_chunk_size", None)
            if "chunked_attention" in layer_types
            else None,
        )

    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":  # pinned host memory: the copy runs asynchronously
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    @torch.inference_mode()
    def launch(self, batch: PackedBatch, options: ScoreOptions = DEFAULT_OPTIONS) -> Launched:
        """Enqueue the scoring of one packed micro-batch with ``options``; returns before the device
        is done. The temperature joins the model's own logit transform, and the log-prob op returns
        the outputs ``options`` ask for (and the batch's ``candidates``' log-probs where it has
        some). ``return_routed_experts``: keep a mixture-of-experts model's router choices for the
        completion rows (``Launched.fetch_routed_experts``; ``routing.RoutingUnsupported`` for a
        model without routers)."""
        routing = RoutedExperts(self.model) if options.return_routed_experts else None
        tokens = self._token_inputs(batch.input_ids)  # input_ids [1, T] or inputs_embeds [1, T, H]
        position_ids = self._to_device(batch.position_ids)[None]  # [1, T]
        cu_seqlens = self._to_device(batch.cu_seqlens)  # [n + 1]
        chunking = {}
        if len(batch.completion_lengths) == 1 and batch.num_tokens > self.options.long_sequence_tokens:
            chunking = {CHUNK_KWARG: self.options.chunk_tokens}  # memory linear in T, not in T x MLP width
        keys = None
        host_bounds = (batch.cu_seqlens, batch.cu_seqlens)  # what host-side attention paths read, no sync
        if (shared := batch.shared_keys) is not None:  # completions keyed on their shared prompt's rows
            keys = (self._to_device(shared.cu_seqlens), shared.max_seqlen, self._to_device(shared.index))
            host_bounds = (batch.cu_seqlens, shared.cu_seqlens)
        with routing if routing is not None else contextlib.nullcontext():
            out = self.body(
                **tokens,
                position_ids=position_ids,
                use_cache=False,
                **packed_forward_kwargs(cu_seqlens, batch.max_seqlen, keys=keys, host_bounds=host_bounds),
                **chunking,
            )
        hidden = out.last_hidden_state[0]  # [T, H]
        del out
        contiguous = bool((np.diff(batch.rows) == 1).all())
        row_index = self._to_device(batch.rows) if routing is not None or not contiguous else None
        routed = routing.ids(row_index) if routing is not None else None  # [N, layers, top_k]
        if routed is not None and self.num_experts <= INT16_EXPERTS:
            routed = routed.to(torch.int16)  # the wire's type for them: half the copy to the host
        if contiguous:  # one sequence's rows, back to back: a view, no [N, H] copy
            rows = hidden.narrow(0, int(batch.rows[0]), len(batch.rows))  # [N, H]
        else:
            rows = hidden.index_select(0, row_index)  # [N, H]
        del hidden  # the index_select copy frees the [T, H] states before the lm_head slabs are allocated
        transform = LogitTransform(self.transform.scale, self.transform.softcap, options.temperature)
        scores = self.logprob_op(
            rows,
            self.head_weight,
            self._to_device(batch.targets),
            options,
            bias=self.head_bias,
            transform=transform,
            candidates=self._to_device(batch.candidates) if batch.candidates is not None else None,
        )
        return Launched(
            logprobs=self._to_host(scores.logprobs),
            entropies=self._to_host(scores.entropies),
            completion_lengths=batch.completion_lengths,
            routed_experts=self._to_host(routed) if routed is not None else None,
            ready=self._record_event(),
            top_ids=self._to_host(scores.top_ids),
            top_logprobs=self._to_host(scores.top_logprobs),
            candidate_logprobs=self._to_host(scores.candidate_logprobs),
            candidate_widths=batch.candidate_widths,
            top_k_incomplete=self._to_host(scores.top_k_incomplete),
            ranks=self._to_host(scores.ranks),
        )

    @overload
    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor: ...
    @overload
    def _to_host(self, tensor: None) -> None: ...
    def _to_host(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None or self.device.type != "cuda":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def _record_event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event
