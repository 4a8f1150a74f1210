"""LLMReplica without Serve: arrivals never wait for a step, stats never read a stepping engine."""

from __future__ import annotations

import asyncio
import threading

from kvharbor.actors.replica import LLMReplica
from kvharbor.platform.protocol import GenerateRequest


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
    assert [len(e["token_ids"]) for e in p] == [1, 1, 1] and p[-1]["finish_reason"] == "length"
    assert a[-1]["finish_reason"] == "length"
    engine.check_integrity()


def test_a_request_that_cannot_fit_gets_a_400_event():
    replica = LLMReplica({"device": "cpu", "num_kv_blocks": 8})
    events = asyncio.run(_collect(replica, _req("big", 400, max_tokens=8)))
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
    replica._record_metrics()
    rid = replica.replica_id
    assert recorded["pinned_region"] == [(rid, {"size": 8, "target": 8, "floor": 8, "ceiling": 32,
                                                "demand_peak": 0})]
    assert recorded["step_budget_trims"] == [(rid, 5)]
