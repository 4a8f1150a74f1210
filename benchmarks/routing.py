"""Routing on real replicas, side by side in one run: kvharbor's router vs Ray's prefix router.

    python benchmarks/routing.py [--quick] [--seed N]

The same ``LLMReplica`` deployment (tiny-llama on the CPU, ``--replicas`` replicas, a small
KV cache each) is deployed once per router, fresh (empty caches), and driven with the same
workload from this process through a ``DeploymentHandle``, so every router runs here and
its decision time is measured inside the router process:

  kv            kvharbor ``KVAwareRouter`` (local index fed by KV events)
  ray_prefix    Ray Serve's ``PrefixCacheAffinityRouter`` (``RayPrefixRouter`` only decodes
                the prompt text it reads), default settings
  pow2          Serve's default router (power of two choices)
  round_robin   kvharbor ``RoundRobinRouter``

Workload (needs routing, like llm-d's shared-prefix benchmark): ``--tenants`` tenants, each
with a ``--system-tokens`` system prompt; conversations start as a Poisson process
(open loop, ``--conv-rate`` per second), pick a tenant uniformly (or Zipf-skewed with
``--tenant-zipf``: a few hot tenants, most traffic on their prefixes), and run ``--turns`` turns
that resend the whole history, ``--think-s`` (exponential) apart. One replica's KV cache
holds ``1 / demand_ratio`` of all system prompts together.

Reported per router: prefix hit rate (cached / prompt tokens, as the engine counted them)
and the bound no router can beat on the same requests in the order they were sent (leading
prompt blocks that any earlier prompt held: one unbounded cache shared by all replicas),
TTFT p50/p90/p99 (handle call -> first token) and the TTFT floor no router can beat (each
request computing only what the bound leaves uncached, on an idle replica: ``ttft_floor``,
from cold prompts timed on a one-replica deployment before the routers run; where a tenant's
first requests are over 10 % of all, every router's p90 is a cold system prompt's prefill),
requests/s and output tokens/s, decision time
p50/p99 (inside the router: ``request.metadata["router_decision_ms"]``; Serve's default
router records none). Writes benchmarks/results/routing.json and routing.png.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, bar_panels, machine, pct, result_name, table, write_json  # noqa: E402

MODES = {"kv": "kvharbor KV-aware", "ray_prefix": "Ray PrefixCacheAffinityRouter",
         "pow2": "power of two (Serve default)", "round_robin": "round robin"}
ROUTER_CLASS = {"kv": "kvharbor.platform.router:KVAwareRouter",
                "ray_prefix": "kvharbor.platform.ray_prefix_router:RayPrefixRouter",
                "round_robin": "kvharbor.platform.router:RoundRobinRouter", "pow2": None}
WORDS = ["harbor", "ship", "cargo", "tide", "crane", "dock", "berth", "pilot", "buoy", "quay",
         "hull", "keel", "mast", "sail", "anchor", "chart", "beacon", "ferry", "jetty", "wharf"]


@dataclass(slots=True)
class Conversation:
    start_s: float
    tenant: int
    turns: list[list[dict]]            # message list sent at each turn (history resent)
    think_s: list[float] = field(default_factory=list)


def words(rng: random.Random, n_chars: int) -> str:
    out = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:n_chars]


def workload(args, seed: int) -> list[Conversation]:
    """Conversations with Poisson start times (see module doc); deterministic per seed."""
    rng = random.Random(seed)
    systems = [f"You are the assistant of tenant {t}. " + words(rng, args.system_tokens - 40)
               for t in range(args.tenants)]
    now, convs = 0.0, []
    weights = [1.0 / (k + 1) ** args.tenant_zipf for k in range(args.tenants)]
    for c in range(args.conversations):
        now += rng.expovariate(args.conv_rate)
        t = rng.choices(range(args.tenants), weights)[0] if args.tenant_zipf else rng.randrange(args.tenants)
        history = [{"role": "system", "content": systems[t]}]
        turns = []
        for k in range(args.turns):
            history = history + [{"role": "user", "content": f"question {c}.{k}: "
                                  + words(rng, args.user_tokens)}]
            turns.append(list(history))
            history = history + [{"role": "assistant", "content": words(rng, args.answer_tokens)}]
        convs.append(Conversation(now, t, turns, [rng.expovariate(1 / args.think_s)
                                                  for _ in turns]))
    return convs


MODEL = "kvharbor/tiny-llama"


@functools.cache
def hash_root():
    """The root of the replicas' hash chains (the model identity), as the gateway computes it:
    hashes from another root never match the KV events the router's index is fed with."""
    from kvharbor.engine.hashing import model_root
    from kvharbor.engine.model_identity import model_identity

    return model_root(model_identity(MODEL))


def make_request(tokenizer, messages: list[dict], tenant: int, rid: str, max_tokens: int):
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return request_of(list(ids["input_ids"] if hasattr(ids, "keys") else ids),
                      f"tenant-{tenant}", rid, max_tokens)


def request_of(ids: list[int], tenant: str, rid: str, max_tokens: int):
    """A greedy standard-class request for prompt ``ids``, hashed as the replicas hash."""
    from kvharbor.engine.hashing import hash_prompt_blocks
    from kvharbor.platform.protocol import GenerateRequest

    return GenerateRequest(request_id=rid, tenant=tenant, qos="standard", prompt_token_ids=ids,
                           block_hashes=hash_prompt_blocks(ids, 16, parent=hash_root()),
                           sampling={"max_tokens": max_tokens, "temperature": 0.0,
                                     "ignore_eos": True})


async def drive(handle, convs: list[Conversation], tokenizer, args) -> dict:
    """Run every conversation (open-loop starts); returns raw per-request records."""
    records: list[dict] = []
    router_state: dict = {}
    stream = handle.options(stream=True)     # one handle: its router lives for the whole run
    t0 = time.perf_counter()

    async def one(ci: int, conv: Conversation) -> None:
        await asyncio.sleep(max(0.0, conv.start_s - (time.perf_counter() - t0)))
        for k, messages in enumerate(conv.turns):
            req = make_request(tokenizer, messages, conv.tenant, f"c{ci}-{k}", args.max_tokens)
            sent = time.perf_counter()
            rec = {"prompt": len(req.prompt_token_ids), "cached": 0, "ttft": None, "tokens": 0,
                   "error": None, "sent": sent - t0, "hashes": req.block_hashes}
            try:
                async for event in stream.generate.remote(req):
                    if "error" in event:
                        rec["error"] = event["error"]
                        break
                    if rec["ttft"] is None and event.get("token_ids"):
                        rec["ttft"] = time.perf_counter() - sent
                        rec["cached"] = event.get("num_cached_tokens", 0)
                        rec["replica"] = event.get("replica_id")
                    rec["tokens"] += len(event.get("token_ids", ()))
            except Exception as exc:  # noqa: BLE001 - counted, reported
                rec["error"] = repr(exc)
            rec["done"] = time.perf_counter() - t0
            rec["decision_ms"] = req.metadata.get("router_decision_ms")
            rec["decision_cpu_ms"] = req.metadata.get("router_decision_cpu_ms")
            rec["policy"] = req.metadata.get("router_policy")
            rec["routed_to"] = req.metadata.get("routed_to")
            records.append(rec)
            state = kv_router_state()
            if state["routers"]:
                router_state.update(state)
            await asyncio.sleep(conv.think_s[k])

    await asyncio.gather(*(one(i, c) for i, c in enumerate(convs)))
    return {"records": records, "elapsed": time.perf_counter() - t0,
            "router_index": router_state}


def bound_misses(recs: list[dict], block_size: int = 16) -> list[tuple[int, int]]:
    """(prompt tokens, tokens no router could have had cached) of each request, in send order:
    a request's leading prompt blocks that any earlier-sent request's prompt contained count
    as cached (one cache of unbounded size shared by all replicas; generated tokens are never
    resent here, the history carries the workload's own answer text)."""
    seen: set = set()
    out = []
    for r in sorted(recs, key=lambda r: r["sent"]):
        n = 0
        for h in r["hashes"]:
            if h not in seen:
                break
            n += 1
        out.append((r["prompt"], r["prompt"] - min(n * block_size, r["prompt"])))
        seen.update(r["hashes"])
    return out


def hit_rate_bound(recs: list[dict], block_size: int = 16) -> float:
    """Prefix hit rate no router can beat on these requests in their send order (see
    ``bound_misses``)."""
    return cached_share(bound_misses(recs, block_size))


def cached_share(misses: list[tuple[int, int]]) -> float:
    """The share of prompt tokens cached, from ``bound_misses``' pairs."""
    return sum(p - m for p, m in misses) / max(1, sum(p for p, _ in misses))


def ttft_floor(misses: list[tuple[int, int]], idle: dict[int, float]) -> list[float]:
    """Each request's TTFT had every block the bound allows been cached where it was sent and
    its replica been idle: ``idle`` maps a cold prompt's length to its idle TTFT (``idle_ttft``;
    seconds), and a request computing ``m`` tokens (at least one) is given the idle TTFT of the
    longest measured prompt not longer than ``m``. Computing more tokens never takes less
    time, so this is a floor for every router (the cached context a request attends to only
    adds to it); a length whose timing came out above a longer one's (noise) gets the longer
    one's."""
    xs = sorted(idle)
    low = {x: min(idle[y] for y in xs if y >= x) for x in xs}
    return [low[max((x for x in xs if x <= max(m, 1)), default=xs[0])] for _, m in misses]


IDLE_SIZES = (1, 16, 64, 128, 256, 512, 1024, 1280, 1408, 1536, 1664, 1792, 2048)


async def idle_ttft(handle, sizes=IDLE_SIZES, reps: int = 3) -> dict[int, float]:
    """The fastest of ``reps`` TTFTs of a cold prompt of each length on an idle replica
    (``handle``: a one-replica deployment with nothing else sent to it), one request at a time:
    random token ids, so no prompt shares a block with another."""
    rng, out = random.Random(1234), {}
    for n in sizes:
        best = float("inf")
        for k in range(reps):
            req = request_of([rng.randrange(3, 259) for _ in range(n)], "idle", f"idle-{n}-{k}", 1)
            sent, first = time.perf_counter(), None
            async for event in handle.options(stream=True).generate.remote(req):
                if first is None and event.get("token_ids"):
                    first = time.perf_counter() - sent
            best = min(best, first)
        out[n] = best
    return out


def summarize(mode: str, raw: dict, idle: dict[int, float] | None = None) -> dict:
    """One router's figures; ``idle`` (``idle_ttft``) adds the TTFT floor (``ttft_floor``)."""
    recs = raw["records"]
    ok = [r for r in recs if r["error"] is None and r["ttft"] is not None]
    ttft = [r["ttft"] for r in ok]
    misses = bound_misses(ok)
    floor = ttft_floor(misses, idle) if idle else []
    decision = [r["decision_ms"] for r in recs if r["decision_ms"] is not None]
    cpu = [r["decision_cpu_ms"] for r in recs if r["decision_cpu_ms"] is not None]
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    policies: dict[str, int] = {}
    for r in recs:
        policies[str(r["policy"])] = policies.get(str(r["policy"]), 0) + 1
    return {"router": MODES[mode], "mode": mode, "requests": len(recs),
            "errors": len(recs) - len(ok),
            "hit_rate": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
            "hit_rate_bound": cached_share(misses),
            # requests that must compute 1,024+ tokens whatever the router (a tenant's first)
            "bound_cold_requests": sum(m >= 1024 for _, m in misses),
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "requests_per_s": len(ok) / raw["elapsed"],
            "output_tokens_per_s": sum(r["tokens"] for r in ok) / raw["elapsed"],
            "decision_ms_p50": pct(decision, 50) if decision else None,
            "decision_ms_p99": pct(decision, 99) if decision else None,
            "decisions_measured": len(decision),
            "decision_cpu_ms_p50": pct(cpu, 50) if cpu else None,
            "decision_cpu_ms_p99": pct(cpu, 99) if cpu else None,
            "requests_per_replica": sorted(per_replica.values(), reverse=True),
            "router_policies": policies,
            # KVAwareRouter.on_request_routed names the replica; it must be the one that served
            "routed_to_agrees": sum(r.get("routed_to") == r.get("replica") for r in ok
                                    if r.get("routed_to")),
            **({"ttft_p50_floor_s": pct(floor, 50), "ttft_p90_floor_s": pct(floor, 90)}
               if floor else {})}


_KEEP: list = []            # handles of actors this process created (else Ray collects them)


def deploy(mode: str, args, replicas: int | None = None, name: str | None = None):
    """The LLMReplica deployment under ``mode``'s router (``replicas``: ``--replicas``
    unless given); returns its handle (ready)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvharbor.actors.prefix_directory import get_or_create_directory
    from kvharbor.actors.replica import LLMReplica

    directory = None
    options = {"name": "LLMReplica", "num_replicas": replicas or args.replicas, "max_ongoing_requests": 64,
               "ray_actor_options": {"num_cpus": args.replica_cpus}}
    if mode == "kv":
        directory = f"bench-directory-{os.getpid()}"
        _KEEP.append(get_or_create_directory(directory, namespace="kvharbor"))  # keep it alive
    if ROUTER_CLASS[mode] is not None:
        kwargs = {"directory_name": directory, "directory_namespace": "kvharbor"} \
            if mode == "kv" else {}
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTER_CLASS[mode], request_router_kwargs=kwargs,
            request_routing_stats_period_s=0.5)
    engine = {"model": MODEL, "device": "cpu", "dtype": "float32",
              "num_kv_blocks": args.kv_blocks, "block_size": 16,
              "max_num_batched_tokens": 2048}
    app = serve.deployment(LLMReplica).options(**options).bind(engine, None, directory, 1)
    return serve.run(app, name=name or f"routing-{mode}", route_prefix=None)


async def warm_up(handle, tokenizer, replicas: int) -> None:
    """One short request per replica slot so model loading is not in any timed request."""
    reqs = [make_request(tokenizer, [{"role": "user", "content": f"warm {i}"}], 0, f"w{i}", 2)
            for i in range(2 * replicas)]
    await asyncio.gather(*[_consume(handle, r) for r in reqs])


async def _consume(handle, req) -> None:
    async for _ in handle.options(stream=True).generate.remote(req):
        pass


def measure_idle(args) -> dict[int, float]:
    """``idle_ttft`` on a fresh one-replica deployment (no router of its own), then gone."""
    from ray import serve

    from kvharbor.engine.tokenizer import byte_tokenizer

    handle = deploy("pow2", args, replicas=1, name="routing-idle")
    asyncio.run(warm_up(handle, byte_tokenizer(), 1))
    idle = asyncio.run(idle_ttft(handle))
    serve.delete("routing-idle")
    return idle


def run_mode(mode: str, args, convs, tokenizer, idle: dict[int, float] | None = None) -> dict:
    from ray import serve

    handle = deploy(mode, args)
    asyncio.run(warm_up(handle, tokenizer, args.replicas))
    time.sleep(2.0)                                   # routing stats reach the router
    load_before = os.getloadavg()
    raw = asyncio.run(drive(handle, convs, tokenizer, args))
    row = summarize(mode, raw, idle)
    row["load_avg_before"], row["load_avg_after"] = load_before, os.getloadavg()
    if mode == "kv":
        row["router_index"] = raw["router_index"]
    serve.delete(f"routing-{mode}")
    return row


def kv_router_state() -> dict:
    """Follower counters of the KV-aware routers living in this process."""
    from kvharbor.platform.router import KVAwareRouter

    out = []
    for r in KVAwareRouter.instances():
        c, stats = r.follower.counters, r.follower.index.stats()
        out.append({"entries_replayed": c.entries, "snapshots": c.snapshots,
                    "mismatches": c.mismatches, "poll_errors": c.poll_errors,
                    "index": stats["num_entries"], "matches": stats["matches"],
                    "bisected_matches": stats["bisected_matches"],
                    "replicas": len(r.follower.index.replicas()),
                    "closed_replicas": r.follower.index.closed_replicas(),
                    "lag_s": r.follower.lag_s()})
    return {"routers": out}


def plot(rows, path) -> None:
    names = [r["mode"] for r in rows]
    bar_panels(names, [([r[key] for r in rows], title) for key, title in
                       [("hit_rate", "prefix hit rate (tokens)"), ("ttft_p90_s", "TTFT p90 (s)"),
                        ("output_tokens_per_s", "output tokens/s")]], path, width=13.0)


def goals(rows: list[dict]) -> dict:
    by = {r["mode"]: r for r in rows}
    kv, ray_, p2 = by["kv"], by["ray_prefix"], by["pow2"]
    return {"hit_rate_vs_ray_prefix": kv["hit_rate"] / max(ray_["hit_rate"], 1e-9),
            "hit_rate_vs_pow2": kv["hit_rate"] / max(p2["hit_rate"], 1e-9),
            # no router beats the bound: 1.25x Ray is out of reach where Ray is above 0.8x of it
            "hit_rate_vs_bound": {m: r["hit_rate"] / max(r["hit_rate_bound"], 1e-9) for m, r in by.items()},
            "ttft_p90_vs_pow2": kv["ttft_p90_s"] / p2["ttft_p90_s"],
            # no router's p90 is under its floor: 0.5x power of two is out of reach above it
            "ttft_p90_floor_vs_pow2": kv.get("ttft_p90_floor_s", float("nan")) / p2["ttft_p90_s"],
            "decision_ms_p99": kv["decision_ms_p99"],
            "met": {"hit_rate_ge_1.25x_ray_prefix": kv["hit_rate"] >= 1.25 * ray_["hit_rate"],
                    "hit_rate_ge_2x_pow2": kv["hit_rate"] >= 2.0 * p2["hit_rate"],
                    "ttft_p90_le_0.5x_pow2": kv["ttft_p90_s"] <= 0.5 * p2["ttft_p90_s"],
                    "decision_p99_le_0.3ms": (kv["decision_ms_p99"] or 1e9) <= 0.3}}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--replica-cpus", type=float, default=0.25)
    ap.add_argument("--tenants", type=int, default=24)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--user-tokens", type=int, default=60)
    ap.add_argument("--answer-tokens", type=int, default=40)
    ap.add_argument("--tenant-zipf", type=float, default=0.0,
                    help="tenant popularity skew: tenant k is picked with weight 1/(k+1)^s (0: uniform)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=80)
    ap.add_argument("--conv-rate", type=float, default=2.0, help="conversation starts per second")
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=800, help="KV blocks per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=result_name, default="routing", help="results name")
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.tenants, args.system_tokens = 12, 6, 600
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import ray
    from ray import serve

    from kvharbor.engine.tokenizer import byte_tokenizer
    from kvharbor.platform.loopback import on_loopback

    info = machine()
    demand = args.tenants * (args.system_tokens // 16) / args.kv_blocks
    print(f"workload: {args.conversations} conversations x {args.turns} turns, {args.tenants} "
          f"tenants x {args.system_tokens}-token system prompts = {demand:.2f} x one replica's "
          f"KV cache ({args.kv_blocks} blocks); {args.replicas} replicas", flush=True)
    with on_loopback() as ip:
        ray.init(include_dashboard=False, _node_ip_address=ip, num_cpus=4,
                 log_to_driver=False, namespace="serve")
    serve.start(http_options={"host": "127.0.0.1", "port": 18611})
    tokenizer, convs = byte_tokenizer(), workload(args, args.seed)
    idle = measure_idle(args)
    print("idle TTFT of a cold prompt (tokens: ms):",
          ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in idle.items()), flush=True)
    rows = []
    for mode in args.modes:
        rows.append(run_mode(mode, args, convs, tokenizer, idle))
        print(table(rows[-1:], ["router", "hit_rate", "hit_rate_bound", "ttft_p50_s", "ttft_p90_s",
                                "ttft_p99_s", "requests_per_s", "decision_ms_p50", "decision_ms_p99",
                                "errors"]), flush=True)
    serve.shutdown()
    ray.shutdown()
    print("\nSide by side (same workload, same deployment, fresh caches):")
    print(table(rows, ["router", "hit_rate", "hit_rate_bound", "ttft_p50_s", "ttft_p90_s",
                       "ttft_p90_floor_s", "ttft_p99_s", "requests_per_s", "output_tokens_per_s", "decision_ms_p50",
                       "decision_ms_p99", "decision_cpu_ms_p99", "errors"]))
    result = {"machine": info, "workload": {**vars(args), "demand_ratio": demand},
              "idle_ttft_s": {str(n): t for n, t in idle.items()},
              "real": rows, "load_avg_at_end": os.getloadavg()}
    if {"kv", "ray_prefix", "pow2"} <= {r["mode"] for r in rows}:
        result["goals"] = goals(rows)
        print("goals:", result["goals"])
    write_json(args.out, result)
    plot(rows, RESULTS / f"{args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
