"""The TRL integration refuses, at construction and with a message naming what moved, a TRL
whose GRPOTrainer internals differ from those it hooks into."""

from __future__ import annotations

import pytest
import trl
from logprob_client.integrations.trl import CHECKED_TRL_VERSION, TRLVersionError, check_trl_compatible
from trl import GRPOTrainer


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
