"""Checked-in dashboards are reproducible and query only metrics that exist."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvharbor.observability import cli
from kvharbor.observability.dashboards import (
    load_dashboards, panel_exprs, render_all, variable_queries)
from kvharbor.observability.metrics import METRICS, METRICS_BY_NAME, scraped_names
from tests.observability.promql import grouping_labels, series_in, substitute

REPO = Path(__file__).resolve().parents[2]
CHECKED_IN = REPO / "dashboards"
SCRAPED = {name: spec for spec in METRICS for name in scraped_names(spec)}
EXPECTED_FILES = {"kvharbor-overview.json", "kvharbor-kv-cache.json",
                  "kvharbor-routing.json", "kvharbor-tenants.json"}


def _all_exprs() -> list[tuple[str, str]]:
    return [(file, expr) for file, model in load_dashboards(CHECKED_IN).items()
            for expr in panel_exprs(model)]


def test_generate_reproduces_checked_in_json_exactly(tmp_path):
    assert cli.main(["dashboards", "generate", "--out", str(tmp_path)]) == 0
    generated = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    checked_in = {p.name: p.read_text() for p in CHECKED_IN.glob("*.json")}
    assert set(generated) == EXPECTED_FILES
    assert generated == checked_in, "run `kvharbor dashboards generate` and commit the result"
    assert render_all() == generated, "two renders in one process differ"


def test_every_expr_selects_only_known_series_and_labels():
    exprs = _all_exprs()
    assert len(exprs) >= 30
    for file, expr in exprs:
        used = series_in(expr)
        assert used, f"{file}: no metric in {expr}"
        for name, labels in used.items():
            assert name in SCRAPED, f"{file}: {name} is not a scraped kvharbor series: {expr}"
            bucket = {"le"} if name.endswith("_bucket") else set()
            spec_labels = set(SCRAPED[name].labels) | bucket
            assert labels <= spec_labels, f"{file}: {name} has no label {labels - spec_labels}"
        known = set().union(*(set(SCRAPED[n].labels) for n in used)) | {"le"}
        assert grouping_labels(expr) <= known, f"{file}: grouping by a missing label: {expr}"


def test_histogram_quantiles_use_buckets_and_group_by_le():
    for file, expr in _all_exprs():
        if "histogram_quantile" in expr:
            assert re.search(r"_bucket\{|_bucket\[", expr) and "by (le" in expr, (file, expr)


def test_every_metric_is_plotted_somewhere():
    used = {SCRAPED[name].name for _, expr in _all_exprs() for name in series_in(expr)}
    assert used == set(METRICS_BY_NAME), f"never plotted: {set(METRICS_BY_NAME) - used}"


def test_template_variables_list_label_values_of_existing_series():
    for file, model in load_dashboards(CHECKED_IN).items():
        queries = variable_queries(model)
        assert len(queries) == 3, file
        for query in queries:
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", query).groups()
            assert label in SCRAPED[metric].labels, (file, query)


def test_dashboard_uids_and_panel_ids_are_unique():
    models = load_dashboards(CHECKED_IN)
    assert len({m["uid"] for m in models.values()}) == len(models)
    for file, model in models.items():
        ids = [p["id"] for p in model["panels"]]
        assert ids == list(range(1, len(ids) + 1)), file
        assert file == f"{model['uid']}.json"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_parses_every_expression(tmp_path):
    """Prometheus' own parser accepts every expression (as recording rules)."""
    rules = ["groups:", "  - name: kvharbor-dashboards", "    rules:"]
    for index, (_, expr) in enumerate(_all_exprs()):
        quoted = substitute(expr).replace("'", "''")
        rules += [f"      - record: kvharbor:check_{index}", f"        expr: '{quoted}'"]
    path = tmp_path / "rules.yml"
    path.write_text("\n".join(rules) + "\n")
    result = subprocess.run(["promtool", "check", "rules", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_query_hides_a_missing_metric_and_rare_panels_show_0():
    """``or vector(0)`` turns a metric that does not exist into a flat 0; Grafana's noValue
    shows "0" for an empty answer without lying in the query."""
    rare = {}
    for file, model in load_dashboards(CHECKED_IN).items():
        for expr in panel_exprs(model):
            assert "vector(" not in expr, (file, expr)
        for panel in model["panels"]:
            no_value = panel.get("fieldConfig", {}).get("defaults", {}).get("noValue")
            if no_value is not None:
                rare[panel["title"]] = no_value
    assert rare == {"Errors by status": "0", "Evictions": "0", "Preemptions by QoS": "0",
                    "Prefix waits": "0",
                    "Rate-limited requests": "0", "Step budget trims and cut steps": "0",
                    "Session expirations": "0", "Session hit tokens": "0", "Batches running": "0",
                    "Batches ended by status": "0", "Batch requests by outcome": "0"}, rare
