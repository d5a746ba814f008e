"""The alert rules and scrape config in monitoring/prometheus/ load in Prometheus' own tools, and every
alert fires (and stays quiet) as its promtool unit test says; each alert has a unit test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS = REPO / "monitoring" / "prometheus"
UNIT_TESTS = REPO / "tests" / "prometheus" / "rules_test.yml"

promtool = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    promtool is None, reason="promtool not installed (Debian package `prometheus`)"
)


def alert_names() -> set[str]:
    groups = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}


@needs_promtool
@pytest.mark.timeout(60)
@pytest.mark.swarm
def test_scrape_config_and_rules_are_valid():
    result = subprocess.run([promtool, "check", "config", str(PROMETHEUS / "prometheus.yml")],
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
@pytest.mark.timeout(60)
@pytest.mark.swarm
def test_every_alert_fires_as_its_unit_test_says():
    result = subprocess.run([promtool, "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True,
                            timeout=30, cwd=UNIT_TESTS.parent)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test():
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    tested = {
        case["alertname"] for t in tests for case in t.get("alert_rule_test", []) if case.get("exp_alerts")
    }
    assert alert_names() == tested
