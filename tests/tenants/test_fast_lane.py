"""The premium fast lane (kvharbor.platform.fast_lane): admitted without an actor call, limits exact.

Gateways are ``Admitter`` objects over the plain ``AdmissionController`` and ``ClassQueue`` (no
Ray): an actor call is an awaited coroutine, counted here, so "no call" is a number.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvharbor.platform.admission_flow import Admitter
from kvharbor.platform.class_queue import ClassQueue
from kvharbor.platform.fast_lane import QUIET_SYNCS, LocalTicket
from kvharbor.platform.openai_protocol import APIError
from kvharbor.tenants.leases import LeaseTable
from kvharbor.tenants.limits import AdmissionController, LocalAdmission, TenantLimits

PRIORITIES = {"premium": 100, "standard": 50}


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


class Counted:
    """An actor stand-in: ``obj.method.remote(*args)`` runs the call and returns a future."""

    def __init__(self, target, calls: dict) -> None:
        self._target, self._calls = target, calls

    def __getattr__(self, name):
        method = getattr(self._target, name)
        calls = self._calls

        def call(*args):                 # runs at once, like a sent call; await for the answer
            calls[name] = calls.get(name, 0) + 1
            answer = asyncio.get_running_loop().create_future()
            answer.set_result(method(*args))
            return answer

        return SimpleNamespace(remote=call)


class CountedAdmission(LocalAdmission):
    def __init__(self, controller, calls: dict) -> None:
        super().__init__(controller)
        self.calls = calls

    def __getattribute__(self, name):
        if name in ("try_admit", "release", "renew", "sync_grants"):
            calls = object.__getattribute__(self, "calls")
            calls[name] = calls.get(name, 0) + 1
        return object.__getattribute__(self, name)


class Registry:
    def __init__(self, max_queue: int = 64) -> None:
        self.version = 1
        self.config = SimpleNamespace(qos_classes={
            "premium": SimpleNamespace(priority=100, pinned=True, max_queue=max_queue),
            "standard": SimpleNamespace(priority=50, pinned=False, max_queue=max_queue)})


class Metrics:
    def __init__(self) -> None:
        self.paths: dict[str, int] = {}

    def rate_limited(self, tenant, code):
        pass

    def admitted(self, tenant, qos, path):
        self.paths[path] = self.paths.get(path, 0) + 1


class Cluster:
    """One admission controller and one class queue shared by several gateways."""

    def __init__(self, max_queue: int = 64) -> None:
        self.clock = Clock()
        self.lease_clock = Clock()
        self.controller = AdmissionController(clock=self.clock, lease_s=10,
                                              lease_clock=self.lease_clock)
        self.queue = ClassQueue(leases=LeaseTable(10), holders=LeaseTable(10))
        self.registry = Registry(max_queue)
        self.calls: dict[str, int] = {}

    def gateway(self) -> Admitter:
        admitter = Admitter(CountedAdmission(self.controller, self.calls),
                            Counted(self.queue, self.calls), self.registry, Metrics())
        admitter.lane._wake = lambda: None          # syncs are driven by the test
        return admitter

    def principal(self, tenant: str, qos: str = "premium", **limits) -> SimpleNamespace:
        return SimpleNamespace(tenant=tenant, qos_name=qos, qos=self.registry.config.qos_classes[qos],
                               limits=TenantLimits(**limits))


def assert_books_balance(cluster: Cluster, gws: list[Admitter]) -> None:
    """What the actors count as granted to each gateway equals what the gateway holds: free
    units, units in use, use not yet reported and units waiting to be given back."""
    for gw in gws:
        lane = gw.lane
        grants = cluster.controller._grants.get(lane.holder, {})
        for tenant in set(grants) | set(lane.tenants):
            g, a = grants.get(tenant), lane.tenants.get(tenant)
            actor = (0, 0, 0) if g is None else (g.requests, g.tokens, g.slots)
            mine = (0, 0, 0) if a is None else (a.requests + a.used_requests + a.void[0],
                                                 a.tokens + a.used_tokens + a.void[1],
                                                 a.slots + a.on_slots + a.void[2])
            if a is not None and not a.needs()[0]:
                mine = (actor[0], *mine[1:])          # no request limit: units not counted here
            assert actor == mine, (tenant, actor, mine)
        places = cluster.queue.grants.get(lane.holder, {})
        for qos in set(places) | set(lane.places):
            p = lane.places.get(qos)
            assert places.get(qos, 0) == (0 if p is None else p.free + p.in_use + p.void), qos
            if p is not None:                       # places in use = requests holding one
                assert p.in_use == sum(e == p.epoch for e in gw._lane_places.values()), qos


async def request(gw: Admitter, principal, rid: str, prompt: int = 10, max_tokens: int = 10):
    """early + admit, as the gateway does; the ticket, or the APIError."""
    try:
        await gw.early(principal, rid)
        return await gw.admit(principal, rid, prompt, max_tokens)
    except APIError as error:
        return error


async def finish(gw: Admitter, principal, rid: str, ticket, used: int) -> None:
    gw.leave(principal.qos_name, rid)
    await gw.release(ticket, used)


def run(coro):
    return asyncio.run(coro)


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
    the tenant's limits. A tenant that goes quiet and comes back is hurried the same way."""
    cluster = Cluster()
    gw = Admitter(CountedAdmission(cluster.controller, cluster.calls), Counted(cluster.queue, cluster.calls),
                  cluster.registry, Metrics())
    gw.lane.period_s = 30.0
    acme = cluster.principal("acme", requests_per_minute=1200, tokens_per_minute=200_000,
                             max_concurrent_requests=64)

    async def two_requests(first: str, second: str) -> tuple:
        one = await request(gw, acme, first)
        await finish(gw, acme, first, one, 15)
        for _ in range(20):                      # the woken sync answers (no Ray: at once)
            await asyncio.sleep(0)
        two = await request(gw, acme, second)
        await finish(gw, acme, second, two, 15)
        return one, two

    async def scenario():
        try:
            one, two = await two_requests("r0", "r1")
            assert not isinstance(one, LocalTicket) and isinstance(two, LocalTicket), (one, two)
            for _ in range(QUIET_SYNCS + 2):     # a quiet spell: everything given back
                await gw.lane.sync()
            assert "acme" not in gw.lane.tenants
            _, three = await two_requests("r2", "r3")
            assert isinstance(three, LocalTicket), three
        finally:
            gw.lane._task.cancel()

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


def test_everything_granted_comes_back_when_the_tenant_goes_quiet():
    cluster = Cluster()
    gw = cluster.gateway()
    acme = cluster.principal("acme", requests_per_minute=600, tokens_per_minute=10_000,
                             max_concurrent_requests=8, daily_token_budget=100_000)

    async def scenario():
        for round_ in range(3):
            tickets = [(f"r{round_}-{i}", await request(gw, acme, f"r{round_}-{i}")) for i in range(3)]
            for rid, t in tickets:
                await finish(gw, acme, rid, t, 12)
            await gw.lane.sync()
        assert gw.lane.admitted > 0
        for _ in range(QUIET_SYNCS + 1):
            await gw.lane.sync()
        state = cluster.controller._tenants["acme"]
        assert (state.in_flight, state.granted_requests, state.granted_tokens) == (0, 0, 0)
        assert state.tokens_today == 9 * 12                # exactly what was used, nothing held
        assert state.admitted_total == 9
        assert cluster.queue.snapshot().get("premium", 0) == 0
        assert not gw.lane.holding() and not gw.lane.tenants and not gw.lane.places

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


# ---- limits hold exactly across gateways, whatever the interleaving ---------------------------
LIMITS = dict(requests_per_minute=30, tokens_per_minute=900, max_concurrent_requests=5,
              daily_token_budget=2_000)

ops = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 1), st.integers(1, 40), st.integers(1, 30)),
    st.tuples(st.just("finish"), st.integers(0, 1), st.integers(0, 10_000), st.integers(0, 60)),
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

    async def scenario():
        nonlocal charged, net
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
                used = min(cost, b)
                charged += used
                net -= cost - used
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
            assert net <= 900 + window * 900 / 60 + 1e-9                 # tokens bucket
            state = cluster.controller._tenants.get("acme")
            if state is not None:
                assert state.in_flight <= LIMITS["max_concurrent_requests"]
                assert state.tokens_today <= LIMITS["daily_token_budget"]
        # Everything ends; each gateway goes quiet: all that was granted comes back.
        while running:
            g2, rid, t, cost = running.pop()
            charged += cost
            await finish(gws[g2], acme, rid, t, cost)
        for _ in range(QUIET_SYNCS + 1):
            for gw in gws:
                await gw.lane.sync()
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



@pytest.mark.parametrize("lost", ["grants", "places"])
def test_a_sync_whose_answer_is_lost_is_applied_once(lost):
    """The actor applied a sync but its answer never came back (a timeout): the gateway sends
    the same sync again and gets the same answer; nothing is counted twice or dropped."""
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
