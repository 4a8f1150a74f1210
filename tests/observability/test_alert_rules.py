"""Prometheus alert rules: valid, unit-tested with promtool, and only about metrics that exist."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvharbor.observability.metrics import METRICS, scraped_names

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "prometheus"
RULES = PROMETHEUS_DIR / "alerts.yml"


def _promtool(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        pytest.skip("needs `promtool` (apt-get install prometheus; .ci/run installs it)")
    return subprocess.run(["promtool", *args], cwd=PROMETHEUS_DIR, capture_output=True,
                          text=True, timeout=120)


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_alert_rules_fire_where_they_should_and_nowhere_else():
    """alerts_test.yml feeds synthetic series per rule, with cases that must stay silent."""
    result = _promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_config_loads_the_rules():
    result = _promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr


def test_every_rule_is_tested_and_queries_only_exported_metrics():
    exported = {name for spec in METRICS for name in scraped_names(spec)}
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    tests = (PROMETHEUS_DIR / "alerts_test.yml").read_text()
    for rule in _rules():
        used = set(re.findall(r"\bray_kvharbor_\w+", rule["expr"]))
        scrape_jobs = set(re.findall(r'\bup\{job="([^"]+)"\}', rule["expr"]))
        assert used or scrape_jobs, f"{rule['alert']} queries no kvharbor metric"
        assert scrape_jobs <= jobs, f"{rule['alert']} watches jobs prometheus.yml lacks: {scrape_jobs}"
        unknown = used - exported
        assert not unknown, f"{rule['alert']} queries metrics kvharbor does not export: {unknown}"
        assert f"alertname: {rule['alert']}" in tests, f"{rule['alert']} has no promtool test"
        assert rule["annotations"]["summary"] and rule["labels"]["severity"] in ("page", "warn")
