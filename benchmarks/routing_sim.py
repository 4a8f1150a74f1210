"""Routing simulator: kvharbor's router vs baselines vs a true upper bound, side by side.

No model and no Ray. Simulated replicas with an LRU KV cache emit the stored / removed
events a real engine would; the events reach a real ``DirectoryShard`` after
``event_delay_s`` and the router's real ``IndexFollower`` at its next poll
(``poll_interval_s``), so the router decides on a lagging index, with the real
``ActiveBlocks`` covering the gap and the real ``KVAwarePolicy`` ranking.

Policies:
  kv_aware      the router above (event-fed local index + active blocks)
  approx        the same policy fed only by its own routing history (SGLang-style, no events)
  pow2          power of two choices on in-flight counts
  round_robin   in turn
  upper_bound   not a router: block hits of one pooled cache with every replica's capacity
                together, managed by Belady's optimal offline replacement. Any routing's
                prefix hits are at most this (the union of the replicas' caches is such a
                pooled cache, and prefix hits are block hits), so ``vs bound`` is a true
                lower bound on how close a policy gets to the best possible.

Workloads (``--workloads``):
  prefix   ``tenants`` tenants with ``prefix_tokens`` system prompts, Zipf popularity,
           each request = a tenant prompt + a short unique suffix
  chat     multi-turn conversations: a tenant system prompt, then turns that resend the
           whole history (each turn adds ``turn_tokens``), Zipf tenants, exponential think time

A request takes ``decode_s`` plus its uncached prompt tokens / ``prefill_tokens_per_s``.
Metrics (hit rate and imbalance after a warm-up of ``warmup_frac`` of the requests; the
bound ratio over all requests, both from cold caches):
  hit rate      prefix-cached prompt tokens / prompt tokens
  vs bound      cached tokens / upper-bound cached tokens
  imbalance     max / mean over replicas of the time-averaged in-flight count

Also measured: directory ingest (block events/s into one shard), follower replay rate, and
bytes per (hash, replica) entry of ``PrefixIndex``.

    python benchmarks/routing_sim.py            (about 5 minutes on 2 cores)
    python benchmarks/routing_sim.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.routing_bound import belady_hit_blocks, index_costs  # noqa: E402
from kvharbor.actors.prefix_directory import DirectoryShard  # noqa: E402
from kvharbor.engine.hashing import hash_prompt_blocks  # noqa: E402
from kvharbor.platform.active_blocks import ActiveBlocks, RoutingHistory, with_active  # noqa: E402
from kvharbor.platform.index_follower import IndexFollower  # noqa: E402
from kvharbor.platform.routing_policy import (Candidate, KVAwarePolicy,  # noqa: E402
                                              PowerOfTwoPolicy, RoundRobinPolicy,
                                              RouteRequest)

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("kv_aware", "approx", "pow2", "round_robin")


@dataclass(slots=True)
class SimConfig:
    replicas: int
    workload: str = "prefix"             # "prefix" | "chat"
    tenants: int = 150
    prefix_tokens: int = 6000
    turn_tokens: int = 160               # chat: user + answer tokens added per turn
    max_turns: int = 4
    think_s: float = 1.0
    block_size: int = 16
    suffix_tokens: tuple[int, int] = (16, 64)
    zipf_s: float = 1.0
    capacity_ratio: float = 6.0          # all prefixes / one replica's KV capacity
    mean_in_flight: float = 12.0         # offered load per replica
    requests_per_replica: int = 40
    decode_s: float = 2.0
    prefill_tokens_per_s: float = 20_000.0
    event_delay_s: float = 0.05          # engine step + publish -> directory
    poll_interval_s: float = 0.02        # router polls the directory log this often
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
    hashes: list
    prompt_tokens: int


class LRUCache:
    """One replica's KV cache: full-block hashes in LRU order, bounded in blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.blocks = capacity, OrderedDict()

    def stats(self) -> dict:
        """What a replica reports to routers about its cache (every block is evictable here:
        the simulation holds no block for a running request)."""
        return {"free_shared_blocks": self.capacity, "shared_blocks": self.capacity,
                "empty_shared_blocks": self.capacity - len(self.blocks)}

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
        stored_set = set(removed)
        return hit, [h for h in stored if h not in stored_set], removed


def _zipf_cum(cfg: SimConfig) -> list[float]:
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.tenants)]
    return list(accumulate(w / sum(weights) for w in weights))


def _rate(cfg: SimConfig, mean_prompt: float) -> float:
    mean_s = cfg.decode_s + 0.3 * mean_prompt / cfg.prefill_tokens_per_s
    return cfg.replicas * cfg.mean_in_flight / mean_s


def make_workload(cfg: SimConfig) -> list[SimRequest]:
    """Requests in arrival order (deterministic per ``cfg.seed``); see the module doc."""
    rng = random.Random(cfg.seed)
    prefixes = [hash_prompt_blocks([7] * cfg.prefix_tokens, cfg.block_size, salt=f"tenant-{t}")
                for t in range(cfg.tenants)]
    cum, n = _zipf_cum(cfg), cfg.replicas * cfg.requests_per_replica
    if cfg.workload == "prefix":
        rate, now, out = _rate(cfg, cfg.prefix_tokens), 0.0, []
        for _ in range(n):
            now += rng.expovariate(rate)
            t = rng.choices(range(cfg.tenants), cum_weights=cum)[0]
            suffix = rng.randint(*cfg.suffix_tokens)
            extra = [rng.randbytes(16) for _ in range(suffix // cfg.block_size)]
            out.append(SimRequest(now, prefixes[t] + extra, cfg.prefix_tokens + suffix))
        return out
    if cfg.workload == "chat":
        return _chat_workload(cfg, rng, prefixes, cum, n)
    raise ValueError(f"unknown workload {cfg.workload!r}; use 'prefix' or 'chat'")


def chat_warmup_s(cfg: SimConfig) -> float:
    """Time for the conversation mix to reach steady state (the longest conversation)."""
    return cfg.max_turns * (cfg.decode_s + cfg.think_s)


def _chat_workload(cfg, rng, prefixes, cum, n) -> list[SimRequest]:
    """Conversations start as a Poisson process over ``warm-up + n / rate`` seconds; turns
    after that window are cut (so the measured window is in steady state)."""
    mean_turns = (1 + cfg.max_turns) / 2
    rate = _rate(cfg, cfg.prefix_tokens + cfg.turn_tokens * mean_turns)
    end = chat_warmup_s(cfg) + n / rate
    out, start = [], 0.0
    while start < end:
        start += rng.expovariate(rate / mean_turns)
        t = rng.choices(range(cfg.tenants), cum_weights=cum)[0]
        turns = rng.randint(1, cfg.max_turns)
        history = [rng.randbytes(16) for _ in range(turns * cfg.turn_tokens // cfg.block_size)]
        at = start
        for k in range(1, turns + 1):
            if at > end:
                break
            blocks = k * cfg.turn_tokens // cfg.block_size
            out.append(SimRequest(at, prefixes[t] + history[:blocks],
                                  cfg.prefix_tokens + k * cfg.turn_tokens))
            at += cfg.decode_s + rng.expovariate(1 / cfg.think_s)
    out.sort(key=lambda r: r.arrival)
    return out


class KVRouterSim:
    """KVAwareRouter's decision path without Serve: follower index + active blocks + policy."""

    def __init__(self, cfg: SimConfig, ids: list[str], clock) -> None:
        self.cfg, self.ids = cfg, ids
        self.shard = DirectoryShard(max_blocks=cfg.capacity_blocks * cfg.replicas * 2)
        self.active = ActiveBlocks(ttl_s=5.0, clock=clock)
        self.follower = IndexFollower([None], max_blocks=cfg.capacity_blocks * cfg.replicas * 2,
                                      on_stored=self.active.confirm, clock=clock)
        self.policy = KVAwarePolicy()
        self.loop = asyncio.new_event_loop()
        self.next_poll = 0.0

    def poll(self, now: float) -> None:
        if now < self.next_poll:
            return
        st = self.follower.state[0]
        reply = self.shard.poll(st.epoch, st.cursor, 1 << 20)
        self.loop.run_until_complete(self.follower.apply(0, reply))
        self.next_poll = now + self.cfg.poll_interval_s

    def choose(self, req: SimRequest, in_flight: list[int], stats: list[dict]) -> int:
        matches = self.follower.index.match(req.hashes)
        cands = [Candidate(rid, with_active(matches.get(rid), self.active, rid, req.hashes), stats[i],
                           in_flight[i], self.active.count(rid))
                 for i, rid in enumerate(self.ids)]
        ranked = self.policy.rank(RouteRequest(req.prompt_tokens, self.cfg.block_size), cands)
        top = ranked[0]
        self.active.add(top.replica_id, req.hashes[top.predicted_cached_tokens // self.cfg.block_size:])
        return int(top.replica_id.rsplit("-", 1)[1])


class HistoryRouterSim:
    """The same policy fed only by this router's routing history (approximate mode)."""

    def __init__(self, cfg: SimConfig, ids: list[str]) -> None:
        self.cfg, self.ids = cfg, ids
        self.history = RoutingHistory(cfg.capacity_blocks * cfg.replicas)
        self.policy = KVAwarePolicy()

    def choose(self, req: SimRequest, in_flight: list[int], stats: list[dict]) -> int:
        matches = self.history.index.match(req.hashes)
        cands = [Candidate(rid, matches.get(rid), stats[i], in_flight[i]) for i, rid in enumerate(self.ids)]
        ranked = self.policy.rank(RouteRequest(req.prompt_tokens, self.cfg.block_size), cands)
        self.history.record(ranked[0].replica_id, req.hashes)
        return int(ranked[0].replica_id.rsplit("-", 1)[1])


class LoadOnlySim:
    def __init__(self, cfg: SimConfig, ids: list[str], policy) -> None:
        self.cfg, self.ids, self.policy = cfg, ids, policy

    def choose(self, req: SimRequest, in_flight: list[int], stats: list[dict]) -> int:
        cands = [Candidate(rid, None, {}, in_flight[i]) for i, rid in enumerate(self.ids)]
        ranked = self.policy.rank(RouteRequest(req.prompt_tokens, self.cfg.block_size), cands)
        return int(ranked[0].replica_id.rsplit("-", 1)[1])


class Sim:
    """Runs one policy over one workload; see the module doc for the metrics."""

    def __init__(self, cfg: SimConfig, policy: str) -> None:
        self.cfg, self.policy_name, self.now = cfg, policy, 0.0
        self.caches = [LRUCache(cfg.capacity_blocks) for _ in range(cfg.replicas)]
        self.in_flight = [0] * cfg.replicas
        self.ids = [f"replica-{i}" for i in range(cfg.replicas)]
        self.seq = [0] * cfg.replicas
        rng = random.Random(cfg.seed + 1)
        self.router = {"kv_aware": lambda: KVRouterSim(cfg, self.ids, lambda: self.now),
                       "approx": lambda: HistoryRouterSim(cfg, self.ids),
                       "pow2": lambda: LoadOnlySim(cfg, self.ids, PowerOfTwoPolicy(rng)),
                       "round_robin": lambda: LoadOnlySim(cfg, self.ids, RoundRobinPolicy()),
                       }[policy]()
        self.decision_ns: list[int] = []

    def run(self, requests: list[SimRequest]) -> dict:
        cfg, kv = self.cfg, isinstance(self.router, KVRouterSim)
        done: list[tuple[float, int]] = []
        events: list = []
        warm = int(len(requests) * cfg.warmup_frac)
        if cfg.workload == "chat":
            warm = next(i for i, r in enumerate(requests) if r.arrival >= chat_warmup_s(cfg))
        area, last, t_warm = [0.0] * cfg.replicas, [0.0] * cfg.replicas, 0.0
        hits = prompts = hits_all = 0

        def shift(r: int, t: float, delta: int) -> None:
            area[r] += self.in_flight[r] * (t - last[r])
            last[r] = t
            self.in_flight[r] += delta

        for n, req in enumerate(requests):
            self.now = now = req.arrival
            if n == warm:
                area, last, t_warm = [0.0] * cfg.replicas, [now] * cfg.replicas, now
            while done and done[0][0] <= now:
                t, r = heapq.heappop(done)
                shift(r, t, -1)
            if kv:
                while events and events[0][0] <= now:
                    _, r, seq, stored, removed = heapq.heappop(events)
                    self.router.shard.apply_events(self.ids[r], seq, stored, removed)
                self.router.poll(now)
            stats = [c.stats() for c in self.caches]
            t0 = time.perf_counter_ns()
            r = self.router.choose(req, self.in_flight, stats)
            self.decision_ns.append(time.perf_counter_ns() - t0)
            hit, stored, removed = self.caches[r].admit(req.hashes)
            hit_tok = min(hit * cfg.block_size, req.prompt_tokens)
            if kv:
                heapq.heappush(events, (now + cfg.event_delay_s, r, self.seq[r], stored, removed))
                self.seq[r] += 1
            hits_all += hit_tok
            if n >= warm:
                hits += hit_tok
                prompts += req.prompt_tokens
            shift(r, now, +1)
            heapq.heappush(done, (now + cfg.decode_s + (req.prompt_tokens - hit_tok)
                                  / cfg.prefill_tokens_per_s, r))
        end = requests[-1].arrival
        for r in range(cfg.replicas):
            shift(r, end, 0)
        avg = [a / (end - t_warm) for a in area]
        us = sorted(x / 1000 for x in self.decision_ns)
        return {"hit_rate": hits / prompts, "hit_tokens_all": hits_all,
                "imbalance": max(avg) / statistics.fmean(avg),
                "mean_in_flight": statistics.fmean(avg),
                "decision_us_p50": us[len(us) // 2], "decision_us_p99": us[int(len(us) * 0.99)]}


def run_one(cfg: SimConfig, policies=POLICIES) -> dict:
    """Every policy and the upper bound on one workload."""
    requests = make_workload(cfg)
    bound_blocks = belady_hit_blocks([r.hashes for r in requests],
                                     cfg.capacity_blocks * cfg.replicas)
    bound = sum(min(b * cfg.block_size, r.prompt_tokens) for b, r in zip(bound_blocks, requests))
    row = {}
    for name in policies:
        t0 = time.perf_counter()
        m = Sim(cfg, name).run(requests)
        m["vs_bound"] = m["hit_tokens_all"] / bound
        m["sim_seconds"] = time.perf_counter() - t0
        row[name] = m
    total = sum(r.prompt_tokens for r in requests)
    return {"config": {**asdict(cfg), "capacity_blocks": cfg.capacity_blocks},
            "upper_bound_hit_rate_all": bound / total, "policies": row}


CHAT = {"tenants": 60, "prefix_tokens": 1504, "capacity_ratio": 3.0, "mean_in_flight": 8.0,
        "decode_s": 1.0, "think_s": 1.0, "max_turns": 4}
SCENARIOS = {
    # name: (SimConfig overrides); "tuned" is the workload the policy defaults were tuned on
    "prefix-s0 (tuned)": {"workload": "prefix", "seed": 0},
    "prefix-s1": {"workload": "prefix", "seed": 1},
    "prefix-s2-zipf0.8": {"workload": "prefix", "seed": 2, "zipf_s": 0.8},
    "chat-s3": {"workload": "chat", "seed": 3, **CHAT},
    "chat-s4-ratio6": {"workload": "chat", "seed": 4, **{**CHAT, "capacity_ratio": 6.0}},
}


def print_table(results: dict) -> None:
    head = (f"{'scenario':<20} {'replicas':>8} {'policy':<12} {'hit rate':>8} {'vs bound':>8} "
            f"{'imbalance':>9} {'in-flight':>9} {'p50 µs':>8} {'p99 µs':>8}")
    print(head)
    print("-" * len(head))
    for key, res in results.items():
        name, n = key.rsplit("@", 1)
        for pol, m in res["policies"].items():
            print(f"{name:<20} {n:>8} {pol:<12} {m['hit_rate']:>8.3f} {m['vs_bound']:>8.3f} "
                  f"{m['imbalance']:>9.3f} {m['mean_in_flight']:>9.1f} "
                  f"{m['decision_us_p50']:>8.0f} {m['decision_us_p99']:>8.0f}")
        print(f"{name:<20} {n:>8} {'upper_bound':<12} "
              f"{res['upper_bound_hit_rate_all']:>8.3f} {'1.000':>8}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    width = 0.8 / len(POLICIES)
    for k, name in enumerate(POLICIES):
        xs = [i + (k - len(POLICIES) / 2 + 0.5) * width for i in range(len(keys))]
        for ax, key in zip(axes, ("vs_bound", "imbalance")):
            ax.bar(xs, [results[s]["policies"][name][key] for s in keys], width, label=name)
    for ax, title, goal in zip(axes, ("cached tokens / upper bound", "imbalance (max/mean in-flight)"),
                               (0.9, 1.2)):
        ax.set_xticks(range(len(keys)), [k.replace(" (tuned)", "*").replace("@", "\n") for k in keys],
                      fontsize=7)
        ax.axhline(goal, color="k", linestyle="--", linewidth=1)
        ax.set_title(title)
    axes[0].set_ylim(0, 1.1)
    axes[0].legend(fontsize=8, ncol=4, loc="lower center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256],
                    help="cluster sizes for the tuned scenario; the others run at the largest")
    ap.add_argument("--requests-per-replica", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="16 replicas, few requests")
    ap.add_argument("--out", type=Path, default=RESULTS / "routing_sim.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.requests_per_replica = [16], 30
    t0 = time.perf_counter()
    results = {}
    for i, (name, over) in enumerate(SCENARIOS.items()):
        for n in (args.sizes if i == 0 else args.sizes[-1:]):
            cfg = SimConfig(replicas=n, requests_per_replica=args.requests_per_replica, **over)
            results[f"{name}@{n}"] = run_one(cfg)
            print(f"  {name} @ {n} replicas done ({time.perf_counter() - t0:.0f} s)", flush=True)
    print_table(results)
    costs = index_costs(replicas=args.sizes[-1])
    print(f"\nindex @ {args.sizes[-1]} replicas: ingest {costs['ingest_block_events_per_s']:,.0f} "
          f"block events/s per shard, follower replay {costs['replay_block_events_per_s']:,.0f}/s, "
          f"match p50 {costs['match_us_p50']:.0f} µs, "
          f"{costs['bytes_per_entry']:.0f} bytes per (hash, replica) entry")
    big = [v for k, v in results.items() if k.endswith(f"@{args.sizes[-1]}")]
    goals = {"min_vs_bound_at_largest": min(r["policies"]["kv_aware"]["vs_bound"] for r in big),
             "max_imbalance_at_largest": max(r["policies"]["kv_aware"]["imbalance"] for r in big),
             "ingest_block_events_per_s": costs["ingest_block_events_per_s"]}
    goals["met"] = {"vs_bound_ge_0.9": goals["min_vs_bound_at_largest"] >= 0.9,
                    "imbalance_le_1.2": goals["max_imbalance_at_largest"] <= 1.2,
                    "ingest_ge_100k": goals["ingest_block_events_per_s"] >= 100_000}
    print("goals:", goals)
    import os

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"scenarios": results, "index_costs": costs, "goals": goals,
                                    "load_avg_at_end": os.getloadavg()}, indent=2))
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
