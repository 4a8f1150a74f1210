"""Leases expire unless renewed; a release after expiry undoes nothing twice."""

from __future__ import annotations

import asyncio
import gc

from kvharbor.tenants.leases import LeaseKeeper, LeaseTable
from kvharbor.tenants.limits import AdmissionController
from kvharbor.tenants.schema import TenantLimits


def test_a_lease_expires_only_without_renewal():
    table = LeaseTable(lease_s=10)
    table.add("a", "slot-a", now=0)
    table.add("b", "slot-b", now=0)
    assert table.renew(["a", "zzz"], now=6) == ["zzz"]
    assert table.expire(now=9.9) == []
    assert table.expire(now=10.0) == ["slot-b"]          # b was never renewed
    assert table.expire(now=15.9) == [] and len(table) == 1
    assert table.expire(now=16.0) == ["slot-a"]          # a: 10 s after its renewal at 6
    assert table.pop("a") is None and table.renew(["a"], now=17) == ["a"]


def test_pop_gives_the_payload_back_once():
    table = LeaseTable(lease_s=10)
    table.add("a", 42, now=0)
    assert table.pop("a") == 42 and table.pop("a") is None and table.expire(now=100) == []


def test_keeper_renews_what_it_holds_and_forgets_what_the_actor_lost():
    table = LeaseTable(lease_s=0.3)
    calls = []

    async def renew(ids):
        calls.append(list(ids))
        return table.renew(ids)

    async def scenario():
        keeper = LeaseKeeper(renew, period_s=0.1)
        for lease_id in ("a", "b"):
            table.add(lease_id, lease_id)
            keeper.hold(lease_id)
        await asyncio.sleep(0.8)                  # > 2 lease times: alive only through renewals
        alive = sorted(p for p in ("a", "b") if p not in table.expire())
        table.pop("b")                            # the actor forgot b (say it restarted)
        await asyncio.sleep(0.25)
        keeper.drop("a")
        return alive, set(keeper.held)

    alive, held = asyncio.run(scenario())
    assert alive == ["a", "b"] and len(calls) >= 5
    assert held == set()                          # b forgotten after the actor said so; a dropped


def test_a_failed_renewal_is_tried_again_next_period(caplog):
    """An actor call that fails (a timeout, a restarting actor) must not end the renewals:
    the leases would then run out under requests that are still running. The failure is
    logged, and the renewals keep their period (not one call after another)."""
    table = LeaseTable(lease_s=0.35)
    calls = []

    async def renew(ids):
        calls.append(list(ids))
        if len(calls) == 1:
            raise ConnectionError("actor unreachable")
        return table.renew(ids)

    async def scenario():
        keeper = LeaseKeeper(renew, period_s=0.1)
        table.add("a", "slot-a")
        keeper.hold("a")
        await asyncio.sleep(0.8)                  # > 2 lease times after the failed call
        expired = table.expire()
        keeper.drop("a")
        return expired

    expired = asyncio.run(scenario())
    gc.collect()        # a renewal task that died logs now, not inside pytest's failure report
    assert expired == [], "the lease ran out: renewals stopped after the failed one"
    assert 4 <= len(calls) <= 8, calls             # 0.8 s at one call a 0.1 s period
    assert "lease renewal of 1 leases failed: ConnectionError('actor unreachable')" in caplog.text


def test_a_hung_renewal_gives_up_and_a_keeper_that_went_idle_starts_again():
    """A renewal call that never answers (a wedged actor) is abandoned after ``timeout_s`` and
    tried again, and a keeper whose leases were all dropped (its loop ended, with no call for
    no leases) renews the next lease it holds: either way the leases of running requests keep
    being renewed."""
    table = LeaseTable(lease_s=0.6)
    calls = []

    async def renew(ids):
        calls.append(list(ids))
        if len(calls) == 1:
            await asyncio.Event().wait()          # never answers
        return table.renew(ids)

    async def scenario():
        keeper = LeaseKeeper(renew, period_s=0.1, timeout_s=0.1)
        table.add("a", "slot-a")
        keeper.hold("a")
        await asyncio.sleep(1.3)                  # > 2 lease times after the hung call
        expired_a = table.expire()
        keeper.drop("a")
        table.pop("a")                            # released, as a finished request does
        await asyncio.sleep(0.3)                  # nothing held: the loop ends
        renewals, idle = len(calls), keeper._task.done()
        table.add("b", "slot-b")
        keeper.hold("b")
        await asyncio.sleep(1.3)
        expired_b = table.expire()
        keeper.drop("b")
        return expired_a, calls[renewals:], expired_b, idle

    expired_a, after_idle, expired_b, idle = asyncio.run(scenario())
    assert expired_a == [], "the lease ran out behind a renewal that never answered"
    assert idle and all(calls), "a keeper that holds nothing still ran (or called the actor with no leases)"
    assert expired_b == [] and len(after_idle) >= 4 and all(ids == ["b"] for ids in after_idle), after_idle


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_an_unrenewed_admission_ticket_gives_its_slot_back():
    clock = FakeClock()
    ctl = AdmissionController(lease_s=10, lease_clock=clock)
    lim = TenantLimits(max_concurrent_requests=2)
    alive, dead = ctl.try_admit("t", lim, 5, 5).ticket, ctl.try_admit("t", lim, 5, 5).ticket
    assert not ctl.try_admit("t", lim, 5, 5).ok                       # both slots taken
    clock.t += 6
    assert ctl.renew([alive.ticket_id]) == []                          # only its holder renews
    clock.t += 5                                                       # dead: 11 s without renewal
    assert ctl.usage("t")["in_flight"] == 1 and ctl.expired_total == 1
    assert ctl.renew([dead.ticket_id]) == [dead.ticket_id]
    assert ctl.release(dead, 0) is False and ctl.usage("t")["in_flight"] == 1   # not twice
    assert ctl.try_admit("t", lim, 5, 5).ok
    assert ctl.release(alive, 10) is True and ctl.usage("t")["in_flight"] == 1
    assert ctl.renew([alive.ticket_id]) == [alive.ticket_id]           # released: no lease left


def test_an_admission_is_what_finds_a_dead_tickets_slot_free():
    clock = FakeClock()
    ctl = AdmissionController(lease_s=10, lease_clock=clock)
    lim = TenantLimits(max_concurrent_requests=1)
    assert ctl.try_admit("t", lim, 1, 1).ok and not ctl.try_admit("t", lim, 1, 1).ok
    clock.t += 11                                                      # its holder died
    assert ctl.try_admit("t", lim, 1, 1).ok


def test_a_renewal_is_what_finds_another_tickets_lease_ran_out():
    """The first call after a ticket's lease ran out may be another ticket's renewal: it
    releases the dead one (its tokens charged in full) and renews the live one."""
    clock = FakeClock()
    ctl = AdmissionController(clock=lambda: 5000.0, lease_s=10, lease_clock=clock)
    lim = TenantLimits(tokens_per_minute=100, max_concurrent_requests=2)
    alive, dead = ctl.try_admit("t", lim, 10, 10).ticket, ctl.try_admit("t", lim, 10, 10).ticket
    clock.t += 6
    assert ctl.renew([alive.ticket_id]) == []
    clock.t += 5                                                       # dead: 11 s unrenewed
    assert ctl.renew([alive.ticket_id]) == [] and ctl.expired_total == 1
    assert ctl.release(dead) is False                                  # released already
    usage = ctl.usage("t")
    assert usage["in_flight"] == 1 and usage["tokens_available"] == 60  # 2 x 20 still charged


def test_an_unrenewed_class_queue_place_is_given_back():
    from kvharbor.platform.class_queue import ClassQueue
    from kvharbor.tenants.leases import LeaseTable

    queue = ClassQueue(leases=LeaseTable(lease_s=10))
    prio = {"standard": 1}
    assert queue.enter("standard", prio, 2, "a", now=0) is None
    assert queue.enter("standard", prio, 2, "b", now=0) is None
    assert queue.enter("standard", prio, 2, "c", now=1) == 2            # full
    assert queue.renew(["a"], now=8) == []
    assert queue.enter("standard", prio, 2, "c", now=10.5) is None       # b expired at 10
    queue.leave("standard", "b")                                         # late leave: a no-op
    assert queue.snapshot() == {"standard": 2}
    queue.leave("standard", "a")
    queue.leave("standard", "a")                                         # twice: once
    assert queue.snapshot() == {"standard": 1}
