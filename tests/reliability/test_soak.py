"""Soak: a few thousand short requests across tenants, then every invariant still holds.

Closed loop at 32 connections saturates this host; the gateway's overload guard may then shed
standard and batch requests (429 ``overloaded``), never premium ones and never all of a class,
and nothing else fails.

After the load: each replica passes ``check_integrity()``, holds no blocks but its pinned
prefixes, and the prefix directory lists exactly the live replicas with exactly the
blocks each one has cached.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import ray

from kvharbor.actors.replica_sync import system_prompt_tokens
from kvharbor.engine.model_info import load_tokenizer
from kvharbor.tenants import TenantRegistry
from tests.reliability.helpers import DEMO, edited_tenants, wait_idle

N_REQUESTS = 2400
CONCURRENCY = 32
TIME_CAP_S = 100.0
KEYS = [DEMO["premium"], DEMO["standard"], DEMO["batch"]]


def _no_rate_limits(doc) -> None:
    doc["defaults"].update({"requests_per_minute": None, "tokens_per_minute": None,
                            "max_concurrent_requests": 64, "daily_token_budget": None})
    for tenant in doc["tenants"].values():
        for field in ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests",
                      "daily_token_budget"):
            tenant.pop(field, None)


def _body(rng: random.Random, model: str) -> dict:
    """Short prompts: one of 24 shared 32-token prefixes + a short unique tail."""
    prefix = "".join(random.Random(rng.randrange(24)).choice("abcdefgh") for _ in range(32))
    tail = "".join(rng.choice("xyz ") for _ in range(rng.randrange(1, 12)))
    return {"model": model, "prompt": prefix + tail, "max_tokens": rng.randint(1, 4),
            "temperature": rng.choice([0.0, 0.8]), "stream": rng.random() < 0.25}


async def _drive(app) -> tuple[dict[tuple[str, int, str | None], int], int, float]:
    """Send up to N_REQUESTS (stop starting new ones after TIME_CAP_S); count by (key,
    status, error code)."""
    rng = random.Random(11)
    counts: dict[tuple[str, int, str | None], int] = {}
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(N_REQUESTS):
        queue.put_nowait((KEYS[i % 3], _body(rng, app.model)))
    start = time.monotonic()

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty() and time.monotonic() - start < TIME_CAP_S:
            key, body = queue.get_nowait()
            r = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            code = None if r.status_code == 200 else r.json()["error"]["code"]
            if r.status_code == 429:
                assert r.headers.get("retry-after"), r.headers
            outcome = (key, r.status_code, code)
            counts[outcome] = counts.get(outcome, 0) + 1
            if body["stream"] and r.status_code == 200:
                assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text[-300:]

    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=app.base_url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
    return counts, N_REQUESTS - queue.qsize(), time.monotonic() - start


def _pinned_prefix_blocks(app) -> int:
    registry = TenantRegistry(app.tenants_path)
    tokenizer = load_tokenizer(app.model)
    return sum(len(system_prompt_tokens(tokenizer, text)) // 16
               for texts in registry.pinned_prefixes().values() for text in texts)


def _directory_matches_replicas(app, timeout_s: float = 8.0) -> None:
    directory = app.directory()
    deadline = time.time() + timeout_s
    while True:
        reports = app.replica_call("check_integrity")
        listed = set(ray.get(directory.replicas.remote(), timeout=10))
        held = {rid: set(ray.get(directory.replica_hashes.remote(rid), timeout=10)) for rid in reports}
        diff = {rid: (len(held[rid] ^ set(r["cached"])), len(r["cached"])) for rid, r in reports.items()}
        if listed == set(reports) and all(d == 0 for d, _ in diff.values()):
            return
        if time.time() > deadline:
            raise AssertionError(f"directory lists {listed}, replicas are {set(reports)}; "
                                 f"(mismatched hashes, cached) per replica: {diff}")
        time.sleep(0.5)


def test_soak_keeps_every_invariant(kvharbor_app):
    with edited_tenants(kvharbor_app, _no_rate_limits):
        counts, sent, elapsed = asyncio.run(_drive(kvharbor_app))
    print(f"soak: {sent} requests in {elapsed:.1f} s ({sent / elapsed:.1f} req/s), statuses {counts}")
    assert sum(counts.values()) == sent
    assert sent >= 1000, f"only {sent} requests in {TIME_CAP_S} s"
    refused = {k: n for k, n in counts.items() if k[1] != 200}
    assert all(status == 429 and code == "overloaded" and key != DEMO["premium"]
               for key, status, code in refused), refused
    served = {key: sum(n for k, n in counts.items() if k[0] == key and k[1] == 200) for key in KEYS}
    # The guard sheds the lower classes as far as this host's speed requires (26-569 of 800
    # each were served in 7 runs here); it must not starve either of them.
    assert served[DEMO["standard"]] > 0 and served[DEMO["batch"]] > 0, counts
    stats = wait_idle(kvharbor_app)
    pinned = _pinned_prefix_blocks(kvharbor_app)
    assert pinned > 0
    for s in stats:
        assert s["blocks_used"] == pinned, (s["replica_id"], s["blocks_used"], pinned)
    _directory_matches_replicas(kvharbor_app)
