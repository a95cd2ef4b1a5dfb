"""The README documents every setting (flag and environment variable) and every metric."""

from __future__ import annotations

import re
from pathlib import Path

from logprob_service import metrics  # noqa: F401  (registers the series)
from logprob_service.config import Settings
from prometheus_client import REGISTRY

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_in_the_configuration_table():
    for name in Settings.model_fields:
        flag = "--model NAME=SOURCE" if name == "models" else "--" + name.replace("_", "-")
        env = "LOGPROB_" + name.upper()
        assert f"`{flag}`" in README, flag
        assert f"`{env}`" in README, env


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
