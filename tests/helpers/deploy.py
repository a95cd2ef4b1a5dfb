"""The deploy/ files as tests read them: the PromQL of the dashboard and the alert rules, the
metric names that PromQL uses, and the container and cluster files (Dockerfile, compose, k8s)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "logprob-service.json"
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "deploy" / "compose.yaml"
K8S_DIR = ROOT / "deploy" / "k8s"

NO_PROMETHEUS = (
    "Debian's prometheus package is not installed (apt-get install prometheus; .ci/run installs it), "
    "so there is no {} binary"
)

# PromQL keywords that look like names.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}


def which(binary: str) -> str | None:
    return shutil.which(binary)


def dev_tool(name: str) -> str | None:
    """A command a [dev] package installs, in this interpreter's environment (not always on PATH)."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def prometheus_job() -> str:
    """The scrape job that the alert rules and the dashboard select."""
    (job,) = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())["scrape_configs"]
    return job["job_name"]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those nested in collapsed rows too."""
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries(board: dict[str, Any]) -> list[str]:
    """The PromQL of every panel target and every query variable, as written (with $variables)."""
    exprs = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def alert_queries() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (Grafana variables allowed) selects.

    Strings, label matchers, range selectors and label lists (``by (...)``, ``on (...)``) are cut
    out first; what is left that is a name not followed by ``(`` (a function) is a metric name.
    ``label_values(metric{...}, label)`` (a Grafana variable query) names its first argument.
    """
    names = set(re.findall(r"label_values\(\s*([a-zA-Z_:][\w:]*)", expr))
    expr = re.sub(r"label_values\([^)]*\)", "", expr)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    for match in re.finditer(r"(?<![\w.])[a-zA-Z_:][\w:]*", expr):
        if expr[match.end() :].lstrip().startswith("(") or match.group() in _KEYWORDS:
            continue
        names.add(match.group())
    return names


def exported_names(families: Any) -> set[str]:
    """The sample names a scrape's metric families (prometheus_client's parser) can carry,
    declared families without samples included."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", "")}
    names = set()
    for family in families:
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names
