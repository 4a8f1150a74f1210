"""KVAwareRouter with fake replicas and pending requests, its index fed by in-process or real
directory shards."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.serve._private.common import (DeploymentHandleSource, DeploymentID, ReplicaID,
                                       RequestMetadata)
from ray.serve.request_router import PendingRequest

from kvharbor.actors.prefix_directory import DirectoryShard
from kvharbor.engine.hashing import hash_prompt_blocks
from kvharbor.platform.protocol import GenerateRequest
from kvharbor.platform.router import FIRST_POLL_WAIT_S, KVAwareRouter

DEPLOYMENT = DeploymentID(name="LLMReplica", app_name="kvharbor")
PROMPT = list(range(64 * 16))                       # 64 full blocks
HASHES = hash_prompt_blocks(PROMPT, 16)


class FakeReplica:
    """What choose_replicas reads from a RunningReplica."""

    def __init__(self, uid: str, **stats) -> None:
        self.replica_id = ReplicaID(unique_id=uid, deployment_id=DEPLOYMENT)
        self.routing_stats = {"block_size": 16, **stats}
        self.max_ongoing_requests = 64


class FakeShard:
    """A directory shard in-process: ``poll`` answers from a ``DirectoryShard``; ``call``
    records control-plane calls. ``hang`` makes every call wait forever."""

    def __init__(self, shard: DirectoryShard | None = None) -> None:
        self.shard = shard or DirectoryShard()
        self.polls, self.calls, self.hang, self.fail = 0, [], False, False

    async def poll(self, epoch, cursor, max_entries):
        self.polls += 1
        if self.hang:
            await asyncio.Event().wait()
        if self.fail:
            raise ConnectionError("directory down")
        return self.shard.poll(epoch, cursor, max_entries)

    async def call(self, method, *args):
        self.calls.append((method, *args))
        return getattr(self.shard, method)(*args)


def make_router(shard: FakeShard | None = None, synced: bool = True, **kwargs) -> KVAwareRouter:
    """A router whose follower reads ``shard``; the background poll task is not started
    (tests call ``poll_once`` themselves), so every directory call is visible."""
    router = KVAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    router._ensure_following = lambda: None
    if shard is not None:
        router.shards = [shard]
        router.follower.shards = [shard]
        if synced:
            asyncio.run(router.follower.poll_once())
    return router


def pending(hashes=HASHES, as_kwarg: bool = False, rid: str = "r1", prompt=PROMPT,
            **fields) -> PendingRequest:
    fields = {"tenant": "acme", "qos": "standard", **fields}
    req = GenerateRequest(request_id=rid, prompt_token_ids=prompt, block_hashes=list(hashes),
                          sampling={}, **fields)
    args, kwargs = ([], {"request": req}) if as_kwarg else ([req], {})
    return PendingRequest(args=args, kwargs=kwargs,
                          metadata=RequestMetadata(request_id=rid, internal_request_id="i-" + rid))


def route(router: KVAwareRouter, replicas, **pending_kwargs):
    """One choose_replicas call in a fresh event loop; returns (ranks, pending request)."""

    async def go():
        pr = pending(**pending_kwargs)        # PendingRequest needs a running loop
        return await router.choose_replicas(replicas, pr), pr

    return asyncio.run(go())


def uids(ranks) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def md(pr) -> dict:
    return pr.args[0].metadata


def routed(router, pr, replica: FakeReplica) -> None:
    """What Serve does once the replica accepted the request."""
    router.on_request_routed(pr, replica.replica_id, None)


def test_routes_to_the_replica_holding_the_prefix_and_records_the_prediction():
    shard = FakeShard()
    shard.shard.apply_events("b", 0, stored=HASHES[:40])
    shard.shard.apply_events("c", 0, stored=HASHES[:10])
    router = make_router(shard)
    replicas = [FakeReplica(x) for x in "abcd"]

    ranks, pr = route(router, replicas)
    got = uids(ranks)
    assert got[:2] == [["b"], ["c"]] and sorted(got[2]) == ["a", "d"]
    assert md(pr)["router_policy"] == "kv_aware" and md(pr)["router_fallback_reason"] is None
    assert md(pr)["router_predicted_cached_tokens"] == 40 * 16
    assert md(pr)["router_predicted_by_replica"] == {"b": 640, "c": 160}
    assert 0 <= md(pr)["router_decision_ms"] < 1000
    assert pr.routing_context.should_backoff        # Serve sleeps between failed attempts


def _fresh_router(shard: FakeShard) -> KVAwareRouter:
    """A router as Serve makes it, its follower started by the router itself."""
    router = KVAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    router.shards = router.follower.shards = [shard]
    return router


def test_a_new_router_routes_its_first_request_by_the_index():
    """A gateway replica that has not routed yet (its follower never polled) must not fall back
    to power of two for its first request: it waits for the follower's first poll."""
    shard = FakeShard()
    shard.shard.apply_events("b", 0, stored=HASHES)

    async def go():
        router = _fresh_router(shard)
        pr = pending()
        ranks = await router.choose_replicas([FakeReplica("a"), FakeReplica("b")], pr)
        router._follow_task.cancel()
        return ranks, pr

    ranks, pr = asyncio.run(go())
    assert uids(ranks)[0] == ["b"] and md(pr)["router_policy"] == "kv_aware", md(pr)


def test_a_directory_that_never_answers_delays_only_the_first_decision():
    shard = FakeShard()
    shard.hang = True

    async def go():
        router = _fresh_router(shard)
        replicas = [FakeReplica("a"), FakeReplica("b")]
        start = time.perf_counter()
        await router.choose_replicas(replicas, pending(rid="r1"))
        first = time.perf_counter() - start
        start = time.perf_counter()
        pr = pending(rid="r2")
        await router.choose_replicas(replicas, pr)
        router._follow_task.cancel()
        return first, time.perf_counter() - start, pr

    first, second, pr = asyncio.run(go())
    assert FIRST_POLL_WAIT_S * 0.9 <= first < FIRST_POLL_WAIT_S + 0.5, first
    assert second < 0.05 and md(pr)["router_policy"] != "kv_aware", (second, md(pr))


def test_a_decision_makes_no_directory_call_even_when_the_directory_hangs():
    shard = FakeShard()
    shard.shard.apply_events("b", 0, stored=HASHES)
    router = make_router(shard)
    shard.hang = True
    polls = shard.polls
    start = time.perf_counter()
    for i in range(20):
        ranks, pr = route(router, [FakeReplica("a"), FakeReplica("b")], rid=f"r{i}")
        assert uids(ranks)[0] == ["b"] and md(pr)["router_policy"] == "kv_aware"
    assert time.perf_counter() - start < 1.0
    assert shard.polls == polls and shard.calls == []


def test_request_passed_as_keyword_is_found():
    shard = FakeShard()
    shard.shard.apply_events("b", 0, stored=HASHES)
    router = make_router(shard)
    ranks, pr = route(router, [FakeReplica("a"), FakeReplica("b")], as_kwarg=True)
    assert uids(ranks)[0] == ["b"]
    assert pr.kwargs["request"].metadata["router_predicted_cached_tokens"] == 1024


def test_busy_hot_replica_loses_to_idle_ones():
    shard = FakeShard()
    shard.shard.apply_events("hot", 0, stored=HASHES)
    router = make_router(shard)
    replicas = [FakeReplica("hot"), FakeReplica("x"), FakeReplica("y")]
    router._replica_queue_len_cache.update(replicas[0].replica_id, 30)   # Serve's fresh count
    router._replica_queue_len_cache.update(replicas[1].replica_id, 2)
    router._replica_queue_len_cache.update(replicas[2].replica_id, 1)
    ranks, _ = route(router, replicas)
    assert uids(ranks)[0] == ["y"] and uids(ranks)[-1][-1] == "hot"


def test_fresh_routing_stats_outweigh_a_leaked_in_flight_count():
    """Serve's count can stay high after cancelled streams (seen after a test that closed
    held streams: an idle replica holding the prefix lost every request for seconds). Fresh
    stats give the load: what the replica reported plus what this router sent it since."""
    shard = FakeShard()
    shard.shard.apply_events("hot", 0, stored=HASHES)
    router = make_router(shard)
    now = time.time()
    replicas = [FakeReplica("hot", num_running=0, num_waiting=0, at=now),
                FakeReplica("x", num_running=0, num_waiting=0, at=now)]
    router._replica_queue_len_cache.update(replicas[0].replica_id, 3)      # leaked
    router._replica_queue_len_cache.update(replicas[1].replica_id, 0)
    ranks, pr = route(router, replicas, rid="r0")
    assert uids(ranks)[0] == ["hot"]
    routed(router, pr, replicas[0])
    assert router._in_flight(replicas[0]) == 1           # sent after the report: counted
    for i in range(1, 3):
        _, pr = route(router, replicas, rid=f"r{i}")
        routed(router, pr, replicas[0])
    assert router._in_flight(replicas[0]) == 3
    assert uids(route(router, replicas, rid="r3")[0])[0] == ["x"]     # now it is busy
    replicas[0].routing_stats.update(at=time.time(), num_running=2)   # a report after the sends
    assert router._in_flight(replicas[0]) == 2                         # they are in it, not added
    replicas[0].routing_stats.update(at=now, num_running=0)
    replicas[0].routing_stats["at"] = now - 10                         # stale stats: Serve's count
    router._replica_queue_len_cache.update(replicas[0].replica_id, 5)  # (the stale bound says 3)
    assert router._in_flight(replicas[0]) == 5 and router._in_flight(replicas[1]) == 0


def test_requests_that_ended_since_the_last_report_do_not_count():
    """Fresh stats bound the load from above only: a replica that reported 3 running
    requests and has finished 2 of them since (Serve's count: 1) has a load of 1, and wins
    a request with no prefix anywhere over a replica at 2."""
    router = make_router(FakeShard())
    now = time.time()
    replicas = [FakeReplica("drained", num_running=3, num_waiting=0, at=now),
                FakeReplica("busy", num_running=2, num_waiting=0, at=now)]
    router._replica_queue_len_cache.update(replicas[0].replica_id, 1)
    router._replica_queue_len_cache.update(replicas[1].replica_id, 2)
    assert router._in_flight(replicas[0]) == 1 and router._in_flight(replicas[1]) == 2
    ranks, _ = route(router, replicas, hashes=hash_prompt_blocks(list(range(500, 1500)), 16))
    assert uids(ranks)[0] == ["drained"]


def test_request_without_hashes_falls_back_to_power_of_two():
    router = make_router(FakeShard())
    ranks, pr = route(router, [FakeReplica(x) for x in "abcd"], hashes=[])
    assert len(ranks) == 1 and len(ranks[0]) == 2 and len(set(uids(ranks)[0])) == 2
    assert md(pr)["router_policy"] == "pow2_fallback"
    assert md(pr)["router_fallback_reason"] == "no_hashes"


def test_without_the_event_stream_the_router_routes_from_its_own_history():
    shard = FakeShard()
    shard.fail = True
    router = make_router(shard)                       # first poll failed: never synced
    replicas = [FakeReplica(x) for x in "abcd"]
    ranks, first = route(router, replicas, rid="first")
    assert md(first)["router_policy"] == "pow2_fallback"
    assert md(first)["router_fallback_reason"] == "no_history"
    chosen = next(r for r in replicas if r.replica_id.unique_id == uids(ranks)[0][0])
    routed(router, first, chosen)
    router.active = type(router.active)()            # only the history may explain the choice
    ranks, second = route(router, replicas, rid="second")
    assert md(second)["router_policy"] == "approx"
    assert md(second)["router_fallback_reason"] == "stream_not_started"
    assert uids(ranks)[0] == [chosen.replica_id.unique_id]


def test_a_stale_stream_switches_to_approximate_mode():
    now = [0.0]
    shard = FakeShard()
    shard.shard.apply_events("b", 0, stored=HASHES)
    router = make_router(shard, stale_after_s=1.0)
    router.follower.clock = lambda: now[0]
    asyncio.run(router.follower.poll_once())
    _, pr = route(router, [FakeReplica("a"), FakeReplica("b")], rid="x")
    routed(router, pr, FakeReplica("b"))
    now[0] = 5.0
    ranks, pr = route(router, [FakeReplica("a"), FakeReplica("b")], rid="y")
    assert md(pr)["router_policy"] == "approx"
    assert md(pr)["router_fallback_reason"] == "stream_stale"
    assert uids(ranks)[0] == ["b"]


def test_a_burst_of_a_new_prefix_follows_the_first_request_until_load_spreads_it():
    router = make_router(FakeShard())
    replicas = [FakeReplica(x) for x in "abcd"]
    ranks, pr = route(router, replicas, rid="r0")
    first = uids(ranks)[0][0]
    ranks, pr = route(router, replicas, rid="r1")     # no KV event yet: active blocks
    assert uids(ranks)[0] == [first]
    assert md(pr)["router_predicted_by_replica"][first] == len(PROMPT)
    loads = dict.fromkeys("abcd", 0)
    loads[first] = 2
    for i in range(2, 42):                            # Serve's in-flight count moves
        for r in replicas:
            router._replica_queue_len_cache.update(r.replica_id, loads[r.replica_id.unique_id])
        ranks, _ = route(router, replicas, rid=f"r{i}")
        loads[uids(ranks)[0][0]] += 1
    assert max(loads.values()) / (sum(loads.values()) / 4) <= 1.25
    assert loads[first] == max(loads.values())


def test_a_bursts_second_copy_joins_the_replica_computing_its_prefix():
    """Copies of one 400-token prompt sent through one router before any KV event: the
    second goes where the first is computing the prefix although that replica has a request
    more in flight (it is that request); the third, with two ahead, spills to the idle one."""
    router = make_router(FakeShard())
    replicas = {x: FakeReplica(x) for x in "ab"}
    prompt = list(range(7_000, 7_400))
    hashes = hash_prompt_blocks(prompt, 16)
    ranks, pr = route(router, list(replicas.values()), rid="c0", hashes=hashes, prompt=prompt)
    hot = uids(ranks)[0][0]
    cold = next(x for x in replicas if x != hot)
    routed(router, pr, replicas[hot])
    router._replica_queue_len_cache.update(replicas[hot].replica_id, 1)
    router._replica_queue_len_cache.update(replicas[cold].replica_id, 0)
    ranks, pr = route(router, list(replicas.values()), rid="c1", hashes=hashes, prompt=prompt)
    assert uids(ranks)[0] == [hot] and md(pr)["router_predicted_cached_tokens"] == 400
    routed(router, pr, replicas[hot])
    router._replica_queue_len_cache.update(replicas[hot].replica_id, 2)
    ranks, _ = route(router, list(replicas.values()), rid="c2", hashes=hashes, prompt=prompt)
    assert uids(ranks)[0] == [cold]


def test_prefill_just_sent_to_a_replica_weighs_on_the_next_unrelated_request():
    """The router's active blocks reach the policy: ``r0`` sends a 4,096-token prompt to one
    replica (no KV event yet); an unrelated prompt then goes to the other replica although
    that one has a request more in flight (one request ahead costs 512 tokens, the 256
    blocks still to prefill 1,024)."""
    router = make_router(FakeShard())
    replicas = [FakeReplica(x) for x in "ab"]
    long = hash_prompt_blocks(list(range(256 * 16)), 16)
    ranks, pr = route(router, replicas, hashes=long, rid="r0")
    first = uids(ranks)[0][0]
    routed(router, pr, next(r for r in replicas if r.replica_id.unique_id == first))
    assert router.active.count(first) == 256
    for r in replicas:
        router._replica_queue_len_cache.update(r.replica_id, 0 if r.replica_id.unique_id == first else 1)
    other = hash_prompt_blocks(list(range(50_000, 50_000 + 64 * 16)), 16)
    ranks, _ = route(router, replicas, hashes=other, rid="r1")
    assert uids(ranks)[0] != [first]


def test_stored_events_confirm_active_blocks():
    shard = FakeShard()
    router = make_router(shard)
    _, pr = route(router, [FakeReplica("a"), FakeReplica("b")], rid="r0")
    assert md(pr)["router_predicted_by_replica"] == {}
    (target,) = router.active.replicas()
    assert router.active.count(target) == len(HASHES)
    shard.shard.apply_events(target, 0, stored=HASHES)
    asyncio.run(router.follower.poll_once())
    assert router.active.count(target) == 0
    assert router.follower.index.match(HASHES)[target].blocks == len(HASHES)


def test_a_retry_skips_the_replica_that_failed_unless_it_is_the_only_one():
    shard = FakeShard()
    shard.shard.apply_events("b", 0, stored=HASHES)
    router = make_router(shard)
    replicas = [FakeReplica(x) for x in "abc"]
    ranks, pr = route(router, replicas)
    assert uids(ranks)[0] == ["b"]
    routed(router, pr, replicas[1])
    from kvharbor.platform.generation import exclude_failed_replica

    exclude_failed_replica(md(pr))
    assert md(pr)["exclude_replicas"] == ["b"]
    ranks, _ = route(router, replicas, metadata=dict(md(pr)))
    assert "b" not in {u for rank in uids(ranks) for u in rank}
    ranks, _ = route(router, [replicas[1]], metadata=dict(md(pr)))
    assert uids(ranks) == [["b"]]


def test_dead_replica_is_forgotten_here_and_in_the_directory():
    shard = FakeShard()
    shard.shard.apply_events("b", 0, stored=HASHES)
    router = make_router(shard)
    b = FakeReplica("b")
    routed(router, route(router, [b])[1], b)
    other = hash_prompt_blocks(PROMPT, 16, salt="other")       # not cached: active at b
    routed(router, route(router, [b], hashes=other, session_id="s9", rid="r2")[1], b)
    assert "b" in router._sent and router.active.count("b") == len(other)
    assert "b" in router._stats_sessions

    async def go():
        router._lazily_fetched_loop = asyncio.get_running_loop()
        router.on_replica_actor_died(b.replica_id)
        for _ in range(5):
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert router.follower.index.match(HASHES) == {}
    assert ("remove_replica", "b") in shard.calls
    assert shard.shard.match(HASHES) == {}
    assert "b" not in router._sent                    # its send times go too
    # and nothing else of it stays behind: routing history, active blocks, reported sessions
    assert router.history.index.replicas() == [] and router.active.replicas() == []
    assert "b" not in router._stats_sessions


def test_a_decision_brings_an_idle_follower_back_to_full_pace():
    """The request's KV events follow within a step or two: a router whose follower slowed
    down while nothing happened polls at full pace again from its next decision on."""
    shard = FakeShard()
    shard.shard.apply_events("b", 0, stored=HASHES[:40])
    router = make_router(shard, idle_poll_interval_s=0.5)
    assert router.follower.idle_poll_interval_s == 0.5
    router.follower._active_at -= 60.0                 # a minute of nothing
    assert router.follower.idle()
    route(router, [FakeReplica(x) for x in "ab"])
    assert not router.follower.idle()


def test_unknown_router_kwargs_are_rejected():
    with pytest.raises(ValueError, match="unknown KVAwareRouter kwargs"):
        make_router(match_timout_s=1)


def test_policy_kwargs_reach_the_policy():
    router = make_router(policy={"load_cost_tokens": 7.0})
    assert router.policy.load_cost_tokens == 7.0


def test_real_directory_actor_feeds_the_router_index(ray_cluster):
    from kvharbor.actors.prefix_directory import get_or_create_directory

    handle = get_or_create_directory(name="kvh-router-test", namespace="kvh-tests")
    try:
        ray_cluster.get(handle.apply_events.remote("c", 0, HASHES[:30]))
        router = KVAwareRouter(deployment_id=DEPLOYMENT,
                               handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(directory_name="kvh-router-test",
                                directory_namespace="kvh-tests", poll_interval_s=0.01)
        replicas = [FakeReplica(x) for x in "abc"]

        async def go():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                pr = pending()
                ranks = await router.choose_replicas(replicas, pr)
                if md(pr)["router_policy"] == "kv_aware":
                    return ranks, pr
                await asyncio.sleep(0.05)
            raise AssertionError("the router never synced with the directory")

        ranks, pr = asyncio.run(go())
        assert uids(ranks)[0] == ["c"]
        assert md(pr)["router_predicted_by_replica"] == {"c": 480}
    finally:
        ray_cluster.kill(handle)


def test_the_index_follower_stops_once_ray_is_shut_down(monkeypatch):
    """A router left in a driver after ray.shutdown() stops polling its directory actors
    instead of calling one (which makes Ray start a new local cluster while the interpreter
    exits); routers over in-process shards (these tests) never depend on Ray."""
    from kvharbor.platform import index_follower

    from tests.platform.follower_helpers import CountingActorShard, returns_within

    shard = CountingActorShard()
    router = make_router(shard, synced=False)
    router._first_poll = asyncio.Event()

    monkeypatch.setattr(index_follower, "ray_initialized", lambda: True)
    assert asyncio.run(returns_within(router._follow, 0.05)) is False and shard.polls >= 1  # polls
    polls = shard.polls
    monkeypatch.setattr(index_follower, "ray_initialized", lambda: False)
    assert asyncio.run(returns_within(router._follow, 0.05)) is True and shard.polls == polls  # no call
    fake = make_router(FakeShard(), synced=False)
    assert not fake.follower.ray_shut_down()               # in-process shards: Ray never matters


def test_serve_can_pickle_the_router_class_while_routers_are_alive():
    """Serve pickles the router class by value (``RequestRouterConfig``, e.g. in
    ``serve.status()``); a live router with a running follower task must not break that,
    and stays listed: unpickling in this process resets the class's own attributes (a
    registry kept there was emptied, so ``routing.py`` reported no router index)."""
    import kvharbor.platform.router as router_module
    from ray import cloudpickle

    async def scenario():
        router = KVAwareRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        router._follow_task = asyncio.get_running_loop().create_task(asyncio.sleep(10))
        assert router in KVAwareRouter.instances()
        cloudpickle.register_pickle_by_value(router_module)
        try:
            copy = cloudpickle.loads(cloudpickle.dumps(KVAwareRouter))
            assert router in KVAwareRouter.instances() and router in copy.instances()
            another = copy(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
            assert another in KVAwareRouter.instances()
        finally:
            cloudpickle.unregister_pickle_by_value(router_module)
            router._follow_task.cancel()
        return copy

    copy = asyncio.run(scenario())
    assert copy.__name__ == "KVAwareRouter"


def test_the_first_poll_of_the_follower_releases_a_waiting_first_decision():
    """``_follow`` marks the router's first poll (a new router's first decision waits for it)."""
    from tests.platform.follower_helpers import returns_within

    router = make_router(FakeShard(), synced=False)
    router._first_poll = asyncio.Event()
    assert asyncio.run(returns_within(router._follow, 0.05)) is False   # follows until cancelled
    assert router._first_poll.is_set()


def test_a_request_serve_sends_to_a_lower_rank_takes_its_active_blocks_along():
    """The blocks noted as about to be computed at the top choice move to the replica that
    took the request when Serve had to fall back to a lower rank (the top one was full)."""
    router = make_router(FakeShard())
    replicas = {x: FakeReplica(x) for x in "ab"}
    ranks, pr = route(router, list(replicas.values()))
    top, other = uids(ranks)[0][0], uids(ranks)[1][0]
    assert router.active.count(top) == len(HASHES) and router.active.count(other) == 0
    routed(router, pr, replicas[other])
    assert router.active.count(other) == len(HASHES) and router.active.count(top) == 0


def test_the_block_size_comes_from_the_replicas_reports():
    """Hashes are per block of the replicas' size; a router configured for another size still
    predicts cached tokens in the replicas' blocks."""
    hashes = hash_prompt_blocks(PROMPT, 32)
    shard = FakeShard()
    shard.shard.apply_events("b", 0, stored=hashes[:10])
    router = make_router(shard, default_block_size=16)
    replicas = [FakeReplica(x, block_size=32) for x in "ab"]
    ranks, pr = route(router, replicas, hashes=hashes)
    assert uids(ranks)[0] == ["b"] and md(pr)["router_predicted_cached_tokens"] == 320


def test_a_replica_id_keyword_sends_the_call_to_that_replica():
    router = make_router(FakeShard())
    replicas = [FakeReplica(x) for x in "abc"]

    async def go():
        pr = PendingRequest(args=[], kwargs={"replica_id": "c"},
                            metadata=RequestMetadata(request_id="x", internal_request_id="i-x"))
        return await router.choose_replicas(replicas, pr)

    assert uids(asyncio.run(go())) == [["c"]]


def test_what_the_router_remembers_per_request_stays_bounded():
    """A decision notes its guess until Serve reports where the request went; requests that
    are never routed (cancelled while queued) must not pile up."""
    router = make_router(FakeShard())
    replicas = [FakeReplica(x) for x in "ab"]

    async def go():
        for i in range(4200):
            await router.choose_replicas(replicas, pending(rid=f"r{i}"))

    asyncio.run(go())
    assert len(router._guesses) == 4096


def test_the_send_times_kept_per_replica_cover_only_the_fresh_stats_window(monkeypatch):
    """The router keeps when it sent each replica a request, to count sends after the
    replica's last report; it forgets those older than a report can be fresh (2 s), so a
    router that routes for days keeps seconds of them."""
    from types import SimpleNamespace

    clock = [1000.0]     # the method's own globals: another test unpickles the class by value
    monkeypatch.setitem(KVAwareRouter.on_request_routed.__globals__, "time",
                        SimpleNamespace(time=lambda: clock[0]))
    router = make_router(FakeShard())
    replica = FakeReplica("a")

    async def go():
        for i in range(600):                          # 10 sends a second for a minute
            clock[0] += 0.1
            router.on_request_routed(pending(rid=f"r{i}"), replica.replica_id, None)

    asyncio.run(go())
    assert 19 <= len(router._sent["a"]) <= 21


def test_round_robin_router_ranks_every_replica_once_starting_one_further_each_time():
    from kvharbor.platform.router import RoundRobinRouter

    router = RoundRobinRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    replicas = [FakeReplica(x) for x in "cab"]
    firsts = []
    for _ in range(4):
        ranks = uids(asyncio.run(router.choose_replicas(replicas, None)))
        assert sorted(u for rank in ranks for u in rank) == ["a", "b", "c"]
        firsts.append(ranks[0][0])
    assert firsts == ["a", "b", "c", "a"]
