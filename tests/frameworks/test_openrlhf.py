"""OpenRLHF's reference group with ``ServiceReferenceActor``, against OpenRLHF's own computation.

The actor is called as OpenRLHF 0.11.2's ``RayActorGroup`` calls its reference actors
(``execute_batch("forward", ...)`` with the experience maker's lists of sample batches, each
batch right-padded as ``zero_pad_sequences`` pads it, ``action_mask`` over columns 1.. as the
samples generator makes it), and its ``[B, A]`` output is compared with OpenRLHF's own
``Actor.forward`` (what ``ReferenceModelActor`` runs, packing off) on the same checkpoint: the
served float32 scores must be within float32 rounding of the exact answer (OpenRLHF's
``log_probs_from_logits`` on float64 logits), the tolerance taken from the error of OpenRLHF's
own float32 forward (``tests.helpers.tolerances.scores``).

OpenRLHF's trainer cannot run here: it needs vLLM engines, DeepSpeed and flash-attn on GPUs
(flash-attn does not build without CUDA). ``openrlhf.models`` imports flash_attn and deepspeed at
module level without using them on the path tested (no packing, no ZeRO-3), so empty stand-ins
are registered for them when they are missing; the test is at the actor boundary. Checked
against OpenRLHF 0.11.2.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip(
    "openrlhf",
    reason="OpenRLHF is not installed: the framework tests run in .venv-frameworks (scripts/install-frameworks.sh)",
)


from importlib.metadata import version

from logprob_client.integrations.openrlhf import (
    CHECKED_OPENRLHF_VERSION,
    ServiceConfigError,
    ServiceReference,
    ServiceReferenceActor,
    split_arguments,
)
from transformers import AutoModelForCausalLM

from tests.helpers import tolerances
from tests.helpers.models import VOCAB

# What openrlhf.models imports of flash-attn and DeepSpeed at module level (unused on this path).
STAND_INS = {
    "flash_attn": {},
    "flash_attn.bert_padding": dict.fromkeys(("index_first_axis", "pad_input", "rearrange", "unpad_input")),
    "flash_attn.utils": {},
    "flash_attn.utils.distributed": {"all_gather": None},
    "deepspeed": {},
}


@contextlib.contextmanager
def stand_ins_for_missing_packages():
    """Empty modules for the packages of ``STAND_INS`` that are not installed, while OpenRLHF's
    modules are imported; taken away after (verl, in the same process, would take them for flash-attn)."""
    missing = {top for top in (name.partition(".")[0] for name in STAND_INS) if importlib.util.find_spec(top) is None}
    added = [name for name in STAND_INS if name.partition(".")[0] in missing]
    for name in added:
        module = types.ModuleType(name)
        module.__dict__.update(STAND_INS[name])
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []
        sys.modules[name] = module
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


with stand_ins_for_missing_packages():
    from openrlhf.models import Actor
    from openrlhf.models.utils import log_probs_from_logits
    from openrlhf.utils.utils import zero_pad_sequences

pytestmark = pytest.mark.frameworks

TEMPERATURE = 0.8


def test_the_installed_openrlhf_is_the_checked_version():
    assert version("openrlhf") == CHECKED_OPENRLHF_VERSION


def strategy(param_dtype: str = "fp32", ring: int = 1, tp: int = 1) -> SimpleNamespace:
    """What ``init_model_from_pretrained`` reads of OpenRLHF's strategy: its parsed arguments."""
    ds = SimpleNamespace(ring_attn_size=ring, tensor_parallel_size=tp, param_dtype=param_dtype)
    return SimpleNamespace(args=SimpleNamespace(rollout=SimpleNamespace(temperature=TEMPERATURE), ds=ds))


def reference_actor(served_target: str, qwen_dir, model: str = "ref", rank: int = 0, **kwargs) -> ServiceReferenceActor:
    cls = type("Actor", (ServiceReferenceActor,), {"service": ServiceReference(served_target, model)})
    actor = cls(world_size=2, rank=rank)
    actor.init_model_from_pretrained(strategy(**kwargs), str(qwen_dir))
    return actor


def sample(tokens: list[int], action_ranges: list[tuple[int, int]]):
    """One sample as OpenRLHF's samples generator makes it from a vLLM response."""
    sequences = torch.tensor(tokens, dtype=torch.long)
    attention_mask = torch.ones(len(tokens), dtype=torch.long)
    action_mask = torch.zeros_like(attention_mask)
    for start, end in action_ranges:
        action_mask[start:end] = 1
    return sequences[None], attention_mask[None], action_mask[1:][None]


def batch(samples):
    """Samples joined into one batch as ``Experience.concat_experiences`` joins them: right-padded."""
    return [zero_pad_sequences([s[k] for s in samples], "right", stack=False) for k in range(3)]


def grpo_samples(rng: np.random.Generator, prompts: int, n: int):
    """``n`` samples per prompt; one multi-turn sample (an action, tool output, another action)."""
    out = []
    for _ in range(prompts):
        prompt = rng.integers(3, VOCAB, int(rng.integers(1, 9))).tolist()
        for _ in range(n):
            response = rng.integers(3, VOCAB, int(rng.integers(1, 12))).tolist()
            out.append(sample(prompt + response, [(len(prompt), len(prompt) + len(response))]))
    prompt, first, tool, second = ([int(x) for x in rng.integers(3, VOCAB, k)] for k in (4, 3, 2, 5))
    p, f, t = len(prompt), len(first), len(tool)
    out.append(sample(prompt + first + tool + second, [(p, p + f), (p + f + t, p + f + t + len(second))]))
    return out


class OpenRLHFReference:
    """OpenRLHF's own reference output (``Actor.forward``, float32) and the exact one (its
    ``log_probs_from_logits`` on float64 logits, same layout) for a batch."""

    def __init__(self, qwen_dir) -> None:
        model = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()
        self.actor = Actor(model, packing_samples=False, temperature=TEMPERATURE)
        self.actor.packing_samples = False  # Actor sets it only when it loads the model itself (0.11.2)
        self.exact_model = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float64).eval()

    @torch.no_grad()
    def __call__(self, sequences, attention_mask, action_mask):
        own = self.actor(sequences, action_mask, attention_mask)
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        logits = self.exact_model(sequences, attention_mask=attention_mask, position_ids=position_ids).logits
        exact = log_probs_from_logits(logits / TEMPERATURE, torch.roll(sequences, shifts=-1, dims=1))[:, :-1]
        exact = exact[:, -action_mask.shape[1] :] * action_mask
        return own, exact


def check(got: torch.Tensor, own: torch.Tensor, exact: torch.Tensor, action_mask: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.device.type == "cpu" and got.shape == action_mask.shape
    acted = action_mask.bool()
    atol = tolerances.scores(float((own.double() - exact)[acted].abs().max()))
    np.testing.assert_allclose(got[acted].numpy(), exact[acted].numpy(), atol=atol, rtol=0)
    assert not got[~acted].any(), "columns outside the actions must be 0"


@pytest.fixture(scope="module")
def reference(qwen_dir) -> OpenRLHFReference:
    return OpenRLHFReference(qwen_dir)


def test_grpo_groups_through_execute_batch_as_the_actor_group_calls_it(served, qwen_dir, reference, rng, monkeypatch):
    samples = grpo_samples(rng, prompts=3, n=4)
    order = rng.permutation(len(samples))
    micro_batches = [batch([samples[i] for i in order[k : k + 4]]) for k in range(0, len(samples), 4)]
    actor = reference_actor(served.target, qwen_dir)
    calls = []
    score = actor.client.score
    monkeypatch.setattr(
        actor.client, "score", lambda p, c, **kw: calls.append([x.tobytes() for x in p]) or score(p, c, **kw)
    )

    data = {
        key: [mb[k] for mb in micro_batches] for k, key in enumerate(("sequences", "attention_mask", "action_mask"))
    }
    results = actor.execute_batch("forward", data, 0, len(micro_batches))

    assert len(results) == len(micro_batches)
    for (sequences, attention_mask, action_mask), got in zip(micro_batches, results):
        check(got, *reference(sequences, attention_mask, action_mask), action_mask)
    # all micro-batches in one call, each prompt's samples (spread over them) sent together
    ((sent,),) = [calls]
    runs = [p for i, p in enumerate(sent) if i == 0 or sent[i - 1] != p]
    assert len(sent) == len(samples) and len(runs) == len(set(sent)) == 4


def test_forward_of_single_sequences(served, qwen_dir, reference, rng):
    sequences, attention_mask, action_mask = batch(grpo_samples(rng, prompts=3, n=1))
    got = reference_actor(served.target, qwen_dir).forward(sequences, action_mask, attention_mask)
    check(got, *reference(sequences, attention_mask, action_mask), action_mask)


def test_duplicate_ranks_of_a_ring_or_tensor_parallel_group_score_nothing(served, qwen_dir, rng):
    actor = reference_actor(served.target, qwen_dir, rank=1, ring=2)
    actor.client.close()  # a call would fail
    data = {key: [x] for key, x in zip(("sequences", "attention_mask", "action_mask"), batch(grpo_samples(rng, 1, 2)))}
    assert actor.execute_batch("forward", data, 0, 1) == [None]


@pytest.mark.parametrize(
    "target,model,dtype,match",
    [
        ("127.0.0.1:1", "ref", "fp32", r"no logprob-service answers at --ref\.service_address='127\.0\.0\.1:1'"),
        (None, "nope", "fp32", r"--ref\.service_model='nope': the service serves no such model"),
        (None, "tiny", "fp32", r"'tiny' has a vocabulary of 4096 tokens but the policy '.*' has 517"),
        (None, "ref", "bf16", r"'ref' is served in float32 but --ds\.param_dtype is bf16"),
    ],
    ids=["wrong-address", "unknown-model", "vocab-mismatch", "dtype-mismatch"],
)
def test_bad_configuration_fails_at_start_up_naming_the_flag(served, qwen_dir, target, model, dtype, match):
    with pytest.raises(ServiceConfigError, match=match):
        reference_actor(target or served.target, qwen_dir, model=model, param_dtype=dtype)


def test_the_launcher_takes_its_flags_and_passes_openrlhf_s_on():
    service, rest = split_arguments(
        ["--ref.service_address", "h1:1,h2:2", "--actor.model_name_or_path", "m", "--ref.service_model=ref", "--x"]
    )
    assert service == ServiceReference("h1:1,h2:2", "ref") and rest == ["--actor.model_name_or_path", "m", "--x"]
    with pytest.raises(SystemExit, match=r"--ref\.service_address is required"):
        split_arguments(["--ref.service_model", "ref"])
