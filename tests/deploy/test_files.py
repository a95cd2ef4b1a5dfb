"""deploy/prometheus and deploy/grafana: valid for promtool and Grafana, and every metric they use
is one a running server exports."""

from __future__ import annotations

import asyncio
import re
import subprocess
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.deploy import (
    GRAFANA_DIR,
    NO_PROMETHEUS,
    PROMETHEUS_DIR,
    alert_queries,
    dashboard,
    dashboard_queries,
    exported_names,
    metric_names,
    panels,
    which,
)

PROMTOOL = which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMETHEUS.format("promtool"))


def promtool(*args: str) -> str:
    done = subprocess.run([PROMTOOL, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def scoring_calls() -> set[str]:
    """The ``rpc`` label values of scoring requests, as the server records them: gRPC's methods
    that take a ScoreRequest, and the HTTP edge's POST routes (every one scores), by path."""
    from logprob_proto import logprob_pb2
    from logprob_service.http.app import Edge
    from logprob_service.http.server import peer_routes

    service = logprob_pb2.DESCRIPTOR.services_by_name["LogprobService"]
    grpc_methods = {m.name for m in service.methods if m.input_type.name == "ScoreRequest"}
    http_paths = {r.path for r in peer_routes(Edge(None, None, 1)) if "POST" in r.methods}  # type: ignore[arg-type]
    return grpc_methods | http_paths


def test_the_scoring_filters_name_every_scoring_rpc_and_route():
    """The overview's scoring panels, the error ratio and its alert select scoring requests by
    ``rpc``: gRPC's and the HTTP edge's alike (an HTTP request's ``rpc`` is its route's path)."""
    filters = [
        match
        for expr in dashboard_queries(dashboard()) + alert_queries()
        for match in re.findall(r'rpc=~"([^"]*)"', expr)
    ]
    expected = scoring_calls()
    assert {"ScoreTokens", "/v1/completions", "/generate"} <= expected
    assert len(filters) == 7  # the dashboard's scoring requests (1) and error ratios (2 x 2), the alert's (2)
    for alternatives in filters:
        assert set(alternatives.split("|")) == expected, alternatives


@needs_promtool
def test_promtool_accepts_the_scrape_config_and_its_rule_files():
    assert "SUCCESS: 1 rule files found" in promtool("check", "config", "prometheus.yml")


@needs_promtool
def test_promtool_accepts_the_alert_rules_and_their_unit_tests_pass():
    assert "SUCCESS: 5 rules found" in promtool("check", "rules", "alerts.yml")
    assert "SUCCESS" in promtool("test", "rules", "alerts_test.yml")


async def test_every_metric_of_the_dashboard_and_alerts_is_exported_by_a_running_server(running, metrics_url):
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=10).read().decode())
    exported = exported_names(text_string_to_metric_families(text))
    used = {name for expr in dashboard_queries(dashboard()) + alert_queries() for name in metric_names(expr)}
    # The parse found the names the files are about (so the check below is not vacuous).
    assert {"logprob_tokens_scored_total", "logprob_request_duration_seconds_bucket", "up"} <= used
    assert {"logprob_gpu_memory_reserved_bytes", "process_resident_memory_bytes"} <= used
    assert used - exported == {"up"}  # `up` is Prometheus' own, for every target


def test_metric_name_parser_skips_functions_labels_and_keywords():
    expr = (
        'histogram_quantile(0.99, sum by (le, model) (rate(a_bucket{job=~"$job", x="b_total"}[$__rate_interval])))'
        ' / on (instance) group_left c_bytes and d unless label_values(e_info{f="g"}, instance)'
    )
    assert metric_names(expr) == {"a_bucket", "c_bytes", "d", "e_info"}


def test_dashboard_is_well_formed_for_grafana():
    board = dashboard()
    assert board["uid"] == "logprob-service" and board["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels(board):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        # Every query goes to the data source the viewer picks, so the file imports anywhere.
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
    titles = {p["title"] for p in panels(board)}
    # What the issue asks the dashboard to show.
    assert {"Tokens scored / s", "Request latency", "Queued tokens", "Batch fill", "GPU memory"} <= titles
    assert {"Failed requests / s by status", "Prompt sharing"} <= titles


def test_grafana_provisioning_points_at_the_dashboard_and_a_prometheus_source():
    source = yaml.safe_load((GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert source["apiVersion"] == 1 and source["datasources"][0]["type"] == "prometheus"
    provider = yaml.safe_load((GRAFANA_DIR / "provisioning" / "dashboards" / "logprob-service.yaml").read_text())
    (entry,) = provider["providers"]
    # docs/metrics.md and deploy/compose.yaml mount deploy/grafana/dashboards at this path.
    assert entry["type"] == "file" and entry["options"]["path"] == "/var/lib/grafana/dashboards/logprob-service"
