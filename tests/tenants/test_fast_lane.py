"""The premium fast lane (kvharbor.platform.fast_lane): premium admitted without an actor
call, grants that follow arrivals, and what a sync does when a gateway, an actor or an answer
is lost. Limits across gateways: ``test_fast_lane_limits.py``; the harness:
``fast_lane_harness.py``.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kvharbor.platform.admission_flow import Admitter
from kvharbor.platform.class_queue import ClassQueue
from kvharbor.platform.error_body import APIError
from kvharbor.platform.fast_lane import QUIET_SYNCS, LocalTicket
from kvharbor.tenants.leases import LeaseTable
from kvharbor.tenants.limits import AdmissionController
from tests.tenants.fast_lane_harness import (Cluster, assert_books_balance, count_grant_syncs,
                                             finish, request, run)


def held_grant_sync(gw: Admitter):
    """The gateway's grant sync with its answer held back: ``(slow, sent, gate)``. Install
    ``slow`` as ``gw.lane._sync_grants``; ``sent`` is set once a report has gone out, and the
    answer comes once the test sets ``gate``."""
    sent, gate = asyncio.Event(), asyncio.Event()
    original = gw.lane._sync_grants

    async def slow(holder, reports, seq=0):
        sent.set()
        await gate.wait()
        return await original(holder, reports, seq)

    return slow, sent, gate


def test_premium_requests_after_the_first_sync_make_no_actor_call():
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", requests_per_minute=1200, tokens_per_minute=200_000,
                             max_concurrent_requests=64)

    async def scenario():
        first = await request(gw, acme, "r0")
        assert not isinstance(first, LocalTicket)        # nothing granted yet: the actors decide
        await finish(gw, acme, "r0", first, 15)
        await gw.lane.sync()
        before = dict(cluster.calls)
        tickets = [await request(gw, acme, f"r{i}") for i in range(1, 5)]
        assert all(isinstance(t, LocalTicket) for t in tickets), tickets
        for i, t in enumerate(tickets, 1):
            await finish(gw, acme, f"r{i}", t, 15)
        assert cluster.calls == before, (before, cluster.calls)
        assert gw.metrics.paths == {"actor": 1, "fast_lane": 4}      # kvharbor_admissions
        await gw.lane.sync()
        usage = cluster.controller.usage("acme")
        assert usage["admitted_total"] == 5 and usage["admitted_fast_lane"] == 4
        assert cluster.controller._tenants["acme"].granted_tokens >= 0

    run(scenario())


def test_a_first_arrival_gets_its_grant_without_waiting_a_period():
    """The gateway's own sync loop (not driven by the test), with a 30 s period: the first
    request of a tenant wakes a sync at once, so the second finds a grant, in the place and in
    the tenant's limits. A tenant that goes quiet and comes back is hurried the same way, and
    so is a second tenant of a class whose places the gateway already holds."""
    cluster = Cluster()
    gw = cluster.gateway(sync_period_s=30.0)
    limits = dict(requests_per_minute=1200, tokens_per_minute=200_000, max_concurrent_requests=64)
    acme, initech = cluster.principal("acme", **limits), cluster.principal("initech", **limits)

    async def two_requests(principal, first: str, second: str) -> tuple:
        one = await request(gw, principal, first)
        await finish(gw, principal, first, one, 15)
        for _ in range(20):                      # the woken sync answers (no Ray: at once)
            await asyncio.sleep(0)
        two = await request(gw, principal, second)
        await finish(gw, principal, second, two, 15)
        return one, two

    async def scenario():
        try:
            one, two = await two_requests(acme, "r0", "r1")
            assert not isinstance(one, LocalTicket) and isinstance(two, LocalTicket), (one, two)
            assert gw.lane.places["premium"].free > 0
            one, two = await two_requests(initech, "i0", "i1")
            assert not isinstance(one, LocalTicket) and isinstance(two, LocalTicket), (one, two)
            for _ in range(QUIET_SYNCS + 2):     # a quiet spell: everything given back
                await gw.lane.sync()
            assert "acme" not in gw.lane.tenants
            _, three = await two_requests(acme, "r2", "r3")
            assert isinstance(three, LocalTicket), three
        finally:
            gw.lane._task.cancel()

    run(scenario())


def test_a_tenant_sending_every_second_keeps_its_grant_between_requests():
    """A sparse premium tenant (a request every second, four syncs apart at the 0.25 s
    period) is admitted from its grant every time after the first: the grant outlives the
    gaps. (Given back after two quiet syncs, each of its requests paid the actor calls.)"""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", requests_per_minute=1200, tokens_per_minute=200_000,
                             max_concurrent_requests=64)

    async def scenario():
        paths = []
        for i in range(5):
            t = await request(gw, acme, f"r{i}")
            paths.append(isinstance(t, LocalTicket))
            await finish(gw, acme, f"r{i}", t, 15)
            for _ in range(4):
                await gw.lane.sync()
        assert paths == [False, True, True, True, True], paths
        assert cluster.calls["enter_or_recall"] == 1          # its class's places held too
        # Nothing runs: the operator's view has no request in flight, the slots the grant
        # keeps idle are listed apart (and still count against the tenant's limit).
        usage = cluster.controller.usage("acme")
        assert usage["in_flight"] == 0 and usage["granted_idle_slots"] > 0, usage
        assert cluster.controller._tenants["acme"].in_flight == usage["granted_idle_slots"]

    run(scenario())


def test_other_classes_keep_the_call_per_request():
    cluster = Cluster()
    gw = cluster.gateway()
    globex = cluster.principal("globex", qos="standard", max_concurrent_requests=64)

    async def scenario():
        for i in range(3):
            t = await request(gw, globex, f"s{i}")
            assert not isinstance(t, LocalTicket)
            await finish(gw, globex, f"s{i}", t, 5)
            await gw.lane.sync()
        assert cluster.calls["try_admit"] == 3 and cluster.calls["enter_or_recall"] == 3

    run(scenario())


def test_what_the_grant_cannot_cover_goes_to_the_actor():
    """The grant admits a request only if its tokens fit in what the gateway holds and no
    per-request limit refuses it: otherwise the actor decides (admits it from the bucket, or
    answers the 400), as it would without a grant."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", tokens_per_minute=100_000, max_tokens_per_request=64)

    async def scenario():
        await finish(gw, acme, "r0", await request(gw, acme, "r0"), 20)
        await gw.lane.sync()                     # a grant sized by r0's 20 tokens
        assert gw.lane.tenants["acme"].tokens == 160
        assert isinstance(await request(gw, acme, "small"), LocalTicket)
        over = await request(gw, acme, "over", max_tokens=65)     # 75 tokens: they fit
        assert isinstance(over, APIError) and over.status == 400, over
        assert over.code == "max_tokens_per_request"
        big = await request(gw, acme, "big", prompt=100, max_tokens=60)    # 160 > 140 free
        assert not isinstance(big, (LocalTicket, APIError)), big
        assert gw.lane.tenants["acme"].tokens == 140
        assert cluster.calls["try_admit"] == 3   # r0, over, big

    run(scenario())


def test_a_request_that_used_more_than_it_reserved_is_charged_what_it_used():
    """A request with ``n`` > 1 reserves prompt + max_tokens once and its choices may use
    more. From the grant as from the actor, the tenant is charged what its requests used, also
    when they used more than the grant held."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", tokens_per_minute=100_000, daily_token_budget=1_000_000)

    async def scenario():
        await finish(gw, acme, "r0", await request(gw, acme, "r0"), 30)     # the actor's
        await gw.lane.sync()
        burst = [await request(gw, acme, f"b{i}") for i in range(8)]     # all 160 granted tokens
        assert all(isinstance(t, LocalTicket) for t in burst), burst
        for i, t in enumerate(burst):            # 10 prompt + 2 x 10 completion tokens each
            await finish(gw, acme, f"b{i}", t, 30)
        assert_books_balance(cluster, [gw])
        await gw.lane.sync()
        assert_books_balance(cluster, [gw])
        for _ in range(QUIET_SYNCS + 1):
            await gw.lane.sync()
        usage = cluster.controller.usage("acme")           # the clock stood still: no refill
        assert usage["tokens_today"] == 9 * 30 and usage["tokens_available"] == 100_000 - 9 * 30
        assert cluster.controller._tenants["acme"].granted_tokens == 0

    run(scenario())


def test_the_grant_reserves_max_tokens_for_each_of_a_requests_choices():
    """From the grant as from the actor, an ``n``-choice request takes prompt + n x
    max_tokens; one that no grant could hold goes to the actor, which answers 400."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", tokens_per_minute=1_000, daily_token_budget=1_000_000)

    async def scenario():
        first = await request(gw, acme, "r0", n=3)                             # the actor's
        assert first.reserved_tokens == 10 + 3 * 10, first
        await finish(gw, acme, "r0", first, 10)
        await gw.lane.sync()
        ticket = await request(gw, acme, "r1", n=3)
        assert isinstance(ticket, LocalTicket) and ticket.cost == 10 + 3 * 10, ticket
        refused = await request(gw, acme, "r2", max_tokens=100, n=10)           # 1,010 > 1,000
        assert isinstance(refused, APIError) and refused.status == 400, refused
        await finish(gw, acme, "r1", ticket, 40)
        assert_books_balance(cluster, [gw])

    run(scenario())


def test_everything_granted_comes_back_when_the_tenant_goes_quiet():
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", requests_per_minute=600, tokens_per_minute=10_000,
                             max_concurrent_requests=8, daily_token_budget=100_000)
    grant_syncs = count_grant_syncs(gw)

    async def scenario():
        for round_ in range(3):
            tickets = [(f"r{round_}-{i}", await request(gw, acme, f"r{round_}-{i}")) for i in range(3)]
            for rid, t in tickets:
                await finish(gw, acme, rid, t, 12)
            await gw.lane.sync()
        assert gw.lane.admitted > 0
        for _ in range(QUIET_SYNCS + 1):
            await gw.lane.sync()
            assert_books_balance(cluster, [gw])        # what goes back leaves the gateway
        state = cluster.controller._tenants["acme"]
        assert (state.in_flight, state.granted_requests, state.granted_tokens) == (0, 0, 0)
        assert state.tokens_today == 9 * 12                # exactly what was used, nothing held
        assert state.admitted_total == 9
        assert cluster.queue.snapshot().get("premium", 0) == 0
        assert not gw.lane.holding() and not gw.lane.tenants and not gw.lane.places
        before, sent = dict(cluster.calls), grant_syncs["n"]
        await gw.lane.sync()                           # nothing to settle: no call at all
        assert cluster.calls == before and grant_syncs["n"] == sent, (before, cluster.calls)

    run(scenario())


def test_a_dead_gateways_grant_comes_back_within_the_lease():
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", max_concurrent_requests=8)

    async def scenario():
        await request(gw, acme, "r0")
        await gw.lane.sync()
        held = [await request(gw, acme, f"r{i}") for i in range(1, 3)]
        assert all(isinstance(t, LocalTicket) for t in held)
        # The gateway dies here: no release, no more syncs.
        state = cluster.controller._tenants["acme"]
        assert state.in_flight >= 3 and cluster.queue.snapshot()["premium"] >= 3
        cluster.lease_clock.t += 10.5
        cluster.queue.expire(time.time() + 10.5)     # its leases run on time.time()
        cluster.controller.usage("acme")          # any call sweeps expired leases
        # r0's ticket is a central lease: it expires too.
        assert state.in_flight == 0 and state.granted_requests == 0
        assert cluster.queue.snapshot()["premium"] == 0

    run(scenario())


def test_an_actor_that_forgot_the_grant_voids_the_free_units():
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", max_concurrent_requests=4)

    async def scenario():
        await request(gw, acme, "r0")
        await gw.lane.sync()
        running = await request(gw, acme, "r1")
        assert isinstance(running, LocalTicket)
        # The admission and class-queue actors restart: no grants, no places.
        cluster.controller = AdmissionController(clock=cluster.clock, lease_s=10,
                                                 lease_clock=cluster.lease_clock)
        gw.admission.controller = cluster.controller
        cluster.queue = ClassQueue(leases=LeaseTable(10), holders=LeaseTable(10))
        gw.class_queue._target = cluster.queue
        await gw.lane.sync()
        free = lambda: gw.lane.tenants["acme"].slots if "acme" in gw.lane.tenants else 0  # noqa: E731
        assert free() == 0
        # The next one is decided by the new controller, which then counts it.
        t = await request(gw, acme, "r2")
        assert not isinstance(t, LocalTicket)
        assert cluster.controller._tenants["acme"].in_flight == 1
        # The request admitted from the forgotten grant ends: no slot appears from nowhere.
        await finish(gw, acme, "r1", running, 5)
        assert free() == 0
        await gw.lane.sync()
        assert_books_balance(cluster, [gw])

    run(scenario())


def test_places_all_in_use_are_void_when_the_class_queue_forgot_them():
    """Every place of the grant is in use (none free) when the class-queue actor restarts:
    the gateway still says it holds a grant, learns it is gone, and the requests that end
    later give no place back to the new grant."""
    cluster = Cluster(max_queue=4)
    gw = cluster.gateway()
    acme = cluster.principal("acme", max_concurrent_requests=64)

    async def scenario():
        await finish(gw, acme, "r0", await request(gw, acme, "r0"), 5)
        await gw.lane.sync()                     # half the room: 2 places
        running = [await request(gw, acme, f"r{i}") for i in (1, 2)]
        assert all(isinstance(t, LocalTicket) for t in running), running
        assert (gw.lane.places["premium"].free, gw.lane.places["premium"].in_use) == (0, 2)
        cluster.queue = ClassQueue(leases=LeaseTable(10), holders=LeaseTable(10))
        gw.class_queue._target = cluster.queue
        await gw.lane.sync()
        assert_books_balance(cluster, [gw])
        for i, t in zip((1, 2), running):
            await finish(gw, acme, f"r{i}", t, 5)
        assert_books_balance(cluster, [gw])

    run(scenario())


def test_a_request_admitted_while_the_actor_forgets_the_grant_gives_nothing_back():
    """A request admitted from the grant while the sync that learns the actor forgot it is
    on its way: the grant it came from is gone, so its end gives no slot to the new one."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", max_concurrent_requests=16)
    slow, sent, gate = held_grant_sync(gw)

    async def scenario():
        await finish(gw, acme, "r0", await request(gw, acme, "r0"), 5)
        await gw.lane.sync()
        cluster.controller = AdmissionController(clock=cluster.clock, lease_s=10,
                                                 lease_clock=cluster.lease_clock)
        gw.admission.controller = cluster.controller
        gw.lane._sync_grants = slow
        syncing = asyncio.create_task(gw.lane.sync())
        await sent.wait()                        # the report is sent; the answer waits
        during = await request(gw, acme, "r1")
        assert isinstance(during, LocalTicket)
        gate.set()
        await syncing
        slots = gw.lane.tenants["acme"].slots
        await finish(gw, acme, "r1", during, 5)
        assert gw.lane.tenants["acme"].slots == slots

    run(scenario())


def test_a_reload_that_lowers_the_limit_stops_local_admissions_beyond_it():
    cluster = Cluster()
    gw = cluster.gateway()
    wide = cluster.principal("acme", max_concurrent_requests=64)

    async def scenario():
        t0 = await request(gw, wide, "r0")
        await finish(gw, wide, "r0", t0, 5)
        for i in range(1, 9):                        # enough arrivals to grow the grant
            await finish(gw, wide, f"r{i}", await request(gw, wide, f"r{i}"), 5)
        await gw.lane.sync()
        assert gw.lane.tenants["acme"].slots >= 8
        cluster.registry.version += 1
        narrow = cluster.principal("acme", max_concurrent_requests=2)
        tickets = [await request(gw, narrow, f"n{i}") for i in range(4)]
        admitted = [t for t in tickets if not isinstance(t, APIError)]
        assert len(admitted) == 2, tickets
        await gw.lane.sync()                         # the old grant's free slots go back
        assert cluster.controller._tenants["acme"].in_flight <= 2

    run(scenario())


def test_a_sync_whose_caller_is_cancelled_still_settles():
    """The first request after a reload waits for a sync; its client leaving must not cut
    the sync in half (the actor would count units the gateway dropped)."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", max_concurrent_requests=32)
    slow = asyncio.Event()
    original = gw.admission.sync_grants

    async def held_sync(holder, reports, seq=0):
        await slow.wait()
        return await original(holder, reports, seq)

    async def scenario():
        await finish(gw, acme, "r0", await request(gw, acme, "r0"), 5)
        await gw.lane.sync()
        assert gw.lane.tenants["acme"].slots > 0
        cluster.registry.version += 1                       # a reload voids the free slots
        gw.admission.sync_grants = held_sync
        gw.lane._sync_grants = held_sync
        waiting = asyncio.ensure_future(request(gw, acme, "r1"))
        await asyncio.sleep(0.01)
        waiting.cancel()                                    # the client went away
        slow.set()
        await asyncio.sleep(0.01)
        async with gw.lane._syncing:                        # the sync ran to its end
            pass
        assert "r1" not in gw._lane_places and not gw.places.held     # its place is back
        assert_books_balance(cluster, [gw])

    run(scenario())


@pytest.mark.parametrize("lost", ["grants", "places"])
def test_a_sync_whose_answer_is_lost_is_applied_once(lost, caplog):
    """The actor applied a sync but its answer never came back (a timeout): the gateway logs
    which sync failed, sends it again and gets the same answer; nothing is counted twice or
    dropped."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", requests_per_minute=600, max_concurrent_requests=16)
    lose = {"armed": False}
    if lost == "grants":
        original = gw.lane._sync_grants

        async def flaky(holder, reports, seq=0):
            answer = await original(holder, reports, seq)
            if lose["armed"]:
                lose["armed"] = False
                raise TimeoutError("answer lost")
            return answer

        gw.lane._sync_grants = flaky
    else:
        original = gw.lane._sync_places

        async def flaky(holder, priorities, reports, seq=0):
            answer = await original(holder, priorities, reports, seq)
            if lose["armed"]:
                lose["armed"] = False
                raise TimeoutError("answer lost")
            return answer

        gw.lane._sync_places = flaky

    async def scenario():
        tickets = [await request(gw, acme, "r0")]
        await gw.lane.sync()
        tickets += [await request(gw, acme, f"r{i}") for i in range(1, 4)]
        assert sum(isinstance(t, LocalTicket) for t in tickets) == 3
        lose["armed"] = True
        await gw.lane.sync()                                # applied, answer lost
        assert f"{lost[:-1]} sync failed (TimeoutError('answer lost'))" in caplog.text
        await gw.lane.sync()                                # sent again: same answer
        assert_books_balance(cluster, [gw])
        for i, t in enumerate(tickets):
            await finish(gw, acme, f"r{i}", t, 10)
        for _ in range(QUIET_SYNCS + 2):
            await gw.lane.sync()
        state = cluster.controller._tenants["acme"]
        assert state.admitted_total == 4 and state.in_flight == 0
        assert sum(cluster.queue.snapshot().values()) == 0

    run(scenario())


def test_a_reload_that_lowers_max_queue_stops_local_places_beyond_it():
    """The gateway holds a grant of premium places; tenants.yaml lowers premium's max_queue to
    2: the places held under the old limit are not used again, and no more than 2 premium
    requests run at once."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme")

    async def scenario():
        for i in range(9):                           # enough arrivals to grow the grant
            await finish(gw, acme, f"r{i}", await request(gw, acme, f"r{i}"), 5)
        await gw.lane.sync()
        assert gw.lane.places["premium"].free >= 8
        cluster.registry.version += 1
        cluster.registry.config.qos_classes["premium"].max_queue = 2
        tickets = [await request(gw, acme, f"n{i}") for i in range(4)]
        await gw.lane.sync()
        tickets += [await request(gw, acme, f"m{i}") for i in range(2)]
        refused = [t for t in tickets if isinstance(t, APIError)]
        assert len(tickets) - len(refused) == 2, tickets
        assert {t.code for t in refused} == {"queue_full"}, refused

    run(scenario())


def test_places_all_in_use_at_a_sync_stay_held_and_are_void_when_forgotten():
    """A sync finds every place of the grant in use and no room for more (another gateway
    took the rest of max_queue): the gateway still holds its grant, so when the class queue
    restarts it learns the grant is gone and its running requests give no place back."""
    cluster = Cluster(max_queue=4)
    gw, other = cluster.gateway(), cluster.gateway()
    acme = cluster.principal("acme")

    async def scenario():
        await finish(gw, acme, "r0", await request(gw, acme, "r0"), 5)
        await gw.lane.sync()                     # half the room: 2 places
        running = [await request(gw, acme, f"r{i}") for i in (1, 2)]
        assert all(isinstance(t, LocalTicket) for t in running), running
        elsewhere = [await request(other, acme, f"o{i}") for i in (1, 2)]
        assert not any(isinstance(t, APIError) for t in elsewhere), elsewhere
        await gw.lane.sync()                     # room 0: nothing added, nothing free
        assert (gw.lane.places["premium"].free, gw.lane.places["premium"].in_use) == (0, 2)
        cluster.queue = ClassQueue(leases=LeaseTable(10), holders=LeaseTable(10))
        gw.class_queue._target = cluster.queue
        await gw.lane.sync()
        for i, t in zip((1, 2), running):
            await finish(gw, acme, f"r{i}", t, 5)
        assert_books_balance(cluster, [gw])

    run(scenario())


def test_a_tenant_without_token_limits_is_charged_the_tokens_its_requests_used():
    """tokens_today counts every token a tenant used, as on the actor path, when its premium
    requests are admitted from a grant that reserves none (it has no token limit), and when a
    request outlives the syncs that gave the rest of the grant back."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", max_concurrent_requests=64)
    free = cluster.principal("free")                 # no limit at all: nothing is granted

    async def scenario():
        for i in range(4):
            await finish(gw, acme, f"r{i}", await request(gw, acme, f"r{i}"), 15)
            await gw.lane.sync()
        assert gw.metrics.paths == {"actor": 1, "fast_lane": 3}
        assert cluster.controller.usage("acme")["tokens_today"] == 4 * 15
        long = await request(gw, free, "f0")
        assert isinstance(long, LocalTicket), long
        for _ in range(QUIET_SYNCS + 2):
            await gw.lane.sync()
        await finish(gw, free, "f0", long, 40)
        await gw.lane.sync()
        assert cluster.controller.usage("free")["tokens_today"] == 40

    run(scenario())


def test_tokens_used_while_a_sync_is_on_its_way_are_charged_at_the_next():
    """A request ends while a sync's answer is on its way, after that sync's report was taken:
    what it used waits for the next sync, even though the tenant's entry holds nothing else."""
    cluster = Cluster()
    gw = cluster.gateway()
    free = cluster.principal("free")                 # no limit: admitted here, nothing granted
    original = gw.lane._sync_grants
    slow, sent, gate = held_grant_sync(gw)

    async def scenario():
        ticket = await request(gw, free, "f0")
        assert isinstance(ticket, LocalTicket), ticket
        gw.lane._sync_grants = slow
        syncing = asyncio.create_task(gw.lane.sync())
        await sent.wait()                            # its report is taken; the answer waits
        await finish(gw, free, "f0", ticket, 40)
        gate.set()
        await syncing
        gw.lane._sync_grants = original
        await gw.lane.sync()
        assert cluster.controller.usage("free")["tokens_today"] == 40

    run(scenario())


@pytest.mark.parametrize("slots", [64, None], ids=["with_slots", "tokens_only"])
def test_after_a_quiet_spell_the_token_grant_follows_the_new_requests_not_an_old_big_one(slots):
    """A tenant's token grant is sized by its largest request since it was last quiet: a big
    request, a quiet spell (one long request still running keeps the tenant's allowance),
    then small requests ask for 8 x their own cost, not 8 x the old big one's."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", tokens_per_minute=100_000, max_concurrent_requests=slots)

    async def scenario():
        big = await request(gw, acme, "big", prompt=10, max_tokens=990)         # cost 1,000
        await finish(gw, acme, "big", big, 20)
        await gw.lane.sync()                                                      # 8 x 1,000 granted
        long = await request(gw, acme, "long")                                   # cost 20
        assert isinstance(long, LocalTicket) and gw.lane.tenants["acme"].tokens >= 7_000
        for _ in range(QUIET_SYNCS + 1):
            await gw.lane.sync()
        assert gw.lane.tenants["acme"].tokens == 0                                # all back
        small = await request(gw, acme, "small")                                  # cost 20
        await gw.lane.sync()
        assert 0 < gw.lane.tenants["acme"].tokens <= 8 * 20, gw.lane.tenants["acme"]
        for rid, ticket in (("long", long), ("small", small)):
            await finish(gw, acme, rid, ticket, 20)

    run(scenario())
