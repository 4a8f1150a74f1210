"""AdmissionActor: one shared :class:`AdmissionController` for all gateway replicas.

Run it as a single named, detached actor (:func:`get_or_create_admission_actor`); every gateway
replica calls it, and because an actor runs its (synchronous) methods one at a time, the
limits hold exactly across replicas. See :mod:`kvharbor.tenants.limits` for the semantics.

The actor also holds the cluster's QoS class queue (``kvharbor.platform.class_queue``), so
the gateway's hot path is one actor call per request: ``enter_and_admit`` (queue place, then
limits; a refusal by either takes nothing) before, and ``release_and_leave`` after, sent
without waiting for it. :class:`GateKeeper` is that pair as a plain class (tested without Ray).

From async code use :class:`ActorAdmission`, which awaits the actor's object refs (never
``ray.get`` inside a coroutine)::

    admission = ActorAdmission(get_or_create_admission_actor())
    result = await admission.try_admit(p.tenant, p.limits, prompt_tokens, max_tokens)
    if not result.ok:
        raise APIError(result.status, result.reason, result.limit,
                       headers=retry_headers(result.retry_after_s or 1.0))
    try:
        ...generate...
    finally:
        await admission.release(result.ticket, tokens_used)
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from kvharbor.actors.calls import await_or_undo, detached
from kvharbor.platform.class_queue import ClassQueue
from kvharbor.tenants.leases import DEFAULT_LEASE_S
from kvharbor.tenants.limits import Admission, AdmissionController, GrantAnswer, GrantReport, Ticket

CALL_TIMEOUT_S = 5.0
"""Longest wait for an admission call; then the request gets 503 (the actor is down)."""

DEFAULT_ACTOR_NAME = "kvharbor-admission"


class GateKeeper:
    """Class queue + admission limits, decided together (one call per request each way)."""

    def __init__(self, controller: AdmissionController | None = None) -> None:
        self.ctl = controller or AdmissionController()
        self.queue = ClassQueue()

    def enter_and_admit(self, qos: str, priorities: dict[str, int], max_queue: int, tenant: str,
                        limits: Any, prompt_tokens: int, max_tokens: int | None,
                        now: float | None = None) -> Admission:
        """Take a queue place for ``qos`` (429 ``queue_full`` when ``max_queue`` requests of it
        or higher classes are in flight), then admit under the tenant's limits; a refusal
        gives the queue place back. Release an admitted request with ``release_and_leave``."""
        ahead = self.queue.enter(qos, priorities, max_queue)
        if ahead is not None:
            return Admission(ok=False, status=429, limit="queue_full", retry_after_s=1.0,
                             reason=f"the queue of QoS class {qos!r} is full: {ahead} requests of "
                                    f"this or higher classes are in flight (max_queue {max_queue}); "
                                    "retry later")
        admission = self.ctl.try_admit(tenant, limits, prompt_tokens, max_tokens, now)
        if not admission.ok:
            self.queue.leave(qos)
        return admission

    def release_and_leave(self, ticket: Ticket, qos: str, tokens_used: int | None = None,
                          now: float | None = None) -> bool:
        """End an admitted request: its queue place and its admission ticket (once)."""
        released = self.ctl.release(ticket, tokens_used, now)
        if released:
            self.queue.leave(qos)
        return released


@ray.remote(num_cpus=0, max_restarts=-1, allow_out_of_order_execution=True)
class AdmissionActor:
    """Thin Ray wrapper: each method forwards to one AdmissionController (and, for
    ``enter_and_admit``, the class queue it holds beside it).

    Restarted by Ray when it dies (``max_restarts=-1``), with counters from zero: limits
    loosen for at most a minute; releases and renewals of tickets it no longer knows are
    no-ops. Tickets are leased (``lease_s``): one whose gateway stops renewing it is released.
    Calls run in arrival order, not per-caller submission order (see ``ClassQueueActor``).
    """

    def __init__(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        self._gate = GateKeeper(AdmissionController(lease_s=lease_s))
        self._ctl = self._gate.ctl

    def enter_and_admit(self, qos: str, priorities: dict[str, int], max_queue: int, tenant: str,
                        limits: Any, prompt_tokens: int, max_tokens: int | None) -> Admission:
        return self._gate.enter_and_admit(qos, priorities, max_queue, tenant, limits,
                                          prompt_tokens, max_tokens)

    def release_and_leave(self, ticket: Ticket, qos: str, tokens_used: int | None = None) -> bool:
        return self._gate.release_and_leave(ticket, qos, tokens_used)

    def queue_snapshot(self) -> dict[str, int]:
        return self._gate.queue.snapshot()

    def try_admit(self, tenant: str, limits: Any, prompt_tokens: int, max_tokens: int | None,
                  now: float | None = None, n: int = 1) -> Admission:
        return self._ctl.try_admit(tenant, limits, prompt_tokens, max_tokens, now, n)

    def release(self, ticket: Ticket, tokens_used: int | None = None,
                now: float | None = None) -> bool:
        return self._ctl.release(ticket, tokens_used, now)

    def renew(self, ticket_ids: list[str], now: float | None = None) -> list[str]:
        return self._ctl.renew(ticket_ids, now)

    def usage(self, tenant: str, now: float | None = None) -> dict:
        return self._ctl.usage(tenant, now)

    def usage_all(self, now: float | None = None) -> dict[str, dict]:
        return self._ctl.usage_all(now)

    def sync_grants(self, holder: str, reports: list[GrantReport], seq: int = 0) -> list[GrantAnswer]:
        return self._ctl.sync_grants(holder, reports, seq)


def get_or_create_admission_actor(name: str = DEFAULT_ACTOR_NAME,
                                  namespace: str | None = "kvharbor") -> ray.actor.ActorHandle:
    """The cluster's one admission actor, created on first use (detached: outlives callers)."""
    return AdmissionActor.options(name=name, namespace=namespace, lifetime="detached",
                                  get_if_exists=True).remote()


class ActorAdmission:
    """Async facade over an AdmissionActor handle; same methods as ``LocalAdmission``."""

    def __init__(self, handle: ray.actor.ActorHandle):
        # Calls are no request's children: a client that goes away must not cancel a release.
        self.handle = handle if isinstance(handle, detached) else detached(handle)

    async def try_admit(self, tenant: str, limits: Any, prompt_tokens: int,
                        max_tokens: int | None, now: float | None = None, n: int = 1) -> Admission:
        """Raises ``TimeoutError`` after ``CALL_TIMEOUT_S`` (the slot, if taken, is given back)."""
        call = self.handle.try_admit.remote(tenant, limits, prompt_tokens, max_tokens, now, n)
        return await await_or_undo(call, self._release_orphan, CALL_TIMEOUT_S)

    async def enter_and_admit(self, qos: str, priorities: dict[str, int], max_queue: int,
                              tenant: str, limits: Any, prompt_tokens: int,
                              max_tokens: int | None) -> Admission:
        """One round trip: queue place + limits (an orphaned admission is given back)."""
        call = self.handle.enter_and_admit.remote(qos, priorities, max_queue, tenant, limits,
                                                  prompt_tokens, max_tokens)
        return await await_or_undo(call, lambda a: a.ok and self.release_and_leave(a.ticket, qos, 0))

    def release_and_leave(self, ticket: Ticket, qos: str, tokens_used: int | None = None) -> None:
        """Fire and forget: the request's answer does not wait for the accounting."""
        self.handle.release_and_leave.remote(ticket, qos, tokens_used)

    async def sync_grants(self, holder: str, reports: list[GrantReport],
                          seq: int = 0) -> list[GrantAnswer]:
        """A gateway's fast-lane grants settled and topped up (``kvharbor.platform.fast_lane``)."""
        return await self.handle.sync_grants.remote(holder, reports, seq)

    async def queue_snapshot(self) -> dict[str, int]:
        return await self.handle.queue_snapshot.remote()

    def _release_orphan(self, admission: Admission) -> None:
        """An admission whose caller was cancelled: give its slot back, nothing was used."""
        if admission.ok:
            self.handle.release.remote(admission.ticket, 0)

    async def release(self, ticket: Ticket, tokens_used: int | None = None,
                      now: float | None = None) -> bool:
        return await asyncio.wait_for(self.handle.release.remote(ticket, tokens_used, now), CALL_TIMEOUT_S)

    async def renew(self, ticket_ids: list[str]) -> list[str]:
        return await asyncio.wait_for(self.handle.renew.remote(ticket_ids), CALL_TIMEOUT_S)

    async def usage(self, tenant: str, now: float | None = None) -> dict:
        return await asyncio.wait_for(self.handle.usage.remote(tenant, now), CALL_TIMEOUT_S)

    async def usage_all(self, now: float | None = None) -> dict[str, dict]:
        return await asyncio.wait_for(self.handle.usage_all.remote(now), CALL_TIMEOUT_S)
