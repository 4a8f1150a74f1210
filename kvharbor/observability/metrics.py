"""Every kvharbor metric, defined once, recorded through ``ray.util.metrics``.

The table :data:`METRICS` is the single source of truth: :class:`KvharborMetrics` creates
one Ray metric object per entry, and the Grafana dashboards and the docs are generated from
the same table, so a panel can only query a metric that exists.

Names. A metric named ``kvharbor_requests`` here is scraped from Ray's metrics endpoint as
``ray_kvharbor_requests_total`` (Ray prefixes ``ray_``; counters get ``_total``; histograms
give ``_bucket``/``_sum``/``_count``). :func:`scraped_names` returns the scraped names of an
entry; dashboards must use those.

Processes. Ray metric objects belong to the process that created them. :func:`get_metrics`
creates the recorder lazily, once per process, on first use inside the actor (gateway,
replica or router process), never at import time. In a process where Ray is not initialised
(unit tests of plain classes, the offline ``LLM``) it returns a no-op recorder that is not
cached, so a later call after ``ray.init`` gets the real one.

Cardinality (bounded by construction). Every label value comes from a small set:

===========  ==================================================================
label        values
===========  ==================================================================
``tenant``   tenants in ``tenants.yaml`` (tens); unauthenticated calls: ``anonymous``
``qos``      QoS classes in ``tenants.yaml`` (a handful)
``replica``  live Serve replica ids (one per GPU)
``region``   :data:`REGIONS` (``pinned``, ``shared``)
``state``    :data:`BLOCK_STATES` (``used``, ``cached``, ``free``, ``reserved``); for LoRA
             requests :data:`LORA_STATES` (``running``, ``waiting``)
``adapter``  LoRA adapters a replica loaded (build_app's ``lora_modules`` and tenants.yaml's
             ``lora_adapters``: set by the operator, tens)
``status``   :data:`STATUSES`; anything else is recorded as ``other``; for batches
             :data:`BATCH_STATUSES`
``reason``   :data:`RATE_LIMIT_REASONS`; anything else is recorded as ``other``
``path``     :data:`ADMISSION_PATHS` (``fast_lane``, ``actor``)
``ingress``  :data:`INGRESSES` (``main``: the app's port; ``premium_lane``: ``premium_port``)
``outcome``  ``met`` | ``missed``; for a batch's requests :data:`BATCH_REQUEST_OUTCOMES`
``location`` :data:`MEMORY_LOCATIONS` (``device``, ``host``)
``kind``     :data:`MEMORY_KINDS` (``kv_cache``, ``model_weights``, ``lora_adapters``); for router metrics
             :data:`ROUTER_MODES` or :data:`DIRECTORY_SYNC_KINDS`; for speculative decoding
             :data:`SPEC_TOKEN_KINDS` (``draft``, ``accepted``)
``reason``   (router decisions) :data:`ROUTER_FALLBACK_REASONS`
===========  ==================================================================

Worst case per histogram: tenants x QoS classes x buckets series. Request ids, prompts and
the model names clients send never become label values (``adapter`` is a loaded adapter's).

Histogram sums (measured, Ray 2.60): ``_sum`` adds each observation's *bucket midpoint*, not
the value (0.012 s observed in the 0.01-0.025 bucket adds 0.0175), so ``_sum / _count`` is
only as exact as the buckets; dashboards use ``histogram_quantile`` over ``_bucket``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

MetricKind = Literal["counter", "gauge", "histogram"]

STATUSES = ("ok", "error", "rejected", "rate_limited", "aborted", "timeout", "replica_failed")
# The ``limit`` names of kvharbor.tenants.limits.Admission, plus the QoS class queue cap.
RATE_LIMIT_REASONS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests",
                      "daily_token_budget", "max_tokens_per_request", "queue_full", "overloaded")
ADMISSION_PATHS = ("fast_lane", "actor")
# Where a request entered: the app's HTTP port, or the premium lane (build_app premium_port).
INGRESSES = ("main", "premium_lane")
REGIONS = ("pinned", "shared")
# A batch of the Batch API: created, then ended in one of OpenAI's final statuses; its lines
# (requests) answered 2xx (completed), answered otherwise (failed) or never run (expired).
BATCH_STATUSES = ("created", "completed", "failed", "expired", "cancelled")
BATCH_REQUEST_OUTCOMES = ("completed", "failed", "expired")
MEMORY_LOCATIONS = ("device", "host")
MEMORY_KINDS = ("kv_cache", "model_weights", "lora_adapters")
LORA_STATES = ("running", "waiting")
BLOCK_STATES = ("used", "cached", "free", "reserved")
PINNED_REGION_KINDS = ("size", "target", "floor", "ceiling", "demand_peak")
SPEC_TOKEN_KINDS = ("draft", "accepted")
OTHER = "other"
# How the KV-aware router decided: its event-fed index, its own routing history
# (approximate), or power of two choices; and why it was not the index.
ROUTER_MODES = ("kv_index", "approx", "pow2")
ROUTER_AFFINITIES = ("session", "cache_key")
ROUTER_FALLBACK_REASONS = ("none", "no_hashes", "stream_not_started", "stream_stale",
                           "no_history")
DIRECTORY_SYNC_KINDS = ("replica_resync", "router_snapshot", "replay_mismatch")

# Seconds. From 0.5 ms (a tiny CPU model's decode step) to a minute (a long GPU prefill
# behind a queue); roughly x2-x2.5 per bucket.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64,
                 1.25, 2.5, 5.0)
# Ray 2.60 drops a gauge series ~20 s (two export intervals) after its last set(); the
# recorder re-sends every gauge's last value this often, so gauges behave like Prometheus'.
GAUGE_REFRESH_S = 5.0
ROUTER_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                    0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: its registered name (without Ray's ``ray_`` prefix) and schema."""

    name: str
    kind: MetricKind
    labels: tuple[str, ...]
    description: str
    buckets: tuple[float, ...] = ()


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("kvharbor_requests", "counter", ("tenant", "qos", "status", "ingress"),
               "Finished requests by final status and ingress (main port or premium lane)."),
    MetricSpec("kvharbor_ttft_seconds", "histogram", ("tenant", "qos", "ingress"),
               "Time from arrival at the gateway to the first streamed token, by ingress (main "
               "port or premium lane).", LATENCY_BUCKETS_S),
    MetricSpec("kvharbor_inter_token_latency_seconds", "histogram", ("tenant", "qos"),
               "Time between consecutive streamed tokens of one request.", ITL_BUCKETS_S),
    MetricSpec("kvharbor_request_latency_seconds", "histogram", ("tenant", "qos"),
               "Time from arrival to the last token (end to end).", LATENCY_BUCKETS_S),
    MetricSpec("kvharbor_prompt_tokens", "counter", ("tenant", "qos"),
               "Prompt tokens of finished requests."),
    MetricSpec("kvharbor_cached_prompt_tokens", "counter", ("tenant", "qos"),
               "Prompt tokens served from the KV cache (prefix hits) instead of recomputed."),
    MetricSpec("kvharbor_generated_tokens", "counter", ("tenant", "qos"),
               "Generated (completion) tokens."),
    MetricSpec("kvharbor_slo_requests", "counter", ("tenant", "qos", "outcome"),
               "Requests judged against their QoS class latency SLO (outcome met|missed)."),
    MetricSpec("kvharbor_rate_limited", "counter", ("tenant", "reason"),
               "Requests refused by admission control, by limit that refused them."),
    MetricSpec("kvharbor_gateway_loop_lag_seconds", "gauge", (),
               "Median event-loop lag of a gateway over its last 0.25 s (one series per gateway "
               "process); the overload guard sheds lower classes while it exceeds overload_lag_ms."),
    MetricSpec("kvharbor_overload_limit", "gauge", (),
               "A gateway's overload guard limit on requests of non-pinned classes in flight "
               "through it (-1: no limit); the lowest classes shed first when it binds."),
    MetricSpec("kvharbor_overload_in_flight", "gauge", (),
               "Requests of non-pinned classes in flight through a gateway at the end of its "
               "overload guard's last window, the count its limit is compared with."),
    MetricSpec("kvharbor_proxy_loop_lag_seconds", "gauge", (),
               "Median event-loop lag of Serve's HTTP proxy over its last 0.25 s (one series per "
               "proxy); its overload guard sheds lower classes before any gateway call while it "
               "exceeds the lag target."),
    MetricSpec("kvharbor_proxy_overload_limit", "gauge", (),
               "The proxy's overload guard limit on requests of non-pinned classes in flight "
               "through it (-1: no limit)."),
    MetricSpec("kvharbor_proxy_overload_in_flight", "gauge", (),
               "Requests of non-pinned classes in flight through Serve's proxy at the end of its "
               "overload guard's last window, the count its limit is compared with."),
    MetricSpec("kvharbor_batches", "counter", ("tenant", "status"),
               "Batches (Batch API) created and ended, by final status; created minus ended is "
               "the batches running now (a batch runs and is counted in the gateway that "
               "created it)."),
    MetricSpec("kvharbor_batch_requests", "counter", ("tenant", "outcome"),
               "Requests (lines) of batches by result: answered 2xx (completed), answered "
               "otherwise (failed), never run before the batch expired (expired)."),
    MetricSpec("kvharbor_admissions", "counter", ("tenant", "qos", "path"),
               "Requests admitted, by path: fast_lane (from the gateway's grant, no actor "
               "call) or actor (the admission and class-queue calls)."),
    MetricSpec("kvharbor_kv_blocks", "gauge", ("replica", "region", "state"),
               "KV blocks per replica by region (pinned|shared) and state "
               "(used|cached|free|reserved)."),
    MetricSpec("kvharbor_memory_bytes", "gauge", ("replica", "location", "kind"),
               "Bytes a replica holds by location (device|host) and kind "
               "(kv_cache|model_weights|lora_adapters); host kv_cache is the host KV tier."),
    MetricSpec("kvharbor_kv_tenant_blocks", "gauge", ("replica", "tenant"),
               "KV blocks held (ref count > 0) by a tenant's requests on a replica."),
    MetricSpec("kvharbor_kv_evictions", "counter", ("replica",),
               "Cached KV blocks whose contents were evicted to make room."),
    MetricSpec("kvharbor_sessions", "gauge", ("replica",),
               "Sessions (X-Session-ID) whose KV blocks a replica holds between turns."),
    MetricSpec("kvharbor_session_blocks", "gauge", ("replica", "tenant"),
               "KV block references held by a tenant's sessions on a replica."),
    MetricSpec("kvharbor_session_expirations", "counter", ("replica",),
               "Idle sessions released because their session_ttl_s passed."),
    MetricSpec("kvharbor_session_hit_tokens", "counter", ("replica",),
               "Prompt tokens of session turns after the first that were prefix-cache hits."),
    MetricSpec("kvharbor_preemptions", "counter", ("replica", "qos"),
               "Running requests preempted (to be recomputed), by the preempted request's QoS."),
    MetricSpec("kvharbor_pinned_region_blocks", "gauge", ("replica", "kind"),
               "Pinned KV region of a replica, sized by load: kind size (now), target, floor, "
               "ceiling (absent: fixed region) and demand_peak (peak pinned-class blocks over "
               "the demand window)."),
    MetricSpec("kvharbor_step_budget_trims", "counter", ("replica",),
               "Lower-class prefill chunks cut or decodes deferred to keep an engine step under "
               "a higher class's step target."),
    MetricSpec("kvharbor_prefix_waits", "counter", ("replica",),
               "Engine steps a waiting request sat out because a request scheduled ahead of it "
               "was computing its next prompt blocks (it takes them as a prefix hit the step "
               "after): a burst of one prefix computes it once."),
    MetricSpec("kvharbor_spec_decode_tokens", "counter", ("replica", "kind"),
               "Speculative decoding: draft tokens verified (kind draft) and those accepted (kind "
               "accepted), as vLLM's spec_decode_num_draft_tokens / num_accepted_tokens."),
    MetricSpec("kvharbor_steps_interrupted", "counter", ("replica",),
               "Lower-class engine steps cut short for a premium arrival (the work done so far "
               "is thrown away and the premium request runs in the next step)."),
    MetricSpec("kvharbor_queue_length", "gauge", ("replica", "qos"),
               "Requests waiting to be scheduled on a replica, by QoS class."),
    MetricSpec("kvharbor_running_requests", "gauge", ("replica", "qos"),
               "Requests currently running (scheduled) on a replica, by QoS class."),
    MetricSpec("kvharbor_lora_requests", "gauge", ("replica", "adapter", "state"),
               "Requests of each LoRA adapter loaded on a replica, by state (running: "
               "scheduled; waiting), as vLLM's lora_requests_info."),
    MetricSpec("kvharbor_direct_streams", "gauge", ("replica",),
               "Direct streams (pinned classes' requests streamed from a gateway over TCP) open "
               "on a replica; Serve's ongoing-request count leaves them out."),
    MetricSpec("kvharbor_replica_up", "gauge", ("replica",),
               "1 while a replica's engine loop runs, 0 once it stops."),
    MetricSpec("kvharbor_router_decision_seconds", "histogram", (),
               "Time the KV-aware router spends choosing replicas for one request.",
               ROUTER_BUCKETS_S),
    MetricSpec("kvharbor_router_decisions", "counter", ("kind", "reason"),
               "Routing decisions by how the router decided (kind: kv_index|approx|pow2) and "
               "why it did not use its event-fed index (reason; none when it did)."),
    MetricSpec("kvharbor_router_affinity", "counter", ("kind",),
               "Routing decisions whose first choice was set by affinity (kind: session, the "
               "replica holding the request's X-Session-ID; cache_key, the home of its "
               "prompt_cache_key)."),
    MetricSpec("kvharbor_router_index_lag_seconds", "gauge", (),
               "Seconds since this router's prefix index last caught up with the directory's "
               "event log (one series per router process)."),
    MetricSpec("kvharbor_directory_resyncs", "counter", ("kind",),
               "Full-state resyncs: a replica re-sent its cache (replica_resync), a router took "
               "a directory snapshot (router_snapshot) or found its replay inconsistent "
               "(replay_mismatch)."),
    MetricSpec("kvharbor_router_predicted_prefix_tokens", "counter", ("replica",),
               "Prompt tokens the router predicted would be prefix hits on the chosen replica."),
    MetricSpec("kvharbor_router_observed_prefix_tokens", "counter", ("replica",),
               "Prompt tokens the engine actually found cached for routed requests."),
)

METRICS_BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}
_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def scraped_names(spec: MetricSpec) -> tuple[str, ...]:
    """The series names Prometheus sees for ``spec`` on Ray's metrics endpoint."""
    return tuple(f"ray_{spec.name}{suffix}" for suffix in _SUFFIXES[spec.kind])


def _bounded(value: str, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``, else ``"other"`` (keeps cardinality fixed)."""
    return value if value in allowed else OTHER


class KvharborMetrics:
    """Typed recording methods over the Ray metric objects of one process.

    Units: seconds for latencies, tokens and blocks as plain counts. Negative counts are
    ignored for counters (Ray rejects them); zero increments are skipped.

    Gauges are sticky: a value set once is re-sent every ``gauge_refresh_s`` by a daemon
    thread until it is set again (set 0 for a tenant or class that went away), because Ray
    forgets a gauge that is not set for about 20 s.
    """

    def __init__(self, gauge_refresh_s: float = GAUGE_REFRESH_S) -> None:
        from ray.util import metrics as ray_metrics

        self._m: dict[str, object] = {}
        self._gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._gauge_lock = threading.Lock()
        for spec in METRICS:
            if spec.kind == "counter":
                obj = ray_metrics.Counter(spec.name, spec.description, tag_keys=spec.labels)
            elif spec.kind == "gauge":
                obj = ray_metrics.Gauge(spec.name, spec.description, tag_keys=spec.labels)
            else:
                obj = ray_metrics.Histogram(spec.name, spec.description,
                                            boundaries=list(spec.buckets), tag_keys=spec.labels)
            self._m[spec.name] = obj
        threading.Thread(target=self._refresh_gauges_forever, args=(gauge_refresh_s,),
                         name="kvharbor-gauge-refresh", daemon=True).start()

    def _set(self, name: str, value: float, tags: dict[str, str]) -> None:
        """Set a gauge and remember it, so the refresher keeps re-sending it."""
        with self._gauge_lock:
            self._gauges[(name, tuple(sorted(tags.items())))] = value
        self._m[name].set(value, tags=tags)

    def refresh_gauges(self) -> int:
        """Re-send every gauge's last value (Ray drops one not set for ~20 s); returns count."""
        with self._gauge_lock:
            items = list(self._gauges.items())
        for (name, tags), value in items:
            self._m[name].set(value, tags=dict(tags))
        return len(items)

    def _refresh_gauges_forever(self, period_s: float) -> None:
        while True:
            time.sleep(period_s)
            try:
                self.refresh_gauges()
            except Exception:  # noqa: BLE001 - e.g. Ray shutting down; never kill the process
                logger.debug("gauge refresh failed", exc_info=True)

    def _inc(self, name: str, value: float, tags: dict[str, str]) -> None:
        if value > 0:
            self._m[name].inc(value, tags=tags)

    # --- gateway -------------------------------------------------------------------------
    def request_finished(self, tenant: str, qos: str, status: str, ingress: str = "main") -> None:
        """Count one finished request; ``status`` in :data:`STATUSES` (else ``other``),
        ``ingress`` in :data:`INGRESSES` (else ``other``)."""
        self._inc("kvharbor_requests", 1,
                  {"tenant": tenant, "qos": qos, "status": _bounded(status, STATUSES),
                   "ingress": _bounded(ingress, INGRESSES)})

    def ttft(self, tenant: str, qos: str, seconds: float, ingress: str = "main") -> None:
        """Time to first token of one request, in seconds, by where it entered."""
        self._m["kvharbor_ttft_seconds"].observe(
            seconds, tags={"tenant": tenant, "qos": qos, "ingress": _bounded(ingress, INGRESSES)})

    def inter_token_latency(self, tenant: str, qos: str, seconds: float) -> None:
        """Gap between two consecutive streamed tokens, in seconds."""
        self._m["kvharbor_inter_token_latency_seconds"].observe(
            seconds, tags={"tenant": tenant, "qos": qos})

    def request_latency(self, tenant: str, qos: str, seconds: float) -> None:
        """End-to-end latency of one finished request, in seconds."""
        self._m["kvharbor_request_latency_seconds"].observe(
            seconds, tags={"tenant": tenant, "qos": qos})

    def tokens(self, tenant: str, qos: str, prompt: int, cached: int, generated: int) -> None:
        """Token counts of one request: prompt, of which ``cached`` were prefix hits, output."""
        tags = {"tenant": tenant, "qos": qos}
        self._inc("kvharbor_prompt_tokens", prompt, tags)
        self._inc("kvharbor_cached_prompt_tokens", cached, tags)
        self._inc("kvharbor_generated_tokens", generated, tags)

    def slo(self, tenant: str, qos: str, met: bool) -> None:
        """Whether one request met its QoS class's latency SLO."""
        self._inc("kvharbor_slo_requests", 1,
                  {"tenant": tenant, "qos": qos, "outcome": "met" if met else "missed"})

    def rate_limited(self, tenant: str, reason: str) -> None:
        """One request refused by admission; ``reason`` in :data:`RATE_LIMIT_REASONS`."""
        self._inc("kvharbor_rate_limited", 1,
                  {"tenant": tenant, "reason": _bounded(reason, RATE_LIMIT_REASONS)})

    def overload_guard(self, lag_s: float, limit: float, in_flight: int, where: str = "gateway") -> None:
        """An overload guard after one window (``limit`` inf: no limit); ``where`` is
        ``gateway`` or ``proxy`` (Serve's HTTP proxy, ``kvharbor.platform.proxy_guard``)."""
        proxy = where == "proxy"
        self._set("kvharbor_proxy_loop_lag_seconds" if proxy else "kvharbor_gateway_loop_lag_seconds", lag_s, {})
        self._set("kvharbor_proxy_overload_limit" if proxy else "kvharbor_overload_limit",
                  -1 if limit == float("inf") else limit, {})
        self._set("kvharbor_proxy_overload_in_flight" if proxy else "kvharbor_overload_in_flight",
                  in_flight, {})

    def admitted(self, tenant: str, qos: str, path: str) -> None:
        """One request admitted; ``path`` in :data:`ADMISSION_PATHS`."""
        self._inc("kvharbor_admissions", 1,
                  {"tenant": tenant, "qos": qos, "path": _bounded(path, ADMISSION_PATHS)})

    def batch(self, tenant: str, status: str) -> None:
        """One batch created, or ended in ``status``; statuses in :data:`BATCH_STATUSES`."""
        self._inc("kvharbor_batches", 1,
                  {"tenant": tenant, "status": _bounded(status, BATCH_STATUSES)})

    def batch_requests(self, tenant: str, outcome: str, n: int = 1) -> None:
        """``n`` lines of a batch finished with ``outcome`` (:data:`BATCH_REQUEST_OUTCOMES`)."""
        self._inc("kvharbor_batch_requests", n,
                  {"tenant": tenant, "outcome": _bounded(outcome, BATCH_REQUEST_OUTCOMES)})

    # --- replica -------------------------------------------------------------------------
    def kv_blocks(self, replica: str, region: str, state: str, n: int) -> None:
        """Set the number of blocks of ``region`` in ``state`` on ``replica`` (a gauge)."""
        self._set("kvharbor_kv_blocks", n, {
            "replica": replica, "region": _bounded(region, REGIONS),
            "state": _bounded(state, BLOCK_STATES)})

    def memory_bytes(self, replica: str, breakdown: dict[str, dict[str, int]]) -> None:
        """Set ``{location: {kind: bytes}}`` (``Engine.stats()["memory_bytes"]``) as gauges."""
        for location, kinds in breakdown.items():
            for kind, n in kinds.items():
                self._set("kvharbor_memory_bytes", n, {
                    "replica": replica, "location": _bounded(location, MEMORY_LOCATIONS),
                    "kind": _bounded(kind, MEMORY_KINDS)})

    def kv_occupancy(self, replica: str, tenant: str, blocks: int) -> None:
        """Set the number of KV blocks ``tenant``'s requests hold on ``replica``."""
        self._set("kvharbor_kv_tenant_blocks", blocks, {"replica": replica, "tenant": tenant})

    def kv_occupancy_by_tenant(self, replica: str, blocks_by_tenant: dict[str, int]) -> None:
        """Publish every tenant's blocks on ``replica`` at once; tenants seen before but
        missing from ``blocks_by_tenant`` are set to 0 (gauges are sticky, see the class)."""
        with self._gauge_lock:
            known = {dict(tags)["tenant"] for (name, tags) in self._gauges
                     if name == "kvharbor_kv_tenant_blocks" and dict(tags)["replica"] == replica}
        for tenant in sorted(known | set(blocks_by_tenant)):
            self.kv_occupancy(replica, tenant, blocks_by_tenant.get(tenant, 0))

    def evictions(self, replica: str, n: int) -> None:
        """Add ``n`` evicted cached blocks."""
        self._inc("kvharbor_kv_evictions", n, {"replica": replica})

    def sessions(self, replica: str, active: int, blocks_by_tenant: dict[str, int],
                 expired: int, hit_tokens: int) -> None:
        """Sessions held now, their blocks by tenant (a tenant no longer listed is set to 0 by
        the caller passing it with 0), and ``expired`` / ``hit_tokens`` added since the last call."""
        self._set("kvharbor_sessions", active, {"replica": replica})
        for tenant, n in blocks_by_tenant.items():
            self._set("kvharbor_session_blocks", n, {"replica": replica, "tenant": tenant})
        if expired:
            self._inc("kvharbor_session_expirations", expired, {"replica": replica})
        if hit_tokens:
            self._inc("kvharbor_session_hit_tokens", hit_tokens, {"replica": replica})

    def preemptions(self, replica: str, qos: str, n: int = 1) -> None:
        """Add ``n`` preemptions of requests of class ``qos``."""
        self._inc("kvharbor_preemptions", n, {"replica": replica, "qos": qos})

    def pinned_region(self, replica: str, blocks: dict[str, int | None]) -> None:
        """Set the pinned region gauges: ``{kind: blocks}``, kinds in :data:`PINNED_REGION_KINDS`
        (None: not set, e.g. no ceiling)."""
        for kind, n in blocks.items():
            if n is not None:
                self._set("kvharbor_pinned_region_blocks", n,
                          {"replica": replica, "kind": _bounded(kind, PINNED_REGION_KINDS)})

    def step_budget_trims(self, replica: str, n: int) -> None:
        """Count lower-class items trimmed by the step budget since the last call."""
        self._inc("kvharbor_step_budget_trims", n, {"replica": replica})

    def prefix_waits(self, replica: str, n: int) -> None:
        """Count steps waiting requests sat out for a prefix in flight since the last call."""
        self._inc("kvharbor_prefix_waits", n, {"replica": replica})

    def spec_decode_tokens(self, replica: str, draft: int, accepted: int) -> None:
        """Count draft tokens verified and accepted since the last call."""
        for kind, n in (("draft", draft), ("accepted", accepted)):
            self._inc("kvharbor_spec_decode_tokens", n, {"replica": replica, "kind": kind})

    def steps_interrupted(self, replica: str, n: int) -> None:
        """Count steps cut short for a premium arrival since the last call."""
        self._inc("kvharbor_steps_interrupted", n, {"replica": replica})

    def queue_length(self, replica: str, qos: str, n: int) -> None:
        """Set the number of waiting requests of class ``qos`` on ``replica``."""
        self._set("kvharbor_queue_length", n, {"replica": replica, "qos": qos})

    def running(self, replica: str, qos: str, n: int) -> None:
        """Set the number of running requests of class ``qos`` on ``replica``."""
        self._set("kvharbor_running_requests", n, {"replica": replica, "qos": qos})

    def lora_requests(self, replica: str, counts: dict[str, dict[str, int]]) -> None:
        """Set ``{adapter: {state: requests}}`` on ``replica`` (states in :data:`LORA_STATES`);
        adapters seen before but missing from ``counts`` (no longer loaded) are set to 0."""
        with self._gauge_lock:
            known = {dict(tags)["adapter"] for (name, tags) in self._gauges
                     if name == "kvharbor_lora_requests" and dict(tags)["replica"] == replica}
        for adapter in sorted(known | set(counts)):
            for state in LORA_STATES:
                self._set("kvharbor_lora_requests", counts.get(adapter, {}).get(state, 0),
                          {"replica": replica, "adapter": adapter, "state": state})

    def direct_streams(self, replica: str, n: int) -> None:
        """Set the direct streams open on ``replica``."""
        self._set("kvharbor_direct_streams", n, {"replica": replica})

    def replica_up(self, replica: str, up: bool = True) -> None:
        """Mark ``replica``'s engine loop as running (1) or stopped (0)."""
        self._set("kvharbor_replica_up", 1 if up else 0, {"replica": replica})

    # --- router --------------------------------------------------------------------------
    def router_decision(self, seconds: float) -> None:
        """Time one ``choose_replicas`` call took, in seconds."""
        self._m["kvharbor_router_decision_seconds"].observe(seconds)

    def router_mode(self, mode: str, reason: str | None) -> None:
        """One routing decision: ``mode`` in :data:`ROUTER_MODES`, ``reason`` why not the index."""
        self._inc("kvharbor_router_decisions", 1,
                  {"kind": _bounded(mode, ROUTER_MODES),
                   "reason": _bounded(reason or "none", ROUTER_FALLBACK_REASONS)})

    def router_affinity(self, kind: str) -> None:
        """One decision whose first choice an affinity set (:data:`ROUTER_AFFINITIES`)."""
        self._inc("kvharbor_router_affinity", 1, {"kind": _bounded(kind, ROUTER_AFFINITIES)})

    def router_index_lag(self, seconds: float) -> None:
        """Seconds since the router's index last caught up with the directory log."""
        self._set("kvharbor_router_index_lag_seconds", seconds, {})

    def directory_resync(self, kind: str) -> None:
        """One full-state resync; ``kind`` in :data:`DIRECTORY_SYNC_KINDS`."""
        self._inc("kvharbor_directory_resyncs", 1, {"kind": _bounded(kind, DIRECTORY_SYNC_KINDS)})

    def router_prefix_tokens(self, replica: str, predicted: int, observed: int) -> None:
        """Predicted (router) vs observed (engine) prefix-hit tokens of one routed request."""
        self._inc("kvharbor_router_predicted_prefix_tokens", predicted, {"replica": replica})
        self._inc("kvharbor_router_observed_prefix_tokens", observed, {"replica": replica})


class NullMetrics(KvharborMetrics):
    """Same methods, records nothing: for processes without Ray."""

    def __init__(self) -> None:  # noqa: D107 - no Ray objects, no refresher thread
        self._m = {}
        self._gauges = {}

    def __getattribute__(self, name: str):
        if not name.startswith("_") and callable(getattr(KvharborMetrics, name, None)):
            return lambda *args, **kwargs: None
        return object.__getattribute__(self, name)


_lock = threading.Lock()
_instance: KvharborMetrics | None = None


def get_metrics() -> KvharborMetrics:
    """This process's recorder, created on first use (a no-op one while Ray is not up)."""
    global _instance
    if _instance is not None:
        return _instance
    import ray

    if not ray.is_initialized():
        return NullMetrics()
    with _lock:
        if _instance is None:
            _instance = KvharborMetrics()
        return _instance
