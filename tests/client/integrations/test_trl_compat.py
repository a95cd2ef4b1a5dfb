"""The TRL integration refuses, at construction and with a message naming what moved, a TRL
whose GRPOTrainer internals differ from those it hooks into; and what it refuses or skips
before it ever reaches the service."""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="trl is optional: pip install trl==1.16.0 (CI gets it via the dev extra)")

import trl
from datasets import Dataset
from logprob_client import LogprobClient
from logprob_client.integrations.trl import (
    CHECKED_TRL_VERSION,
    RemoteReference,
    RemoteReferenceGRPOTrainer,
    TRLVersionError,
    check_trl_compatible,
)
from logprob_service.models.builtin import build_builtin, tiny_llama_tokenizer
from trl import GRPOConfig, GRPOTrainer


def test_the_installed_trl_is_compatible():
    check_trl_compatible(GRPOTrainer)


def test_the_installed_trl_is_the_checked_version():
    """pyproject pins the version this was checked against; a new pin must re-check (and bump it)."""
    assert trl.__version__ == CHECKED_TRL_VERSION


class HookGone(GRPOTrainer):
    _get_per_token_logps_and_entropies = None


class HookReshaped(GRPOTrainer):
    def _get_per_token_logps_and_entropies(self, model, inputs, logits_to_keep, batch_size=None):
        raise AssertionError("never called")


class ReferenceScoredElsewhere(GRPOTrainer):
    def _generate_and_score_completions(self, inputs):
        return self._get_per_token_logps_and_entropies(self.model, inputs, None, 1)


@pytest.mark.parametrize(
    "trainer_cls,names",
    [
        (HookGone, ["HookGone._get_per_token_logps_and_entropies does not exist"]),
        (HookReshaped, ["HookReshaped._get_per_token_logps_and_entropies(self, model, inputs", "no longer takes"]),
        (ReferenceScoredElsewhere, ["_generate_and_score_completions no longer uses beta, ref_model"]),
    ],
    ids=["gone", "reshaped", "not-called-for-the-reference"],
)
def test_moved_internals_fail_with_a_clear_message(trainer_cls, names):
    with pytest.raises(TRLVersionError) as info:
        check_trl_compatible(trainer_cls)
    message = str(info.value)
    for fragment in [*names, f"TRL {trl.__version__}", f"checked against TRL {CHECKED_TRL_VERSION}"]:
        assert fragment in message, (fragment, message)


def unreachable_reference() -> RemoteReference:
    """A client whose every call would fail: proves that a code path makes none."""
    return RemoteReference(LogprobClient("127.0.0.1:1", max_attempts=1, timeout=2), model="ref")


def test_sync_ref_model_is_refused_before_anything_loads(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), beta=0.1, sync_ref_model=True, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="sync_ref_model=True"):
        RemoteReferenceGRPOTrainer(model="never-loaded", args=args, reference=unreachable_reference())


def test_beta_without_a_reference_is_refused_before_anything_loads(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), beta=0.1, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"beta=0\.1 needs reference="):
        RemoteReferenceGRPOTrainer(model="never-loaded", args=args)


def test_beta_zero_warns_and_never_calls_the_service(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), beta=0.0, use_cpu=True, bf16=False, report_to=[])
    with pytest.warns(UserWarning, match="beta=0"):
        trainer = RemoteReferenceGRPOTrainer(
            model=build_builtin("tiny-llama"),
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}),
            processing_class=tiny_llama_tokenizer(),
            reference=unreachable_reference(),
        )
    assert trainer.ref_model is None and trainer.beta == 0.0 and args.beta == 0.0
