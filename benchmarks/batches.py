"""The Batch API against what a client does without it: the same requests sent over HTTP by an
async client keeping as many in flight as a batch does (8), on the same running app.

One app (``build_app``: ``--replicas`` LLM replicas on the builtin tiny-llama, 2 gateways) on a
copy of tenants.yaml without rate, token or concurrency limits (``benchmarks.qos.lifted_tenants``;
``--tenants-limits`` keeps the file's: the demo standard tenant's tokens_per_minute=200000 then
binds after about ten arms and both arms run at that limit, not at the app's speed), one
workload per seed: ``--lines`` completions of the standard demo tenant, prompts of 8-120 words
drawn from the seed, ``--max-tokens`` tokens each, greedy, EOS ignored. Rounds alternate the
arm that runs first (batch, http, http, batch, ...); the prefix cache is flushed
(``/admin/cache/flush``) before each arm, so neither reads what the other computed. Timed per
arm: a batch from ``batches.create`` to the poll that sees it ``completed`` (every ``--poll-s``,
100 ms: up to that much is counted against the batch; each poll is an HTTP request, and at 20 ms
they took a fifth of the batch's speed on this 2-core machine; upload excluded, its result file
read after); HTTP from the first send to the last answer (a 429 is waited out, ``retry-after-ms``
else ``Retry-After``, and the request sent again, as the batch runner and OpenAI's client do). Outputs checked: every line's text is the same in
both arms (greedy), else the benchmark fails.

    python -m benchmarks.batches --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import machine, median, result_name, table, write_json
from kvharbor.platform.batch_runner import retry_after

PORT = 8311
HTTP_429S = [0]
"""429s the HTTP client waited out so far (the batch runner waits its own out the same way)."""
KEY = "kvh-demo-standard"
ADMIN = "kvh-demo-admin"
MODEL = "kvharbor/tiny-llama"
WORDS = ("harbor tide vessel anchor lantern quay rope gull sail compass chart keel current beacon "
         "storm pier cargo ferry reef dock mast crew voyage island").split()


def workload(seed: int, lines: int, max_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"model": MODEL, "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))),
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for _ in range(lines)]


def tagged(bodies: list[dict], tag: str) -> list[dict]:
    return [{**b, "prompt": f"[{tag}] {b['prompt']}"} for b in bodies]


async def run_batch(client: httpx.AsyncClient, bodies: list[dict], poll_s: float = 0.1) -> tuple[float, list[str]]:
    content = "".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": b}) + "\n"
                      for i, b in enumerate(bodies)).encode()
    meta = (await client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("w.jsonl", content)})).json()
    start = time.perf_counter()
    batch = (await client.post("/v1/batches", json={"input_file_id": meta["id"], "endpoint": "/v1/completions",
                                                     "completion_window": "24h"})).json()
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(poll_s)
        batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
    elapsed = time.perf_counter() - start
    if batch["status"] != "completed" or batch["error_file_id"]:
        raise SystemExit(f"batch ended {batch['status']} with errors: {batch}")
    out = (await client.get(f"/v1/files/{batch['output_file_id']}/content")).content.decode().splitlines()
    texts = {json.loads(x)["custom_id"]: json.loads(x)["response"]["body"]["choices"][0]["text"] for x in out}
    return elapsed, [texts[str(i)] for i in range(len(bodies))]


async def run_http(client: httpx.AsyncClient, bodies: list[dict], in_flight: int = 8) -> tuple[float, list[str]]:
    slots, texts = asyncio.Semaphore(in_flight), [None] * len(bodies)
    refused = HTTP_429S

    async def one(i: int, body: dict) -> None:
        async with slots:
            r = await client.post("/v1/completions", json=body)
            while r.status_code == 429:            # as the batch runner (and the openai client) do
                refused[0] += 1
                await asyncio.sleep(retry_after(r.headers))
                r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            texts[i] = r.json()["choices"][0]["text"]

    start = time.perf_counter()
    await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    return time.perf_counter() - start, texts


async def measure(args) -> dict:
    headers = {"Authorization": f"Bearer {KEY}"}
    out = {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", headers=headers, timeout=600) as client:
        await run_http(client, tagged(workload(99, 16, 4), "warm"))
        await run_batch(client, tagged(workload(98, 16, 4), "warm"))
        for seed in args.seeds:
            bodies, times = workload(seed, args.lines, args.max_tokens), {"batch": [], "http": []}
            refused_before = HTTP_429S[0]
            for r in range(args.rounds):
                order = ("batch", "http") if r % 2 == 0 else ("http", "batch")
                texts = {}
                for arm in order:
                    flushed = await client.post("/admin/cache/flush", headers={"Authorization": f"Bearer {ADMIN}"})
                    flushed.raise_for_status()          # each arm starts from an empty prefix cache
                    tagged_bodies = tagged(bodies, f"s{seed}r{r}")
                    elapsed, texts[arm] = await (run_batch(client, tagged_bodies, args.poll_s) if arm == "batch"
                                                 else run_http(client, tagged_bodies))
                    times[arm].append(elapsed)
                if texts["batch"] != texts["http"]:
                    raise SystemExit(f"seed {seed} round {r}: the batch's answers differ from HTTP's")
            tokens = args.lines * args.max_tokens
            out[seed] = {arm: {"s": t, "median_s": median(t), "tokens_per_s": tokens / median(t)}
                         for arm, t in times.items()}
            out[seed]["http_429s"] = HTTP_429S[0] - refused_before
            out[seed]["batch_over_http"] = out[seed]["batch"]["tokens_per_s"] / out[seed]["http"]["tokens_per_s"]
    return out


def run_on_app(replicas: int, tenants: Path, coroutine_fn, config: dict | None = None):
    """Start the app (``replicas`` LLM replicas, 2 gateways, ``tenants``, more ``build_app``
    ``config``) on ``PORT``, run ``coroutine_fn()`` against it, stop everything; returns what
    the coroutine returned."""
    import ray
    from ray import serve

    from kvharbor.platform.app import build_app, wait_until_healthy

    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", namespace="serve", log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        serve.run(build_app({"replicas": replicas, "gateway_replicas": 2, "tenants": str(tenants), **(config or {})}),
                  name="kvharbor", route_prefix="/", blocking=False)
        wait_until_healthy(f"http://127.0.0.1:{PORT}", timeout_s=300)
        return asyncio.run(coroutine_fn())
    finally:
        serve.shutdown()
        ray.shutdown()


def run_lifted(args, measure, prefix: str, config: dict | None = None) -> tuple[dict, dict]:
    """This machine's description and ``measure(args)``'s results, measured on an app of
    ``args.replicas`` LLM replicas (and ``config``) whose tenants.yaml has its limits lifted."""
    from benchmarks.qos import lifted_tenants

    info = machine()
    tenants = lifted_tenants(Path(tempfile.mkdtemp(prefix=prefix)))
    return info, run_on_app(args.replicas, tenants, lambda: measure(args), config)


def report(args, payload: dict, rows: list[dict], columns: list[str]) -> int:
    """Print ``rows`` as a table and write ``payload`` (with ``args``) as ``args.name``'s JSON."""
    print(table(rows, columns))
    path = write_json(args.name, {**payload, "args": vars(args)})
    print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lines", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--poll-s", type=float, default=0.1,
                   help="seconds between the batch arm's status polls (each an HTTP request)")
    p.add_argument("--tenants-limits", action="store_true",
                   help="keep tenants.yaml's rate, token and concurrency limits (default: lifted)")
    p.add_argument("--name", type=result_name, default="batches")
    args = p.parse_args(argv)
    from benchmarks.qos import ROOT, lifted_tenants

    info = machine()
    folder = Path(tempfile.mkdtemp(prefix="kvh-batches-bench-"))
    tenants = ROOT / "tenants.yaml" if args.tenants_limits else lifted_tenants(folder)
    results = run_on_app(args.replicas, tenants, lambda: measure(args))
    rows = [{"seed": s, "batch tok/s": f"{r['batch']['tokens_per_s']:.0f}", "http tok/s": f"{r['http']['tokens_per_s']:.0f}",
             "batch/http": f"{r['batch_over_http']:.2f}x", "HTTP 429s": r["http_429s"]} for s, r in results.items()]
    return report(args, {"machine": info, "results": results}, rows,
                  ["seed", "batch tok/s", "http tok/s", "batch/http", "HTTP 429s"])


if __name__ == "__main__":
    sys.exit(main())
