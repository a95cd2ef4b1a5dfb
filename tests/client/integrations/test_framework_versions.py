"""The verl and OpenRLHF integrations reach into their frameworks' internals: on a release other
than the one tested, start-up warns, naming both versions."""

from __future__ import annotations

import warnings

import pytest
from logprob_client.integrations._served import UntestedVersionWarning, warn_untested_version


def test_another_release_is_named_with_the_tested_one():
    with pytest.warns(UntestedVersionWarning, match=r"tested with verl 0\.9\.1; verl 0\.10\.0 is installed"):
        assert warn_untested_version("verl", "0.9.1", installed="0.10.0") == "0.10.0"


def test_the_tested_release_and_an_absent_framework_say_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_untested_version("verl", "0.9.1", installed="0.9.1") == "0.9.1"
        assert warn_untested_version("no-such-framework-here", "1.0") is None


def test_the_verl_and_openrlhf_modules_check_at_start_up():
    from pathlib import Path

    integrations = Path(__file__).resolve().parents[3] / "client" / "logprob_client" / "integrations"
    assert 'warn_untested_version("verl", CHECKED_VERL_VERSION)' in (integrations / "verl.py").read_text()
    assert 'warn_untested_version("openrlhf", CHECKED_OPENRLHF_VERSION)' in (integrations / "openrlhf.py").read_text()


def test_the_verl_guide_says_what_a_verl_user_would_otherwise_guess():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    guide = (root / "docs" / "verl.md").read_text()
    (pins,) = re.findall(r'"(transformers>=[^"]+)"', (root / "scripts" / "install-frameworks.sh").read_text())
    assert pins in guide  # verl's transformers range, as CI installs it
    for said in (
        "CHECKED_VERL_VERSION",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "fsdp_config.model_dtype",
        "CUDA_VISIBLE_DEVICES",
        "trainer.n_gpus_per_node",
        "--ipc=host",
    ):
        assert said in guide, said
