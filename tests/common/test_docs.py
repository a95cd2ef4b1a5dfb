"""The README documents every setting (flag and environment variable), every metric, every loss
helper, and what the TRL integration exports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from logprob_service.config import ENV_ONLY_SETTINGS, Settings
from logprob_service.observability import metrics  # noqa: F401  (registers the series)
from prometheus_client import REGISTRY

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_in_the_configuration_table():
    for name in Settings.model_fields:
        flag = "--model NAME=SOURCE" if name == "models" else "--" + name.replace("_", "-")
        env = "LOGPROB_" + name.upper()
        if name in ENV_ONLY_SETTINGS:  # a secret: its row says it has no flag
            assert f"| (none: environment only) | `{env}` |" in README, env
        else:
            assert f"| `{flag}` | `{env}` |" in README, flag


def test_every_metric_is_in_the_metrics_table():
    # Every family of the registry the /metrics endpoint serves, the GPU ones included (declared
    # even without a GPU), named as they appear in a scrape.
    suffix = {"counter": "_total", "info": "_info"}
    names = {
        family.name + suffix.get(family.type, "") for family in REGISTRY.collect() if family.name.startswith("logprob_")
    }
    assert len(names) >= 20, names
    documented = set(re.findall(r"^\| `(logprob_[a-z_]+)` \|", README, flags=re.M))
    assert names == documented


def test_every_loss_helper_is_in_the_losses_table():
    import inspect

    from logprob_client import losses

    public = {
        name
        for name, obj in vars(losses).items()
        if inspect.isfunction(obj) and obj.__module__ == losses.__name__ and not name.startswith("_")
    }
    section = README.split("## Loss and KL helpers", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`([a-z_0-9]+)[`(]", section)) & public
    assert public and public == documented, public - documented


def test_trl_section_names_what_the_integration_exports():
    pytest.importorskip("trl", reason="trl is optional: pip install 'logprob-service[trl]'")
    from logprob_client.integrations import trl

    section = README.split("## TRL: the reference model on the service", 1)[1].split("\n## ", 1)[0]
    for name in ("RemoteReferenceGRPOTrainer", "RemoteReference", "TRLVersionError", trl.CHECKED_TRL_VERSION):
        assert name in section, name
    assert '"logprob-service[trl]"' in section and "_get_per_token_logps_and_entropies" in section
