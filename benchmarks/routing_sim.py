"""Routing simulator: KV-aware vs power-of-two vs round-robin vs an oracle, side by side.

No model and no Ray: simulated replicas with a bounded LRU KV cache emit the same stored /
removed events a real engine would, into the real ``PrefixIndex``; the KV-aware router is
the real ``KVAwarePolicy``. Workload: ``tenants`` tenants, each with a ``prefix_tokens``
system prompt, requests = tenant prefix + a short unique suffix, tenant popularity Zipf.
A replica's cache holds ``1 / capacity_ratio`` of all tenants' prefixes together. Requests
take ``decode_s`` plus their uncached prompt tokens / ``prefill_tokens_per_s``, so in-flight
counts move and cache hits shorten requests.

The oracle knows the popularity of every tenant in advance and bin-packs tenants onto
replicas (a hot tenant split over as many replicas as its load needs, at most ``K``
prefixes per replica so they all fit) and sends each request to the least loaded replica
assigned to its tenant.

Metrics (after a warm-up of ``warmup_frac`` of the requests):
  hit rate        prefix-cached prompt tokens / prompt tokens
  imbalance       max / mean over replicas of the time-averaged in-flight count
  inst. imbalance median over arrivals of max / mean of the instantaneous in-flight count
  decision time   in-process ``PrefixIndex.match`` + candidate build + ``rank`` (µs)

Run:  python benchmarks/routing_sim.py            (about 1-2 minutes on 2 cores)
      python benchmarks/routing_sim.py --quick    (a smoke run)
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvharbor.actors.prefix_directory import PrefixIndex  # noqa: E402
from kvharbor.engine.hashing import hash_prompt_blocks  # noqa: E402
from kvharbor.platform.routing_policy import (Candidate, KVAwarePolicy,  # noqa: E402
                                              PowerOfTwoPolicy, RoundRobinPolicy,
                                              RouteRequest)

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("kv_aware", "pow2", "round_robin", "oracle")


@dataclass(slots=True)
class SimConfig:
    replicas: int
    tenants: int = 150
    prefix_tokens: int = 6000
    block_size: int = 16
    suffix_tokens: tuple[int, int] = (16, 64)
    zipf_s: float = 1.0
    capacity_ratio: float = 6.0          # all prefixes / one replica's KV capacity
    mean_in_flight: float = 12.0         # offered load per replica
    requests_per_replica: int = 160
    decode_s: float = 2.0
    prefill_tokens_per_s: float = 20_000.0
    event_delay_s: float = 0.05          # engine -> directory latency
    warmup_frac: float = 0.25
    seed: int = 0

    @property
    def prefix_blocks(self) -> int:
        return self.prefix_tokens // self.block_size

    @property
    def capacity_blocks(self) -> int:
        return int(self.tenants * self.prefix_blocks / self.capacity_ratio)


@dataclass(slots=True)
class SimRequest:
    arrival: float
    tenant: int
    hashes: list
    prompt_tokens: int


class LRUCache:
    """One replica's KV cache: full-block hashes in LRU order, bounded in blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.blocks = capacity, OrderedDict()

    def admit(self, hashes: list) -> tuple[int, list, list]:
        """Cache the request's blocks. Returns (leading hit blocks, stored, removed)."""
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.blocks:
            hit += 1
        stored = []
        for h in hashes:
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = None
                stored.append(h)
        removed = []
        while len(self.blocks) > self.capacity:
            removed.append(self.blocks.popitem(last=False)[0])
        return hit, stored, removed


def make_workload(cfg: SimConfig) -> tuple[list[SimRequest], list[float]]:
    """Poisson arrivals, Zipf tenants; returns the requests and the tenant probabilities."""
    rng = random.Random(cfg.seed)
    prefixes = [hash_prompt_blocks([7] * cfg.prefix_tokens, cfg.block_size, salt=f"tenant-{t}")
                for t in range(cfg.tenants)]
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.tenants)]
    probs = [w / sum(weights) for w in weights]
    mean_s = cfg.decode_s + 0.3 * cfg.prefix_tokens / cfg.prefill_tokens_per_s
    rate = cfg.replicas * cfg.mean_in_flight / mean_s
    now, out, cum, tenants = 0.0, [], list(accumulate(probs)), range(cfg.tenants)
    for _ in range(cfg.replicas * cfg.requests_per_replica):
        now += rng.expovariate(rate)
        t = rng.choices(tenants, cum_weights=cum)[0]
        suffix = rng.randint(*cfg.suffix_tokens)
        extra = [rng.randbytes(16) for _ in range(suffix // cfg.block_size)]
        out.append(SimRequest(now, t, prefixes[t] + extra, cfg.prefix_tokens + suffix))
    return out, probs


def oracle_assignment(cfg: SimConfig, probs: list[float]) -> list[list[int]]:
    """Tenant -> replicas: load-aware bin packing with at most K prefixes per replica."""
    k_max = max(1, cfg.capacity_blocks // cfg.prefix_blocks - 2)   # room for suffix churn
    pieces = []
    for t, p in enumerate(probs):
        n = max(1, math.ceil(p * cfg.replicas))
        pieces += [(p / n, t)] * n
    pieces.sort(reverse=True)
    load, held = [0.0] * cfg.replicas, [set() for _ in range(cfg.replicas)]
    for share, t in pieces:
        ok = [r for r in range(cfg.replicas) if len(held[r]) < k_max and t not in held[r]]
        r = min(ok or range(cfg.replicas), key=lambda i: load[i])
        load[r] += share
        held[r].add(t)
    return [[r for r in range(cfg.replicas) if t in held[r]] for t in range(cfg.tenants)]


class Sim:
    """Runs one policy over one workload; see the module doc for the metrics."""

    def __init__(self, cfg: SimConfig, policy: str, probs: list[float]) -> None:
        self.cfg, self.policy_name = cfg, policy
        self.caches = [LRUCache(cfg.capacity_blocks) for _ in range(cfg.replicas)]
        self.in_flight = [0] * cfg.replicas
        self.ids = [f"replica-{i}" for i in range(cfg.replicas)]
        self.index = PrefixIndex(max_blocks=cfg.capacity_blocks * cfg.replicas)
        self.seq = [0] * cfg.replicas
        rng = random.Random(cfg.seed + 1)
        self.policy = {"kv_aware": KVAwarePolicy(), "pow2": PowerOfTwoPolicy(rng),
                       "round_robin": RoundRobinPolicy(), "oracle": None}[policy]
        self.assignment = oracle_assignment(cfg, probs) if policy == "oracle" else None
        self.decision_ns: list[int] = []

    def choose(self, req: SimRequest) -> int:
        if self.assignment is not None:
            return min(self.assignment[req.tenant], key=lambda r: self.in_flight[r])
        t0 = time.perf_counter_ns()
        matches = self.index.match(req.hashes) if self.policy_name == "kv_aware" else {}
        cands = [Candidate(rid, matches.get(rid), {}, self.in_flight[i])
                 for i, rid in enumerate(self.ids)]
        ranked = self.policy.rank(RouteRequest(req.prompt_tokens, self.cfg.block_size), cands)
        self.decision_ns.append(time.perf_counter_ns() - t0)
        return int(ranked[0].replica_id.rsplit("-", 1)[1])

    def run(self, requests: list[SimRequest]) -> dict:
        cfg = self.cfg
        done: list[tuple[float, int]] = []          # (finish time, replica)
        events: list[tuple[float, int, int, list, list]] = []
        warm = int(len(requests) * cfg.warmup_frac)
        area, last = [0.0] * cfg.replicas, [0.0] * cfg.replicas
        hit_tokens = prompt_tokens = 0
        inst = []

        def shift(r: int, now: float, delta: int) -> None:
            area[r] += self.in_flight[r] * (now - last[r])
            last[r] = now
            self.in_flight[r] += delta

        for n, req in enumerate(requests):
            now = req.arrival
            if n == warm:
                area, last = [0.0] * cfg.replicas, [now] * cfg.replicas
                t_warm = now
            while done and done[0][0] <= now:
                t, r = heapq.heappop(done)
                shift(r, t, -1)
            while events and events[0][0] <= now:
                _, r, seq, stored, removed = heapq.heappop(events)
                self.index.apply_events(self.ids[r], seq, stored, removed)
            r = self.choose(req)
            hit, stored, removed = self.caches[r].admit(req.hashes)
            hit_tok = min(hit * cfg.block_size, req.prompt_tokens)
            if self.policy_name == "kv_aware":
                heapq.heappush(events, (now + cfg.event_delay_s, r, self.seq[r], stored, removed))
                self.seq[r] += 1
            if n >= warm:
                hit_tokens += hit_tok
                prompt_tokens += req.prompt_tokens
                mean = sum(self.in_flight) / cfg.replicas
                if mean > 0:
                    inst.append(max(self.in_flight) / mean)
            shift(r, now, +1)
            service = cfg.decode_s + (req.prompt_tokens - hit_tok) / cfg.prefill_tokens_per_s
            heapq.heappush(done, (now + service, r))
        end = requests[-1].arrival
        for r in range(cfg.replicas):
            shift(r, end, 0)
        avg = [a / (end - t_warm) for a in area]
        return self._metrics(hit_tokens, prompt_tokens, avg, inst)

    def _metrics(self, hit_tokens: int, prompt_tokens: int, avg: list[float],
                 inst: list[float]) -> dict:
        out = {"hit_rate": hit_tokens / prompt_tokens,
               "imbalance": max(avg) / statistics.fmean(avg),
               "inst_imbalance_p50": statistics.median(inst),
               "mean_in_flight": statistics.fmean(avg)}
        if self.decision_ns:
            us = sorted(x / 1000 for x in self.decision_ns)
            out["decision_us_p50"] = us[len(us) // 2]
            out["decision_us_p99"] = us[int(len(us) * 0.99)]
        if self.policy_name == "kv_aware":
            out["directory_entries"] = self.index.stats()["num_entries"]
        return out


def run_all(sizes: list[int], **overrides) -> dict:
    """Every policy on the same workload, per cluster size; ``overrides`` set SimConfig."""
    results = {}
    for n in sizes:
        cfg = SimConfig(replicas=n, **overrides)
        requests, probs = make_workload(cfg)
        row = {}
        for name in POLICIES:
            t0 = time.perf_counter()
            row[name] = Sim(cfg, name, probs).run(requests)
            row[name]["sim_seconds"] = time.perf_counter() - t0
        for name in POLICIES:
            row[name]["hit_rate_vs_oracle"] = row[name]["hit_rate"] / row["oracle"]["hit_rate"]
        results[n] = {"config": {**asdict(cfg), "capacity_blocks": cfg.capacity_blocks},
                      "policies": row}
    return results


def print_table(results: dict) -> None:
    head = (f"{'replicas':>8} {'policy':<12} {'hit rate':>8} {'vs oracle':>9} "
            f"{'imbalance':>9} {'inst p50':>8} {'in-flight':>9} {'p50 µs':>8} {'p99 µs':>8}")
    print(head)
    print("-" * len(head))
    for n, res in results.items():
        for name, m in res["policies"].items():
            print(f"{n:>8} {name:<12} {m['hit_rate']:>8.3f} {m['hit_rate_vs_oracle']:>9.3f} "
                  f"{m['imbalance']:>9.3f} {m['inst_imbalance_p50']:>8.3f} "
                  f"{m['mean_in_flight']:>9.1f} {m.get('decision_us_p50', float('nan')):>8.0f} "
                  f"{m.get('decision_us_p99', float('nan')):>8.0f}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.2
    for k, name in enumerate(POLICIES):
        xs = [i + (k - 1.5) * width for i in range(len(sizes))]
        for ax, key in zip(axes, ("hit_rate_vs_oracle", "imbalance")):
            ax.bar(xs, [results[n]["policies"][name][key] for n in sizes], width, label=name)
    for ax, title, goal in zip(axes, ("prefix hit rate / oracle", "imbalance (max/mean in-flight)"),
                               (0.9, 1.2)):
        ax.set_xticks(range(len(sizes)), [f"{n} replicas" for n in sizes])
        ax.axhline(goal, color="k", linestyle="--", linewidth=1)
        ax.set_title(title)
    axes[0].set_ylim(0, 1.3)
    axes[1].set_ylim(0, 1.7)
    axes[0].legend(fontsize=8, ncol=4, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--requests-per-replica", type=int, default=160)
    ap.add_argument("--capacity-ratio", type=float, default=6.0,
                    help="all tenants' prefixes / one replica's KV capacity")
    ap.add_argument("--stress-ratio", type=float, default=20.0,
                    help="also run 16 replicas at this capacity ratio (0: skip)")
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true", help="16 replicas, few requests")
    ap.add_argument("--out", type=Path, default=RESULTS / "routing_sim.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.requests_per_replica, args.stress_ratio = [16], 60, 0
    t0 = time.perf_counter()
    common = {"requests_per_replica": args.requests_per_replica, "zipf_s": args.zipf_s}
    scenarios = {"main": run_all(args.sizes, capacity_ratio=args.capacity_ratio, **common)}
    if args.stress_ratio:
        scenarios["stress"] = run_all([16], capacity_ratio=args.stress_ratio, **common)
    for name, results in scenarios.items():
        ratio = next(iter(results.values()))["config"]["capacity_ratio"]
        print(f"\n[{name}] prefix demand = {ratio:g} x one replica's KV capacity")
        print_table(results)
    print("goal: kv_aware hit rate >= 0.9 x oracle with imbalance (max/mean) <= 1.2")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {name: {str(k): v for k, v in res.items()} for name, res in scenarios.items()}
    args.out.write_text(json.dumps(doc, indent=2))
    plot(scenarios["main"], args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} "
          f"in {time.perf_counter() - t0:.0f} s")

if __name__ == "__main__":
    main()
