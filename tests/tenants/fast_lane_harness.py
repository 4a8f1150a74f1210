"""Fast-lane test harness: gateways are ``Admitter`` objects over the plain
``AdmissionController`` and ``ClassQueue`` (no Ray); an actor call is an awaited coroutine,
counted here, so "no call" is a number."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvharbor.platform.admission_flow import Admitter
from kvharbor.platform.class_queue import ClassQueue
from kvharbor.platform.error_body import APIError
from kvharbor.tenants.leases import LeaseTable
from kvharbor.tenants.limits import AdmissionController, LocalAdmission, TenantLimits


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

    def gateway(self, sync_period_s: float | None = None, **options) -> Admitter:
        """A gateway's ``Admitter`` over this cluster's actors (``options``: its keyword
        arguments, e.g. ``guard`` or ``lease_s``). Its syncs are driven by the test, unless
        ``sync_period_s`` is given: then its own sync loop runs, at that period."""
        admitter = Admitter(CountedAdmission(self.controller, self.calls),
                            Counted(self.queue, self.calls), self.registry, Metrics(), **options)
        if sync_period_s is None:
            admitter.lane._wake = lambda: None
        else:
            admitter.lane.period_s = sync_period_s
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
            if a is not None:                       # no request or token limit: not counted
                need_r, need_t, _ = a.needs()       # here (used tokens are charged, not granted)
                mine = (mine[0] if need_r else actor[0], mine[1] if need_t else actor[1], mine[2])
            assert actor == mine, (tenant, actor, mine)
        places = cluster.queue.grants.get(lane.holder, {})
        for qos in set(places) | set(lane.places):
            p = lane.places.get(qos)
            assert places.get(qos, 0) == (0 if p is None else p.free + p.in_use + p.void), qos
            if p is not None:                       # places in use = requests holding one
                assert p.in_use == sum(e == p.epoch for e in gw._lane_places.values()), qos


def count_grant_syncs(gw: Admitter) -> dict:
    """Counts the grant syncs the gateway sends, in the returned ``{"n": ...}`` (the lane holds
    the admission service's ``sync_grants`` bound once, so ``Cluster.calls`` misses them)."""
    count, original = {"n": 0}, gw.lane._sync_grants

    async def counted(holder, reports, seq=0):
        count["n"] += 1
        return await original(holder, reports, seq)

    gw.lane._sync_grants = counted
    return count


async def request(gw: Admitter, principal, rid: str, prompt: int = 10, max_tokens: int = 10,
                  n: int = 1):
    """early + admit, as the gateway does; the ticket, or the APIError."""
    try:
        await gw.early(principal, rid)
        return await gw.admit(principal, rid, prompt, max_tokens, n)
    except APIError as error:
        return error


async def finish(gw: Admitter, principal, rid: str, ticket, used: int) -> None:
    gw.leave(principal.qos_name, rid)
    await gw.release(ticket, used)


def run(coro):
    return asyncio.run(coro)
