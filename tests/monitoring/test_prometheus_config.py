"""The scrape config, alert rules and dashboards are checked by the real promtool."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import torch
from prometheus_client import generate_latest

from nodeagent.metrics import AgentMetrics

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
PROMETHEUS = MONITORING / "prometheus"
# Every metric the node agent exports (nodeagent/metrics.py); dashboards and alerts may use no other.
AGENT_METRICS = {
    "arceus_stage_step_seconds",
    "arceus_samples_processed_total",
    "arceus_micro_batches_processed_total",
    "arceus_tensor_bytes_sent_total",
    "arceus_tensor_bytes_received_total",
    "arceus_device_memory_used_bytes",
    "arceus_stage_assigned",
    "arceus_heartbeat_age_seconds",
    "arceus_compute_seconds_total",
    "arceus_stage_info",
    "arceus_stage_wait_seconds_total",
    "arceus_stage_step_wait_seconds",
}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)


def test_scrape_config_and_rules_are_valid() -> None:
    result = _promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_fire_as_their_unit_tests_expect() -> None:
    result = _promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def _metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\barceus_[a-z_]+", expr))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_dashboards_and_alerts_use_only_exported_metrics() -> None:
    exprs = [t["expr"] for p in json.loads((MONITORING / "grafana" / "arceus-nodeagents.json").read_text())["panels"]
             for t in p["targets"]]
    exprs.append((PROMETHEUS / "alerts.yml").read_text())
    used = set().union(*(_metric_names(e) for e in exprs))
    assert used, "no arceus_ metric referenced at all"
    assert used <= AGENT_METRICS, used - AGENT_METRICS


def test_agent_exports_every_metric_the_dashboards_rely_on() -> None:
    exposed = generate_latest(AgentMetrics(torch.device("cpu")).registry).decode()
    for name in AGENT_METRICS:
        assert re.search(rf"^# HELP {name} ", exposed, re.M), name
