"""The four kvharbor dashboards, as data (see :mod:`kvharbor.observability.panels`).

Overview (traffic, latency, tokens, SLO), KV cache (blocks, hit rate, evictions,
preemptions, occupancy), Routing (decision time, predicted vs observed prefix hits, queues)
and Tenants (one tenant's view: requests, tokens, hit rate, rate limits, TTFT; its batches).
"""

from __future__ import annotations

from kvharbor.observability.panels import (
    RATE, RQ, TQ, DashboardSpec, PanelSpec, Query, R, T, _sel, hit_rate_panel,
    latency_panel, quantile, rate_sum, ratio, series)


def _overview() -> DashboardSpec:
    req = "kvharbor_requests"
    ok = TQ[:-1] + ',status="ok"}'
    errors = TQ[:-1] + ',status!="ok"}'
    slo_met = TQ[:-1] + ',outcome="met"}'
    traffic = (
        PanelSpec("Requests by status", "Finished requests per second.", "reqps",
                  (Query(rate_sum(req, "status", TQ), "{{status}}"),), stacked=True),
        PanelSpec("Requests by tenant", "Finished requests per second.", "reqps",
                  (Query(rate_sum(req, "tenant", TQ), "{{tenant}}"),), stacked=True),
        PanelSpec("Requests by ingress", "Finished requests per second by where they entered: "
                  "the app's port (main) or the premium lane (build_app premium_port).", "reqps",
                  (Query(rate_sum(req, "ingress", TQ), "{{ingress}}"),), stacked=True),
        PanelSpec("Error ratio", "Share of requests not finished ok.", "percentunit",
                  (Query(f"1 - {ratio(rate_sum(req, 'qos', ok), rate_sum(req, 'qos', TQ))}",
                         "{{qos}}"),)),
        PanelSpec("Errors by status", "Requests per second that did not finish ok.", "reqps",
                  (Query(rate_sum(req, "status", errors), "{{status}}"),), no_value="0"),
    )
    latency = (
        latency_panel("Time to first token by QoS", "kvharbor_ttft_seconds", "qos", TQ,
                      "Arrival at the gateway to first streamed token."),
        latency_panel("Time to first token by ingress", "kvharbor_ttft_seconds", "ingress", TQ,
                      "The app's port (main) against the premium lane (premium_port), for the "
                      "tenants and classes selected above."),
        latency_panel("Inter-token latency by QoS", "kvharbor_inter_token_latency_seconds",
                      "qos", TQ, "Gap between consecutive streamed tokens."),
        latency_panel("End-to-end latency by QoS", "kvharbor_request_latency_seconds", "qos",
                      TQ, "Arrival to last token."),
        PanelSpec("SLO attainment by QoS", "Share of requests that met their class's SLO.",
                  "percentunit", (Query(ratio(rate_sum("kvharbor_slo_requests", "qos", slo_met),
                                              rate_sum("kvharbor_slo_requests", "qos", TQ)),
                                        "{{qos}}"),)),
    )
    tokens = (
        PanelSpec("Tokens per second", "Prompt, cached prompt and generated tokens.", "short", (
            Query(f"sum(rate({series('kvharbor_prompt_tokens')}{TQ}[{RATE}]))", "prompt"),
            Query(f"sum(rate({series('kvharbor_cached_prompt_tokens')}{TQ}[{RATE}]))",
                  "cached prompt"),
            Query(f"sum(rate({series('kvharbor_generated_tokens')}{TQ}[{RATE}]))",
                  "generated"))),
        PanelSpec("Replicas up", "Replicas whose engine loop runs.", "short",
                  (Query(f"sum({series('kvharbor_replica_up')}{R})", "replicas"),),
                  kind="stat"),
    )
    return DashboardSpec("kvharbor-overview", "kvharbor / Overview",
                         "Traffic, latency, tokens and SLOs across tenants.",
                         (("Traffic", traffic), ("Latency and SLO", latency),
                          ("Tokens", tokens)))


def _kv_cache() -> DashboardSpec:
    blocks = series("kvharbor_kv_blocks")
    pinned = R[:-1] + ',region="pinned"}'
    panels = (
        PanelSpec("KV blocks by region and state", "Blocks per replica (gauge).", "short",
                  (Query(f"sum by (replica, region, state) ({blocks}{R})",
                         "{{replica}} {{region}}/{{state}}"),), stacked=True),
        PanelSpec("Pinned region", "Pinned blocks by state; reserved = idle but held for "
                  "pinned QoS classes.", "short",
                  (Query(f"sum by (state) ({blocks}{pinned})", "{{state}}"),), stacked=True),
        PanelSpec("Pinned region sized by load", "Blocks per replica: the region's size, its "
                  "target (peak premium demand with headroom, between floor and ceiling) and "
                  "the peak demand it follows.", "short",
                  (Query(f"sum by (replica, kind) ({series('kvharbor_pinned_region_blocks')}{R})",
                         "{{replica}} {{kind}}"),)),
        PanelSpec("Step budget trims and cut steps", "Lower-class prefill chunks cut or decodes "
                  "deferred per second to keep steps under the premium step target, and steps "
                  "cut short for a premium arrival.", "short",
                  (Query(rate_sum("kvharbor_step_budget_trims", "replica", R),
                         "{{replica}} trims"),
                   Query(rate_sum("kvharbor_steps_interrupted", "replica", R),
                         "{{replica}} cut steps")), no_value="0"),
        PanelSpec("Speculative decoding acceptance", "Share of verified draft tokens that were "
                  "accepted (each accepted draft is a token without a step of its own), per "
                  "replica; empty without speculative_config.", "percentunit",
                  (Query(ratio(rate_sum("kvharbor_spec_decode_tokens", "replica", R[:-1] + ',kind="accepted"}'),
                               rate_sum("kvharbor_spec_decode_tokens", "replica", R[:-1] + ',kind="draft"}')),
                         "{{replica}}"),)),
        PanelSpec("KV utilisation", "Used blocks / all blocks, per replica.", "percentunit", (
            Query(f'sum by (replica) ({blocks}{R[:-1]},state="used"}}) / '
                  f"sum by (replica) ({blocks}{R})", "{{replica}}"),)),
        hit_rate_panel("Prefix hit rate by tenant", "tenant", TQ),
        PanelSpec("Evictions", "Cached blocks evicted per second.", "short",
                  (Query(rate_sum("kvharbor_kv_evictions", "replica", R),
                         "{{replica}}"),), no_value="0"),
        PanelSpec("Prefix waits", "Steps per second a waiting request sat out while a request "
                  "ahead computed its prompt's next blocks (a burst of one prefix computes it "
                  "once; the others take it as a hit the step after).", "short",
                  (Query(rate_sum("kvharbor_prefix_waits", "replica", R),
                         "{{replica}}"),), no_value="0"),
        PanelSpec("Preemptions by QoS", "Requests preempted per second (recomputed later).",
                  "short", (Query(rate_sum("kvharbor_preemptions", "qos", RQ),
                                  "{{qos}}"),), no_value="0"),
        PanelSpec("KV occupancy by tenant", "Blocks held by each tenant's requests.", "short",
                  (Query(f"sum by (tenant) ({series('kvharbor_kv_tenant_blocks')}{T})",
                         "{{tenant}}"),), stacked=True),
        PanelSpec("Memory by location and kind", "Bytes per replica: KV cache and weights on "
                  "the device, the host KV tier in host memory.", "bytes",
                  (Query(f"sum by (replica, location, kind) ({series('kvharbor_memory_bytes')}{R})",
                         "{{replica}} {{location}}/{{kind}}"),), stacked=True),
    )
    return DashboardSpec("kvharbor-kv-cache", "kvharbor / KV cache",
                         "Paged KV cache: pinned and shared regions, prefix hits, pressure.",
                         (("KV cache", panels), ("Sessions", _session_panels())))


def _session_panels() -> tuple:
    """The Sessions row: sessions held, their blocks by tenant, expirations, session hits."""
    rt = _sel('replica=~"$replica"', 'tenant=~"$tenant"')
    return (
        PanelSpec("Active sessions", "Sessions whose KV blocks a replica holds between turns.",
                  "short", (Query(f"sum by (replica) ({series('kvharbor_sessions')}{R})",
                                  "{{replica}}"),)),
        PanelSpec("Session-held blocks by tenant", "KV block references held by each tenant's "
                  "sessions (the per-tenant cap is session_max_blocks).", "short",
                  (Query(f"sum by (tenant) ({series('kvharbor_session_blocks')}{rt})",
                         "{{tenant}}"),), stacked=True),
        PanelSpec("Session expirations", "Idle sessions released per second (session_ttl_s).",
                  "short", (Query(rate_sum("kvharbor_session_expirations", "replica", R),
                                  "{{replica}}"),), no_value="0"),
        PanelSpec("Session hit tokens", "Prompt tokens per second that later turns of sessions "
                  "found in the cache.", "short",
                  (Query(rate_sum("kvharbor_session_hit_tokens", "replica", R),
                         "{{replica}}"),), no_value="0"),
    )


def _routing() -> DashboardSpec:
    predicted = "kvharbor_router_predicted_prefix_tokens"
    observed = "kvharbor_router_observed_prefix_tokens"
    panels = (
        PanelSpec("Router decision time", "Time in choose_replicas per request.", "s", (
            Query(quantile(0.5, "kvharbor_router_decision_seconds", ""), "p50"),
            Query(quantile(0.99, "kvharbor_router_decision_seconds", ""), "p99"))),
        PanelSpec("Routing decisions", "choose_replicas calls per second.", "ops", (
            Query(f"sum(rate({series('kvharbor_router_decision_seconds', '_count')}[{RATE}]))",
                  "decisions"),)),
        PanelSpec("Predicted vs observed prefix-hit tokens", "Router's prediction for the "
                  "chosen replica vs what the engine found cached.", "short", (
                      Query(f"sum(rate({series(predicted)}{R}[{RATE}]))", "predicted"),
                      Query(f"sum(rate({series(observed)}{R}[{RATE}]))", "observed"))),
        PanelSpec("Prediction accuracy by replica", "Observed / predicted prefix-hit tokens.",
                  "percentunit", (Query(ratio(rate_sum(observed, "replica", R),
                                              rate_sum(predicted, "replica", R)),
                                        "{{replica}}"),)),
        PanelSpec("Routing mode", "Decisions per second by how the router decided "
                  "(kv_index | approx | pow2) and why it did not use its index.", "ops",
                  (Query(rate_sum("kvharbor_router_decisions", "kind, reason"),
                         "{{kind}} {{reason}}"),), stacked=True),
        PanelSpec("Affinity decisions", "Decisions per second whose first choice was the "
                  "replica holding the request's session or the home of its prompt_cache_key.", "ops",
                  (Query(rate_sum("kvharbor_router_affinity", "kind"), "{{kind}}"),), stacked=True),
        PanelSpec("Router index lag", "Seconds since each router's index caught up with the "
                  "directory log (worst router).", "s",
                  (Query(f"max({series('kvharbor_router_index_lag_seconds')})", "lag"),)),
        PanelSpec("Directory resyncs", "Full-state resyncs per second: replica snapshots, "
                  "router snapshots, replay mismatches.", "ops",
                  (Query(rate_sum("kvharbor_directory_resyncs", "kind"), "{{kind}}"),)),
        PanelSpec("Queue length by QoS", "Waiting requests per replica and class.", "short",
                  (Query(f"sum by (replica, qos) ({series('kvharbor_queue_length')}{RQ})",
                         "{{replica}} {{qos}}"),), stacked=True),
        PanelSpec("Running requests by QoS", "Scheduled requests per replica and class.",
                  "short", (Query(f"sum by (replica, qos) "
                                  f"({series('kvharbor_running_requests')}{RQ})",
                                  "{{replica}} {{qos}}"),), stacked=True),
        PanelSpec("Requests by LoRA adapter", "Running and waiting requests of each LoRA "
                  "adapter, over all replicas (base-model requests are not listed).", "short",
                  (Query(f"sum by (adapter, state) ({series('kvharbor_lora_requests')}{R})",
                         "{{adapter}} {{state}}"),), stacked=True),
        PanelSpec("Open direct streams", "Pinned classes' requests streaming from a gateway "
                  "over TCP, per replica: Serve's ongoing-request count leaves them out, "
                  "kvharbor's autoscaling policy adds them (build_app autoscaling).", "short",
                  (Query(f"sum by (replica) ({series('kvharbor_direct_streams')}{R})",
                         "{{replica}}"),), stacked=True),
    )
    return DashboardSpec("kvharbor-routing", "kvharbor / Routing",
                         "KV-aware routing: decision cost, prefix-hit prediction, queues.",
                         (("Routing", panels),))


def _tenants() -> DashboardSpec:
    panels = (
        PanelSpec("Requests by tenant and status", "Finished requests per second.", "reqps",
                  (Query(rate_sum("kvharbor_requests", "tenant, status", TQ),
                         "{{tenant}} {{status}}"),)),
        PanelSpec("Tokens by tenant", "Prompt and generated tokens per second.", "short", (
            Query(rate_sum("kvharbor_prompt_tokens", "tenant", TQ), "{{tenant}} prompt"),
            Query(rate_sum("kvharbor_generated_tokens", "tenant", TQ),
                  "{{tenant}} generated"))),
        hit_rate_panel("Prefix hit rate", "tenant", TQ),
        PanelSpec("Rate-limited requests", "Requests refused by admission, by limit.", "reqps",
                  (Query(rate_sum("kvharbor_rate_limited", "tenant, reason", T),
                         "{{tenant}} {{reason}}"),), no_value="0"),
        PanelSpec("Overload guard", "Event-loop lag (median over 0.25 s) of each gateway and "
                  "of Serve's HTTP proxy, their limits on non-pinned requests in flight "
                  "(-1: none) and the non-pinned requests in flight they compare with it; while "
                  "the lag exceeds overload_lag_ms the limit falls and the lowest classes get "
                  "429 overloaded (see Rate-limited requests).", "short", (
                      Query(f"max({series('kvharbor_gateway_loop_lag_seconds')}) * 1000",
                            "loop lag ms (worst gateway)"),
                      Query(f"min({series('kvharbor_overload_limit')})",
                            "limit (tightest gateway)"),
                      Query(f"max({series('kvharbor_overload_in_flight')})",
                            "in flight (busiest gateway)"),
                      Query(f"max({series('kvharbor_proxy_loop_lag_seconds')}) * 1000",
                            "loop lag ms (proxy)"),
                      Query(f"min({series('kvharbor_proxy_overload_limit')})",
                            "limit (proxy)"),
                      Query(f"max({series('kvharbor_proxy_overload_in_flight')})",
                            "in flight (busiest proxy)"))),
        PanelSpec("Admissions by path", "Requests admitted from the gateway's grant (fast_lane, "
                  "premium classes, no actor call) or by the admission actor.", "reqps",
                  (Query(rate_sum("kvharbor_admissions", "tenant, path", TQ),
                         "{{tenant}} {{path}}"),)),
        latency_panel("Time to first token by tenant", "kvharbor_ttft_seconds", "tenant", TQ,
                      "Arrival at the gateway to first streamed token."),
        PanelSpec("KV blocks held", "Blocks held by the tenant's requests, all replicas.",
                  "short", (Query(f"sum by (tenant) "
                                  f"({series('kvharbor_kv_tenant_blocks')}{T})",
                                  "{{tenant}}"),)),
    )
    return DashboardSpec("kvharbor-tenants", "kvharbor / Tenants",
                         "Per-tenant usage and experience; pick tenants above.",
                         (("Tenants", panels), ("Batch API", _batch_panels())))


def _batch_panels() -> tuple:
    """The Batch API row: batches running, batches ended by status, their lines by outcome."""
    batches = series("kvharbor_batches")
    created = f"sum by (tenant) ({batches}{T[:-1]},status=\"created\"}})"
    ended = f"sum by (tenant) ({batches}{T[:-1]},status!=\"created\"}})"
    return (
        PanelSpec("Batches running", "Batches created and not yet ended, per tenant, as "
                  "the gateway replicas running them count them (a batch runs in the replica "
                  "that created it; one that stops fails its batches).", "short",
                  (Query(f"{created} - ({ended} or 0 * {created})", "{{tenant}}"),),
                  no_value="0"),
        PanelSpec("Batches ended by status", "Batches per second that ended completed, "
                  "failed, expired or cancelled.", "ops",
                  (Query(rate_sum("kvharbor_batches", "tenant, status",
                                  T[:-1] + ',status!="created"}'),
                         "{{tenant}} {{status}}"),), no_value="0"),
        PanelSpec("Batch requests by outcome", "Lines of batches finished per second: answered "
                  "2xx (completed), answered otherwise (failed, in the error file) or never run "
                  "before the batch's window ended (expired). They are also counted with the "
                  "tenant's requests above: a line is one request to the gateway.", "reqps",
                  (Query(rate_sum("kvharbor_batch_requests", "tenant, outcome", T),
                         "{{tenant}} {{outcome}}"),), stacked=True, no_value="0"),
    )


DASHBOARDS: tuple[DashboardSpec, ...] = (_overview(), _kv_cache(), _routing(), _tenants())
