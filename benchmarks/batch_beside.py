"""What a batch takes from interactive traffic beside it, with its lines at the tenant's own
class (``service_tier: "default"``) and as ``"flex"`` (the lowest class, the Batch API's
default since 3254040).

One app (``build_app``: ``--replicas`` LLM replicas on the builtin tiny-llama, 2 gateways) on a
copy of tenants.yaml without rate, token or concurrency limits (``benchmarks.qos.lifted_tenants``).
Interactive traffic: the standard demo tenant (globex) streams completions (prompts of 8-120
words, ``--max-tokens`` 16, greedy) at ``--rate`` requests a second, open loop (Poisson
arrivals from the seed), for ``--seconds``; its time to first token is measured at the client
(send to the first chunk with text). Three arms, their order rotating per round: ``alone``
(interactive only), ``default`` and ``flex`` (the same, beside a batch of the premium demo
tenant, acme: ``--lines`` completions of 32 tokens whose lines name that tier; the batch
starts 1 s before the interactive traffic and is cancelled when it ends). The prefix cache is
flushed before each arm. Reported per arm: interactive TTFT p50 / p90 / p99 over all rounds,
its 429s, and the batch's lines finished per second while it ran.

    python -m benchmarks.batch_beside --seeds 0 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx

from benchmarks.batches import ADMIN, MODEL, PORT, report, run_lifted, tagged, workload
from benchmarks.common import pct, result_name

INTERACTIVE_KEY = "kvh-demo-standard"
BATCH_KEY = "kvh-demo-premium"
ARMS = ("alone", "default", "flex")


async def interactive(client: httpx.AsyncClient, bodies: list[dict], rate: float, seed: int) -> tuple[list, int]:
    """Open-loop streamed completions: their TTFTs (s) and the number answered 429."""
    rng, ttfts, refused = random.Random(seed), [], [0]

    async def one(body: dict) -> None:
        start = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code == 429:
                refused[0] += 1
                return
            r.raise_for_status()
            first = None
            async for line in r.aiter_lines():     # read it all: the request finishes normally
                if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    first = time.perf_counter() - start
                    ttfts.append(first)

    tasks = []
    for body in bodies:
        tasks.append(asyncio.create_task(one(body)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return ttfts, refused[0]


async def start_batch(client: httpx.AsyncClient, bodies: list[dict], tier: str) -> str:
    content = "".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions",
                                  "body": {**b, "service_tier": tier}}) + "\n" for i, b in enumerate(bodies)).encode()
    meta = (await client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("w.jsonl", content)})).json()
    batch = (await client.post("/v1/batches", json={"input_file_id": meta["id"], "endpoint": "/v1/completions",
                                                     "completion_window": "24h"})).json()
    return batch["id"]


async def stop_batch(client: httpx.AsyncClient, batch_id: str) -> dict:
    batch = (await client.post(f"/v1/batches/{batch_id}/cancel")).json()
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(0.1)
        batch = (await client.get(f"/v1/batches/{batch_id}")).json()
    if batch["request_counts"]["failed"]:
        raise SystemExit(f"batch lines failed: {batch}")
    return batch


async def measure(args) -> dict:
    base = f"http://127.0.0.1:{PORT}"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    out = {}
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {INTERACTIVE_KEY}"},
                                 timeout=600) as users, \
            httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {BATCH_KEY}"}, timeout=600) as owner:
        await interactive(users, tagged(workload(99, 8, 4), "warm"), 4.0, 99)
        for seed in args.seeds:
            n = max(1, round(args.rate * args.seconds))
            requests = workload(seed, n, args.max_tokens)
            lines = workload(1000 + seed, args.lines, 32)
            arms = {arm: {"ttft": [], "429s": 0, "lines_per_s": []} for arm in ARMS}
            for r in range(args.rounds):
                for arm in ARMS[r % 3:] + ARMS[:r % 3]:
                    (await users.post("/admin/cache/flush", headers=admin)).raise_for_status()
                    tag = f"s{seed}r{r}{arm}"
                    batch_id, started = None, time.perf_counter()
                    if arm != "alone":
                        batch_id = await start_batch(owner, tagged(lines, tag), arm)
                        await asyncio.sleep(1.0)
                    ttfts, refused = await interactive(users, tagged(requests, tag), args.rate, seed * 100 + r)
                    arms[arm]["ttft"] += ttfts
                    arms[arm]["429s"] += refused
                    if batch_id is not None:
                        done = await stop_batch(owner, batch_id)
                        arms[arm]["lines_per_s"].append(done["request_counts"]["completed"]
                                                        / (time.perf_counter() - started))
            out[seed] = {arm: {"ttft_ms": {f"p{q}": 1000 * pct(a["ttft"], q) for q in (50, 90, 99)},
                               "requests": len(a["ttft"]), "http_429s": a["429s"],
                               "batch_lines_per_s": a["lines_per_s"]} for arm, a in arms.items()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rate", type=float, default=6.0, help="interactive requests a second")
    p.add_argument("--seconds", type=float, default=15.0, help="interactive traffic per arm")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lines", type=int, default=2000, help="batch lines (more than it finishes in an arm)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--name", type=result_name, default="batch_beside")
    args = p.parse_args(argv)
    info, results = run_lifted(args, measure, "kvh-batch-beside-")
    rows = []
    for seed, arms in results.items():
        alone = arms["alone"]["ttft_ms"]["p99"]
        for arm, a in arms.items():
            t = a["ttft_ms"]
            rows.append({"seed": seed, "arm": arm, "TTFT p50/p90/p99 ms": f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f}",
                         "p99 / alone": f"{t['p99'] / alone:.2f}x", "429s": a["http_429s"],
                         "batch lines/s": " ".join(f"{x:.1f}" for x in a["batch_lines_per_s"]) or "-"})
    return report(args, {"machine": info, "model": MODEL, "results": results}, rows,
                  ["seed", "arm", "TTFT p50/p90/p99 ms", "p99 / alone", "429s", "batch lines/s"])


if __name__ == "__main__":
    sys.exit(main())
