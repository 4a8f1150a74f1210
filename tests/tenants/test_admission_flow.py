"""The gateway's side of admission (``kvharbor.platform.admission_flow.Admitter``) for the
classes that take the actor calls: which refusals a gateway remembers, the overload guard's
count when the class queue refuses, and the leases of queue places. Harness (no Ray):
``fast_lane_harness.py``."""

from __future__ import annotations

import asyncio

from kvharbor.platform.class_queue import ClassQueue
from kvharbor.platform.openai_protocol import APIError
from kvharbor.platform.overload_guard import OverloadGuard
from kvharbor.tenants.leases import LeaseTable
from tests.tenants.fast_lane_harness import Cluster, finish, request, run


def test_a_concurrency_refusal_is_not_remembered():
    """Only refusals that nothing but time clears (requests_per_minute, the daily budget) are
    answered from the gateway's memory: a tenant refused at max_concurrent_requests is admitted
    as soon as one of its requests ends."""
    cluster = Cluster()
    gw = cluster.gateway()
    globex = cluster.principal("globex", qos="standard", max_concurrent_requests=1)

    async def scenario():
        first = await request(gw, globex, "s0")
        refused = await request(gw, globex, "s1")
        assert isinstance(refused, APIError) and refused.status == 429, refused
        assert refused.code == "max_concurrent_requests"
        await finish(gw, globex, "s0", first, 5)
        again = await request(gw, globex, "s2")
        assert not isinstance(again, APIError), again

    run(scenario())


def test_a_class_queue_refusal_leaves_the_overload_guards_count():
    """A request the class queue refuses (queue_full) is not in flight: the overload guard
    must not count it, or a run of refusals would shed the class for good."""
    cluster = Cluster(max_queue=1)
    gw = cluster.gateway(guard=OverloadGuard(lag_target_ms=1000.0))
    globex = cluster.principal("globex", qos="standard")

    async def scenario():
        running = await request(gw, globex, "s0")
        refusals = [await request(gw, globex, f"s{i}") for i in range(1, 6)]
        assert all(isinstance(r, APIError) and r.code == "queue_full" for r in refusals), refusals
        assert gw.guard.in_flight == 1
        await finish(gw, globex, "s0", running, 5)
        assert gw.guard.in_flight == 0

    run(scenario())


def test_a_running_requests_queue_place_is_renewed_past_its_lease():
    """Queue places are leased so that a dead gateway's come back; a live request's place is
    renewed and stays counted however long the request runs."""
    cluster = Cluster()
    cluster.queue = ClassQueue(leases=LeaseTable(0.3), holders=LeaseTable(0.3))
    gw = cluster.gateway(lease_s=0.3)
    globex = cluster.principal("globex", qos="standard")

    async def scenario():
        running = await request(gw, globex, "s0")
        await asyncio.sleep(1.0)                     # three leases long
        cluster.queue.expire()
        assert cluster.queue.snapshot() == {"standard": 1}
        await finish(gw, globex, "s0", running, 5)
        assert cluster.queue.snapshot() == {"standard": 0}

    run(scenario())
