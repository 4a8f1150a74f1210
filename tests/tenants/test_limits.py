"""Admission limits, run against the in-process controller and the shared Ray actor alike.

Every call passes ``now`` explicitly (no sleeping). Each test uses its own tenant name, so the
actor variant can share one actor across the module.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from kvharbor.tenants import LocalAdmission, TenantLimits

from .conftest import T0

_names = itertools.count()


@pytest.fixture(scope="module")
def actor_admission(request):
    request.getfixturevalue("ray_cluster")
    import ray

    from kvharbor.tenants.admission_actor import ActorAdmission, get_or_create_admission_actor

    handle = get_or_create_admission_actor(name="kvharbor-admission-test-limits",
                                           namespace="kvharbor-tests")
    yield ActorAdmission(handle)
    ray.kill(handle)


@pytest.fixture(params=["local", "actor"])
def adm(request):
    """An async admission client plus a fresh tenant name: ``(client, tenant)``."""
    client = LocalAdmission() if request.param == "local" else \
        request.getfixturevalue("actor_admission")
    return client, f"t{next(_names)}-{request.param}"


def run(coro):
    return asyncio.run(coro)


def test_requests_per_minute_bucket(adm):
    client, tenant = adm
    lim = TenantLimits(requests_per_minute=3)
    results = [run(client.try_admit(tenant, lim, 1, 1, now=T0)) for _ in range(4)]
    assert [r.ok for r in results] == [True, True, True, False]
    assert results[-1].status == 429 and results[-1].limit == "requests_per_minute"
    assert results[-1].retry_after_s == pytest.approx(20.0)        # 60 s / 3 requests
    assert not run(client.try_admit(tenant, lim, 1, 1, now=T0 + 19.9)).ok
    assert run(client.try_admit(tenant, lim, 1, 1, now=T0 + 20.0)).ok


def test_tokens_per_minute_reserves_and_refunds(adm):
    client, tenant = adm
    lim = TenantLimits(tokens_per_minute=1000)
    first = run(client.try_admit(tenant, lim, 100, 500, now=T0))       # reserves 600
    assert first.ok
    second = run(client.try_admit(tenant, lim, 100, 400, now=T0))      # needs 500, has 400
    assert second.status == 429 and second.limit == "tokens_per_minute"
    assert second.retry_after_s == pytest.approx(6.0)                  # 100 tokens at 1000/min
    run(client.release(first.ticket, tokens_used=200, now=T0))        # refund 400
    assert run(client.try_admit(tenant, lim, 100, 400, now=T0)).ok
    usage = run(client.usage(tenant, now=T0))
    assert usage["tokens_available"] == pytest.approx(300)


def test_a_refund_after_the_bucket_refilled_never_lifts_it_past_its_capacity(adm):
    """A request reserves the whole minute's 1,000 tokens and ends a minute later having
    used none: the bucket has refilled meanwhile, and the refund must not stack on top (the
    tenant could then take 2,000 tokens in a minute)."""
    client, tenant = adm
    lim = TenantLimits(tokens_per_minute=1000)
    first = run(client.try_admit(tenant, lim, 100, 900, now=T0))
    assert first.ok
    run(client.release(first.ticket, tokens_used=0, now=T0 + 60))
    assert run(client.usage(tenant, now=T0 + 60))["tokens_available"] == pytest.approx(1000)
    assert run(client.try_admit(tenant, lim, 100, 900, now=T0 + 60)).ok
    again = run(client.try_admit(tenant, lim, 100, 900, now=T0 + 60))
    assert again.status == 429 and again.limit == "tokens_per_minute"


def test_a_request_fits_the_token_bucket_exactly_or_waits(adm):
    """The bucket's last tokens admit a request of exactly that size; one token more waits
    for the refill of that one token."""
    client, tenant = adm
    lim = TenantLimits(tokens_per_minute=1000)
    assert run(client.try_admit(tenant, lim, 100, 500, now=T0)).ok         # 400 left
    over = run(client.try_admit(tenant, lim, 101, 300, now=T0))            # needs 401
    assert over.status == 429 and over.limit == "tokens_per_minute"
    assert over.retry_after_s == pytest.approx(0.06)                      # 1 token at 1000/min
    assert run(client.try_admit(tenant, lim, 100, 300, now=T0)).ok         # needs 400


def test_request_larger_than_a_bucket_is_400_not_429(adm):
    client, tenant = adm
    result = run(client.try_admit(tenant, TenantLimits(tokens_per_minute=100), 90, 20, now=T0))
    assert result.status == 400 and "tokens_per_minute is 100" in result.reason


def test_a_request_of_n_choices_reserves_max_tokens_for_each(adm):
    """``n`` choices may each generate ``max_tokens``: the reservation is prompt + n x
    max_tokens, and a request whose reservation no bucket holds is a 400 naming ``n``;
    ``max_tokens_per_request`` stays a bound on each choice."""
    client, tenant = adm
    lim = TenantLimits(tokens_per_minute=1000, max_tokens_per_request=200)
    too_many = run(client.try_admit(tenant, lim, 100, 200, now=T0, n=5))     # 1,100 > 1,000
    assert too_many.status == 400 and too_many.limit == "tokens_per_minute"
    assert "(prompt 100 + 5 choices x max_tokens 200)" in too_many.reason and ", n or" in too_many.reason
    assert run(client.try_admit(tenant, lim, 100, 200, now=T0, n=3)).ok      # reserves 700
    assert run(client.usage(tenant, now=T0))["tokens_available"] == pytest.approx(300)


def test_max_tokens_per_request_is_400_naming_the_limit(adm):
    client, tenant = adm
    lim = TenantLimits(max_tokens_per_request=256)
    bad = run(client.try_admit(tenant, lim, 10, 257, now=T0))
    assert (bad.ok, bad.status, bad.limit) == (False, 400, "max_tokens_per_request")
    assert "max_tokens_per_request=256" in bad.reason and bad.retry_after_s is None
    assert run(client.try_admit(tenant, lim, 10, 256, now=T0)).ok


def test_max_concurrent_requests(adm):
    client, tenant = adm
    lim = TenantLimits(max_concurrent_requests=2)
    a, b = (run(client.try_admit(tenant, lim, 1, 1, now=T0)) for _ in range(2))
    third = run(client.try_admit(tenant, lim, 1, 1, now=T0))
    assert third.status == 429 and third.limit == "max_concurrent_requests"
    assert third.retry_after_s > 0
    assert run(client.release(a.ticket, 2, now=T0)) is True
    assert run(client.release(a.ticket, 2, now=T0)) is False          # second release ignored
    assert run(client.try_admit(tenant, lim, 1, 1, now=T0)).ok
    assert run(client.usage(tenant, now=T0))["in_flight"] == 2


def test_daily_budget_resets_at_utc_midnight(adm):
    client, tenant = adm
    lim = TenantLimits(daily_token_budget=1000)
    first = run(client.try_admit(tenant, lim, 400, 400, now=T0))
    assert first.ok
    late = run(client.try_admit(tenant, lim, 100, 200, now=T0 + 60))
    assert late.status == 429 and late.limit == "daily_token_budget"
    assert late.retry_after_s == pytest.approx(57_600 - 60)
    run(client.release(first.ticket, tokens_used=500, now=T0 + 60))     # 300 refunded
    second = run(client.try_admit(tenant, lim, 100, 200, now=T0 + 60))  # 500 + 300 <= 1000
    assert second.ok
    assert not run(client.try_admit(tenant, lim, 100, 200, now=T0 + 61)).ok
    assert not run(client.try_admit(tenant, lim, 100, 101, now=T0 + 61)).ok  # 800 + 201 > 1000
    assert run(client.try_admit(tenant, lim, 100, 100, now=T0 + 61)).ok  # 800 + 200: exactly 1000
    assert run(client.try_admit(tenant, lim, 100, 200, now=T0 + 57_600)).ok
    assert run(client.usage(tenant, now=T0 + 57_600))["tokens_today"] == 300
    # yesterday's request ends today: its unused tokens go back to yesterday, not today
    run(client.release(second.ticket, tokens_used=0, now=T0 + 57_601))
    assert run(client.usage(tenant, now=T0 + 57_601))["tokens_today"] == 300


def test_longest_wait_wins_when_several_limits_refuse(adm):
    client, tenant = adm
    lim = TenantLimits(requests_per_minute=1, daily_token_budget=10)
    assert run(client.try_admit(tenant, lim, 5, 5, now=T0)).ok
    both = run(client.try_admit(tenant, lim, 1, 1, now=T0))
    assert both.limit == "daily_token_budget" and both.retry_after_s == pytest.approx(57_600)


def test_limits_change_takes_effect_on_next_call(adm):
    client, tenant = adm
    assert run(client.try_admit(tenant, TenantLimits(requests_per_minute=1), 1, 1, now=T0)).ok
    assert not run(client.try_admit(tenant, TenantLimits(requests_per_minute=1), 1, 1, now=T0)).ok
    assert run(client.try_admit(tenant, TenantLimits(), 1, 1, now=T0)).ok      # limit removed
    assert run(client.try_admit(tenant, {"requests_per_minute": 5}, 1, 1, now=T0)).ok


def test_tenants_are_independent(adm):
    client, tenant = adm
    lim = TenantLimits(requests_per_minute=1)
    assert run(client.try_admit(tenant, lim, 1, 1, now=T0)).ok
    assert run(client.try_admit(tenant + "-other", lim, 1, 1, now=T0)).ok
    assert set(run(client.usage_all(now=T0))) >= {tenant, tenant + "-other"}


def test_usage_counts_each_refusal_under_the_limit_that_refused_it(adm):
    client, tenant = adm
    lim = TenantLimits(requests_per_minute=1, max_tokens_per_request=10)
    assert run(client.try_admit(tenant, lim, 1, 1, now=T0)).ok
    for _ in range(2):
        assert run(client.try_admit(tenant, lim, 1, 1, now=T0)).limit == "requests_per_minute"
    assert run(client.try_admit(tenant, lim, 1, 11, now=T0)).limit == "max_tokens_per_request"
    usage = run(client.usage(tenant, now=T0))
    assert usage["rejected"] == {"requests_per_minute": 2, "max_tokens_per_request": 1}
    assert usage["admitted_total"] == 1


def test_admissions_and_429s_carry_what_the_buckets_hold_and_a_400_does_not(adm):
    """``rates`` feed the x-ratelimit headers: units left and seconds until full."""
    client, tenant = adm
    lim = TenantLimits(requests_per_minute=120, max_tokens_per_request=10)
    first = run(client.try_admit(tenant, lim, 1, 1, now=T0))
    assert first.rates["requests"] == (119, pytest.approx(0.5))
    for _ in range(119):
        run(client.try_admit(tenant, lim, 1, 1, now=T0))
    refused = run(client.try_admit(tenant, lim, 1, 1, now=T0))
    assert refused.status == 429 and refused.rates["requests"] == (0, pytest.approx(60.0))
    assert refused.reason.endswith("retry in 500 ms")                   # waits under 1 s in ms
    per_second = TenantLimits(requests_per_minute=60)
    for _ in range(60):
        run(client.try_admit(tenant + "-b", per_second, 1, 1, now=T0))
    one_s = run(client.try_admit(tenant + "-b", per_second, 1, 1, now=T0))
    assert one_s.reason.endswith("retry in 1.0 s")
    assert run(client.try_admit(tenant, lim, 1, 11, now=T0)).rates is None


def test_usage_shows_the_buckets_refilled_to_the_time_asked(adm):
    client, tenant = adm
    lim = TenantLimits(requests_per_minute=3, daily_token_budget=100)
    for _ in range(3):
        assert run(client.try_admit(tenant, lim, 10, 10, now=T0)).ok
    assert run(client.usage(tenant, now=T0 + 40))["requests_available"] == pytest.approx(2.0)
    assert run(client.usage(tenant, now=T0 + 57_600))["tokens_today"] == 0   # a new UTC day


def test_usage_after_a_reload_shows_the_new_limits_and_caps_refunds_at_them(adm):
    client, tenant = adm
    big = run(client.try_admit(tenant, TenantLimits(tokens_per_minute=1000), 200, 300, now=T0))
    assert big.ok                                                       # 500 of 1000 left
    smaller = TenantLimits(tokens_per_minute=400)
    assert run(client.try_admit(tenant, smaller, 50, 50, now=T0)).ok     # 400 - 100 left
    run(client.release(big.ticket, tokens_used=0, now=T0))              # 500 back: capped at 400
    usage = run(client.usage(tenant, now=T0))
    assert usage["limits"]["tokens_per_minute"] == 400
    assert usage["tokens_available"] == 400


def test_renew_names_the_tickets_that_are_no_longer_held(adm):
    """The gateway's lease keeper renews its tickets and forgets those the controller no
    longer holds (released, or expired while the gateway could not reach it)."""
    client, tenant = adm
    ticket = run(client.try_admit(tenant, TenantLimits(), 1, 1, now=T0)).ticket
    assert run(client.renew([ticket.ticket_id, "never-issued"])) == ["never-issued"]
    run(client.release(ticket, now=T0))
    assert run(client.renew([ticket.ticket_id])) == [ticket.ticket_id]


def test_actor_shares_limits_between_gateway_replicas(actor_admission):
    """Two caller actors (stand-ins for gateway replicas) admit against one named actor."""
    import ray

    from kvharbor.tenants.admission_actor import ActorAdmission

    @ray.remote(num_cpus=0)
    class FakeGateway:
        def __init__(self, handle):
            self.admission = ActorAdmission(handle)

        async def burst(self, n: int) -> int:
            lim = TenantLimits(requests_per_minute=25)
            results = await asyncio.gather(*(self.admission.try_admit(
                "shared-tenant", lim, 1, 1, now=T0) for _ in range(n)))
            return sum(r.ok for r in results)

    gateways = [FakeGateway.remote(actor_admission.handle) for _ in range(2)]
    admitted = ray.get([g.burst.remote(20) for g in gateways], timeout=60)
    assert sum(admitted) == 25 and all(a > 0 for a in admitted)
    assert run(actor_admission.usage("shared-tenant", now=T0))["admitted_total"] == 25


def test_a_caller_cancelled_while_being_admitted_does_not_leak_its_slot(actor_admission):
    """A client that disconnects during ``try_admit`` must not hold a concurrency slot."""
    tenant = f"t{next(_names)}-cancel"
    limits = TenantLimits(max_concurrent_requests=1)

    async def cancel_mid_admission():
        task = asyncio.ensure_future(actor_admission.try_admit(tenant, limits, 10, 10, now=T0))
        await asyncio.sleep(0)            # the actor call is sent, its answer not yet back
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):              # the orphaned admission is released in the background
            usage = await actor_admission.usage(tenant, now=T0)
            if usage["admitted_total"] == 1 and usage["in_flight"] == 0:
                break
            await asyncio.sleep(0.05)
        return usage, await actor_admission.try_admit(tenant, limits, 10, 10, now=T0)

    usage, again = asyncio.run(cancel_mid_admission())
    assert usage["admitted_total"] == 1 and usage["in_flight"] == 0, usage
    assert again.ok, again.reason


def test_the_actor_facade_takes_and_gives_back_queue_places_and_slots(actor_admission):
    """The gateway's path through the actor: ``enter_and_admit`` takes a queue place and a
    slot in one call; a caller cancelled during it gets both given back; ``release_and_leave``
    (sent without waiting) frees both and charges the tokens used; ``renew`` names only the
    tickets the actor does not hold; ``sync_grants`` hands a gateway its grant."""
    from kvharbor.tenants.limits import GrantReport

    tenant = f"t{next(_names)}-gate"
    batch, premium = f"{tenant}-batch", f"{tenant}-premium"    # class names of this test only
    prio = {premium: 100, batch: 10}

    async def settled(check):
        """(queue snapshot, usage of each tenant) once ``check`` holds of it (5 s at most)."""
        for _ in range(100):
            state = (await actor_admission.queue_snapshot(),
                     {t: await actor_admission.usage(t) for t in (tenant, tenant + "-2")})
            if check(*state):
                break
            await asyncio.sleep(0.05)
        return state

    async def main():
        one = {"max_concurrent_requests": 1, "max_tokens_per_request": 8}
        first = await actor_admission.enter_and_admit(batch, prio, 2, tenant, one, 10, 5)
        assert first.ok, first.reason                # 10 prompt tokens, max_tokens 5 (cap 8)
        queue, usage = await settled(lambda q, u: True)
        assert (queue[batch], usage[tenant]["in_flight"]) == (1, 1)
        assert await actor_admission.renew([first.ticket.ticket_id, "nobody's"]) == ["nobody's"]

        task = asyncio.ensure_future(actor_admission.enter_and_admit(
            premium, prio, 5, tenant + "-2", {}, 10, 5))
        await asyncio.sleep(0)            # the call is sent, its answer not yet back
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        queue, usage = await settled(lambda q, u: u[tenant + "-2"]["admitted_total"] == 1
                                     and q.get(premium) == 0)
        assert (queue[premium], usage[tenant + "-2"]["in_flight"]) == (0, 0), "orphan kept"

        assert actor_admission.release_and_leave(first.ticket, batch, 12) is None
        queue, usage = await settled(lambda q, u: q[batch] == 0)
        assert (queue[batch], usage[tenant]["in_flight"]) == (0, 0)
        assert usage[tenant]["tokens_today"] == 12                 # 15 reserved, 12 used

        report = GrantReport(tenant + "-3", TenantLimits(requests_per_minute=10), want_requests=4)
        [answer] = await actor_admission.sync_grants(f"{tenant}-gateway", [report], seq=1)
        assert (answer.tenant, answer.requests, answer.known) == (tenant + "-3", 4, True)
        # the same sync sent again (its answer lost): the same answer, not a second grant
        assert await actor_admission.sync_grants(f"{tenant}-gateway", [report], seq=1) == [answer]
        assert (await actor_admission.usage(tenant + "-3"))["requests_available"] == 6

    asyncio.run(main())


def test_the_admission_actor_outlives_the_process_that_created_it(ray_cluster):
    """The first gateway to start creates the cluster's admission actor; when that gateway
    goes (scaled down, restarted), the actor and its counts stay for the others."""
    import ray

    from kvharbor.tenants.admission_actor import get_or_create_admission_actor

    name, tenant = f"kvharbor-admission-test-owner-{next(_names)}", f"t{next(_names)}-owner"

    @ray.remote(num_cpus=0)
    class FirstGateway:
        def admit(self) -> bool:
            handle = get_or_create_admission_actor(name=name, namespace="kvharbor-tests")
            return ray.get(handle.try_admit.remote(tenant, {}, 1, 1)).ok

    first = FirstGateway.remote()
    assert ray.get(first.admit.remote(), timeout=60)
    ray.kill(first)
    handle = get_or_create_admission_actor(name=name, namespace="kvharbor-tests")
    try:
        for _ in range(6):                   # an actor owned by the creator dies within ~1 s
            assert ray.get(handle.usage.remote(tenant), timeout=10)["admitted_total"] == 1
            time.sleep(0.5)
    finally:
        ray.kill(handle)


async def _answer_later(value):
    """An actor call that answers ``value`` after 50 ms."""
    await asyncio.sleep(0.05)
    return value


def test_await_or_undo_undoes_only_when_the_caller_was_cancelled():
    from kvharbor.actors.calls import await_or_undo

    undone = []

    async def main():
        assert await await_or_undo(_answer_later("kept"), undone.append) == "kept"
        task = asyncio.ensure_future(await_or_undo(_answer_later("orphan"), undone.append))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert undone == ["orphan"]


def test_await_or_undo_undoes_a_call_that_answers_after_its_timeout():
    """An actor that answers late (restarting, overloaded): the caller gets TimeoutError, and
    what the call took is given back once it completes."""
    from kvharbor.actors.calls import await_or_undo

    undone = []

    async def main():
        with pytest.raises(TimeoutError):
            await await_or_undo(_answer_later("slot"), undone.append, timeout_s=0.01)
        assert undone == []                          # not yet: the call has not answered
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert undone == ["slot"]


def test_gatekeeper_queue_and_limits_in_one_call_refusals_take_nothing(clock):
    """Queue place + admission in one call: a full queue admits nothing; a limit refusal
    gives the queue place back; release frees both, once."""
    from kvharbor.tenants.admission_actor import GateKeeper
    from kvharbor.tenants.limits import AdmissionController

    gate = GateKeeper(AdmissionController(clock=clock))
    prio = {"premium": 100, "batch": 10}
    one = {"max_concurrent_requests": 1}
    first = gate.enter_and_admit("batch", prio, 2, "t", one, 10, 5)
    assert first.ok and gate.queue.snapshot() == {"batch": 1}
    limited = gate.enter_and_admit("batch", prio, 2, "t", one, 10, 5)
    assert (limited.ok, limited.status, limited.limit) == (False, 429, "max_concurrent_requests")
    assert gate.queue.snapshot() == {"batch": 1}, "a refused request kept its queue place"
    gate.enter_and_admit("premium", prio, 5, "p", {}, 10, 5)
    full = gate.enter_and_admit("batch", prio, 2, "u", {}, 10, 5)
    assert (full.ok, full.status, full.limit) == (False, 429, "queue_full")
    assert gate.ctl.usage("u")["admitted_total"] == 0
    assert gate.release_and_leave(first.ticket, "batch", 12)
    assert not gate.release_and_leave(first.ticket, "batch", 12)
    assert gate.queue.snapshot() == {"batch": 0, "premium": 1}
    assert gate.enter_and_admit("batch", prio, 2, "t", one, 10, 5).ok
    assert not gate.release_and_leave(first.ticket, "batch", 12)   # stale: frees no new place
    assert gate.queue.snapshot() == {"batch": 1, "premium": 1}
