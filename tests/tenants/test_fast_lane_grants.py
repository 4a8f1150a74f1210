"""How much a gateway's grant holds and for how long: sized by the last period's arrivals
(grown by a burst, shrunk when arrivals slow), kept at that size while unused, kept while a
request still holds a place, given back whole on a reload, and asked again after the actor
forgot it; and how often the gateway's own loop syncs. Harness: ``fast_lane_harness.py``."""

from __future__ import annotations

import asyncio

from kvharbor.platform.error_body import APIError
from kvharbor.platform.fast_lane import HEADROOM, MIN_TARGET, QUIET_SYNCS, LocalTicket
from kvharbor.tenants.limits import AdmissionController
from tests.tenants.fast_lane_harness import (Cluster, assert_books_balance, count_grant_syncs,
                                             finish, request, run)

WIDE = dict(requests_per_minute=1200, tokens_per_minute=200_000, max_concurrent_requests=64)


def _one_gateway(**limits):
    """A cluster, its one gateway and premium tenant acme (``WIDE`` limits unless given)."""
    cluster = Cluster()
    return cluster, cluster.gateway(), cluster.principal("acme", **(limits or WIDE))


async def _served(gw, principal, n: int) -> None:
    """``n`` requests (10 + 10 tokens) admitted and finished in one period, then a sync."""
    for i in range(n):
        await finish(gw, principal, f"w{i}", await request(gw, principal, f"w{i}"), 20)
    await gw.lane.sync()


def test_a_burst_grows_the_next_grant_to_cover_it():
    """20 arrivals in one period: the next grant is sized HEADROOM x 20 (within half of what
    the limits have left), so a second burst of 20 running at once is admitted here, not just
    the minimum grant's 8."""
    cluster, gw, acme = _one_gateway()

    async def scenario():
        await _served(gw, acme, 20)
        second = [await request(gw, acme, f"b{i}") for i in range(20)]
        assert all(isinstance(t, LocalTicket) for t in second), second
        assert_books_balance(cluster, [gw])

    assert HEADROOM * 20 > 20 > MIN_TARGET
    run(scenario())


def test_a_burst_grant_shrinks_back_to_its_target_when_arrivals_slow():
    """After a burst of 20 the grant holds far more than the minimum of each unit; a period
    with one arrival gives back all but MIN_TARGET of each (request-sized tokens), so the
    gateway does not sit on a burst's share of the limits, and the actors count as granted
    exactly what it keeps."""
    cluster, gw, acme = _one_gateway()

    async def scenario():
        await _served(gw, acme, 20)
        a, places = gw.lane.tenants["acme"], gw.lane.places["premium"]
        assert min(a.requests, a.slots, a.tokens // 20, places.free) > 2 * MIN_TARGET
        await _served(gw, acme, 1)
        assert (a.requests, a.tokens, a.slots, places.free) == \
            (MIN_TARGET, MIN_TARGET * 20, MIN_TARGET, MIN_TARGET)
        grant = cluster.controller._grants[gw.lane.holder]["acme"]
        assert (grant.requests, grant.tokens, grant.slots) == (MIN_TARGET, MIN_TARGET * 20, MIN_TARGET)
        assert cluster.queue.grants[gw.lane.holder]["premium"] == MIN_TARGET
        assert_books_balance(cluster, [gw])

    run(scenario())


def test_an_unused_grant_stays_at_its_target():
    """One arrival, then quiet syncs (fewer than QUIET_SYNCS): each sync tops the grant up to
    its target, never past it, so an idle gateway does not pile up a tenant's limit."""
    cluster, gw, acme = _one_gateway()

    async def scenario():
        await _served(gw, acme, 1)
        for _ in range(4):
            await gw.lane.sync()
            grant = cluster.controller._grants[gw.lane.holder]["acme"]
            assert (grant.requests, grant.tokens, grant.slots) == (MIN_TARGET, MIN_TARGET * 20, MIN_TARGET)
            assert cluster.queue.grants[gw.lane.holder]["premium"] == MIN_TARGET
            assert_books_balance(cluster, [gw])

    run(scenario())


def test_a_long_request_keeps_its_place_through_a_quiet_spell():
    """A request admitted here runs longer than QUIET_SYNCS periods with no other arrival:
    its class's grant is not forgotten under it (the class queue still counts its place), and
    once it ends the place goes back."""
    cluster, gw, acme = _one_gateway()

    async def scenario():
        await _served(gw, acme, 1)
        long = await request(gw, acme, "long")
        assert isinstance(long, LocalTicket)
        for _ in range(QUIET_SYNCS + 2):
            await gw.lane.sync()
            assert_books_balance(cluster, [gw])
        assert gw.lane.places["premium"].in_use == 1
        assert cluster.queue.grants[gw.lane.holder]["premium"] == 1
        await finish(gw, acme, "long", long, 20)
        for _ in range(QUIET_SYNCS + 1):
            await gw.lane.sync()
            assert_books_balance(cluster, [gw])
        assert not gw.lane.places and not cluster.queue.grants.get(gw.lane.holder)
        assert cluster.queue.snapshot().get("premium", 0) == 0

    run(scenario())


def test_a_grants_last_unit_of_each_kind_is_used_here():
    """After one sync the grant holds MIN_TARGET requests, slots and request-sized token
    units: that many requests running at once are all admitted here, the last one taking the
    last unit of each (the next goes to the actor)."""
    cluster, gw, acme = _one_gateway()

    async def scenario():
        await _served(gw, acme, 1)
        running = [await request(gw, acme, f"r{i}", 10, 10) for i in range(1, MIN_TARGET + 1)]
        assert all(isinstance(t, LocalTicket) for t in running), running
        a = gw.lane.tenants["acme"]
        assert (a.requests, a.tokens, a.slots) == (0, 0, 0)
        assert not isinstance(await request(gw, acme, "over", 10, 10), LocalTicket)

    run(scenario())


def test_a_reload_gives_back_every_free_unit_of_the_old_limits():
    """All three limits lowered: the old grant's free requests, tokens and slots go back at
    the next sync, and the books balance after it."""
    cluster, gw, wide = _one_gateway()

    async def scenario():
        await _served(gw, wide, 4)
        assert_books_balance(cluster, [gw])
        cluster.registry.version += 1
        narrow = cluster.principal("acme", requests_per_minute=600, tokens_per_minute=100_000,
                                   max_concurrent_requests=32)
        await finish(gw, narrow, "n0", await request(gw, narrow, "n0"), 20)
        await gw.lane.sync()
        assert_books_balance(cluster, [gw])
        assert not any(gw.lane.tenants["acme"].void)

    run(scenario())


def test_a_reload_that_adds_a_token_limit_is_kept_by_local_admissions():
    """A tenant limited only in concurrency gets a tokens_per_minute limit: the grants after
    the reload carry tokens, so the fast lane stops where the new limit does."""
    cluster, gw, acme = _one_gateway(max_concurrent_requests=64)

    async def scenario():
        await _served(gw, acme, 4)
        cluster.registry.version += 1
        metered = cluster.principal("acme", max_concurrent_requests=64, tokens_per_minute=200)
        admitted = 0
        for i in range(12):                          # 40 tokens each: 5 fit in 200
            t = await request(gw, metered, f"m{i}", 20, 20)
            if not isinstance(t, APIError):
                admitted += 1
                await finish(gw, metered, f"m{i}", t, 40)
            await gw.lane.sync()
        assert admitted == 5, admitted

    run(scenario())


def test_after_the_actor_forgot_the_grant_the_fast_lane_comes_back():
    """The admission actor restarts: the gateway voids its free units, then asks for a new
    grant as a newcomer, and premium requests are admitted here again."""
    cluster, gw, acme = _one_gateway()

    async def scenario():
        await _served(gw, acme, 1)
        assert isinstance(await request(gw, acme, "r1"), LocalTicket)
        cluster.controller = AdmissionController(clock=cluster.clock, lease_s=10,
                                                 lease_clock=cluster.lease_clock)
        gw.admission.controller = cluster.controller
        await gw.lane.sync()                         # told to start over
        await finish(gw, acme, "r2", await request(gw, acme, "r2"), 20)
        await gw.lane.sync()
        assert isinstance(await request(gw, acme, "r3"), LocalTicket)

    run(scenario())


def test_a_busy_gateway_syncs_once_a_period_not_back_to_back():
    """The gateway's own sync loop at a 50 ms period. A second tenant arriving while the loop
    runs hurries one sync; after it the loop goes back to one sync a period while a request
    admitted from the grant runs: about ten in 0.5 s, not one after another."""
    cluster = Cluster()
    gw = cluster.gateway(sync_period_s=0.05)
    acme, initech = cluster.principal("acme", **WIDE), cluster.principal("initech", **WIDE)
    syncs = count_grant_syncs(gw)

    async def scenario():
        try:
            await finish(gw, acme, "a0", await request(gw, acme, "a0"), 20)
            await asyncio.sleep(0.1)
            await finish(gw, initech, "i0", await request(gw, initech, "i0"), 20)
            running = await request(gw, acme, "a1")      # from the grant, runs on: the
            assert isinstance(running, LocalTicket)      # loop has work all along
            await asyncio.sleep(0.05)
            before = syncs["n"]
            await asyncio.sleep(0.5)
            assert 3 <= syncs["n"] - before <= 14, syncs["n"] - before
            await finish(gw, acme, "a1", running, 20)
        finally:
            gw.lane._task.cancel()

    run(scenario())
