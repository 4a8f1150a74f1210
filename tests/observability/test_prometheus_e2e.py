"""End to end: the running app's metrics answer every dashboard query in real Prometheus.

Uses the session's ``kvharbor_app`` (tests/conftest.py: 2 replicas, builtin tiny model),
sends a short multi-tenant load with the three demo keys (shared prefixes, some streamed)
plus a burst from the rate-limited test tenant, and asserts that every PromQL expression of
every checked-in dashboard returns at least one series. Panels of rare events (Grafana
``noValue`` "0") may return nothing here (a short load need not preempt or evict anything),
but their queries must still parse and run; every other query must be backed by real series.

Other tests in the session record synthetic series (tenants and replicas named ``obs-*``)
on the same Ray metrics endpoint, so ``$tenant`` and ``$replica`` are set to the app's own
values, and the one unlabelled metric (router decision time) must grow during the load.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvharbor.observability.dashboards import load_dashboards, panel_exprs
from tests.conftest import DEMO, TEST_KEYS
from tests.observability.promql import substitute, wait_all_return_series

pytestmark = pytest.mark.slow

CHECKED_IN = Path(__file__).resolve().parents[2] / "dashboards"
PREFIX = "You are a helpful assistant for the kvharbor observability test. " * 3
DECISIONS = "sum(ray_kvharbor_router_decision_seconds_count)"
LIMITED = 'sum(ray_kvharbor_rate_limited_total{tenant="limited"})'
LOAD_TENANTS = {"acme", "globex", "initech"}      # tenants.yaml's owners of the DEMO keys


def _one_request(client, model: str, key: str, index: int) -> tuple[int, str]:
    """(HTTP status, start of the body) of one completion; even indices stream, every third
    belongs to a session (so the session panels have series of these tenants)."""
    body = {"model": model, "prompt": f"{PREFIX} Question {index % 4}: what is {index}?",
            "max_tokens": 8, "temperature": 0.0, "stream": index % 2 == 0}
    headers = {"Authorization": f"Bearer {key}"}
    if index % 3 == 0:
        headers["X-Session-ID"] = f"e2e-{index}"
    if body["stream"]:
        with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            text = "".join(resp.iter_lines())
            return resp.status_code, text[:200]
    resp = client.post("/v1/completions", json=body, headers=headers)
    return resp.status_code, resp.text[:200]


def _load(app, keys: tuple[str, ...], requests_per_key: int, lane: bool = False) -> list[tuple[int, str]]:
    with app.client(lane=lane) as client:
        jobs = [(key, i) for i in range(requests_per_key) for key in keys]
        with ThreadPoolExecutor(max_workers=6) as pool:
            return list(pool.map(lambda job: _one_request(client, app.model, *job), jobs))


def _app_values(prometheus, metric: str, label: str) -> str:
    """Regex alternation of ``label``'s values on ``metric``, synthetic ``obs-*`` excluded."""
    values = prometheus.api(f"label/{label}/values", **{"match[]": metric})["data"]
    ours = sorted(v for v in values if not v.startswith("obs-"))
    assert ours, f"the app exported no {metric} series with a {label} label"
    return "|".join(ours)


def _scalar(prometheus, expr: str) -> float:
    result = prometheus.query(expr)
    return float(result[0]["value"][1]) if result else 0.0


def _grows(prometheus, expr: str, before: float, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _scalar(prometheus, expr) > before:
            return True
        time.sleep(1)
    return False


def test_every_dashboard_query_returns_series_under_load(kvharbor_app, prometheus):
    wait_all_return_series(prometheus, ["up == 1"], 30)     # scraped at least once
    decisions_before = _scalar(prometheus, DECISIONS)
    limited_before = _scalar(prometheus, LIMITED)
    results = _load(kvharbor_app, (DEMO["premium"], DEMO["standard"], DEMO["batch"]), 12)
    failed = [r for r in results if r[0] != 200]
    assert len(failed) <= len(results) // 3, failed
    assert 429 in [status for status, _ in _load(kvharbor_app, (TEST_KEYS["limited"],), 10)]
    lane = _load(kvharbor_app, (DEMO["premium"],), 4, lane=True)     # premium via its own port
    assert [status for status, _ in lane] == [200] * 4, lane
    wait_all_return_series(prometheus, ['ray_kvharbor_requests_total{tenant!~"obs-.*"}',
                                        'ray_kvharbor_kv_blocks{replica!~"obs-.*"}'], 60)
    # Each process's series reach Prometheus at its own export and scrape: poll until this
    # load's three tenants' and both replicas' have. (Counting any three tenants is not enough:
    # earlier tests' tenants can fill the list before this load's are exported, and then the
    # per-tenant gauges of this load, e.g. its sessions' blocks, match nothing; CI saw that.)
    deadline = time.monotonic() + 60
    while True:
        tenants = _app_values(prometheus, "ray_kvharbor_requests_total", "tenant")
        replicas = _app_values(prometheus, "ray_kvharbor_kv_blocks", "replica")
        ready = (LOAD_TENANTS <= set(tenants.split("|")) and len(replicas.split("|")) >= 2)
        if ready or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert ready, (tenants, replicas)

    models = load_dashboards(CHECKED_IN)
    exprs = sorted({e for m in models.values() for e in panel_exprs(m, rare=False)})
    rare = sorted({e for m in models.values() for e in panel_exprs(m, rare=True)})
    assert rare and not any("vector(0)" in e for e in exprs + rare)
    for expr in rare:
        prometheus.query(substitute(expr, tenant=tenants, replica=replicas))   # raises if invalid
    counts = wait_all_return_series(prometheus, exprs, timeout_s=60,
                                    tenant=tenants, replica=replicas)
    empty = [expr for expr, n in counts.items() if n == 0]
    assert not empty, f"{len(empty)} of {len(exprs)} queries returned nothing: {empty}"
    # The two ingresses are told apart: the lane's requests and TTFTs carry its label.
    lane_series = ['ray_kvharbor_requests_total{ingress="premium_lane", qos="premium"}',
                   'ray_kvharbor_ttft_seconds_count{ingress="premium_lane", qos="premium"}',
                   'ray_kvharbor_ttft_seconds_count{ingress="main", qos="premium"}']
    counts = wait_all_return_series(prometheus, lane_series, timeout_s=60)
    assert all(counts.values()), counts
    assert _grows(prometheus, DECISIONS, decisions_before), "router decisions not recorded"
    assert _grows(prometheus, LIMITED, limited_before), "429s not counted as rate-limited"
