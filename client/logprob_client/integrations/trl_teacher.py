"""logprob-service as the teacher of TRL's ``ServerDistillationTrainer`` (on-policy distillation).

TRL 1.16's ``trl.experimental.server_distillation.ServerDistillationTrainer`` asks its teacher for
log-probs through one method of its ``teacher_client`` (a ``VLLMClient``, set in ``__init__``):
``get_sequence_logprobs(sequences, prompt_lengths, top_logprobs, temperature)``, which answers
per sequence the teacher's top-k log-probs and ids at each completion position and its log-prob
of the actual token. ``ServiceTeacher`` answers the same from a logprob-service (``top_k``), the
actual token's log-prob exact whether or not it is among the top-k (vLLM answers -inf there):

    from logprob_client import LogprobClient
    from logprob_client.integrations.trl_teacher import ServiceDistillationTrainer, ServiceTeacher

    trainer = ServiceDistillationTrainer(
        model=student,
        args=ServerDistillationConfig(loss_top_k=20, beta=0.0, ...),
        teacher=ServiceTeacher(LogprobClient("teacher-host:50051"), model="teacher"),
        ...,
    )

``ServiceDistillationTrainer`` is TRL's trainer with ``ServiceTeacher`` as its ``teacher_client``,
the one attribute TRL reads the teacher from. TRL's ``__init__`` is ``DistillationTrainer``'s with
no local teacher, three settings copied from ``args``, and a ``VLLMClient`` made from
``args.teacher_model_server_url`` (which needs vLLM installed, and a server answering there). This
subclass runs the same ``__init__`` with the teacher in place of that client; a TRL whose
``__init__`` does more is refused when the trainer is built (``check_teacher_compatible``), so it
fails at once rather than train with a setting left unset. ``examples/distill_trl.py`` runs it end
to end. docs/distillation.md says when to use this or TRL's own trainer against the HTTP edge.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

try:
    import trl
    from trl.trainer.distillation_trainer import DistillationTrainer

    with warnings.catch_warnings():  # "importing from trl.experimental": this module pins what it uses (TRL 1.16)
        warnings.simplefilter("ignore")
        from trl.experimental.server_distillation import ServerDistillationTrainer
except ImportError as err:  # an optional dependency
    raise ImportError(
        f"logprob_client.integrations.trl_teacher needs TRL (the [trl] extra): pip install trl==1.16.0 ({err})"
    ) from err

from ..client import LogprobClient
from .trl import CHECKED_TRL_VERSION, TRLVersionError

# The settings ServerDistillationTrainer.__init__ copies from its config onto the trainer.
_SETTINGS = ("reverse_kl_top_1_mode", "loss_top_k", "loss_add_tail")
# Every name its code uses (co_names): DistillationTrainer's __init__ (``super().__init__``), the
# settings, and the VLLMClient made from the URL and kept as ``teacher_client``.
_INIT_NAMES = frozenset(
    {"ServerDistillationConfig", "super", "__init__", *_SETTINGS}
    | {"generation.vllm_client", "VLLMClient", "teacher_model_server_url", "teacher_client"}
)


class ServiceTeacher:
    """``VLLMClient.get_sequence_logprobs`` (TRL 1.16) answered by logprob-service's ``model``."""

    def __init__(self, client: LogprobClient, model: str | None = None) -> None:
        self.client = client
        self.model = model

    def get_sequence_logprobs(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lengths: Sequence[int],
        top_logprobs: int = 100,
        temperature: float = 1.0,
        chunk_size: int = 0,
        max_concurrent_requests: int = 4,
    ) -> dict[str, list]:
        """Per sequence (prompt + completion ids, ``prompt_lengths[i]`` of them the prompt), at each
        completion position: ``logprobs`` and ``logprob_token_ids`` [C][K] (the teacher's top-k,
        descending, ties by id), ``actual_logprobs`` and ``actual_token_ids`` [C][1]. A sequence
        with no completion gets empty lists. ``chunk_size`` and ``max_concurrent_requests`` are
        vLLM's and unused: the client cuts large calls into RPCs in flight together."""
        del chunk_size, max_concurrent_requests
        sent = [i for i, (ids, p) in enumerate(zip(sequences, prompt_lengths, strict=True)) if len(ids) > p]
        out: dict[str, list[Any]] = {
            key: [[] for _ in sequences]
            for key in ("logprobs", "logprob_token_ids", "actual_logprobs", "actual_token_ids")
        }
        if not sent:
            return out
        prompts = [np.asarray(sequences[i][: prompt_lengths[i]]) for i in sent]
        completions = [np.asarray(sequences[i][prompt_lengths[i] :]) for i in sent]
        answer = self.client.score(prompts, completions, model=self.model, temperature=temperature, top_k=top_logprobs)
        for i, completion, logprobs, top_ids, top_lps in zip(
            sent, completions, answer.logprobs, answer.top_ids, answer.top_logprobs, strict=True
        ):
            out["logprobs"][i] = top_lps.tolist()
            out["logprob_token_ids"][i] = top_ids.tolist()
            out["actual_logprobs"][i] = logprobs[:, None].tolist()
            out["actual_token_ids"][i] = np.asarray(completion)[:, None].tolist()
        return out


def check_teacher_compatible(trainer_cls: type = ServerDistillationTrainer) -> None:
    """Raise ``TRLVersionError`` unless ``trainer_cls.__init__`` is ``DistillationTrainer``'s, the
    settings in ``_SETTINGS`` and the ``teacher_client``, as ``ServiceDistillationTrainer`` runs it."""
    problem = ""
    if trainer_cls.__mro__[1] is not DistillationTrainer:
        problem = f"{trainer_cls.__name__} no longer derives from DistillationTrainer"
    else:
        extra = set(trainer_cls.__init__.__code__.co_names) - _INIT_NAMES
        if extra:
            problem = f"{trainer_cls.__name__}.__init__ now also uses {', '.join(sorted(extra))}"
    if problem:
        raise TRLVersionError(
            f"logprob_client.integrations.trl_teacher cannot build TRL {trl.__version__}'s trainer: {problem}. "
            f"It was checked against TRL {CHECKED_TRL_VERSION}: install that "
            f"(pip install trl=={CHECKED_TRL_VERSION}), or adapt ServiceDistillationTrainer to the new __init__."
        )


class ServiceDistillationTrainer(ServerDistillationTrainer):
    """TRL's ``ServerDistillationTrainer`` whose teacher is ``teacher`` (a ``ServiceTeacher``); every
    other argument is TRL's. ``args.teacher_model_server_url`` must be set (TRL's config checks it)
    but is not used."""

    def __init__(self, *args: Any, teacher: ServiceTeacher, **kwargs: Any) -> None:
        check_teacher_compatible()
        named = inspect.signature(ServerDistillationTrainer.__init__).bind(self, *args, **kwargs).arguments
        del named["self"]
        config = named.get("args")
        if config is None:
            raise ValueError("args: a ServerDistillationConfig is needed (TRL's config for this trainer)")
        DistillationTrainer.__init__(self, teacher_model=None, **named)  # what TRL's super().__init__ runs
        for setting in _SETTINGS:
            setattr(self, setting, getattr(config, setting))
        self.teacher_client = teacher
