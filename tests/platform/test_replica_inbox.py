"""LLMReplica without Serve: arrivals never wait for a step, stats never read a stepping engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvharbor.actors.replica import LLMReplica
from kvharbor.platform.protocol import GenerateRequest
from tests.conftest import until


def _req(rid: str, n: int, qos: str = "premium", max_tokens: int = 3) -> GenerateRequest:
    return GenerateRequest(request_id=rid, tenant="t", qos=qos, prompt_token_ids=[1 + i % 250 for i in range(n)],
                           block_hashes=[], sampling={"max_tokens": max_tokens, "temperature": 0.0,
                                                      "ignore_eos": True})


async def _collect(replica: LLMReplica, request: GenerateRequest) -> list[dict]:
    return [event async for event in replica.generate(request)]


def test_arrival_and_stats_do_not_wait_for_a_step_in_progress():
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64})
    engine = replica.engine
    gate, in_step = threading.Event(), threading.Event()
    step = engine.step
    stats_threads = []

    def slow_step():
        in_step.set()
        gate.wait(30)
        return step()

    def stats_spy(real=engine.stats):
        stats_threads.append(threading.current_thread() is threading.main_thread())
        return real()

    engine.step, engine.stats = slow_step, stats_spy

    async def scenario():
        first = asyncio.create_task(_collect(replica, _req("a", 20, "batch")))
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 30)
        stats_threads.clear()
        premium = asyncio.create_task(_collect(replica, _req("p", 10)))
        await asyncio.sleep(0.05)
        queued = len(replica._inbox)                 # accepted while the step still runs
        routing = await asyncio.wait_for(replica.record_routing_stats(), 1)
        stats = await asyncio.wait_for(replica.stats(), 1)
        on_loop = list(stats_threads)
        gate.set()
        return queued, routing, stats, on_loop, await first, await premium

    queued, routing, stats, on_loop, a, p = asyncio.run(scenario())
    assert queued == 1, "the premium arrival waited for the step in progress"
    assert not any(on_loop), "stats were computed on the event loop while a step ran"
    assert routing["total_blocks"] == stats["blocks_total"] == 64     # the last boundary's snapshot
    # The snapshot predates the step; the arrival still in the inbox counts as waiting (the
    # router adds only what it sends after this report).
    assert (routing["num_running"], routing["num_waiting"]) == (0, 1)
    assert [len(e["token_ids"]) for e in p] == [1, 1, 1] and p[-1]["finish_reason"] == "length"
    assert a[-1]["finish_reason"] == "length"
    engine.check_integrity()


def test_a_request_that_cannot_fit_gets_a_400_event():
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 8})
    events = asyncio.run(asyncio.wait_for(_collect(replica, _req("big", 400, max_tokens=8)), 30))
    assert len(events) == 1 and events[0]["status"] == 400 and "KV blocks" in events[0]["error"]
    assert not replica.engine.has_unfinished()


def test_pinned_region_and_step_trims_are_exported():
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64, "pinned_kv_blocks": 8,
                          "pinned_kv_blocks_max": 32})
    recorded = {}

    class Recorder:
        def __getattr__(self, name):
            return lambda *args: recorded.setdefault(name, []).append(args)

    replica.metrics = Recorder()
    replica.engine.scheduler.num_trimmed = 5
    replica.engine.interrupt.num_interrupted = 2
    replica._record_metrics()
    rid = replica.replica_id
    assert recorded["pinned_region"] == [(rid, {"size": 8, "target": 8, "floor": 8, "ceiling": 32,
                                                "demand_peak": 0})]
    assert recorded["step_budget_trims"] == [(rid, 5)]
    # Idle pinned blocks are reserved for their classes, not free for everyone.
    blocks = {(region, state): n for _, region, state, n in recorded["kv_blocks"]}
    assert blocks[("pinned", "reserved")] == 8 and blocks[("pinned", "free")] == 0
    assert blocks[("shared", "free")] == 56 and ("shared", "reserved") in blocks
    assert recorded["steps_interrupted"] == [(rid, 2)]


def test_streams_of_a_dead_caller_are_aborted_and_others_keep_running(monkeypatch):
    """A gateway killed mid-stream: the replica ends its streams (blocks freed), not others'."""
    import kvharbor.actors.replica as replica_module

    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64})
    monkeypatch.setattr(replica_module, "_actor_alive", lambda namespace, name: name != "dead-gw")
    orphan, kept = _req("orphan", 10, max_tokens=400), _req("kept", 10, max_tokens=30)
    orphan.caller, kept.caller = ("serve", "dead-gw"), ("serve", "live-gw")

    async def scenario():
        a = asyncio.create_task(_collect(replica, orphan))
        b = asyncio.create_task(_collect(replica, kept))
        await until(lambda: len(replica._meta) >= 2 and len(replica.engine.scheduler.running) >= 2, 30)
        aborted = await replica._abort_orphans()
        return aborted, await a, await b

    aborted, a, b = asyncio.run(scenario())
    assert aborted == 1
    assert a[-1]["finish_reason"] == "abort" and sum(len(e["token_ids"]) for e in a) < 400
    assert b[-1]["finish_reason"] == "length" and sum(len(e["token_ids"]) for e in b) == 30
    assert not replica.engine.has_unfinished()
    replica.engine.check_integrity()


def test_actor_alive_is_false_only_for_a_dead_named_actor(ray_cluster):
    import ray

    from kvharbor.actors.replica import _actor_alive

    @ray.remote(num_cpus=0)
    class Caller:
        def ping(self) -> int:
            return 1

    actor = Caller.options(name="kvh-test-caller", namespace="kvharbor-test").remote()
    ray.get(actor.ping.remote())
    assert _actor_alive("kvharbor-test", "kvh-test-caller")
    ray.kill(actor, no_restart=True)
    for _ in range(100):
        if not _actor_alive("kvharbor-test", "kvh-test-caller"):
            break
        import time
        time.sleep(0.1)
    assert not _actor_alive("kvharbor-test", "kvh-test-caller")


def test_a_cpu_replica_lowers_the_priority_of_its_engine_steps_only():
    """``nice``: engine steps run on a thread whose nice value is ``nice`` higher, so the gateway
    and this replica's own event loop (requests in, tokens out) get the cores before the steps'
    compute; the thread that built the replica and runs its loop keeps its priority."""
    import os

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 16}, nice=3)
    stepped_on, step = [], replica.engine.step

    def spy():
        stepped_on.append(threading.get_native_id())
        return step()

    replica.engine.step = spy
    events = asyncio.run(_collect(replica, _req("a", 8)))
    assert events[-1]["finish_reason"] == "length"
    assert stepped_on and all(os.getpriority(os.PRIO_PROCESS, tid) == min(own + 3, 19)
                              for tid in set(stepped_on))
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own, \
        "the replica lowered the priority of the thread that runs its event loop"
    plain = LLMReplica({"device": "cpu", "num_kv_blocks": 16})
    tid = plain._step_pool.submit(threading.get_native_id).result()
    assert os.getpriority(os.PRIO_PROCESS, tid) == own
    replica.__del__()
    plain.__del__()


def test_a_premium_arrival_cuts_the_lower_class_step_in_flight():
    """generate() announces a premium arrival while a batch step runs: the step is cut at its
    next layer and the premium request runs in the very next step; both streams finish."""
    from kvharbor.config import DEFAULT_QOS
    from kvharbor.engine.step_budget import StepInterrupt

    classes = {k: {**q.model_dump(), "step_target_ms": 20.0 if k == "premium" else None}
               for k, q in DEFAULT_QOS.items()}
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64, "qos_classes": classes})
    engine = replica.engine
    in_layer, go = threading.Event(), threading.Event()

    class Held(StepInterrupt):
        """Holds the first step at layer 1 until the premium request has been queued."""

        __slots__ = ()

        def check(self, layer: int, before_mlp: bool = False) -> None:
            if layer == 1 and not before_mlp and not in_layer.is_set():
                in_layer.set()
                go.wait(30)
            super().check(layer, before_mlp)

    held = Held(engine.runner.num_layers)
    held.interruptible = engine.interrupt.interruptible
    engine.interrupt = engine.runner.interrupt = held

    async def scenario():
        batch = asyncio.create_task(_collect(replica, _req("b", 40, "batch", max_tokens=4)))
        await asyncio.get_running_loop().run_in_executor(None, in_layer.wait, 30)
        premium = asyncio.create_task(_collect(replica, _req("p", 10, max_tokens=3)))
        await asyncio.sleep(0.05)
        go.set()
        return await batch, await premium

    b, p = asyncio.run(scenario())
    assert held.num_interrupted == 1, "the batch step was not cut for the premium arrival"
    assert sum(len(e["token_ids"]) for e in p) == 3 and p[-1]["finish_reason"] == "length"
    assert sum(len(e["token_ids"]) for e in b) == 4 and b[-1]["finish_reason"] == "length"
    engine.check_integrity()


def test_routing_stats_tell_empty_blocks_from_cached_ones():
    """A finished prompt's blocks stay cached: free for a new request, but not empty (using
    them evicts a prefix); the router needs the difference to spread new prefixes."""
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64})

    async def scenario():
        before = await replica.record_routing_stats()
        await _collect(replica, _req("a", 160, "batch", max_tokens=1))
        return before, await replica.record_routing_stats()

    before, after = asyncio.run(scenario())
    assert before["empty_shared_blocks"] == before["free_shared_blocks"] == before["shared_blocks"]
    assert after["free_shared_blocks"] == before["free_shared_blocks"]        # all released
    assert after["empty_shared_blocks"] <= before["empty_shared_blocks"] - 160 // 16


class _RecordingDirectory:
    """Stands in for ``DirectorySync``: notes, at each publish, how many events the caller had."""

    def __init__(self, seen: list) -> None:
        self.seen, self.at_publish = seen, []

    def publish(self, engine) -> None:
        engine.drain_kv_events()
        self.at_publish.append(len(self.seen))

    def prepare(self, engine):
        return None

    async def settle(self, resync_ref=None) -> None:
        return None


def test_a_steps_tokens_reach_the_caller_before_its_kv_events_are_published():
    """Publishing a step's KV events is an actor call (~0.7 ms here); the tokens go first."""
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64})
    seen: list[dict] = []
    replica.directory = directory = _RecordingDirectory(seen)

    async def scenario():
        async for event in replica.generate(_req("a", 40, max_tokens=3)):
            seen.append(event)

    asyncio.run(scenario())
    assert [len(e["token_ids"]) for e in seen] == [1, 1, 1]
    # the steps that produced the 1st, 2nd and 3rd token published after the caller had each
    assert directory.at_publish[:3] == [1, 2, 3], directory.at_publish


def test_a_second_stream_under_a_running_request_id_is_refused_and_the_first_keeps_its_tokens():
    """Request ids name streams: a second ``generate`` with an id in use gets a 400 event and
    takes nothing from the stream already running under it."""
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64})

    async def scenario():
        first = asyncio.create_task(_collect(replica, _req("same", 10, max_tokens=20)))
        await until(lambda: "same" in replica._streams, 30)
        second = await _collect(replica, _req("same", 12, max_tokens=5))
        return await first, second

    first, second = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert len(second) == 1 and second[0]["status"] == 400 and "already in use" in second[0]["error"]
    assert first[-1]["finish_reason"] == "length" and sum(len(e["token_ids"]) for e in first) == 20
    assert not replica.engine.has_unfinished()
    replica.engine.check_integrity()


def test_sampling_the_engine_cannot_use_gets_a_400_and_the_running_request_keeps_its_tokens():
    """``sampling`` is a plain dict on the handle: a float seed or a stop list of numbers
    used to be queued and then fail every engine step, the running tenant's request too."""
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64})

    def bad(rid, **sampling):
        return GenerateRequest(request_id=rid, tenant="u", qos="standard", prompt_token_ids=[5, 6, 7],
                               block_hashes=[], sampling={"max_tokens": 4, **sampling})

    async def scenario():
        running = asyncio.create_task(_collect(replica, _req("ok", 10, max_tokens=20)))
        await until(lambda: "ok" in replica._streams, 30)
        refused = [await _collect(replica, bad("seed", seed=1.5)), await _collect(replica, bad("stop", stop=[5]))]
        return await running, refused

    running, refused = asyncio.run(asyncio.wait_for(scenario(), 60))
    for events, field in zip(refused, ("seed", "stop")):
        assert len(events) == 1 and events[0]["status"] == 400 and field in events[0]["error"], events
    assert running[-1]["finish_reason"] == "length" and sum(len(e["token_ids"]) for e in running) == 20
    assert not replica.engine.has_unfinished()


def test_a_stream_its_caller_stops_reading_aborts_the_request():
    """The caller goes away mid-stream (its iterator closed): the request is aborted at the
    next step boundary and its blocks are freed, not generated to max_tokens for nobody."""
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64})

    async def scenario():
        stream = replica.generate(_req("gone", 10, max_tokens=400))
        first = await stream.__anext__()
        request = replica.engine.requests["gone"]
        await stream.aclose()
        await until(lambda: not replica.engine.has_unfinished(), 10)
        return first, request

    first, request = asyncio.run(scenario())
    assert first["token_ids"] and not replica.engine.has_unfinished()
    assert request.num_output_tokens < 400, "generated to max_tokens after its caller left"
    assert replica.engine.stats()["blocks_used"] == 0
    replica.engine.check_integrity()


def test_a_queued_request_that_stops_fitting_ends_its_stream_with_a_400():
    """Capacity shrinks right after a request was queued (a prefix pinned, as a tenants.yaml
    reload does): its stream gets a 400 event naming the shortfall instead of waiting forever."""
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 32})
    engine = replica.engine
    add = engine.add_request

    def add_then_pin(*args, **kwargs):
        req = add(*args, **kwargs)
        engine.pin_prefix([250 - i % 200 for i in range(320)], qos="standard")   # 20 of 32 blocks
        return req

    engine.add_request = add_then_pin
    events = asyncio.run(asyncio.wait_for(_collect(replica, _req("big", 300, max_tokens=20)), 30))
    assert len(events) == 1 and events[0]["status"] == 400, events
    assert "needs 20 KV blocks but only 12" in events[0]["error"]
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_routing_stats_count_running_requests_by_priority():
    """``queue_by_priority`` holds running and waiting requests (what a router weighs a
    replica's load by), not only the waiting ones."""
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64})

    async def scenario():
        task = asyncio.create_task(_collect(replica, _req("a", 10, "batch", max_tokens=200)))
        await until(lambda: replica._snapshot["stats"]["num_running"] >= 1, 30)
        stats = await replica.record_routing_stats()
        await replica.abort("a")
        await task
        return stats

    stats = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert (stats["num_running"], stats["num_waiting"]) == (1, 0)
    assert sum(stats["queue_by_priority"].values()) == 1, stats["queue_by_priority"]


def test_routing_stats_count_waiting_requests_by_priority():
    """One seat, one batch request running and two waiting: ``queue_by_priority`` counts all
    three at batch's priority (the waiting ones from the scheduler's per-tenant queues)."""
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64, "max_num_seqs": 1})

    async def scenario():
        tasks = [asyncio.create_task(_collect(replica, _req(rid, 10, "batch", max_tokens=200)))
                 for rid in ("a", "b", "c")]
        await until(lambda: replica._snapshot["stats"]["num_waiting"] == 2, 30)
        stats = await replica.record_routing_stats()
        for rid in ("a", "b", "c"):
            await replica.abort(rid)
        await asyncio.gather(*tasks)
        return stats

    stats = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert (stats["num_running"], stats["num_waiting"]) == (1, 2)
    batch = replica.engine.config.qos_classes["batch"].priority
    assert stats["queue_by_priority"] == {batch: 3}, stats["queue_by_priority"]


def test_an_engine_loop_that_dies_ends_every_stream_with_an_error():
    """A failure outside a step (here: publishing KV events) kills the engine loop: every
    open stream gets a 500 event at once instead of waiting forever, and health turns red."""
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 64})

    def broken():
        raise RuntimeError("directory client broke")

    replica._publish_events = broken

    async def scenario():
        events = await _collect(replica, _req("a", 10, max_tokens=50))
        with pytest.raises(RuntimeError, match="engine loop died"):
            await replica.check_health()
        return events

    events = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert events[-1]["status"] == 500 and "directory client broke" in events[-1]["error"]
