"""Proof on the real app: a router's own index equals the union of the replicas' caches
after a workload (event lag aside), again after the directory actor is killed and after a
replica is killed, while requests keep flowing.

The router under test lives in this test process: calls through a ``DeploymentHandle``
here are routed by a ``KVAwareRouter`` instance created in this process (the gateway's
routers are the same class in the gateway processes).
"""

from __future__ import annotations

import random
import time

import ray
from ray import serve

from kvharbor.platform.index_follower import ActorShard, IndexFollower
from kvharbor.platform.router import KVAwareRouter
from tests.conftest import DEMO, REPLICA_PREFIX


def _text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(97, 123)) for _ in range(n))


def _send(app, n: int, seed: int) -> list[int]:
    """``n`` completions through the gateway; returns their status codes."""
    codes = []
    with app.client(DEMO["standard"]) as c:
        for i in range(n):
            prompt = _text(64, 7) + _text(random.Random(seed + i).randint(40, 300), seed + i)
            r = c.post("/v1/completions", json={"model": app.model, "prompt": prompt,
                                                "max_tokens": 3, "temperature": 0})
            codes.append(r.status_code)
    return codes


class _Follower:
    """The router's index component (``IndexFollower`` over the app's directory) on its own
    event loop thread in this process, for as long as the module runs (``run`` returns once
    the session's Ray has shut down)."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        shard = ActorShard("kvharbor-prefix-directory", "kvharbor", timeout_s=2.0, retry_s=0.5)
        self.follower = IndexFollower([shard], poll_interval_s=0.02)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.follower.run(), self.loop)


_FOLLOWERS: list = []


def _router(app):
    """A live router's view: the app's KVAwareRouter of this process when Serve still keeps
    one, else the same index component run standalone (routers live as long as Serve keeps
    them). Other apps' routers in this process (the autoscaling test's) follow other
    directories: only the app's own deployment counts."""
    app.replica_call("stats")                       # makes this process's router exist
    handle = app.replica_handle()
    routers = [r for r in KVAwareRouter.instances() if r.follower.status() is None
               and getattr(r, "_deployment_id", None) is not None
               and (r._deployment_id.app_name, r._deployment_id.name)
               == (handle.app_name, handle.deployment_name)]
    if routers:
        return routers[-1]
    if not _FOLLOWERS:
        _FOLLOWERS.append(_Follower())
    return _FOLLOWERS[0]


def _caches(app) -> dict[str, set]:
    return {rid: set(r["cached"]) for rid, r in app.replica_call("check_integrity").items()}


def _index_equals_caches(app, timeout_s: float = 30.0) -> dict[str, set]:
    """Wait until the router's index holds exactly each live replica's cache."""
    deadline = time.time() + timeout_s
    while True:
        router, caches = _router(app), _caches(app)
        index = router.follower.index
        seen = {rid: index.replica_hashes(rid) for rid in caches}
        extra = set(index.replicas()) - set(caches)
        if all(seen[r] == caches[r] for r in caches) and not extra:
            index.check_integrity()
            return caches
        if time.time() > deadline:
            sizes = {r: (len(seen[r]), len(caches[r])) for r in caches}
            raise AssertionError(f"router index vs replica caches: {sizes}, extra {extra}")
        time.sleep(0.5)


def test_router_index_equals_replica_caches_after_a_workload(kvharbor_app):
    assert _send(kvharbor_app, 10, 100) == [200] * 10
    caches = _index_equals_caches(kvharbor_app)
    assert all(caches.values()), "both replicas should hold cached blocks"
    assert _router(kvharbor_app).follower.status() is None


def test_router_index_recovers_after_the_directory_actor_is_killed(kvharbor_app):
    directory = kvharbor_app.directory()
    epoch = ray.get(directory.stats.remote())["epoch"]
    assert _send(kvharbor_app, 4, 200) == [200] * 4
    ray.kill(directory, no_restart=False)            # the actor restarts, empty
    assert _send(kvharbor_app, 6, 300) == [200] * 6  # requests keep flowing meanwhile
    _index_equals_caches(kvharbor_app, timeout_s=45)
    stats = ray.get(kvharbor_app.directory().stats.remote())
    assert stats["epoch"] != epoch                   # it really restarted ...
    caches = _caches(kvharbor_app)                   # ... and was rebuilt from the replicas
    for rid, cached in caches.items():
        assert ray.get(kvharbor_app.directory().replica_hashes.remote(rid)) == cached


def test_router_index_recovers_after_a_replica_is_killed(kvharbor_app):
    before = kvharbor_app.replica_ids()
    victim = before[0]
    ray.kill(ray.get_actor(REPLICA_PREFIX + victim, namespace="serve"), no_restart=False)
    codes = _send(kvharbor_app, 6, 400)              # retried onto the survivor
    assert codes == [200] * 6
    deadline = time.time() + 240
    while time.time() < deadline:
        state = serve.status().applications["kvharbor"].deployments["LLMReplica"]
        ids = kvharbor_app.replica_ids()
        if state.replica_states == {"RUNNING": 2} and len(ids) == 2 and victim not in ids:
            break
        time.sleep(1)
    else:
        raise AssertionError("Serve did not replace the killed replica")
    assert _send(kvharbor_app, 6, 500) == [200] * 6
    _index_equals_caches(kvharbor_app, timeout_s=45)
    # a router forgets the dead replica when Serve says it is gone; the directory (and so
    # every follower of its log) once any router told it
    assert victim not in _router(kvharbor_app).follower.index.replicas()
    assert victim not in ray.get(kvharbor_app.directory().replicas.remote())
