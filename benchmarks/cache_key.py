"""Prompt cache keys through two gateways: prefix hits and latency of agents' request bursts
with and without OpenAI's ``prompt_cache_key``.

One app per router (``build_app``: ``--replicas`` LLM replicas of the builtin tiny-llama with
``--kv-blocks`` KV blocks each, 2 gateway replicas, each with its own router) on a copy of
tenants.yaml without rate, token or concurrency limits. Workload, from the seed: ``--agents``
agents, each with a system prompt of its own (``--prompt-words`` words, ~6 tokens each:
tiny-llama's tokenizer reads bytes); bursts of ``--burst`` concurrent completions of one agent
(its system prompt, then a question of its own; ``--max-tokens`` tokens, greedy) arrive open
loop, Poisson at ``--rate`` bursts a second, the agent drawn uniformly, ``--bursts`` bursts per
arm. Arms, all on the same requests: on kvharbor's router ``key`` (each request sends
``prompt_cache_key`` = its agent's name) and ``none``, their order alternating per round; on
Ray Serve's ``PrefixCacheAffinityRouter`` (``router="ray_prefix"``: its tree of routed
prompts lives in one actor that both gateways' routers share; it reads no key)
``ray_prefix``. The prefix cache is flushed before each arm. Reported per arm, over all
rounds: the prefix hit rate (cached prompt tokens / prompt tokens, from each answer's usage),
latency (send to answer) p50 / p90 / p99, and how many requests each replica served; every
arm's answers are checked to be the same text.

    python -m benchmarks.cache_key --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter

import httpx

from benchmarks.batches import ADMIN, MODEL, PORT, WORDS, report, run_lifted
from benchmarks.common import pct, result_name

KEY = "kvh-demo-standard"
ROUTER_ARMS = {"kv": ("key", "none"), "ray_prefix": ("ray_prefix",)}
"""The arms run on each router's app: kvharbor's with and without keys; Ray Serve's
``PrefixCacheAffinityRouter`` (it reads no key, so its requests send none)."""


def workload(seed: int, args) -> list[list[dict]]:
    """The bursts of one arm: each a list of request bodies of one agent."""
    rng = random.Random(seed)
    systems = [f"Agent {a} of seed {seed}. " + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
               for a in range(args.agents)]
    bursts = []
    for b in range(args.bursts):
        agent = rng.randrange(args.agents)
        bursts.append([{"model": MODEL, "prompt": f"{systems[agent]}\nQuestion {b}.{i}: "
                        + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))),
                        "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                        "cache_key_of": f"agent-{agent}"} for i in range(args.burst)])
    return bursts


async def run_arm(client: httpx.AsyncClient, bursts: list[list[dict]], keyed: bool, rate: float,
                  seed: int) -> list[dict]:
    """Send the bursts open loop; one record per request (in workload order)."""
    rng = random.Random(seed)
    records: list[dict] = []

    async def one(body: dict, slot: int) -> None:
        key = body["cache_key_of"]
        sent = {k: v for k, v in body.items() if k != "cache_key_of"}
        if keyed:
            sent["prompt_cache_key"] = key
        start = time.perf_counter()
        r = await client.post("/v1/completions", json=sent)
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {r.text}")
        answer = r.json()
        usage = answer["usage"]
        records[slot] = {"latency_s": time.perf_counter() - start, "prompt": usage["prompt_tokens"],
                         "cached": usage["prompt_tokens_details"]["cached_tokens"],
                         "replica": answer["kvharbor"]["replica_id"], "text": answer["choices"][0]["text"]}

    tasks = []
    for burst in bursts:
        for body in burst:
            records.append({})
            tasks.append(asyncio.create_task(one(body, len(records) - 1)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return records


def summary(records: list[dict]) -> dict:
    lat = [r["latency_s"] for r in records]
    return {"requests": len(records),
            "hit_rate": sum(r["cached"] for r in records) / max(1, sum(r["prompt"] for r in records)),
            "latency_ms": {f"p{q}": 1000 * pct(lat, q) for q in (50, 90, 99)},
            "per_replica": sorted(Counter(r["replica"] for r in records).values(), reverse=True)}


async def measure(args, arms: tuple[str, ...]) -> dict:
    """Each seed's ``arms`` on the running app: their summaries and their answers' texts."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    out = {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=600,
                                 headers={"Authorization": f"Bearer {KEY}"}) as client:
        warm = workload(99, argparse.Namespace(**{**vars(args), "bursts": 4}))
        await run_arm(client, warm, True, args.rate, 99)
        for seed in args.seeds:
            bursts = workload(seed, args)
            records: dict[str, list[dict]] = {arm: [] for arm in arms}
            for r in range(args.rounds):
                for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                    (await client.post("/admin/cache/flush", headers=admin)).raise_for_status()
                    got = await run_arm(client, bursts, arm == "key", args.rate, seed * 100 + r)
                    records[arm] += got
                    print(f"seed {seed} round {r} {arm}: hit rate {summary(got)['hit_rate']:.3f}",
                          file=sys.stderr, flush=True)
            out[seed] = {arm: {**summary(got), "texts": [x["text"] for x in got]} for arm, got in records.items()}
    return out


def measure_all(args) -> tuple[dict, dict]:
    """Every router's arms, one app per router (started in turn); answers checked to be the same
    text in every arm and round."""
    info, results = {}, {seed: {} for seed in args.seeds}
    for router in args.routers:          # the machine as each app started
        config = {"num_kv_blocks": args.kv_blocks, "replica_cpus": 0.25, "router": router}
        info[router], got = run_lifted(args, lambda a: measure(a, ROUTER_ARMS[router]), "kvh-cache-key-bench-",
                                       config)
        for seed, arms in got.items():
            results[seed].update(arms)
    for seed, arms in results.items():
        texts = [a.pop("texts") for a in arms.values()]
        if any(t != texts[0] for t in texts):
            raise SystemExit(f"seed {seed}: the arms' answers differ")
        arms["same_answers"] = True
    return info, results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kv-blocks", type=int, default=160, help="KV blocks per LLM replica (16 tokens each)")
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=60, help="~6 tokens each (byte tokenizer)")
    p.add_argument("--burst", type=int, default=6)
    p.add_argument("--bursts", type=int, default=40)
    p.add_argument("--rate", type=float, default=1.0, help="bursts a second")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--routers", nargs="+", choices=sorted(ROUTER_ARMS), default=["kv", "ray_prefix"])
    p.add_argument("--name", type=result_name, default="cache_key")
    args = p.parse_args(argv)
    info, results = measure_all(args)
    rows = []
    for seed, res in results.items():
        for arm in (a for r in args.routers for a in ROUTER_ARMS[r]):
            a = res[arm]
            rows.append({"seed": seed, "arm": arm, "hit rate": f"{a['hit_rate']:.3f}",
                         "latency p50/p90/p99 ms": "/".join(f"{a['latency_ms'][q]:.0f}" for q in ("p50", "p90", "p99")),
                         "requests per replica": " ".join(map(str, a["per_replica"]))})
    return report(args, {"machine": info, "results": results}, rows,
                  ["seed", "arm", "hit rate", "latency p50/p90/p99 ms", "requests per replica"])


if __name__ == "__main__":
    sys.exit(main())
