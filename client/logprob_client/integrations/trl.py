"""TRL's ``GRPOTrainer`` with its reference log-probs scored by logprob-service.

    from logprob_client import LogprobClient
    from logprob_client.integrations.trl import RemotePolicy, RemoteReference, RemoteReferenceGRPOTrainer

    trainer = RemoteReferenceGRPOTrainer(
        model="Qwen/Qwen2.5-0.5B-Instruct",
        reward_funcs=reward,
        args=GRPOConfig(beta=0.04, num_iterations=2, ...),
        train_dataset=dataset,
        reference=RemoteReference(LogprobClient("ref-host:50051"), model="ref"),
        old_policy=RemotePolicy(LogprobClient("ref-host:50051"), model="policy"),  # optional
    )

No reference model is loaded on the trainer's devices, and ``beta > 0`` works as in TRL: the KL
term, its metric and the loss are TRL's own, only the reference log-probs come over gRPC.

How it hooks into TRL (checked against TRL 1.16.0):

* **Construction.** TRL's ``__init__`` loads a reference model whenever ``args.beta != 0``. This
  class runs it with ``args.beta`` set to 0 for the duration (so TRL builds none, and no PEFT
  "ref" adapter either), then restores ``beta`` and sets ``self.ref_model`` to the
  ``RemoteReference`` handle. ``beta`` and ``ref_model`` are the attributes TRL's generation step
  reads to decide whether, and with what, to score the reference.
* **The one override point**: ``GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids,
  attention_mask, logits_to_keep, ...)``, TRL's single function for per-token log-probs of the
  last ``logits_to_keep`` columns. Called with the handle (that is, for the reference), it cuts
  the ``(B, P + C)`` batch back into TRL's left-padded prompts and right-padded completions with
  their masks and scores them with the service, at TRL's sampling temperature. Every other call
  (the policy, with gradients) goes to TRL unchanged.

Both are checked when the trainer is built, so a TRL release whose internals moved fails at once
with a message naming what moved, not with wrong numbers mid-run.

Old-policy log-probs (``old_policy=RemotePolicy(client, model="policy")``): TRL computes them,
while generating, when a batch is used for more than one optimizer step (``num_iterations > 1``, or
``steps_per_generation`` beyond ``gradient_accumulation_steps``), as a no-gradient forward of the
policy through the same hook. With ``old_policy``, that call is scored by the service instead:
the policy's weights are pushed first whenever an optimizer step changed them (by CUDA IPC to a
service on this host, else a sparse delta over gRPC after the first push), and the scoring waits
for that version. Without it, TRL computes them
in-process, as it does on its own.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any

try:
    import torch
    import trl
    from trl import GRPOConfig, GRPOTrainer
except ImportError as err:  # an optional dependency
    raise ImportError(
        f"logprob_client.integrations.trl needs TRL (the [trl] extra): pip install trl==1.16.0 ({err})"
    ) from err

from ..client import LogprobClient
from ..wire import ModelInfo
from ._push import WeightPusher
from ._served import Expected, check_served_model

CHECKED_TRL_VERSION = "1.16.0"
_HOOK = "_get_per_token_logps_and_entropies"
_HOOK_PARAMETERS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep")
# The hook's options this module understands; any other one TRL sets (images, token types) is refused.
_KNOWN_OPTIONS = ("batch_size", "compute_entropy", "compute_aux_loss")


class TRLVersionError(RuntimeError):
    """The installed TRL's GRPOTrainer no longer has the internals this integration hooks into."""


@dataclass(frozen=True)
class RemoteReference:
    """The served model that stands in for TRL's reference model.

    ``client``: a ``LogprobClient`` (its RPC limits split large batches into RPCs in flight
    together). ``model``: the name the service serves the reference under.
    """

    client: LogprobClient
    model: str = "default"

    def per_token_logps(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        *,
        temperature: float,
        return_entropy: bool = False,
        min_version: int = 0,
    ) -> Any:
        """``(B, C)`` float32 log-probs of the last ``C = logits_to_keep`` columns of ``input_ids``
        (and entropies, when asked), 0 where ``attention_mask`` is 0.

        ``input_ids``/``attention_mask`` are TRL's ``(B, P + C)`` concatenation of left-padded
        prompts and right-padded completions, which is the client's dense layout split at P.
        """
        p = input_ids.shape[1] - logits_to_keep
        return self.client.score(
            input_ids[:, :p],
            input_ids[:, p:],
            prompt_mask=attention_mask[:, :p],
            completion_mask=attention_mask[:, p:],
            model=self.model,
            temperature=temperature,
            return_entropy=return_entropy,
            min_version=min_version,
        )


@dataclass
class _PolicyOnService:
    """What the service holds of the policy, and how it gets there."""

    step: int | None = None  # the optimizer step whose weights the service holds
    version: int = 0  # the version they went live as
    pusher: WeightPusher | None = None  # made at the first push, in the served model's dtype


@dataclass(frozen=True)
class RemotePolicy(RemoteReference):
    """A served copy of the policy that scores TRL's old-policy log-probs.

    ``model``: the name the service serves it under, loaded from the policy's starting checkpoint
    (or any weights of its shape). Before TRL first needs old-policy log-probs after an optimizer
    step, the policy's weights are pushed, in the served model's dtype, by ``_push.WeightPusher``,
    and the scoring waits for that version (``min_version``). ``transport``: "auto" pushes a
    policy on a GPU by CUDA IPC (``update_weights_ipc``: a device-to-device copy by a service on
    this host), and falls back for good to gRPC when the service refuses it (another host, no
    peer access); "grpc" always sends sparse deltas over gRPC (``update_weights(..., delta=True)``:
    dense the first time, then only what changed); "ipc" only IPC (a refusal is raised).
    """

    model: str = "policy"
    transport: str = "auto"
    served: _PolicyOnService = field(default_factory=_PolicyOnService)

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "ipc", "grpc"):
            raise ValueError(f"transport must be 'auto', 'ipc' or 'grpc', got {self.transport!r}")

    def sync(self, policy: torch.nn.Module, step: int, dtype: str) -> int:
        """Push ``policy``'s weights, cast to ``dtype`` (the served model's), unless the service
        holds those of ``step``; the live version."""
        if self.served.pusher is None:
            self.served.pusher = WeightPusher(
                self.client,
                self.model,
                dtype,
                transport=self.transport,
                timeout_s=self.client.timeout,
                setting="RemotePolicy",
            )
        if self.served.step != step:
            self.served.version = self.served.pusher.push(policy.state_dict().items()).version
            self.served.step = step
        return self.served.version


def check_trl_compatible(trainer_cls: type = GRPOTrainer) -> None:
    """Raise ``TRLVersionError`` unless ``trainer_cls`` has the internals this module relies on."""

    def fail(problem: str) -> TRLVersionError:
        return TRLVersionError(
            f"logprob_client.integrations.trl cannot hook into TRL {trl.__version__}: {problem}. "
            f"It was checked against TRL {CHECKED_TRL_VERSION}: install that "
            f"(pip install trl=={CHECKED_TRL_VERSION}), or adapt RemoteReferenceGRPOTrainer to the new internals."
        )

    hook = getattr(trainer_cls, _HOOK, None)
    if not callable(hook):
        raise fail(f"{trainer_cls.__name__}.{_HOOK} does not exist")
    parameters = tuple(inspect.signature(hook).parameters)
    if parameters[: len(_HOOK_PARAMETERS)] != _HOOK_PARAMETERS or not set(_KNOWN_OPTIONS) <= set(parameters):
        expected = ", ".join((*_HOOK_PARAMETERS, *_KNOWN_OPTIONS))
        raise fail(f"{trainer_cls.__name__}.{_HOOK}{inspect.signature(hook)} no longer takes ({expected}, ...)")
    # The generation step must still score the reference through the hook, gated on `beta` and
    # `ref_model`; __init__ must still read `beta` (to skip loading a reference) and `temperature`.
    for method, names in (
        ("_generate_and_score_completions", {"beta", "ref_model", _HOOK}),
        ("__init__", {"beta", "ref_model", "temperature"}),
    ):
        function = getattr(trainer_cls, method, None)
        code = getattr(inspect.unwrap(function), "__code__", None) if function is not None else None
        if code is None:
            raise fail(f"{trainer_cls.__name__}.{method} does not exist")
        missing = names - set(code.co_names)  # the attribute and method names the function's code uses
        if missing:
            raise fail(f"{trainer_cls.__name__}.{method} no longer uses {', '.join(sorted(missing))}")


class RemoteReferenceGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose reference log-probs come from logprob-service.

    Takes GRPOTrainer's arguments, plus ``reference``: the served model to use as the reference.
    Construction checks that the installed TRL has the expected internals, and that the served
    model exists and has the policy's vocabulary size (the reference must share the tokenizer).
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        *rest: Any,
        reference: RemoteReference | None = None,
        old_policy: RemotePolicy | None = None,
        **kwargs: Any,
    ) -> None:
        check_trl_compatible(GRPOTrainer)
        if args is not None and args.sync_ref_model:
            raise ValueError(
                "sync_ref_model=True copies the policy into a local reference model; a served reference has none. "
                "Set sync_ref_model=False."
            )
        beta = 0.0 if args is None else args.beta
        if beta != 0.0 and reference is None:
            raise ValueError(
                f"beta={beta} needs reference=RemoteReference(...): this trainer loads no reference model of its own"
            )
        if args is not None:
            args.beta = 0.0  # TRL then loads no reference model (nor a PEFT "ref" adapter)
        try:
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        finally:
            if args is not None:
                args.beta = beta
        if getattr(self, "ref_model", "missing") is not None:
            raise TRLVersionError(
                f"TRL {trl.__version__} built a reference model with beta=0; this integration cannot keep it off the "
                f"device (checked against TRL {CHECKED_TRL_VERSION})."
            )
        self.beta = beta
        self.old_policy = old_policy
        self._generating = False  # inside _generate_and_score_completions, where TRL scores the old policy
        if old_policy is not None:
            self._old_policy_dtype = self._check_served_model(old_policy, "old_policy").dtype
        if beta == 0.0:
            if old_policy is None:
                warnings.warn(
                    "beta=0: GRPOTrainer uses no reference log-probs, and no old_policy was given, so the service is "
                    "never called.",
                    stacklevel=2,
                )
            return
        self.ref_model = reference
        self._check_served_model(reference, "reference")

    def _check_served_model(self, served_model: RemoteReference, argument: str) -> ModelInfo:
        """The served model's ``ModelInfo``, once checked to exist and to share the policy's
        vocabulary (``_served.check_served_model``: a ``ServiceConfigError`` naming ``argument``)."""
        return check_served_model(
            served_model.client,
            Expected(
                model=served_model.model,
                model_setting=f"{argument}.model",
                address_setting=f"{argument}.client",
                vocab_size=self.model.config.get_text_config().vocab_size,
                vocab_setting="the policy's config",
            ),
        )

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        self._generating = True
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._generating = False

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's per-token log-probs; the service's for the reference (the ``RemoteReference``
        handle) and, with ``old_policy``, for the old policy: the policy scored without gradients
        while generating (TRL's ``old_per_token_logps``)."""
        served, min_version = model, 0
        if self.old_policy is not None and model is self.model and self._generating and not torch.is_grad_enabled():
            policy = self.accelerator.unwrap_model(self.model)
            served = self.old_policy
            min_version = self.old_policy.sync(policy, self.state.global_step, self._old_policy_dtype)
        if not isinstance(served, RemoteReference):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        options = _hook_signature().bind(self, served, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        options.apply_defaults()
        extra = {
            name
            for name, value in options.arguments.items()
            if name not in (*_HOOK_PARAMETERS, *_KNOWN_OPTIONS) and value is not None
        }
        if extra:
            raise NotImplementedError(f"the served model scores text only; TRL passed {', '.join(sorted(extra))}")
        if options.arguments["compute_aux_loss"]:
            raise NotImplementedError("the served model does not compute a MoE router loss (a policy-only term)")
        # batch_size is TRL's memory chunking of a local forward; the client splits into RPCs itself.
        with_entropy = bool(options.arguments["compute_entropy"])
        scores = served.per_token_logps(
            input_ids,
            attention_mask,
            logits_to_keep,
            temperature=self.temperature,
            return_entropy=with_entropy,
            min_version=min_version,
        )
        logps, entropies = scores if with_entropy else (scores, None)
        return logps, entropies, None


@functools.cache
def _hook_signature() -> inspect.Signature:
    return inspect.signature(getattr(GRPOTrainer, _HOOK))
