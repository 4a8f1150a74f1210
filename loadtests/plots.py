"""PNG plots of a load test over time, from its records.

Time is bucketed by request *end* into ``bucket_s``-second windows from the first request's
start; a point is drawn only for a bucket that has samples.

  latency_over_time.png   TTFT p50 (dashed) and p90 (solid) per QoS class, log scale, with
                          each class's TTFT SLO as a dotted line; ITL p50 in a second panel
  hit_rate_over_time.png  cached prompt tokens / prompt tokens per tenant, and all together
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from loadtests.summary import percentile

COLORS = {"premium": "tab:red", "standard": "tab:blue", "batch": "tab:green"}


def _buckets(records: list[dict], bucket_s: float, key) -> dict[str, dict[int, list[dict]]]:
    t0 = min(r["start"] for r in records)
    out: dict[str, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        out[key(r)][int((r["end"] - t0) // bucket_s)].append(r)
    return out


def _series(buckets: dict[int, list[dict]], bucket_s: float, value) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for b in sorted(buckets):
        v = value(buckets[b])
        if v is not None:
            xs.append((b + 0.5) * bucket_s)
            ys.append(v)
    return xs, ys


def plot_all(records: list[dict], out_dir: Path, slo_ms: dict[str, float], bucket_s: float | None = None) -> list[Path]:
    """Write both PNGs into ``out_dir``; returns their paths (none when there are no records)."""
    if not records:
        return []
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    bucket_s = bucket_s or max(2.0, round(wall / 30.0))
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return []
    paths = [_latency(plt, ok, out_dir, slo_ms, bucket_s), _hit_rate(plt, ok, out_dir, bucket_s)]
    return paths


def _latency(plt, ok: list[dict], out_dir: Path, slo_ms: dict[str, float], bucket_s: float) -> Path:
    streamed = [r for r in ok if r["ttft_ms"] is not None]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for qos, buckets in sorted(_buckets(streamed, bucket_s, lambda r: r["qos"]).items()) if streamed else []:
        color = COLORS.get(qos)
        for q, style in ((50, "--"), (90, "-")):
            xs, ys = _series(buckets, bucket_s, lambda rs, q=q: percentile([r["ttft_ms"] for r in rs], q))
            ax.plot(xs, ys, style, color=color, marker=".", label=f"{qos} TTFT p{q}")
        if qos in slo_ms:
            ax.axhline(slo_ms[qos], color=color, linestyle=":", linewidth=1, label=f"{qos} SLO")
        xs, ys = _series(buckets, bucket_s,
                         lambda rs: percentile([r["itl_ms"] for r in rs if r["itl_ms"] is not None], 50))
        ax2.plot(xs, ys, "-", color=color, marker=".", label=f"{qos} ITL p50")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"Latency over time by QoS class ({bucket_s:g} s buckets)")
    ax.legend(fontsize=7, ncol=3)
    ax2.set_ylabel("inter-token latency (ms)")
    ax2.set_xlabel("time since start (s)")
    ax2.legend(fontsize=7)
    path = out_dir / "latency_over_time.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _hit_rate(plt, ok: list[dict], out_dir: Path, bucket_s: float) -> Path:
    def rate(rs: list[dict]) -> float | None:
        prompt = sum(r["prompt_tokens"] for r in rs)
        return sum(r["cached_tokens"] for r in rs) / prompt if prompt else None

    fig, ax = plt.subplots(figsize=(9, 4))
    for key, buckets in sorted(_buckets(ok, bucket_s, lambda r: f"{r['tenant']}/{r['qos']}").items()):
        xs, ys = _series(buckets, bucket_s, rate)
        ax.plot(xs, ys, "-", marker=".", color=COLORS.get(key.split("/")[1]), label=key)
    xs, ys = _series(_buckets(ok, bucket_s, lambda r: "all")["all"], bucket_s, rate)
    ax.plot(xs, ys, "k-", linewidth=2, label="all")
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("prefix cache hit rate (tokens)")
    ax.set_xlabel("time since start (s)")
    ax.set_title(f"Prefix cache hit rate over time ({bucket_s:g} s buckets)")
    ax.legend(fontsize=8)
    path = out_dir / "hit_rate_over_time.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
