"""Recording methods work inside a Ray actor and show up on Ray's metrics endpoint."""

from __future__ import annotations

import re
import time

from kvharbor.observability.metrics import METRICS, scraped_names
from tests.observability.recorder_actor import Recorder, scrape_until

GAUGE_TTL_S = 20.0
TENANT = "obs-ray-tenant"
REPLICA = "obs-ray-replica"


def _line(text: str, name: str, **labels: str) -> str:
    """The first sample line of ``name`` carrying all ``labels``."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return line
    raise AssertionError(f"no {name} sample with {labels}")


def _values(text: str, name: str) -> set[float]:
    """The values of every sample line of ``name`` (other processes may export it too)."""
    return {float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{")}


def test_actor_records_every_metric_with_expected_names_and_labels(ray_cluster):
    actor = Recorder.remote()
    try:
        assert ray_cluster.get(actor.recorder_type.remote()) == "KvharborMetrics"
        ray_cluster.get(actor.record_all.remote(TENANT, REPLICA))
        ray_cluster.get(actor.record_unknown_labels.remote(TENANT))
        recorded_at = time.monotonic()
        text = scrape_until([rf"^{name}\{{.*" for spec in METRICS for name in scraped_names(spec)]
                            + [rf'^ray_kvharbor_requests_total\{{.*tenant="{TENANT}"',
                               rf'^ray_kvharbor_requests_total\{{.*qos="standard".*tenant="{TENANT}"',
                               rf'^ray_kvharbor_rate_limited_total\{{.*reason="other".*tenant="{TENANT}"',
                               rf'^ray_kvharbor_kv_blocks\{{.*replica="{REPLICA}"'])
        # Ray forgets a gauge ~20 s after its last set(); ours are re-sent, so they stay.
        time.sleep(max(0.0, recorded_at + GAUGE_TTL_S + 10 - time.monotonic()))
        later = scrape_until([rf'^ray_kvharbor_kv_blocks\{{.*replica="{REPLICA}"'], timeout_s=5)
    finally:
        ray_cluster.kill(actor)

    for spec in METRICS:
        for name in scraped_names(spec):
            assert re.search(rf"^{name}\{{", text, re.MULTILINE), f"{name} not exported"

    ok = _line(text, "ray_kvharbor_requests_total", tenant=TENANT, qos="premium", status="ok",
               ingress="premium_lane")
    assert ok.endswith(" 1.0")
    assert _line(text, "ray_kvharbor_requests_total", tenant=TENANT, qos="batch", status="error",
                 ingress="main").endswith(" 1.0")
    # label values outside their sets are counted as "other" (a bounded label set)
    assert _line(text, "ray_kvharbor_requests_total", tenant=TENANT, qos="standard", status="other",
                 ingress="other").endswith(" 1.0")
    assert _line(text, "ray_kvharbor_rate_limited_total", tenant=TENANT, reason="other").endswith(" 1.0")
    assert not any(v in text for v in ("teapot", "sideways", "moon_phase"))
    limited = _line(text, "ray_kvharbor_rate_limited_total", tenant=TENANT,
                    reason="tokens_per_minute")
    assert limited.endswith(" 1.0")
    assert _line(text, "ray_kvharbor_cached_prompt_tokens_total", tenant=TENANT,
                 qos="premium").endswith(" 32.0")
    assert _line(text, "ray_kvharbor_kv_blocks", replica=REPLICA, region="pinned",
                 state="reserved").endswith(" 10.0")
    assert _line(text, "ray_kvharbor_ttft_seconds_bucket", tenant=TENANT, qos="premium",
                 ingress="premium_lane", le="0.005").endswith(" 1.0")
    assert _line(text, "ray_kvharbor_ttft_seconds_bucket", tenant=TENANT, qos="premium",
                 le="0.0025").endswith(" 0.0")
    assert _line(text, "ray_kvharbor_slo_requests_total", tenant=TENANT, qos="batch",
                 outcome="missed").endswith(" 2.0")
    # each overload guard's limit and in-flight count on its own gauge, gateway and proxy apart
    assert 40.0 in _values(text, "ray_kvharbor_overload_limit")
    assert 12.0 in _values(text, "ray_kvharbor_overload_in_flight")
    assert 20.0 in _values(text, "ray_kvharbor_proxy_overload_limit")
    assert 6.0 in _values(text, "ray_kvharbor_proxy_overload_in_flight")
    assert _line(later, "ray_kvharbor_queue_length", replica=REPLICA, qos="batch").endswith(
        " 2.0"), "gauge vanished although it was set and the actor is alive"
