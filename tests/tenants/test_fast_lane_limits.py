"""The fast lane keeps every limit exact across gateways (requests, tokens, concurrency, queue
places), hands idle units to whoever a limit refuses, and leaves a higher class's grant alone
when a lower class floods. Harness: ``fast_lane_harness.py``."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvharbor.platform.error_body import APIError
from kvharbor.platform.fast_lane import QUIET_SYNCS, LocalTicket
from kvharbor.tenants.limits import RECALL_HOLD_S, AdmissionController, GrantReport, TenantLimits
from tests.tenants.fast_lane_harness import Clock, Cluster, assert_books_balance, finish, request, run

# ---- limits hold exactly across gateways, whatever the interleaving ---------------------------
LIMITS = dict(requests_per_minute=30, tokens_per_minute=900, max_concurrent_requests=5,
              daily_token_budget=2_000)

ops = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 1), st.integers(1, 40), st.integers(1, 30)),
    st.tuples(st.just("finish"), st.integers(0, 1), st.integers(0, 10_000), st.integers(0, 90)),
    st.tuples(st.just("sync"), st.integers(0, 1), st.just(0), st.just(0)),
    st.tuples(st.just("tick"), st.just(0), st.integers(0, 20), st.just(0)),
), max_size=120)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_limits_hold_across_two_gateways(script):
    cluster = Cluster(max_queue=4)
    gws = [cluster.gateway(), cluster.gateway()]
    acme = cluster.principal("acme", **LIMITS)
    running: list[tuple[int, str, object, int]] = []
    admitted_at: list[float] = []
    charged = 0                                      # tokens used, as finished requests report
    net = 0                                          # tokens reserved minus refunds so far
    overrun = 0                                      # tokens used beyond what was reserved

    async def scenario():
        nonlocal charged, net, overrun
        start = cluster.clock.t
        for n, (op, g, a, b) in enumerate(script):
            gw = gws[g]
            if op == "arrive":
                t = await request(gw, acme, f"x{n}", a, b)
                if not isinstance(t, APIError):
                    running.append((g, f"x{n}", t, a + b))
                    admitted_at.append(cluster.clock.t)
                    net += a + b
            elif op == "finish" and running:
                g2, rid, t, cost = running.pop(a % len(running))
                used = b                             # may exceed cost: n > 1 choices share it
                charged += used
                net -= cost - used
                overrun += max(0, used - cost)
                await finish(gws[g2], acme, rid, t, used)
            elif op == "sync":
                await gw.lane.sync()
            elif op == "tick":
                cluster.clock.t += a
            # The invariants, after every step.
            assert_books_balance(cluster, gws)
            assert len(running) <= LIMITS["max_concurrent_requests"]
            assert len(running) <= 4                                     # max_queue
            window = cluster.clock.t - start
            assert len(admitted_at) <= 30 + window * 30 / 60 + 1e-9      # requests bucket
            assert net - overrun <= 900 + window * 900 / 60 + 1e-9       # tokens bucket
            state = cluster.controller._tenants.get("acme")
            if state is not None:
                assert state.in_flight <= LIMITS["max_concurrent_requests"]
                assert state.tokens_today <= LIMITS["daily_token_budget"] + overrun
        # Everything ends; each gateway goes quiet: all that was granted comes back.
        while running:
            g2, rid, t, cost = running.pop()
            charged += cost
            await finish(gws[g2], acme, rid, t, cost)
        for _ in range(QUIET_SYNCS + 1):
            for gw in gws:
                await gw.lane.sync()
                assert_books_balance(cluster, gws)
        state = cluster.controller._tenants.get("acme")
        if state is not None:
            assert (state.in_flight, state.granted_requests, state.granted_tokens) == (0, 0, 0)
            assert state.admitted_total == len(admitted_at)
            assert state.tokens_today == charged
        assert sum(cluster.queue.snapshot().values()) == 0

    run(scenario())


@pytest.mark.parametrize("limit", ["max_concurrent_requests", "requests_per_minute"])
def test_a_single_gateway_still_admits_up_to_the_limit(limit):
    """Grants take at most half of what is left, and a miss goes to the actor: one gateway
    admits exactly as many as the limit allows, not fewer."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", **{limit: 12})

    async def scenario():
        ok = 0
        for i in range(20):
            t = await request(gw, acme, f"r{i}")
            ok += not isinstance(t, APIError)
            if i % 3 == 0:
                await gw.lane.sync()
        assert ok == 12
        assert gw.lane.admitted > 0

    run(scenario())


def test_a_grant_counts_as_taken_while_the_bucket_refills():
    """Units granted to a gateway are not refilled behind its back: a burst after a quiet
    minute gets the bucket's capacity, not capacity + the grant."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", requests_per_minute=8)

    async def scenario():
        assert not isinstance(await request(gw, acme, "r0"), APIError)
        await gw.lane.sync()
        assert gw.lane.tenants["acme"].requests > 0
        cluster.clock.t += 60                               # the bucket refills
        burst = [await request(gw, acme, f"b{i}") for i in range(20)]
        assert sum(not isinstance(t, APIError) for t in burst) == 8

    run(scenario())


def test_max_queue_holds_across_gateways_and_one_gateway_reaches_it():
    cluster = Cluster(max_queue=6)
    gws = [cluster.gateway(), cluster.gateway()]
    acme = cluster.principal("acme")                        # no tenant limits: places only

    async def scenario():
        running = 0
        for round_ in range(6):
            for g, gw in enumerate(gws):
                for i in range(3):
                    t = await request(gw, acme, f"r{round_}-{g}-{i}")
                    running += not isinstance(t, APIError)
                await gw.lane.sync()
                assert running <= 6
                assert_books_balance(cluster, gws)
        assert running == 6

    run(scenario())


@pytest.mark.parametrize("limit", ["max_queue", "max_concurrent_requests"])
def test_a_request_refused_while_another_gateway_holds_idle_units_gets_them(limit, monkeypatch):
    """Gateway A holds an idle grant; B reaches the limit through the actors. B's next request
    is not refused: the refusal calls A's idle units back, A's next sync returns them, and B's
    one retry is admitted. The limit still holds: the request after it is refused."""
    import kvharbor.platform.admission_flow as flow
    monkeypatch.setattr(flow, "RECALL_WAIT_S", 0.05)
    cluster = Cluster(max_queue=4 if limit == "max_queue" else 64)
    a, b = cluster.gateway(), cluster.gateway()
    acme = cluster.principal("acme", **({"max_concurrent_requests": 4}
                                        if limit == "max_concurrent_requests" else {}))

    async def scenario():
        assert not isinstance(await request(a, acme, "a0"), APIError)
        await a.lane.sync()                                 # A now holds an idle grant
        assert a.lane.places["premium"].free + getattr(a.lane.tenants.get("acme"), "slots", 0) > 0
        first = [await request(b, acme, f"b{i}") for i in range(2)]    # the limit is reached
        assert not any(isinstance(t, APIError) for t in first), first
        edge = asyncio.ensure_future(request(b, acme, "b2"))
        await asyncio.sleep(0.02)
        await a.lane.sync()          # one sync: A is not quiet yet, only the recall frees it
        assert not isinstance(await edge, APIError)
        over = await request(b, acme, "b3")                 # nothing idle left: refused at once
        assert isinstance(over, APIError) and over.status == 429
        assert_books_balance(cluster, [a, b])

    run(scenario())


def test_a_refund_into_the_grant_does_not_add_to_a_full_bucket():
    """Tokens a request did not use go back to the gateway's grant; the bucket must not
    also refill over them: a quiet minute later the tenant gets its tokens_per_minute, no more."""
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", tokens_per_minute=100)

    async def scenario():
        t0 = await request(gw, acme, "r0")                 # 10 + 10 tokens, from the actor
        await finish(gw, acme, "r0", t0, 20)
        await gw.lane.sync()
        t1 = await request(gw, acme, "r1")
        assert isinstance(t1, LocalTicket)
        await gw.lane.sync()
        cluster.clock.t += 60
        await finish(gw, acme, "r1", t1, 0)                # all 20 refunded into the grant
        await gw.lane.sync()
        burst = [await request(gw, acme, f"b{i}") for i in range(10)]
        assert sum(not isinstance(t, APIError) for t in burst) == 5, burst   # 100 / 20

    run(scenario())


def test_premiums_idle_places_neither_shed_nor_are_recalled_by_a_lower_class():
    """A standard flood meets its max_queue: premium's places held idle by a gateway do not
    count against standard (they are not in flight), and standard's refusals do not take
    them back, so premium keeps its fast lane under the flood."""
    cluster = Cluster(max_queue=6)
    a, b = cluster.gateway(), cluster.gateway()
    acme = cluster.principal("acme")
    globex = cluster.principal("globex", qos="standard")

    async def scenario():
        assert not isinstance(await request(a, acme, "a0"), APIError)
        await a.lane.sync()
        idle = a.lane.places["premium"].free
        assert idle > 0
        outcomes = [await request(b, globex, f"s{i}") for i in range(8)]
        admitted = sum(not isinstance(t, APIError) for t in outcomes)
        assert admitted == 5, outcomes                  # 6 - the one premium in flight
        await a.lane.sync()
        assert a.lane.places["premium"].free >= idle     # not recalled (maybe topped up)
        assert_books_balance(cluster, [a, b])

    run(scenario())


def test_units_a_recall_brought_back_wait_for_the_refused_request():
    """A refusal that recalls a gateway's idle grant holds that tenant's top-ups for
    RECALL_HOLD_S: the gateway's give-back and its next ask come in one sync round, and the
    ask must not take back half of what the refused request's retry needs."""
    clock = [1000.0]
    ctl = AdmissionController(clock=lambda: clock[0])
    lim = TenantLimits(tokens_per_minute=100)
    first = ctl.sync_grants("g1", [GrantReport("acme", lim, want_tokens=50)], seq=1)
    assert first[0].tokens == 50                                 # half of the bucket
    assert ctl.try_admit("acme", lim, 40, 0).ok                      # 10 left in the bucket
    refused = ctl.try_admit("acme", lim, 40, 0)
    assert not refused.ok and refused.recalled                       # g1 holds 50 idle
    back = ctl.sync_grants("g1", [GrantReport("acme", lim, back_tokens=50, held=True)], seq=2)
    assert back[0].recall
    # g1 holds nothing now (held False, as its lane reports then) and asks again
    ask = ctl.sync_grants("g1", [GrantReport("acme", lim, want_tokens=50)], seq=3)
    assert ask[0].known and ask[0].tokens == 0                       # held for the retry
    assert ctl.try_admit("acme", lim, 40, 0).ok                      # the retry: 60 >= 40
    clock[0] += RECALL_HOLD_S
    later = ctl.sync_grants("g1", [GrantReport("acme", lim, want_tokens=50)], seq=4)
    assert later[0].known and later[0].tokens == 10                  # half of what is left


def test_a_limit_added_while_a_gateway_holds_tokens_counts_them_as_taken():
    """A tokens_per_minute limit added to a tenant (a tenants.yaml reload) while a gateway
    holds tokens granted when there was none: its bucket starts with those tokens taken."""
    ctl = AdmissionController(clock=lambda: 1000.0)
    held = ctl.sync_grants("g1", [GrantReport("acme", TenantLimits(), want_tokens=30)], seq=1)
    assert held[0].tokens == 30
    lim = TenantLimits(tokens_per_minute=100)
    over = ctl.try_admit("acme", lim, 71, 0)                         # 70 are not held by g1
    assert over.status == 429 and over.limit == "tokens_per_minute"
    assert ctl.try_admit("acme", lim, 70, 0).ok


def test_a_grant_kept_in_part_through_a_recall_is_still_known_and_comes_back_whole():
    """A gateway called back gives back its idle tokens but keeps its request units: the
    controller keeps that grant, so the gateway's next sync (held) is known, and once it gives
    the rest back the tenant's buckets are full again (no unit lost with a dropped grant)."""
    ctl = AdmissionController(clock=lambda: 1000.0)
    lim = TenantLimits(requests_per_minute=100, tokens_per_minute=1000)
    got = ctl.sync_grants("g1", [GrantReport("acme", lim, want_requests=10, want_tokens=100)], seq=1)
    assert (got[0].requests, got[0].tokens) == (10, 100)
    assert ctl.try_admit("acme", lim, 950, 0).recalled               # 900 left; g1 idles on 100
    back = ctl.sync_grants("g1", [GrantReport("acme", lim, back_tokens=100, held=True,
                                              idle=(10, 0, 0))], seq=2)
    assert back[0].recall and back[0].known
    rest = ctl.sync_grants("g1", [GrantReport("acme", lim, back_requests=10, held=True)], seq=3)
    assert rest[0].known
    usage = ctl.usage("acme")
    assert (usage["requests_available"], usage["tokens_available"]) == (100, 1000)


def test_a_gateway_whose_grant_the_controller_lost_is_told_to_start_over():
    """A gateway that holds a grant from before the controller restarted (or its lease ran
    out) is answered ``known=False`` and given nothing, so it voids what it holds instead of
    admitting from units no bucket counts as taken."""
    lim = TenantLimits(tokens_per_minute=100)
    ctl = AdmissionController(clock=lambda: 1000.0)                  # a fresh (restarted) one
    answer = ctl.sync_grants("g1", [GrantReport("acme", lim, want_tokens=50, held=True)], seq=7)
    assert (answer[0].known, answer[0].tokens) == (False, 0)
    assert ctl.usage("acme")["tokens_available"] == 100


def test_a_sync_sent_again_after_the_gateways_lease_ran_out_is_answered_afresh():
    """The gateway's answer was lost and it could not reach the controller for longer than its
    lease: its grant was dropped meanwhile. Its resend (same seq) is settled again, so the
    slots the answer tells it it holds are counted, not a stored answer's that nobody counts."""
    lease_clock = Clock()
    ctl = AdmissionController(clock=lambda: 1000.0, lease_s=10, lease_clock=lease_clock)
    report = [GrantReport("acme", TenantLimits(max_concurrent_requests=8), want_slots=4)]
    assert ctl.sync_grants("g1", report, seq=1)[0].slots == 4
    lease_clock.t += 11
    assert ctl.usage("acme")["in_flight"] == 0                         # the grant expired
    again = ctl.sync_grants("g1", report, seq=1)
    assert again[0].known and ctl._tenants["acme"].in_flight == again[0].slots == 4


@pytest.mark.parametrize("recalled", [False, True], ids=["quiet", "recalled"])
@pytest.mark.parametrize("want", [(10, 0, 0), (10, 10, 0), (3, 3, 3)])
def test_a_grant_of_any_mix_of_units_is_kept_until_given_back(want, recalled):
    """Whatever a grant holds (requests only; as many tokens as requests; one of each kind
    alike), the controller keeps it, also through a sync that answers a recall while all of it
    is still in use: the gateway's next syncs are known, and what it gives back restores the
    limits in full."""
    lim = TenantLimits(requests_per_minute=30, tokens_per_minute=600, max_concurrent_requests=8)
    ctl = AdmissionController(clock=lambda: 1000.0)
    wants = dict(zip(("want_requests", "want_tokens", "want_slots"), want))
    got = ctl.sync_grants("g1", [GrantReport("acme", lim, **wants)], seq=1)[0]
    assert (got.requests, got.tokens, got.slots) == want
    if recalled:                           # the bucket runs dry while g1 sits on its units
        for _ in range(30 - want[0]):
            ctl.release(ctl.try_admit("acme", lim, 1, 0).ticket)
        assert ctl.try_admit("acme", lim, 1, 0).recalled
    kept = ctl.sync_grants("g1", [GrantReport("acme", lim, held=True)], seq=2)[0]
    assert kept.known and kept.recall == recalled
    if recalled:                           # all of it in use now: nothing idle to call back
        assert not ctl.try_admit("acme", lim, 1, 0).recalled
    back = dict(zip(("back_requests", "back_tokens", "back_slots"), want))
    assert ctl.sync_grants("g1", [GrantReport("acme", lim, held=True, **back)], seq=3)[0].known
    usage = ctl.usage("acme", now=1060.0)                             # a minute: buckets full
    assert (usage["requests_available"], usage["tokens_available"], usage["in_flight"]) == (30, 600, 0)


def test_tokens_a_grant_still_holds_at_utc_midnight_count_against_the_new_day():
    lim = TenantLimits(daily_token_budget=1000)
    ctl = AdmissionController()
    day = 1_796_515_200.0                                           # 2026-12-06 00:00 UTC
    got = ctl.sync_grants("g1", [GrantReport("acme", lim, want_tokens=200)], now=day + 3600)
    assert got[0].tokens == 200 and ctl.usage("acme", now=day + 3600)["tokens_today"] == 200
    for later in (60, 120):                                         # charged once, not per sync
        ctl.sync_grants("g1", [GrantReport("acme", lim, held=True)], now=day + 86_400 + later)
        assert ctl.usage("acme", now=day + 86_400 + later)["tokens_today"] == 200


def test_a_token_grant_takes_at_most_half_of_what_the_daily_budget_has_left():
    lim = TenantLimits(daily_token_budget=1000)
    ctl = AdmissionController(clock=lambda: 1000.0)
    assert ctl.try_admit("acme", lim, 900, 0).ok
    assert ctl.sync_grants("g1", [GrantReport("acme", lim, want_tokens=200)])[0].tokens == 50


def test_a_sync_sweeps_a_dead_gateways_grant_before_it_shares_out():
    """g1 died holding half the slots; once its lease ran out, g2's sync counts them free."""
    lim = TenantLimits(max_concurrent_requests=8)
    lease_clock = Clock()
    ctl = AdmissionController(clock=lambda: 1000.0, lease_s=10, lease_clock=lease_clock)
    assert ctl.sync_grants("g1", [GrantReport("acme", lim, want_slots=4)])[0].slots == 4
    lease_clock.t += 11
    assert ctl.sync_grants("g2", [GrantReport("acme", lim, want_slots=4)])[0].slots == 4


def test_a_refusal_by_the_daily_budget_recalls_idle_tokens_only_when_they_would_admit_it():
    lim = TenantLimits(daily_token_budget=1000)
    ctl = AdmissionController(clock=lambda: 1000.0)
    assert ctl.sync_grants("g1", [GrantReport("acme", lim, want_tokens=200)])[0].tokens == 200
    assert ctl.try_admit("acme", lim, 700, 0).ok                    # 900 of 1000 charged today
    too_much = ctl.try_admit("acme", lim, 400, 0)                   # 700 + 400 > 1000 even so
    assert too_much.limit == "daily_token_budget" and not too_much.recalled
    fits_then = ctl.try_admit("acme", lim, 300, 0)                  # 700 + 300 == 1000: fits
    assert fits_then.limit == "daily_token_budget" and fits_then.recalled


def test_a_dead_gateways_grant_gives_the_tenant_its_whole_rate_back():
    """A gateway died holding request and token units: once its lease runs out the buckets
    refill to their full capacity again, not to capacity less what the dead grant held."""
    lim = TenantLimits(requests_per_minute=30, tokens_per_minute=600)
    lease_clock = Clock()
    ctl = AdmissionController(clock=lambda: 1000.0, lease_s=10, lease_clock=lease_clock)
    got = ctl.sync_grants("g1", [GrantReport("acme", lim, want_requests=10, want_tokens=200)])
    assert (got[0].requests, got[0].tokens) == (10, 200)
    lease_clock.t += 11
    usage = ctl.usage("acme", now=1060.0)                             # a minute: buckets full
    assert (usage["requests_available"], usage["tokens_available"]) == (30, 600)
    assert ctl.expired_total == 1


def test_usage_names_the_utc_day_and_a_request_without_max_tokens_reserves_the_tenants_cap():
    ctl = AdmissionController()
    noon = 1_796_515_200.0 + 12 * 3600                              # 2026-12-06 12:00 UTC
    capped = ctl.try_admit("acme", TenantLimits(max_tokens_per_request=64), 10, None, now=noon)
    assert capped.ticket.reserved_tokens == 10 + 64
    assert ctl.try_admit("acme", TenantLimits(), 10, None, now=noon).ticket.reserved_tokens == 10
    assert ctl.usage("acme", now=noon)["utc_day"] == "2026-12-06"


def test_a_refusal_recalls_idle_slots_only_when_they_would_admit_it():
    """max_concurrent_requests lowered (a reload) below what is in flight: giving back a
    gateway's idle slot would still leave the tenant at its limit, so the refusal does not call
    the slot back (no gateway gives it up for nothing, and the client is not told to retry
    soon). With the limit at 3 the idle slot is the one that would admit it: that refusal
    recalls it."""
    ctl = AdmissionController(clock=lambda: 1000.0)
    wide = TenantLimits(max_concurrent_requests=4)
    assert ctl.sync_grants("g1", [GrantReport("acme", wide, want_slots=1)], seq=1)[0].slots == 1
    assert ctl.try_admit("acme", wide, 1, 1).ok and ctl.try_admit("acme", wide, 1, 1).ok
    narrow = TenantLimits(max_concurrent_requests=2)                # 3 taken: 2 running, 1 idle
    refused = ctl.try_admit("acme", narrow, 1, 1)
    assert refused.status == 429 and refused.limit == "max_concurrent_requests"
    assert not refused.recalled
    three = TenantLimits(max_concurrent_requests=3)                 # the idle slot is the one left
    assert ctl.try_admit("acme", three, 1, 1).recalled


def test_a_recall_calls_back_only_the_gateways_that_sat_on_idle_units():
    """g1 holds idle tokens, g2's grant is all in use, g3 holds a grant of another tenant
    only: a refusal that g1's units would admit calls back g1, not g2 (whose next sync is
    answered without a recall), and g3 is not looked at for this tenant."""
    ctl = AdmissionController(clock=lambda: 1000.0)
    lim = TenantLimits(tokens_per_minute=1000)
    assert ctl.sync_grants("g3", [GrantReport("globex", lim, want_tokens=100)], seq=1)[0].tokens == 100
    assert ctl.sync_grants("g1", [GrantReport("acme", lim, want_tokens=100)], seq=1)[0].tokens == 100
    assert ctl.sync_grants("g2", [GrantReport("acme", lim, want_tokens=100)], seq=1)[0].tokens == 100
    ctl.sync_grants("g2", [GrantReport("acme", lim, held=True, idle=(0, 0, 0))], seq=2)   # all in use
    refused = ctl.try_admit("acme", lim, 850, 0)                     # 800 left; g1 idles on 100
    assert refused.status == 429 and refused.recalled
    g1 = ctl.sync_grants("g1", [GrantReport("acme", lim, back_tokens=100, held=True)], seq=2)
    g2 = ctl.sync_grants("g2", [GrantReport("acme", lim, held=True)], seq=3)
    assert g1[0].recall and not g2[0].recall


def test_a_refusal_recalls_a_grants_last_idle_request():
    lim = TenantLimits(requests_per_minute=2)
    ctl = AdmissionController(clock=lambda: 1000.0)
    assert ctl.sync_grants("g1", [GrantReport("acme", lim, want_requests=1)])[0].requests == 1
    assert ctl.try_admit("acme", lim, 1, 1).ok                      # the bucket's last unit
    refused = ctl.try_admit("acme", lim, 1, 1)
    assert refused.limit == "requests_per_minute" and refused.recalled
