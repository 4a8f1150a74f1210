"""The prefix directory mirrors the replicas' caches (allowing only for event lag)."""

from __future__ import annotations

import random
import time

import ray

from tests.conftest import DEMO


def _directory_matches_replicas(app) -> tuple[bool, dict]:
    caches = {rid: set(r["cached"]) for rid, r in app.replica_call("check_integrity").items()}
    directory = app.directory()
    seen = {rid: ray.get(directory.replica_hashes.remote(rid)) for rid in caches}
    return all(seen[rid] == caches[rid] for rid in caches), {r: (len(seen[r]), len(caches[r])) for r in caches}


def test_directory_equals_union_of_replica_caches(kvharbor_app):
    rng = random.Random(3)
    with kvharbor_app.client(DEMO["standard"]) as c:
        for i in range(12):
            prompt = "".join(chr(rng.randrange(97, 123)) for _ in range(rng.randint(40, 400)))
            r = c.post("/v1/completions", json={"model": kvharbor_app.model, "prompt": prompt,
                                                "max_tokens": 3})
            assert r.status_code == 200
    deadline = time.time() + 15
    ok, sizes = _directory_matches_replicas(kvharbor_app)
    while not ok and time.time() < deadline:
        time.sleep(0.5)
        ok, sizes = _directory_matches_replicas(kvharbor_app)
    assert ok, f"directory vs replica cache sizes: {sizes}"
    assert all(n > 0 for n, _ in sizes.values()), "both replicas should hold cached blocks"
    ray.get(kvharbor_app.directory().check_integrity.remote())
