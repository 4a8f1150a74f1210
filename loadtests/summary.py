"""Summary of a load test from its records: per tenant and QoS class, plus the whole run.

Definitions (all over the records of one group):
  ttft_ms / itl_ms   p50, p90, p99 over successful *streamed* requests (non-streamed requests
                     have no first-token time); itl is each request's mean gap per token
  e2e_ms             p50, p90, p99 over successful requests
  throughput         successful requests and generated tokens per second of test wall time
  cache_hit_rate     cached prompt tokens / prompt tokens (successful requests)
  slo.attainment     streamed requests that were admitted (not 429) and got a first token
                     within the class's ttft_slo_ms, over all streamed admitted requests
                     (an admitted request that failed counts as a miss)
  failures           ``unexpected`` = error + canary_mismatch; ``rate_limited`` (429) apart
  passed             no unexpected failure and every canary check matched
Percentiles interpolate linearly between order statistics; None when there is no sample.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from loadtests.records import UNEXPECTED


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _pcts(values: list[float]) -> dict:
    r = lambda v: None if v is None else round(v, 2)  # noqa: E731
    return {"p50": r(percentile(values, 50)), "p90": r(percentile(values, 90)),
            "p99": r(percentile(values, 99)), "n": len(values)}


def group_stats(records: list[dict], slo_ms: float | None, wall_s: float) -> dict:
    """Latency, throughput, hit rate, SLO attainment and failures of one group of records."""
    ok = [r for r in records if r["status"] == "ok"]
    streamed_ok = [r for r in ok if r["stream"] and r["ttft_ms"] is not None]
    admitted_streams = [r for r in records if r["stream"] and r["status"] != "rate_limited"]
    prompt = sum(r["prompt_tokens"] for r in ok)
    met = sum(1 for r in streamed_ok if slo_ms is not None and r["ttft_ms"] <= slo_ms)
    return {
        "requests": len(records), "ok": len(ok),
        "rate_limited": sum(r["status"] == "rate_limited" for r in records),
        "dropped": sum(r["status"] == "dropped" for r in records),
        "unexpected_failures": sum(r["status"] in UNEXPECTED for r in records),
        "ttft_ms": _pcts([r["ttft_ms"] for r in streamed_ok]),
        "itl_ms": _pcts([r["itl_ms"] for r in streamed_ok if r["itl_ms"] is not None]),
        "e2e_ms": _pcts([r["e2e_ms"] for r in ok]),
        "throughput": {"requests_per_s": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
                       "output_tokens_per_s": round(sum(r["completion_tokens"] for r in ok) / wall_s, 2)
                       if wall_s > 0 else None},
        "cache_hit_rate": round(sum(r["cached_tokens"] for r in ok) / prompt, 4) if prompt else None,
        "slo": {"ttft_slo_ms": slo_ms, "n": len(admitted_streams),
                "attainment": round(met / len(admitted_streams), 4) if admitted_streams and slo_ms else None},
    }


def summarize(records: list[dict], slo_ms: dict[str, float], meta: dict | None = None) -> dict:
    """The whole summary (see the module docstring); ``meta`` is copied in as is."""
    wall = (max(r["end"] for r in records) - min(r["start"] for r in records)) if records else 0.0
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[f"{r['tenant']}/{r['qos']}"].append(r)
    out_groups = {}
    for key, recs in sorted(groups.items()):
        tenant, qos = key.split("/", 1)
        out_groups[key] = {"tenant": tenant, "qos": qos, **group_stats(recs, slo_ms.get(qos), wall)}
    errors = Counter(r["error"] for r in records if r["status"] in UNEXPECTED)
    checks = [r for r in records if r["canary"] and r["status"] in ("ok", "canary_mismatch")]
    mismatches = [r["error"] for r in checks if r["status"] == "canary_mismatch"]
    unexpected = sum(errors.values())
    return {
        **(meta or {}), "wall_s": round(wall, 2), "groups": out_groups,
        "total": group_stats(records, None, wall),
        "failures": {"unexpected": unexpected, "by_error": dict(errors.most_common(20)),
                     "rate_limited": sum(r["status"] == "rate_limited" for r in records),
                     "dropped": sum(r["status"] == "dropped" for r in records)},
        "canaries": {"checks": len(checks), "matched": len(checks) - len(mismatches),
                     "mismatches": mismatches[:50],
                     "by_name": dict(Counter(r["canary"] for r in checks))},
        "passed": unexpected == 0 and not mismatches,
    }


def markdown(summary: dict) -> str:
    """A human-readable table of the summary."""
    head = ("| tenant/qos | req | ok | 429 | fail | TTFT p50/p90/p99 ms | ITL p50/p99 ms | req/s | tok/s "
            "| hit rate | SLO ms | SLO attained |")
    lines = [head, "|" + "---|" * 12]
    f = lambda v, d=0: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    pct = lambda v: "-" if v is None else f"{100 * v:.1f} %"  # noqa: E731
    for key, g in summary["groups"].items():
        t, i = g["ttft_ms"], g["itl_ms"]
        slo = g["slo"]
        lines.append(f"| {key} | {g['requests']} | {g['ok']} | {g['rate_limited']} | {g['unexpected_failures']} "
                     f"| {f(t['p50'])}/{f(t['p90'])}/{f(t['p99'])} | {f(i['p50'], 1)}/{f(i['p99'], 1)} "
                     f"| {f(g['throughput']['requests_per_s'], 2)} | {f(g['throughput']['output_tokens_per_s'], 1)} "
                     f"| {f(g['cache_hit_rate'], 3)} | {f(slo['ttft_slo_ms'])} "
                     f"| {pct(slo['attainment'])} |")
    c = summary["canaries"]
    lines += ["", f"canaries: {c['matched']}/{c['checks']} matched"
              + "".join(f"\n  MISMATCH {m}" for m in c["mismatches"]),
              f"unexpected failures: {summary['failures']['unexpected']}"
              + "".join(f"\n  {n} x {e}" for e, n in summary["failures"]["by_error"].items()),
              f"rate limited (429, expected under overload): {summary['failures']['rate_limited']}",
              f"result: {'PASSED' if summary['passed'] else 'FAILED'}"]
    return "\n".join(lines)
