"""KVAwareRouter with fake replicas, fake pending requests and fake or real directories."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.serve._private.common import (DeploymentHandleSource, DeploymentID, ReplicaID,
                                       RequestMetadata)
from ray.serve.request_router import PendingRequest

from kvharbor.actors.prefix_directory import PrefixIndex
from kvharbor.engine.hashing import hash_prompt_blocks
from kvharbor.platform.protocol import GenerateRequest
from kvharbor.platform.router import DirectoryClient, KVAwareRouter

DEPLOYMENT = DeploymentID(name="LLMReplica", app_name="kvharbor")
PROMPT = list(range(64 * 16))                       # 64 full blocks
HASHES = hash_prompt_blocks(PROMPT, 16)


class FakeReplica:
    """What choose_replicas reads from a RunningReplica."""

    def __init__(self, uid: str, **stats) -> None:
        self.replica_id = ReplicaID(unique_id=uid, deployment_id=DEPLOYMENT)
        self.routing_stats = {"block_size": 16, **stats}
        self.max_ongoing_requests = 64


class FakeDirectory:
    """Stands in for the actor handle: ``match.remote`` returns an awaitable."""

    def __init__(self, index: PrefixIndex, delay_s: float = 0.0, error: Exception | None = None):
        self.index, self.delay_s, self.error, self.calls = index, delay_s, error, 0
        self.match = self

    def remote(self, hashes):
        self.calls += 1
        return self._answer(hashes)

    async def _answer(self, hashes):
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return self.index.match(hashes)


def make_router(directory=None, **kwargs) -> KVAwareRouter:
    router = KVAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    if directory is not None:
        router.directory = DirectoryClient("unused", None, router.directory.timeout_s, 5.0,
                                           handle=directory)
    return router


def pending(hashes=HASHES, as_kwarg: bool = False, **fields) -> PendingRequest:
    req = GenerateRequest(request_id="r1", tenant="acme", qos="standard",
                          prompt_token_ids=PROMPT, block_hashes=list(hashes), sampling={},
                          **fields)
    args, kwargs = ([], {"request": req}) if as_kwarg else ([req], {})
    return PendingRequest(args=args, kwargs=kwargs,
                          metadata=RequestMetadata(request_id="r1", internal_request_id="i1"))


def route(router: KVAwareRouter, replicas, **pending_kwargs):
    """One choose_replicas call in a fresh event loop; returns (ranks, pending request)."""

    async def go():
        pr = pending(**pending_kwargs)        # PendingRequest needs a running loop
        return await router.choose_replicas(replicas, pr), pr

    return asyncio.run(go())


def uids(ranks) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_routes_to_the_replica_holding_the_prefix_and_records_the_prediction():
    index = PrefixIndex()
    index.apply_events("b", 0, stored=HASHES[:40])
    index.apply_events("c", 0, stored=HASHES[:10])
    router = make_router(FakeDirectory(index))
    replicas = [FakeReplica(x) for x in "abcd"]

    ranks, pr = route(router, replicas)
    got = uids(ranks)
    assert got[:2] == [["b"], ["c"]] and sorted(got[2]) == ["a", "d"]
    md = pr.args[0].metadata
    assert md["router_policy"] == "kv_aware" and md["router_fallback_reason"] is None
    assert md["router_predicted_cached_tokens"] == 40 * 16
    assert md["router_predicted_by_replica"] == {"b": 640, "c": 160}
    assert 0 <= md["router_decision_ms"] < 1000
    assert pr.routing_context.should_backoff        # Serve sleeps between failed attempts


def test_request_passed_as_keyword_is_found():
    index = PrefixIndex()
    index.apply_events("b", 0, stored=HASHES)
    router = make_router(FakeDirectory(index))
    ranks, pr = route(router, [FakeReplica("a"), FakeReplica("b")], as_kwarg=True)
    assert uids(ranks)[0] == ["b"]
    assert pr.kwargs["request"].metadata["router_predicted_cached_tokens"] == 1024


def test_busy_hot_replica_loses_to_idle_ones():
    index = PrefixIndex()
    index.apply_events("hot", 0, stored=HASHES)
    router = make_router(FakeDirectory(index))
    replicas = [FakeReplica("hot"), FakeReplica("x"), FakeReplica("y")]
    router._replica_queue_len_cache.update(replicas[0].replica_id, 30)   # Serve's fresh count
    router._replica_queue_len_cache.update(replicas[1].replica_id, 2)
    router._replica_queue_len_cache.update(replicas[2].replica_id, 1)
    ranks, _ = route(router, replicas)
    assert uids(ranks)[0] == ["y"] and uids(ranks)[-1][-1] == "hot"


def test_request_without_hashes_falls_back_to_power_of_two_without_asking_the_directory():
    directory = FakeDirectory(PrefixIndex())
    router = make_router(directory)
    ranks, pr = route(router, [FakeReplica(x) for x in "abcd"], hashes=[])
    assert len(ranks) == 1 and len(ranks[0]) == 2 and len(set(uids(ranks)[0])) == 2
    assert directory.calls == 0
    md = pr.args[0].metadata
    assert md["router_policy"] == "pow2_fallback" and md["router_fallback_reason"] == "no_hashes"


def test_slow_directory_is_abandoned_after_the_timeout():
    router = make_router(FakeDirectory(PrefixIndex(), delay_s=2.0), match_timeout_s=0.05)
    start = time.perf_counter()
    ranks, pr = route(router, [FakeReplica("a"), FakeReplica("b")])
    assert time.perf_counter() - start < 0.5
    assert len(ranks) == 1
    assert pr.args[0].metadata["router_fallback_reason"] == "directory_timeout"


def test_failing_directory_falls_back():
    router = make_router(FakeDirectory(PrefixIndex(), error=RuntimeError("boom")))
    ranks, pr = route(router, [FakeReplica("a"), FakeReplica("b")])
    assert sorted(uids(ranks)[0]) == ["a", "b"]
    assert pr.args[0].metadata["router_fallback_reason"] == "directory_error"


def test_missing_directory_lookup_does_not_block_the_event_loop(monkeypatch):
    router = make_router(match_timeout_s=0.05, lookup_retry_s=60)
    lookups = []

    def slow_missing_lookup():
        lookups.append(1)
        time.sleep(0.3)                      # a slow GCS answer, in the worker thread
        raise ValueError("Failed to look up actor 'kvharbor-prefix-directory'")

    monkeypatch.setattr(router.directory, "_get_actor", slow_missing_lookup)

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        reasons = []
        for _ in range(5):
            pr = pending()
            await router.choose_replicas([FakeReplica("a"), FakeReplica("b")], pr)
            reasons.append(pr.args[0].metadata["router_fallback_reason"])
            await asyncio.sleep(0.1)
        task.cancel()
        return ticks, reasons

    ticks, reasons = asyncio.run(go())
    assert ticks >= 30                        # the loop kept running during the lookup
    assert reasons[0] == "directory_lookup_pending"
    assert reasons[-1] == "directory_not_found"
    assert len(lookups) == 1                  # not retried before lookup_retry_s


def test_dead_replica_is_removed_from_the_directory():
    index = PrefixIndex()
    index.apply_events("b", 0, stored=HASHES)
    directory = FakeDirectory(index)
    directory.remove_replica = type("M", (), {"remote": staticmethod(index.remove_replica)})
    router = make_router(directory)
    router.on_replica_actor_died(FakeReplica("b").replica_id)
    assert index.match(HASHES) == {}


def test_unknown_router_kwargs_are_rejected():
    with pytest.raises(ValueError, match="unknown KVAwareRouter kwargs"):
        make_router(match_timout_s=1)


def test_policy_kwargs_reach_the_policy():
    router = make_router(policy={"load_cost_tokens": 7.0})
    assert router.policy.load_cost_tokens == 7.0


def test_real_directory_actor_is_found_by_name_and_used(ray_cluster):
    from kvharbor.actors.prefix_directory import get_or_create_directory

    handle = get_or_create_directory(name="kvh-router-test", namespace="kvh-tests")
    try:
        ray_cluster.get(handle.apply_events.remote("c", 0, HASHES[:30]))
        router = make_router(directory_name="kvh-router-test", directory_namespace="kvh-tests",
                             match_timeout_s=2.0)
        ranks, pr = route(router, [FakeReplica(x) for x in "abc"])
        assert pr.args[0].metadata["router_policy"] == "kv_aware"
        assert uids(ranks)[0] == ["c"]
        assert pr.args[0].metadata["router_predicted_by_replica"] == {"c": 480}
    finally:
        ray_cluster.kill(handle)

