"""KV-aware routing: shared prefixes land where they are cached; distinct ones spread."""

from __future__ import annotations

import random
import time

from tests.conftest import DEMO


def _text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(97, 123)) for _ in range(n))   # 1 byte = 1 token


def _complete(client, model: str, prompt: str) -> dict:
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_shared_prefix_lands_on_the_same_replica(kvharbor_app):
    prefix = _text(512, 1)
    with kvharbor_app.client(DEMO["standard"]) as c:
        first = _complete(c, kvharbor_app.model, prefix + "first question?")
        time.sleep(1.5)                     # KV events reach the directory
        second = _complete(c, kvharbor_app.model, prefix + "second question!")
    assert second["kvharbor"]["replica_id"] == first["kvharbor"]["replica_id"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 496


def test_distinct_prefixes_spread_over_both_replicas(kvharbor_app):
    """With equally empty caches (see ``RunningApp.flush_caches``)."""
    kvharbor_app.flush_caches()
    replicas = set()
    with kvharbor_app.client(DEMO["standard"]) as c:
        for i in range(8):
            replicas.add(_complete(c, kvharbor_app.model, _text(300, 100 + i))["kvharbor"]["replica_id"])
    assert len(replicas) == 2
