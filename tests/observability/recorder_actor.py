"""A Ray actor that records every kvharbor metric, as gateway, replica and router would."""

from __future__ import annotations

import re
import time
import urllib.request

import ray

from tests.conftest import RAY_METRICS_PORT



def metrics_port() -> int:
    """The running Ray node's metrics export port (the fixture asks for RAY_METRICS_PORT)."""
    try:
        return int(ray._private.worker.global_worker.node.metrics_export_port)
    except (AttributeError, TypeError, ValueError):  # private API moved: use the fixture's
        return RAY_METRICS_PORT


@ray.remote(num_cpus=0)
class Recorder:
    """Records through ``get_metrics()`` inside the actor's own process."""

    def recorder_type(self) -> str:
        from kvharbor.observability.metrics import get_metrics

        return type(get_metrics()).__name__

    def record_all(self, tenant: str, replica: str, scale: int = 1) -> None:
        """Touch every metric once (``scale`` multiplies counts so rates move)."""
        from kvharbor.observability.metrics import get_metrics

        m = get_metrics()
        for qos, status in (("premium", "ok"), ("batch", "rate_limited"), ("batch", "error")):
            ingress = "premium_lane" if qos == "premium" else "main"
            m.request_finished(tenant, qos, status, ingress)
            m.ttft(tenant, qos, 0.004 * scale, ingress)
            m.inter_token_latency(tenant, qos, 0.002)
            m.request_latency(tenant, qos, 0.3)
            m.tokens(tenant, qos, prompt=64 * scale, cached=32 * scale, generated=8 * scale)
            m.slo(tenant, qos, met=qos == "premium")
            m.preemptions(replica, qos, scale)
            m.queue_length(replica, qos, 2 * scale)
            m.running(replica, qos, scale)
        m.rate_limited(tenant, "tokens_per_minute")
        m.admitted(tenant, "premium", "fast_lane")
        for status in ("created", "created", "completed"):      # one more batch running a round
            m.batch(tenant, status)
        for outcome in ("completed", "completed", "completed", "failed"):
            m.batch_requests(tenant, outcome)
        for region in ("pinned", "shared"):
            for state in ("used", "cached", "free", "reserved"):
                m.kv_blocks(replica, region, state, 10 * scale)
        m.kv_occupancy(replica, tenant, 12 * scale)
        m.memory_bytes(replica, {"device": {"kv_cache": 4096 * scale, "model_weights": 8192},
                                 "host": {"kv_cache": 2048 * scale, "model_weights": 0}})
        m.evictions(replica, 3 * scale)
        m.sessions(replica, 2 * scale, {tenant: 5 * scale}, expired=scale, hit_tokens=40 * scale)
        m.replica_up(replica)
        m.direct_streams(replica, scale)
        m.lora_requests(replica, {"support-lora": {"running": scale, "waiting": 2 * scale}})
        m.router_decision(0.0002 * scale)
        m.router_prefix_tokens(replica, predicted=48 * scale, observed=32 * scale)
        m.pinned_region(replica, {"size": 16 * scale, "target": 16 * scale, "floor": 8,
                                  "ceiling": 64, "demand_peak": 12 * scale})
        m.step_budget_trims(replica, 2 * scale)
        m.prefix_waits(replica, 3 * scale)
        m.steps_interrupted(replica, scale)
        m.spec_decode_tokens(replica, draft=8 * scale, accepted=5 * scale)
        m.router_mode("kv_index", None)
        m.router_mode("pow2", "no_hashes")
        m.router_affinity("cache_key")
        m.router_index_lag(0.02 * scale)
        m.overload_guard(0.003 * scale, 40 * scale, 12 * scale)
        m.overload_guard(0.004 * scale, 20 * scale, 6 * scale, where="proxy")
        m.directory_resync("replica_resync")

    def record_unknown_labels(self, tenant: str) -> None:
        """Label values outside their fixed sets: a status, an ingress, a rate-limit reason."""
        from kvharbor.observability.metrics import get_metrics

        m = get_metrics()
        m.request_finished(tenant, "standard", "teapot", "sideways")
        m.rate_limited(tenant, "moon_phase")


def scrape_until(patterns: list[str], timeout_s: float = 40.0) -> str:
    """Ray's metrics text once every regex in ``patterns`` matches a line; raises on timeout."""
    url = f"http://127.0.0.1:{metrics_port()}/metrics"
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            text = ""
        missing = [p for p in patterns if not re.search(p, text, re.MULTILINE)]
        if not missing:
            return text
        time.sleep(1.0)
    raise TimeoutError(f"no lines matching {missing} at {url} in {timeout_s}s")
