"""Stopping a replica (scale-down, redeploy, delete) lets its direct streams finish.

Serve waits for the requests it counts before it stops a replica; direct streams
(``kvharbor.platform.direct_stream``) are not among them, so the replica drains them itself
in ``LLMReplica.__del__``. Here a one-replica deployment whose steps are slowed is deleted
while a direct stream is a few tokens in: the stream still ends with every token it asked for.
"""

from __future__ import annotations

import asyncio
import sys
import time

import ray.cloudpickle
from ray import serve

from kvharbor.actors.replica import LLMReplica
from tests.platform.test_direct_stream import _direct_to, replica_request

STEP_S = 0.05             # the slowed step: 60 tokens take ~3 s, well past Serve's own drain
MAX_TOKENS = 60
APP = "kvh-drain-test"


class SlowStepReplica(LLMReplica):
    """An LLMReplica whose engine sleeps ``STEP_S`` before each step (in its step thread)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        step = self.engine.step

        def slow_step(*a, **kw):
            time.sleep(STEP_S)
            return step(*a, **kw)

        self.engine.step = slow_step


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers lack tests/


def test_deleting_a_replica_lets_its_open_direct_stream_finish(kvharbor_app):
    deployment = serve.deployment(SlowStepReplica).options(
        name="SlowStepReplica", num_replicas=1, graceful_shutdown_wait_loop_s=0.2,
        graceful_shutdown_timeout_s=60, ray_actor_options={"num_cpus": 0.5})
    handle = serve.run(deployment.bind({"device": "cpu", "num_kv_blocks": 64}, None, None, 1, 0,
                                       True), name=APP, route_prefix=None)
    try:
        address = handle.record_routing_stats.remote().result(timeout_s=120)["direct"]
        assert address is not None
        request = replica_request("drain", MAX_TOKENS)

        async def main():
            events = aiter(_direct_to({"direct": address}, request))
            first = await anext(events)
            deleting = asyncio.ensure_future(asyncio.to_thread(serve.delete, APP))
            rest = [e async for e in events]
            await deleting
            return [first, *rest], deleting

        events, _ = asyncio.run(main())
    finally:
        serve.delete(APP)
    tokens = sum(len(e["token_ids"]) for e in events)
    assert tokens == MAX_TOKENS and events[-1]["finish_reason"] == "length", \
        f"the stream ended after {tokens} tokens: {events[-1]}"
    assert APP not in serve.status().applications
