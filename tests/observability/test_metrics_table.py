"""The metric table's invariants: names, kinds, labels, buckets, bounded label values."""

from __future__ import annotations

import pytest

from kvharbor.observability import metrics as m

ALLOWED_LABELS = {"tenant", "qos", "status", "outcome", "reason", "replica", "region", "state",
                  "location", "kind", "path", "ingress", "adapter"}


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
    ("x" * 50, m.REGIONS, "other"), ("fast_lane", m.ADMISSION_PATHS, "fast_lane"),
    ("bypass", m.ADMISSION_PATHS, "other")])
def test_unknown_label_values_collapse_to_other(value, allowed, expected):
    assert m._bounded(value, allowed) == expected


def test_null_recorder_accepts_every_method_and_records_nothing():
    null = m.NullMetrics()
    assert null.request_finished("t", "q", "ok") is None
    assert null.tokens("t", "q", prompt=5, cached=2, generated=1) is None
    assert null.router_prefix_tokens("r", predicted=3, observed=2) is None
    assert null._m == {}


class _FakeMetric:
    """Stands in for a Ray metric object: remembers every set/inc/observe call."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, dict]] = []

    def set(self, value, tags=None):
        self.calls.append((value, dict(tags or {})))

    inc = observe = set


def _recorder_with_fakes() -> m.KvharborMetrics:
    import threading

    rec = object.__new__(m.KvharborMetrics)
    rec._m = {spec.name: _FakeMetric() for spec in m.METRICS}
    rec._gauges, rec._gauge_lock = {}, threading.Lock()
    return rec


def test_tenant_occupancy_snapshot_zeroes_tenants_that_left_and_gauges_are_resent():
    rec = _recorder_with_fakes()
    rec.kv_occupancy_by_tenant("r1", {"acme": 5, "globex": 2})
    rec.kv_occupancy_by_tenant("r1", {"acme": 7})
    rec.kv_occupancy_by_tenant("r2", {"initech": 1})
    calls = rec._m["kvharbor_kv_tenant_blocks"].calls
    assert calls[2:4] == [(7, {"replica": "r1", "tenant": "acme"}),
                          (0, {"replica": "r1", "tenant": "globex"})]
    assert calls[4:] == [(1, {"replica": "r2", "tenant": "initech"})]

    rec.queue_length("r1", "premium", 3)
    assert rec.refresh_gauges() == 4       # acme, globex on r1, initech on r2, one queue
    assert rec._m["kvharbor_queue_length"].calls[-1] == (3, {"replica": "r1", "qos": "premium"})
    assert rec._m["kvharbor_kv_tenant_blocks"].calls[-3:].count(
        (0, {"replica": "r1", "tenant": "globex"})) == 1


def test_counters_skip_zero_and_negative_increments():
    rec = _recorder_with_fakes()
    rec.tokens("acme", "premium", prompt=10, cached=0, generated=-1)
    rec.evictions("r1", 0)
    assert rec._m["kvharbor_prompt_tokens"].calls == [(10, {"tenant": "acme", "qos": "premium"})]
    assert rec._m["kvharbor_cached_prompt_tokens"].calls == []
    assert rec._m["kvharbor_generated_tokens"].calls == []
    assert rec._m["kvharbor_kv_evictions"].calls == []


def test_replica_records_sessions_blocks_by_tenant_expirations_and_hits():
    from types import SimpleNamespace

    from kvharbor import LLM, SamplingParams
    from kvharbor.actors.replica import LLMReplica

    llm = LLM(device="cpu", num_kv_blocks=64, session_ttl_s=10.0)
    now = [100.0]
    llm.engine.sessions.clock = lambda: now[0]
    rec = _recorder_with_fakes()
    replica = SimpleNamespace(engine=llm.engine, replica_id="r1", _reported={}, metrics=rec)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = llm.generate([list(range(40))], sp, tenant="acme", session_id="s")[0]
    llm.generate([list(range(40)) + first.token_ids + [7] * 8], sp, tenant="acme", session_id="s")
    LLMReplica._record_session_metrics(replica)
    held = llm.stats()["session_blocks_held"]
    assert rec._m["kvharbor_sessions"].calls[-1] == (1, {"replica": "r1"})
    assert rec._m["kvharbor_session_blocks"].calls[-1] == (held, {"replica": "r1", "tenant": "acme"}) and held > 0
    assert rec._m["kvharbor_session_hit_tokens"].calls == [(32, {"replica": "r1"})]
    now[0] += 11.0
    llm.engine.expire_sessions()
    LLMReplica._record_session_metrics(replica)
    assert rec._m["kvharbor_sessions"].calls[-1] == (0, {"replica": "r1"})
    assert rec._m["kvharbor_session_blocks"].calls[-1] == (0, {"replica": "r1", "tenant": "acme"})
    assert rec._m["kvharbor_session_expirations"].calls == [(1, {"replica": "r1"})]
    assert len(rec._m["kvharbor_session_hit_tokens"].calls) == 1      # no new hits: no increment


def test_replica_records_requests_by_lora_adapter_and_zeroes_an_unloaded_one(tmp_path):
    """Running and waiting requests per loaded adapter (an idle one at 0, base-model requests
    not counted), the adapters' bytes as memory kind lora_adapters; an adapter removed while a
    request of it waits is still counted, and once none is left its series go to 0."""
    from types import SimpleNamespace

    from kvharbor import LLM, SamplingParams
    from kvharbor.actors.replica import LLMReplica
    from tests.conftest import write_test_adapter

    path = write_test_adapter(tmp_path / "a")
    llm = LLM(device="cpu", num_kv_blocks=64, max_num_seqs=2, lora_modules={"a": path, "b": path, "idle": path})
    engine, sp = llm.engine, SamplingParams(max_tokens=8, ignore_eos=True)
    for i, lora in enumerate(["a", "a", None, "b"]):
        engine.add_request(f"r{i}", [3, 4, 5, 6], sp, lora=lora)
    engine.step()                                      # two run, the other two wait
    rec = _recorder_with_fakes()
    replica = SimpleNamespace(engine=engine, replica_id="r1", _reported={"evictions": 0}, metrics=rec,
                              _record_session_metrics=lambda: None, _open_direct_streams=lambda: 0)

    def record():
        rec._m["kvharbor_lora_requests"].calls.clear()
        LLMReplica._record_metrics(replica)
        return {(t["adapter"], t["state"]): n for n, t in rec._m["kvharbor_lora_requests"].calls}

    got = record()
    assert got == {("a", "running"): 2, ("a", "waiting"): 0, ("b", "running"): 0, ("b", "waiting"): 1,
                   ("idle", "running"): 0, ("idle", "waiting"): 0}
    memory = {(t["location"], t["kind"]): n for n, t in rec._m["kvharbor_memory_bytes"].calls}
    assert memory[("device", "lora_adapters")] == 3 * engine.loras.adapters["a"].nbytes > 0
    engine.loras.remove("idle")
    engine.loras.remove("b")
    got = record()
    assert got[("idle", "running")] == got[("idle", "waiting")] == 0 and got[("a", "running")] == 2
    assert got[("b", "waiting")] == 1, "a removed adapter's queued request is still counted"
    assert engine.abort("r3")
    got = record()
    assert got[("b", "running")] == got[("b", "waiting")] == 0


def test_replica_counts_speculative_draft_and_accepted_tokens_once():
    """The replica adds the drafts verified and accepted since its last report (a second
    report with no new step adds nothing)."""
    from types import SimpleNamespace

    from kvharbor import LLM, SamplingParams
    from kvharbor.actors.replica import LLMReplica

    llm = LLM(device="cpu", num_kv_blocks=256, speculative_config={"adaptive": False})
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6, 7, 5]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    spec = llm.engine.spec
    assert spec.accepted_tokens > 0
    rec = _recorder_with_fakes()
    replica = SimpleNamespace(engine=llm.engine, replica_id="r1", _reported={"evictions": 0}, metrics=rec,
                              _record_session_metrics=lambda: None, _open_direct_streams=lambda: 0)
    LLMReplica._record_metrics(replica)
    got = {t["kind"]: n for n, t in rec._m["kvharbor_spec_decode_tokens"].calls}
    assert got == {"draft": spec.draft_tokens, "accepted": spec.accepted_tokens}
    LLMReplica._record_metrics(replica)
    total = {}
    for n, t in rec._m["kvharbor_spec_decode_tokens"].calls:
        total[t["kind"]] = total.get(t["kind"], 0) + n
    assert total == got
