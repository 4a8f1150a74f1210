"""The metric table's invariants: names, kinds, labels, buckets, bounded label values."""

from __future__ import annotations

import pytest

from kvharbor.observability import metrics as m

ALLOWED_LABELS = {"tenant", "qos", "status", "outcome", "reason", "replica", "region", "state"}


def test_names_are_unique_prefixed_and_ray_valid():
    names = [spec.name for spec in m.METRICS]
    assert len(names) == len(set(names))
    for name in names:
        assert name.startswith("kvharbor_") and name.replace("_", "").isalnum(), name
        assert not name.endswith("_total"), "Ray appends _total to counters itself"


def test_labels_are_from_the_bounded_set_and_every_spec_is_described():
    for spec in m.METRICS:
        assert set(spec.labels) <= ALLOWED_LABELS, spec
        assert spec.description.strip(), spec.name
        assert spec.kind in ("counter", "gauge", "histogram")


def test_histogram_buckets_cover_cpu_milliseconds_and_gpu_seconds():
    histograms = [spec for spec in m.METRICS if spec.kind == "histogram"]
    assert {s.name for s in histograms} >= {"kvharbor_ttft_seconds",
                                            "kvharbor_inter_token_latency_seconds",
                                            "kvharbor_router_decision_seconds"}
    for spec in histograms:
        assert list(spec.buckets) == sorted(set(spec.buckets)), spec.name
        assert spec.buckets[0] <= 0.001 and spec.buckets[-1] >= 1.0, spec.name


def test_scraped_names_follow_ray_conventions():
    by_name = m.METRICS_BY_NAME
    assert m.scraped_names(by_name["kvharbor_requests"]) == ("ray_kvharbor_requests_total",)
    assert m.scraped_names(by_name["kvharbor_kv_blocks"]) == ("ray_kvharbor_kv_blocks",)
    assert m.scraped_names(by_name["kvharbor_ttft_seconds"]) == (
        "ray_kvharbor_ttft_seconds_bucket", "ray_kvharbor_ttft_seconds_sum",
        "ray_kvharbor_ttft_seconds_count")


def test_required_metrics_exist():
    required = {"kvharbor_requests", "kvharbor_ttft_seconds",
                "kvharbor_inter_token_latency_seconds", "kvharbor_prompt_tokens",
                "kvharbor_cached_prompt_tokens", "kvharbor_generated_tokens",
                "kvharbor_kv_blocks", "kvharbor_preemptions", "kvharbor_kv_evictions",
                "kvharbor_router_decision_seconds", "kvharbor_router_predicted_prefix_tokens",
                "kvharbor_router_observed_prefix_tokens", "kvharbor_rate_limited",
                "kvharbor_queue_length"}
    assert required <= set(m.METRICS_BY_NAME)
    assert m.METRICS_BY_NAME["kvharbor_kv_blocks"].labels == ("replica", "region", "state")


@pytest.mark.parametrize("value, allowed, expected", [
    ("ok", m.STATUSES, "ok"), ("HTTP 418", m.STATUSES, "other"),
    ("max_concurrent_requests", m.RATE_LIMIT_REASONS, "max_concurrent_requests"),
    ("x" * 50, m.REGIONS, "other")])
def test_unknown_label_values_collapse_to_other(value, allowed, expected):
    assert m._bounded(value, allowed) == expected


def test_null_recorder_accepts_every_method_and_records_nothing():
    null = m.NullMetrics()
    assert null.request_finished("t", "q", "ok") is None
    assert null.tokens("t", "q", prompt=5, cached=2, generated=1) is None
    assert null.router_prefix_tokens("r", predicted=3, observed=2) is None
    assert null._m == {}
