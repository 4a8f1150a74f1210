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


def test_a_cache_salt_is_routed_to_and_reused_only_by_requests_that_send_it(kvharbor_app):
    """vLLM's ``cache_salt``: follow-ups sending the first request's salt land on its replica
    (the router hashes with the salt, as the engine does) and reuse its 512-token prefix; the
    same prompt with another salt or none reuses nothing; an empty salt is a 400."""
    prefix = _text(512, 78)
    with kvharbor_app.client(DEMO["standard"]) as c:
        def complete(suffix: str, **salt) -> dict:
            r = c.post("/v1/completions", json={"model": kvharbor_app.model, "prompt": prefix + suffix,
                                                "max_tokens": 2, "temperature": 0, **salt})
            assert r.status_code == 200, r.text
            return r.json()

        first = complete("first?", cache_salt="user-1")
        time.sleep(1.5)                     # KV events reach the routers
        follow = [complete(f"then {i}!", cache_salt="user-1") for i in range(3)]
        others = [complete("first?", cache_salt="user-2"), complete("first?")]
        empty = c.post("/v1/chat/completions", json={"model": kvharbor_app.model, "cache_salt": "",
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert {f["kvharbor"]["replica_id"] for f in follow} == {first["kvharbor"]["replica_id"]}
    assert all(f["usage"]["prompt_tokens_details"]["cached_tokens"] >= 496 for f in follow)
    assert [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in others] == [0, 0]
    assert empty.status_code == 400 and "cache_salt" in empty.text, empty.text
