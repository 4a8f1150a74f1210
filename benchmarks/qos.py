"""QoS benchmark: premium TTFT at 2x capacity, priority scheduling vs FCFS, side by side.

One run starts its own Ray (loopback) and Serve on 127.0.0.1:18500, deploys the kvharbor app
once per scheduling mode, side by side (``/priority`` and ``/fcfs``; 2 CPU replicas each,
tiny-llama, platform defaults otherwise), and measures with its own asyncio + httpx client:

  idle       premium requests alone: the premium arrival stream of the overload phase
             (Poisson, 20 % of 2x capacity) with no other traffic
  overload   open-loop Poisson arrivals at ``load`` x capacity, 20 % premium (acme: pinned
             system prompt + question, 16 tokens), 40 % standard (globex: ~750-token
             document question, 24 tokens), 40 % batch (initech: document summary, 32 tokens)

Phases run in ABBA order (priority, fcfs, fcfs, priority; idle phases first, then overload)
with identical arrivals and prompts per pass in both modes, so a drift of the shared
machine's load hits both modes alike. Only one mode receives traffic at a time.

Capacity (requests/s) is measured once, on the first mode's deployment after a warm-up: a
burst of ``--burst`` (96) requests of the same mix sent at once, and the completion rate
between its first and third quartile of completions (``steady_rate``: the burst's first and
last completions are not at full pipeline; a 24-request burst divided by its last completion
measured 19.4 req/s where 48 req/s was served); ``--rate`` skips that and uses a given rate. ``overload.offered_tokens_per_s``
versus ``throughput_tokens_per_s`` shows whether the system really was saturated.

Every request is streamed with ``temperature 0, ignore_eos``; TTFT is from sending the
request to the first token chunk, measured at the client. Throughput is generated tokens
delivered inside the overload window, per second (each chunk carries the usage so far:
``continuous_usage_stats``; a batch-class chunk holds up to 16 tokens, its ``stream_interval``). A premium
request that has no first token ``grace_s`` after the window ends is cancelled and counted
with TTFT = time waited so far (a lower bound; "censored" in the output).

Goals: premium p99 TTFT (overload, priority) <= 1.5x premium p99 TTFT (idle, same mode), and
throughput (priority) >= 0.95x throughput (fcfs). They are only evaluated (true/false, else
null with a note) when both modes' overload phases were saturated: delivered tokens/s below
90 % of offered tokens/s. Tenants' rate limits are lifted in a
temporary copy of tenants.yaml so admission control does not shape the offered load.
HTTP enters through ``--ingress`` (default ``proxy``: Serve's Python proxy actor in front of
each mode's gateway; ``direct``: the gateway serves HTTP itself, what ``serve run
kvharbor.app`` runs, for one mode only, since the modes run side by side as apps of their own
and a direct gateway holds the one port; ``haproxy``: HAProxy to the gateway replicas); the
JSON's ``args`` record which. ``--overload-lag-ms`` sets the overload guards of the gateways and of
Serve's proxy (``off``: both off); ``--proxy-guard off`` turns the proxy's alone off. The
client's own event-loop lag is recorded per pass (``client_loop_lag_ms_by_pass``): a TTFT
measured by a client whose loop is late would include that wait. Its garbage collector is off
during each timed phase (``qos_load.client_gc_paused``; ``gc_runs`` and ``gc_ms_max`` in the same
record), and each tenant sends through a connection pool of its own (``qos_load.open_loop``).

Run:  python benchmarks/qos.py            (about 7 minutes on 2 shared cores)
      python benchmarks/qos.py --quick    (shorter phases; numbers are noisier)
Writes benchmarks/results/qos.json and qos.png (qos_step<N>.* with --step-tokens N).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import noise_floor, result_name  # noqa: E402
from benchmarks.qos_load import (MAX_TOKENS, MIX, Outcome, burst_capacity, http_client,  # noqa: E402
                                  make_job, open_loop, poisson_jobs, rounded, run_phase, send)
from loadtests import workload  # noqa: E402
from loadtests.summary import percentile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PORT = 18500
LANE_PORT = 18510                    # + the mode's index: each app's premium lane (--premium-lane)
BASE = f"http://127.0.0.1:{PORT}"
ADMIN_KEY = "kvh-demo-admin"         # tenants.yaml's demo admin key (kept in the lifted copy)


# ---- statistics ----------------------------------------------------------------------------
def _phases(outcomes: list[Outcome]) -> dict[str, float | None]:
    """Median of each phase of the app's TTFT breakdown (queue, tokenize, admit, first_token,
    replica, hops: see ``Generation.timings_ms``) over the requests that reported one."""
    timed = [o.timings for o in outcomes if o.timings]
    keys = sorted({k for t in timed for k in t})
    return {k: rounded(percentile([t[k] for t in timed if k in t], 50)) for k in keys}


APP_PHASES = ("proxy", "parse", "queue", "tokenize", "admit", "first_token")
"""The phases of ``timings_ms`` that follow one another from Serve's proxy to the first token
at the gateway (``replica`` and ``hops`` split ``first_token``)."""


def _tail_phases(outcomes: list[Outcome]) -> dict[str, float | None]:
    """Mean of each phase over the requests whose client TTFT is at or above its p90, plus
    ``outside``: the client's TTFT minus the app's phases (HTTP, the ingress before it
    stamps, the first token's way back)."""
    timed = [o for o in outcomes if o.timings and o.first is not None]
    if not timed:
        return {}
    cut = percentile([o.first - o.sent for o in timed], 90)
    tail = [o for o in timed if o.first - o.sent >= cut]
    keys = sorted({k for o in tail for k in o.timings})
    out = {k: rounded(sum(o.timings.get(k, 0.0) for o in tail) / len(tail)) for k in keys}
    out["outside"] = rounded(sum((o.first - o.sent) * 1000.0 - sum(o.timings.get(k, 0.0) for k in APP_PHASES)
                                 for o in tail) / len(tail))
    out["n"] = len(tail)
    return out


def phase_stats(chunks: list[tuple[list[Outcome], float, float]]) -> dict:
    """Premium TTFT percentiles (ms), throughput, errors, per-class counts over phase chunks.

    Each chunk is (outcomes, window_s, cutoff_s) of one ``open_loop``; throughput counts the
    tokens delivered inside each chunk's window over the sum of the windows.
    """
    outcomes = [o for chunk, _, _ in chunks for o in chunk]
    premium = [o.ttft(cut) for chunk, _, cut in chunks for o in chunk if o.qos == "premium" and o.error is None]
    ttfts = [t * 1000.0 for t, _ in premium]
    censored = sorted(t * 1000.0 for t, c in premium if c)
    p99 = percentile(ttfts, 99)
    total_window = sum(w for _, w, _ in chunks)
    tokens = sum(1 for chunk, w, _ in chunks for o in chunk for t in o.token_times if t <= w)
    offered = sum(MAX_TOKENS[o.qos] for chunk, w, _ in chunks for o in chunk)
    completed = sum(1 for chunk, w, _ in chunks for o in chunk if o.end is not None and o.end <= w)
    per_class = {}
    for qos, _ in MIX:
        mine = [o for o in outcomes if o.qos == qos]
        first = [(o.first - o.sent) * 1000.0 for o in mine if o.first is not None]
        per_class[qos] = {"sent": len(mine), "completed": sum(o.end is not None for o in mine),
                          "http_429": sum(o.error == "HTTP 429" for o in mine),
                          "ttft_p50_ms": rounded(percentile(first, 50)), "ttft_p99_ms": rounded(percentile(first, 99)),
                          "phases_p50_ms": _phases(mine),
                          "phases_slowest_10pct_mean_ms": _tail_phases(mine)}
    return {"premium_ttft_ms": {"p50": rounded(percentile(ttfts, 50)), "p90": rounded(percentile(ttfts, 90)),
                                "p99": rounded(p99), "n": len(ttfts), "censored": len(censored),
                                "p99_is_lower_bound": bool(censored and p99 is not None and p99 >= censored[0])},
            "throughput_tokens_per_s": round(tokens / total_window, 2),
            "offered_tokens_per_s": round(offered / total_window, 2),
            "completed_in_window_per_s": round(completed / total_window, 3),
            "errors": sum(o.error is not None for o in outcomes),
            "error_examples": sorted({o.error for o in outcomes if o.error})[:5],
            "per_class": per_class, "windows_s": [w for _, w, _ in chunks]}


# ---- deployment ----------------------------------------------------------------------------
def lifted_tenants(folder: Path, stream_interval: int | None = None, max_queue: int = 100_000,
                   premium_step_target_ms: float | None = None) -> Path:
    """A copy of tenants.yaml without rate, token or concurrency limits, every class's
    ``max_queue`` set to ``max_queue`` (default: no shedding), every class's
    ``stream_interval`` set to the given one, if any, and premium's ``step_target_ms``, if
    given."""
    data = yaml.safe_load((ROOT / "tenants.yaml").read_text())
    limits = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "daily_token_budget")
    data["defaults"].update({k: 10**9 for k in limits})
    for tenant in data["tenants"].values():
        for k in limits:
            tenant.pop(k, None)
    for spec in data["qos_classes"].values():
        spec["max_queue"] = max_queue
        if stream_interval is not None:
            spec["stream_interval"] = stream_interval
    if premium_step_target_ms is not None:
        data["qos_classes"]["premium"]["step_target_ms"] = premium_step_target_ms
    path = folder / "tenants.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def guard_config(overload_lag_ms: str | None) -> dict:
    """``build_app`` fields for ``--overload-lag-ms``: none (the platform's default), or
    ``overload_lag_ms`` (``off``: the gateway's overload guard is off)."""
    if overload_lag_ms is None:
        return {}
    return {"overload_lag_ms": None if overload_lag_ms == "off" else float(overload_lag_ms)}


def proxy_lag(overload_lag_ms: str | None, proxy_guard: str = "on"):
    """``starting_cluster``'s ``overload_lag_ms`` for Serve's proxy guard: it follows
    ``--overload-lag-ms`` (the platform's default when that is not given) unless
    ``proxy_guard`` is ``off``."""
    if proxy_guard == "off":
        return None
    return "default" if overload_lag_ms is None else guard_config(overload_lag_ms)["overload_lag_ms"]


def deploy(mode: str, tenants: Path, replicas: int, step_tokens: int | None,
           replica_nice: int | None = None, overload_lag_ms: str | None = None,
           premium_port: int | None = None, direct_streams: bool = True,
           main_gateway_nice: int | None = None) -> None:
    from ray import serve  # noqa: PLC0415

    from kvharbor.platform.app import build_app  # noqa: PLC0415

    config = {"replicas": replicas, "tenants": str(tenants),
              "scheduling": "priority" if mode == "priority-nocap" else mode,
              "directory_name": f"qos-bench-directory-{mode}", "direct_streams": direct_streams}
    if mode == "priority-nocap":                  # priority order without the prefill cap
        config["low_priority_prefill_cap"] = None
    if step_tokens:
        config["max_num_batched_tokens"] = step_tokens
    if replica_nice is not None:
        config["cpu_replica_nice"] = replica_nice
    if premium_port is not None:
        config["premium_port"] = premium_port
    if main_gateway_nice is not None:
        config["main_gateway_nice"] = main_gateway_nice
    app = build_app({**config, **guard_config(overload_lag_ms)})
    serve.run(app, name=f"qos-{mode}", route_prefix=f"/{mode}", blocking=False)


async def warm_up(base: str, info, bases: dict[str, str] | None = None, timeout_s: float = 300.0) -> float:
    """Wait until the app answers a premium request (where ``bases`` sends premium), then send
    8 document requests (fills caches). -> seconds."""
    t0 = time.perf_counter()
    probe = make_job("premium", 0.0, random.Random(0), info)
    while True:
        out = Outcome("premium", 0.0)
        async with http_client((bases or {}).get("premium", base)) as client:
            await send(client, probe, time.perf_counter(), out)
        if out.end is not None and out.error is None:
            break
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"the app did not answer in {timeout_s:.0f} s: {out.error}")
        await asyncio.sleep(2.0)
    rng = random.Random(5)
    jobs = [make_job(q, 0.0, rng, info) for q in ("standard", "batch") for _ in range(4)]
    await open_loop(base, jobs, 120.0, 0.0)
    return time.perf_counter() - t0


def replica_stats(mode: str, calls: int = 8) -> dict:
    """Preemptions and prefix hits per replica (best effort: ``stats`` through the router)."""
    from ray import serve  # noqa: PLC0415

    handle = serve.get_deployment_handle("LLMReplica", app_name=f"qos-{mode}")
    seen: dict[str, dict] = {}
    for _ in range(calls):
        try:
            s = handle.stats.remote().result(timeout_s=30)
        except Exception as e:  # noqa: BLE001 - diagnostics only
            return {"error": repr(e)}
        seen[s["replica_id"]] = {k: s.get(k) for k in ("preemptions", "prompt_tokens", "prefix_hit_tokens")}
    return seen


class GuardSampler:
    """Samples the gateway's overload guard (``/admin/tenants/status``) once a second while a
    phase runs, in a thread of its own: loop lag, limit, in flight, requests shed."""

    def __init__(self, base: str, period_s: float = 1.0) -> None:
        import threading  # noqa: PLC0415

        self.base, self.period_s, self.samples = base, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "GuardSampler":
        self._admitted_before = self._admitted()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        time.sleep(0.5)                 # the gateways' next grant sync reports their fast lane
        after = self._admitted()
        self.admissions = {t: {k: n - self._admitted_before.get(t, {}).get(k, 0) for k, n in c.items()}
                           for t, c in after.items()}

    def _admitted(self) -> dict:
        """Per tenant: requests admitted so far, and of them by a gateway's fast lane."""
        try:
            tenants = httpx.get(f"{self.base}/admin/tenants", timeout=10.0,
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["tenants"]
        except (httpx.HTTPError, ValueError, KeyError):
            return {}
        return {t: {"total": v["usage"].get("admitted_total", 0),
                    "fast_lane": v["usage"].get("admitted_fast_lane", 0)} for t, v in tenants.items()}

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        with httpx.Client(base_url=self.base, timeout=5.0, headers=headers) as client:
            while not self._stop.wait(self.period_s):
                try:
                    guard = client.get("/admin/tenants/status").json().get("overload_guard")
                except (httpx.HTTPError, ValueError):
                    continue
                if guard:
                    self.samples.append(guard)

    def summary(self) -> dict:
        """Medians and extremes over the samples (None when the guard was off or unsampled)."""
        on = [g for g in self.samples if g.get("enabled")]
        if not on:
            return {"enabled": False, "samples": len(self.samples)}
        lags = [g["loop_lag_ms"] for g in on]
        limits = [g["limit"] for g in on if g["limit"] is not None]
        return {"enabled": True, "samples": len(on), "loop_lag_ms_p50": rounded(percentile(lags, 50)),
                "loop_lag_ms_max": rounded(max(lags)),
                "limit_min": min(limits) if limits else None,
                "limit_p50": rounded(percentile(limits, 50)) if limits else None,
                "limited_samples": len(limits), "in_flight_p50": rounded(percentile([g["in_flight"] for g in on], 50)),
                "shed_in_phase": on[-1]["shed_total"] - on[0]["shed_total"]}


# ---- orchestration -------------------------------------------------------------------------
def base_url(mode: str) -> str:
    return f"{BASE}/{mode}"


def lane_port(args, mode: str) -> int | None:
    """The premium lane's port of ``mode``'s app (None: ``--premium-lane off``)."""
    return None if args.premium_lane == "off" else LANE_PORT + args.modes.index(mode)


def premium_bases(args, mode: str) -> dict[str, str] | None:
    """Where premium requests go: the premium lane with ``--premium-lane lane``, else the
    main port (None)."""
    if args.premium_lane != "lane":
        return None
    return {"premium": f"http://127.0.0.1:{lane_port(args, mode)}"}


def run_all(args, info, tenants: Path) -> tuple[dict, float, dict]:
    """Deploy every mode side by side, warm up, (measure capacity), then run the phases ABBA.

    Phase order per phase kind: modes, then modes reversed (priority, fcfs, fcfs, priority),
    so a slow drift of the shared machine's load hits both modes alike. Pass ``k`` of a mode
    uses arrival seed ``seed + k``: both modes see the same arrivals.
    -> (stats by mode, offered rate, premium overload points by mode)
    """
    from ray import serve  # noqa: PLC0415

    t0 = time.perf_counter()
    for mode in args.modes:
        deploy(mode, tenants, args.replicas, args.step_tokens, args.replica_nice, args.overload_lag_ms,
               lane_port(args, mode), args.direct_streams == "on", args.main_gateway_nice)
    stats = {m: {"ready_s": round(asyncio.run(warm_up(base_url(m), info, premium_bases(args, m))), 1)}
             for m in args.modes}
    print(f"deployed and warmed up {args.modes} in {time.perf_counter() - t0:.0f} s", flush=True)
    rate = args.rate
    if rate is None:
        capacity, shed = asyncio.run(burst_capacity(base_url(args.modes[0]), args.burst, info))
        stats[args.modes[0]]["capacity_req_per_s"] = round(capacity, 3)
        stats[args.modes[0]]["capacity_burst_429"] = shed
        rate = args.load * capacity
        print(f"capacity {capacity:.2f} req/s ({shed} of the burst shed) -> offered rate "
              f"{rate:.2f} req/s", flush=True)
        time.sleep(3.0)                    # let the burst's stragglers drain
    order = args.modes + args.modes[::-1]
    chunks: dict = {m: {"idle": [], "overload": []} for m in args.modes}
    guards: dict = {m: {"idle": [], "overload": []} for m in args.modes}
    client_lag: dict = {m: {"idle": [], "overload": []} for m in args.modes}
    for phase, window, only in (("idle", args.idle_s, "premium"), ("overload", args.window_s, None)):
        for i, mode in enumerate(order):
            jobs = poisson_jobs(rate, window, args.seed + i // len(args.modes), info, only,
                                args.premium_rate)
            with GuardSampler(base_url(mode)) as sampler:
                outcomes, cutoff, lag = run_phase(base_url(mode), jobs, window, args.grace_s,
                                                  premium_bases(args, mode))
            chunks[mode][phase].append((outcomes, window, cutoff))
            guards[mode][phase].append({**sampler.summary(), "admitted": sampler.admissions})
            client_lag[mode][phase].append(lag)
            print(f"  {phase:8} {mode:8} pass {i // len(args.modes)}: {len(jobs)} requests", flush=True)
            time.sleep(2.0)
    series = {}
    for mode in args.modes:
        stats[mode].update({p: phase_stats(chunks[mode][p]) for p in ("idle", "overload")})
        for p in ("idle", "overload"):
            stats[mode][p]["overload_guard_by_pass"] = guards[mode][p]
            stats[mode][p]["client_loop_lag_ms_by_pass"] = client_lag[mode][p]
        stats[mode]["engine"] = replica_stats(mode)
        series[mode] = [(round(o.sent, 3), round(o.ttft(cut)[0] * 1000.0, 1), o.first is None)
                        for outcomes, _, cut in chunks[mode]["overload"]
                        for o in outcomes if o.qos == "premium" and o.error is None]
        serve.delete(f"qos-{mode}")
    return stats, rate, series


def verdict(modes: dict) -> dict:
    """Ratios and goals (see the module docstring); None where a mode is missing."""
    def p99(mode: str, phase: str) -> float | None:
        return modes.get(mode, {}).get(phase, {}).get("premium_ttft_ms", {}).get("p99")

    out = {}
    for mode in modes:
        idle, over = p99(mode, "idle"), p99(mode, "overload")
        out[f"{mode}_premium_p99_vs_idle"] = round(over / idle, 2) if idle and over else None
    fc = modes.get("fcfs")
    for mode, res in modes.items():
        if mode != "fcfs" and fc and fc["overload"]["throughput_tokens_per_s"]:
            out[f"throughput_{mode}_vs_fcfs"] = round(res["overload"]["throughput_tokens_per_s"]
                                                      / fc["overload"]["throughput_tokens_per_s"], 3)
    for mode, res in modes.items():
        over = res["overload"]
        out[f"{mode}_saturated"] = over["throughput_tokens_per_s"] < 0.9 * over["offered_tokens_per_s"]
    ratio = out.get("priority_premium_p99_vs_idle")
    tp = out.get("throughput_priority_vs_fcfs")
    valid = all(out.get(f"{m}_saturated") for m in modes)
    out["goal_premium_p99_le_1_5x_idle"] = None if ratio is None or not valid else ratio <= 1.5
    out["goal_premium_p99_le_2x_idle"] = None if ratio is None or not valid else ratio <= 2.0
    out["goal_throughput_ge_0_95x_fcfs"] = None if tp is None or not valid else tp >= 0.95
    if not valid:
        out["note"] = ("overload phase not saturated (delivered >= 90 % of offered tokens): capacity was "
                       "underestimated, e.g. the shared machine was busier during the capacity burst; "
                       "goals not evaluated, run again or pass --rate")
    return out


def table(modes: dict, ver: dict, rate: float, premium_rate: float | None = None) -> str:
    rows = [f"offered load {rate:.2f} req/s (20 % premium)" if premium_rate is None else
            f"offered load {rate:.2f} req/s without premium's share, premium {premium_rate:g} req/s",
            f"{'mode':9} {'phase':9} {'prem p50':>9} {'prem p90':>9} {'prem p99':>9} {'n':>4} {'cens':>5} "
            f"{'tok/s':>8} {'offered':>8} {'req/s':>6} {'errors':>6}"]
    for mode, res in modes.items():
        for phase in ("idle", "overload"):
            s = res[phase]
            t = s["premium_ttft_ms"]
            bound = ">=" if t["p99_is_lower_bound"] else ""
            rows.append(f"{mode:9} {phase:9} {t['p50']!s:>9} {t['p90']!s:>9} {bound + str(t['p99']):>9} "
                        f"{t['n']:>4} {t['censored']:>5} {s['throughput_tokens_per_s']:>8} "
                        f"{s['offered_tokens_per_s']:>8} {s['completed_in_window_per_s']:>6} {s['errors']:>6}")
    rows.append("where the TTFT went under overload (p50 per phase, ms, from the app's usage chunk):")
    for mode, res in modes.items():
        for qos, c in res["overload"]["per_class"].items():
            rows.append(f"  {mode:9} {qos:9} " + " ".join(f"{k} {v}" for k, v in c["phases_p50_ms"].items())
                        + f"  (429: {c['http_429']} of {c['sent']})")
            rows.append(f"  {'':9} {'':9} slowest 10 %, mean: "
                        + " ".join(f"{k} {v}" for k, v in c["phases_slowest_10pct_mean_ms"].items()))
    rows.append("the gateway's overload guard under overload, per pass (sampled once a second):")
    for mode, res in modes.items():
        for i, g in enumerate(res["overload"]["overload_guard_by_pass"]):
            rows.append(f"  {mode:9} pass {i}: " + " ".join(f"{k} {v}" for k, v in g.items()))
    rows += [f"{k}: {v}" for k, v in ver.items()]
    return "\n".join(rows)


def plot(modes: dict, series: dict, path: Path) -> None:
    """Premium TTFT by arrival time (overload) per mode, and p99 bars; series: (sent_s, ttft_ms, censored)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    colors = {"priority": "tab:red", "fcfs": "tab:blue", "priority-nocap": "tab:orange"}
    for mode, pts in series.items():
        c = colors.get(mode)
        ax.scatter([p[0] for p in pts if not p[2]], [p[1] for p in pts if not p[2]], s=12, color=c,
                   label=f"{mode}: premium TTFT under overload")
        ax.scatter([p[0] for p in pts if p[2]], [p[1] for p in pts if p[2]], s=20, marker="^", color=c,
                   label=f"{mode}: no token by cutoff (lower bound)")
        idle = modes[mode]["idle"]["premium_ttft_ms"]["p99"]
        if idle:
            ax.axhline(idle * 1.5, color=c, linestyle=":", label=f"{mode}: 1.5x idle p99")
    ax.set_yscale("log")
    ax.set_xlabel("arrival time in overload window (s)")
    ax.set_ylabel("premium TTFT (ms)")
    ax.legend(fontsize=7)
    names = [f"{m}\n{p}" for m in modes for p in ("idle", "overload")]
    vals = [modes[m][p]["premium_ttft_ms"]["p99"] or 0 for m in modes for p in ("idle", "overload")]
    ax2.bar(names, vals, color=[colors.get(m) for m in modes for _ in (0, 1)])
    ax2.set_yscale("log")
    ax2.tick_params(axis="x", labelsize=7, rotation=35)
    ax2.set_ylabel("premium p99 TTFT (ms)")
    ax2.set_title("p99 TTFT: idle vs overload", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="premium TTFT at 2x capacity: priority vs FCFS")
    p.add_argument("--quick", action="store_true", help="shorter phases (noisier)")
    p.add_argument("--rate", type=float, default=None, help="offered req/s (skips the capacity measurement)")
    p.add_argument("--load", type=float, default=2.0, help="offered load as a multiple of capacity")
    p.add_argument("--modes", default="priority,fcfs",
                   help="comma-separated: priority (the default engine, with the lower-class "
                        "prefill cap), priority-nocap (priority order only), fcfs")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--step-tokens", type=int, default=None,
                   help="max_num_batched_tokens per engine step (default: the platform default)")
    p.add_argument("--burst", type=int, default=96, help="requests in the capacity burst")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-queue", type=int, default=100_000,
                   help="every class's max_queue (in flight, all gateways, before 429s); the default "
                        "sheds nothing, so the offered load reaches the replicas")
    p.add_argument("--ingress", choices=("haproxy", "proxy", "direct"), default="proxy",
                   help="HTTP ingress (kvharbor.platform.ingress): Serve's Python proxy (kvharbor's "
                        "default) or HAProxy to the gateway replicas")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="every class's stream_interval (default: tenants.yaml's; 1 streams every token)")
    p.add_argument("--premium-step-target-ms", type=float, default=None,
                   help="premium's step_target_ms (default: tenants.yaml's, half its ttft_slo_ms)")
    p.add_argument("--name", type=result_name, default=None,
                   help="results file stem (default: qos[_step<N>][_nice<N>])")
    p.add_argument("--overload-lag-ms", default=None,
                   help="the gateway's overload_lag_ms (a number, or 'off'; default: the platform's)")
    p.add_argument("--replica-nice", type=int, default=None,
                   help="cpu_replica_nice of the app (default: the platform's, 10)")
    p.add_argument("--main-gateway-nice", type=int, default=None,
                   help="main_gateway_nice of the app (default: the platform's, 19; applies with a "
                        "premium lane only, --premium-lane main|lane)")
    p.add_argument("--proxy-guard", choices=("on", "off"), default="on",
                   help="the overload guard in Serve's proxy (kvharbor.platform.proxy_guard; "
                        "--ingress proxy only): on follows --overload-lag-ms, off turns it off")
    p.add_argument("--premium-rate", type=float, default=None,
                   help="premium requests/s as a Poisson stream of their own (default: 20 %% of "
                        "the offered rate); the other classes keep their share of --rate")
    p.add_argument("--direct-streams", choices=("on", "off"), default="on",
                   help="build_app direct_streams: premium's tokens over a connection of their own "
                        "to the replica (on, the default) or through a Serve handle call (off)")
    p.add_argument("--premium-lane", choices=("off", "main", "lane"), default="off",
                   help="off: no premium lane (the default app); main: deploy the premium lane "
                        "(build_app premium_port) but send premium requests to the main port; "
                        "lane: send them to the lane (kvharbor.platform.premium_lane)")
    args = p.parse_args(argv)
    args.idle_s, args.window_s, args.grace_s = (10, 20, 6) if args.quick else (30, 35, 10)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.ingress == "direct" and len(args.modes) > 1:
        p.error("--ingress direct serves one app (its gateway holds the port) and the modes run "
                "side by side as apps of their own: pass one mode (--modes priority), or "
                "--ingress proxy")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.pop("RAY_ADDRESS", None)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    started = time.time()
    noise = {"before": noise_floor(3.0)}        # the VM's own jitter, beside the ratios
    print(f"noise floor before: {noise['before']}", flush=True)
    info = workload.read_tenants(ROOT / "tenants.yaml")
    from kvharbor.platform.ingress import http_options, starting_cluster  # noqa: PLC0415

    with starting_cluster(args.ingress, proxy_lag(args.overload_lag_ms, args.proxy_guard), port=PORT) as mode:
        if mode != args.ingress:
            raise SystemExit(f"ingress {args.ingress!r} is not available here")
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", namespace="serve", num_cpus=8,
                 log_to_driver=False)
    modes, series, rate = {}, {}, args.rate
    try:
        serve.start(http_options=http_options(mode, PORT))
        with tempfile.TemporaryDirectory() as tmp:
            modes, rate, series = run_all(args, info, lifted_tenants(Path(tmp), args.stream_interval,
                                                                     args.max_queue,
                                                                     args.premium_step_target_ms))
    finally:
        serve.shutdown()
        ray.shutdown()
    noise["after"] = noise_floor(3.0)
    print(f"noise floor after: {noise['after']}", flush=True)
    ver = verdict(modes)
    print(table(modes, ver, rate, args.premium_rate))
    RESULTS.mkdir(exist_ok=True)
    report = {"benchmark": "qos", "args": {k: v for k, v in vars(args).items()}, "offered_req_per_s": round(rate, 3),
              "modes": modes, "verdict": ver, "premium_overload_series": series, "runtime_s": round(time.time() - started, 1),
              "machine": f"{os.cpu_count()} CPUs, shared with other workloads; load average at end "
                         f"{os.getloadavg()[0]:.1f}", "noise_floor": noise}
    stem = "qos" if args.step_tokens is None else f"qos_step{args.step_tokens}"
    if args.replica_nice is not None:
        stem += f"_nice{args.replica_nice}"
    stem = args.name or stem
    (RESULTS / f"{stem}.json").write_text(json.dumps(report, indent=1))
    plot(modes, series, RESULTS / f"{stem}.png")
    print(f"wrote {RESULTS / stem}.json and .png in {report['runtime_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
