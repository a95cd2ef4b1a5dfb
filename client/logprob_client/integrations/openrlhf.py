"""OpenRLHF's reference model served by logprob-service.

``ServiceReferenceActor`` has the methods and return layout of OpenRLHF 0.11.2's
``ReferenceModelActor`` (``openrlhf/trainer/ray/launcher.py``): ``init_model_from_pretrained(strategy,
pretrain)``, ``forward(sequences, action_mask, attention_mask, return_output, packed_seq_lens,
mm_train_inputs_list)`` returning a float32 CPU tensor ``[B, A]`` (the log-prob of each action
token at the rollout temperature, 0 where ``action_mask`` is 0), ``empty_cache()``, and what
``RayActorGroup`` calls (the constructor's ``(world_size, rank, master_addr, master_port)``,
``get_master_addr_port``, ``execute_batch``). It loads no model and takes no GPU memory.

OpenRLHF's launcher (``openrlhf/cli/train_ppo_ray.py``) builds its reference group from
``ReferenceModelActor`` and has no flag to change it; this module's launcher runs that same
script with the class swapped, taking three flags of its own (the rest go to OpenRLHF)::

    python -m logprob_client.integrations.openrlhf \\
        --ref.service_address ref-host:50051 --ref.service_model ref \\
        --actor.model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --algo.kl.init_coef 0.01 ... (OpenRLHF's flags)

(``--ref.service_address`` takes replicas too, "h1:50051,h2:50051"; ``--ref.service_timeout_s``
is optional.) Colocate the reference with the actor (``--train.colocate_actor_ref`` or
``--train.colocate_all``): its actors then take a fifth of the actor's GPUs' Ray slots and
none of their memory.

Token ids are what OpenRLHF passes, so a served model with the policy's tokenizer sees exactly
the trainer's tokens: there is no text, hence no tokenizer, between trainer and service. At
start-up (``init_model_from_pretrained``) the service must answer at the address and serve the
model with the policy's vocabulary (``pretrain``'s config) in ``--ds.param_dtype``; otherwise the
actor fails naming the flag.

Rows: OpenRLHF 0.11 lays a sample out as one right-padded row of observation tokens with
``action_mask`` over columns 1.. (multi-turn: several action ranges). The prompt is every token
before the first action; every token from there to the row's end is scored (tool output between
action ranges too, then masked like OpenRLHF masks it). All the samples of an ``execute_batch``
go in one scoring call, rows with one prompt (the ``n_samples_per_prompt`` of a GRPO group) as
one shared-prompt group. Checked against OpenRLHF 0.11.2 (``CHECKED_OPENRLHF_VERSION``).
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

try:
    import torch
except ImportError as err:  # an optional dependency
    raise ImportError(
        "logprob_client.integrations.openrlhf needs torch, which OpenRLHF brings (the [openrlhf] extra): "
        f"pip install openrlhf ({err})"
    ) from err

import numpy as np

from ..client import LogprobClient
from ..split import DEFAULT_MAX_SEQUENCES_PER_RPC, DEFAULT_MAX_TOKENS_PER_RPC
from ._served import Expected, ServiceConfigError, check_served_model, score_rows, targets, warn_untested_version

CHECKED_OPENRLHF_VERSION = "0.11.2"
FLAGS = ("--ref.service_address", "--ref.service_model", "--ref.service_timeout_s")
USAGE = """\
usage: python -m logprob_client.integrations.openrlhf --ref.service_address HOST:PORT [--ref.service_model NAME]
           [--ref.service_timeout_s S] OPENRLHF_FLAGS...

OpenRLHF's train_ppo_ray with its reference model served by logprob-service (docs/openrlhf.md).

this launcher's flags:
  --ref.service_address HOST:PORT  the service (several replicas: "h1:50051,h2:50051"); required
  --ref.service_model NAME         the served model to score with [default: default]
  --ref.service_timeout_s S        each scoring call's deadline [default: 120]

Every other flag goes to OpenRLHF unchanged: python -m openrlhf.cli.train_ppo_ray --help lists them.
"""

__all__ = [
    "CHECKED_OPENRLHF_VERSION",
    "ServiceConfigError",
    "ServiceReference",
    "ServiceReferenceActor",
    "action_log_probs",
    "main",
    "split_arguments",
]


@dataclass(frozen=True)
class ServiceReference:
    """Where the served reference is (the launcher's ``--ref.service_*`` flags)."""

    address: str
    model: str = "default"
    timeout_s: float = 120.0
    max_sequences_per_rpc: int = DEFAULT_MAX_SEQUENCES_PER_RPC
    max_tokens_per_rpc: int = DEFAULT_MAX_TOKENS_PER_RPC


def _rows(sequences: torch.Tensor, action_mask: torch.Tensor, attention_mask: torch.Tensor):
    """Each row's prompt and scored tokens (numpy), and the action columns of the scored tokens."""
    seqs = sequences.detach().cpu().numpy()
    valid = attention_mask.detach().cpu().numpy().astype(bool)
    actions = action_mask.detach().cpu().numpy().astype(bool)
    width, num_actions = seqs.shape[1], actions.shape[1]
    offset = width - num_actions  # action column j is sequence column offset + j
    prompts, completions, columns = [], [], []
    for b in range(seqs.shape[0]):
        acted = np.flatnonzero(actions[b])
        if acted.size == 0:
            columns.append(None)
            continue
        first = offset + int(acted[0])
        cols = np.flatnonzero(valid[b])
        scored = cols[cols >= first]
        if scored.size == 0 or np.any(np.diff(scored) != 1) or cols[0] >= first:
            raise ValueError(
                f"row {b}: the tokens from its first action on must be contiguous under attention_mask and follow "
                "at least one prompt token"
            )
        prompts.append(seqs[b, cols[cols < first]])
        completions.append(seqs[b, scored])
        columns.append(scored - offset)
    return prompts, completions, columns


def action_log_probs(
    client: LogprobClient,
    model: str,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    temperature: float,
) -> list[torch.Tensor]:
    """OpenRLHF's reference output for each ``(sequences, action_mask, attention_mask)`` batch:
    float32 CPU ``[B, A]``, in one scoring call for all of them."""
    laid_out = [_rows(*batch) for batch in batches]
    prompts = [p for rows in laid_out for p in rows[0]]
    completions = [c for rows in laid_out for c in rows[1]]
    logps, _ = score_rows(client, model, prompts, completions, temperature=temperature, return_entropy=False)
    results, k = [], 0
    for (_, action_mask, _), (_, _, columns) in zip(batches, laid_out):
        out = torch.zeros(action_mask.shape, dtype=torch.float32)
        for b, cols in enumerate(columns):
            if cols is not None:
                out[b, torch.from_numpy(cols)] = torch.from_numpy(logps[k])
                k += 1
        results.append(out * action_mask.detach().cpu().float())
    return results


class ServiceReferenceActor:
    """A drop-in for OpenRLHF's ``ReferenceModelActor`` whose model is the served one.

    ``service`` is set on a subclass by the launcher (``main``), so that Ray ships it with the class.
    """

    service: ServiceReference | None = None

    def __init__(self, world_size: int, rank: int, master_addr: str | None = None, master_port: int | None = None):
        self._world_size, self._rank = world_size, rank
        self.client: LogprobClient | None = None
        self.temperature = 1.0
        self.duplicates = 1

    def get_master_addr_port(self) -> tuple[str, int]:
        return "", 0  # no process group: every rank talks to the service alone

    def init_model_from_pretrained(self, strategy: Any, pretrain: str) -> None:
        """Connect to the service and check the served model against OpenRLHF's settings."""
        if self.service is None:
            raise ServiceConfigError("--ref.service_address is not set (run OpenRLHF through this module's launcher)")
        from transformers import AutoConfig

        args = strategy.args
        self.temperature = float(args.rollout.temperature)
        # ring attention / tensor parallel ranks of a group get the same samples; one scores them
        self.duplicates = int(args.ds.ring_attn_size) * int(args.ds.tensor_parallel_size)
        self.client = LogprobClient(
            targets(self.service.address, "--ref.service_address"),
            timeout=self.service.timeout_s,
            model=self.service.model,
            max_sequences_per_rpc=self.service.max_sequences_per_rpc,
            max_tokens_per_rpc=self.service.max_tokens_per_rpc,
        )
        config = AutoConfig.from_pretrained(pretrain, trust_remote_code=True)
        check_served_model(
            self.client,
            Expected(
                model=self.service.model,
                model_setting="--ref.service_model",
                address_setting=f"--ref.service_address={self.service.address!r}",
                vocab_size=config.get_text_config().vocab_size,
                vocab_setting=f"the policy {pretrain!r}",
                dtype=getattr(args.ds, "param_dtype", None),
                dtype_setting="--ds.param_dtype",
            ),
            timeout=min(self.service.timeout_s, 30.0),
        )

    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_output: bool = False,
        packed_seq_lens: list[int] | None = None,
        mm_train_inputs_list: Any = None,
    ) -> torch.Tensor:
        """``ReferenceModelActor.forward``: ``[B, A]`` float32 on the CPU. ``return_output`` is
        ignored, as there; so is ``packed_seq_lens``, which OpenRLHF 0.11's model ignores too
        (it packs by ``attention_mask``)."""
        return self._score([(sequences, action_mask, attention_mask, mm_train_inputs_list)])[0]

    def _score(self, items: list[tuple]) -> list[torch.Tensor]:
        if self.client is None:
            raise RuntimeError("init_model_from_pretrained was not called")
        for _, action_mask, attention_mask, mm_inputs in items:
            if mm_inputs and any(x is not None for x in mm_inputs):
                raise NotImplementedError("the served reference scores text only; OpenRLHF passed multimodal inputs")
            if action_mask is None or attention_mask is None:
                raise ValueError("the reference needs action_mask and attention_mask, as OpenRLHF passes them")
        batches = [(s, a, m) for s, a, m, _ in items]
        return action_log_probs(self.client, self.service.model, batches, temperature=self.temperature)

    def execute_batch(self, method_name: str, all_data: dict, start_idx: int, end_idx: int) -> list:
        """``BaseModelActor.execute_batch``, with every ``forward`` of the chunk in one scoring call."""
        kwargs = {key: value[start_idx:end_idx] for key, value in all_data.items()}
        n = len(next(iter(kwargs.values())))
        if method_name != "forward":
            method = getattr(self, method_name)
            return [method(**{key: value[i] for key, value in kwargs.items()}) for i in range(n)]
        if self._rank % self.duplicates:
            return [None] * n  # a duplicate rank: OpenRLHF keeps only the first of each group's results
        unknown = set(kwargs) - {"sequences", "action_mask", "attention_mask", "mm_train_inputs_list"}
        if unknown:
            raise NotImplementedError(f"forward got {sorted(unknown)}, which the served reference does not take")
        mm = kwargs.get("mm_train_inputs_list", [None] * n)
        items = [
            (kwargs["sequences"][i], kwargs["action_mask"][i], kwargs["attention_mask"][i], mm[i]) for i in range(n)
        ]
        return self._score(items)

    def empty_cache(self) -> None:
        """Nothing is cached on a device."""


def split_arguments(argv: Sequence[str]) -> tuple[ServiceReference, list[str]]:
    """This launcher's flags (``FLAGS``, as ``--flag value`` or ``--flag=value``) and OpenRLHF's."""
    ours: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in FLAGS:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"{name} needs a value")
                value = argv[i + 1]
                i += 1
            ours[name] = value
        else:
            rest.append(arg)
        i += 1
    if "--ref.service_address" not in ours:
        raise SystemExit(
            "--ref.service_address is required: the service's host:port (or several, comma-separated); "
            "--help lists this launcher's flags"
        )
    service = ServiceReference(
        address=ours["--ref.service_address"],
        model=ours.get("--ref.service_model", "default"),
        timeout_s=float(ours.get("--ref.service_timeout_s", 120.0)),
    )
    return service, rest


def main(argv: Sequence[str] | None = None) -> None:
    """OpenRLHF's ``train_ppo_ray`` with the reference group made of ``ServiceReferenceActor``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(USAGE, end="")
        raise SystemExit(0)
    service, rest = split_arguments(argv)
    try:
        import ray
        from openrlhf.trainer.ray import launcher
    except ImportError as err:
        raise SystemExit(
            f"the launcher runs OpenRLHF's train_ppo_ray, which needs OpenRLHF and Ray on this machine: "
            f"pip install openrlhf=={CHECKED_OPENRLHF_VERSION} ({err})"
        ) from None
    warn_untested_version("openrlhf", CHECKED_OPENRLHF_VERSION)

    actor_cls = type("ServiceReferenceModelActor", (ServiceReferenceActor,), {"service": service})
    launcher.ReferenceModelActor = ray.remote(num_gpus=1)(actor_cls)  # the script imports the name at its start
    sys.argv = ["openrlhf.cli.train_ppo_ray", *rest]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
