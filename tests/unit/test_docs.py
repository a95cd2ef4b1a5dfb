"""The README documents every setting (flag and environment variable) and every metric."""

from __future__ import annotations

import re
from pathlib import Path

from logprob_service import metrics
from logprob_service.config import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_setting_is_in_the_configuration_table():
    for name in Settings.model_fields:
        flag = "--model NAME=SOURCE" if name == "models" else "--" + name.replace("_", "-")
        env = "LOGPROB_" + name.upper()
        assert f"`{flag}`" in README, flag
        assert f"`{env}`" in README, env


def test_every_metric_is_in_the_metrics_table():
    names = {
        m._name + ("_total" if m._type == "counter" else "_info" if m._type == "info" else "")
        for m in vars(metrics).values()
        if hasattr(m, "_name") and hasattr(m, "_type")
    }
    assert names, "no metrics found"
    documented = set(re.findall(r"^\| `(logprob_[a-z_]+)` \|", README, flags=re.M))
    assert names == documented
