"""AdmissionActor: one shared :class:`AdmissionController` for all gateway replicas.

Run it as a single named, detached actor (:func:`get_or_create_admission_actor`); every gateway
replica calls it, and because an actor runs its (synchronous) methods one at a time, the
limits hold exactly across replicas. See :mod:`kvharbor.tenants.limits` for the semantics.

From async code use :class:`ActorAdmission`, which awaits the actor's object refs (never
``ray.get`` inside a coroutine)::

    admission = ActorAdmission(get_or_create_admission_actor())
    result = await admission.try_admit(p.tenant, p.limits, prompt_tokens, max_tokens)
    if not result.ok:
        raise HTTPException(result.status, result.reason,
                            headers={"Retry-After": str(math.ceil(result.retry_after_s or 1))})
    try:
        ...generate...
    finally:
        await admission.release(result.ticket, tokens_used)
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from kvharbor.actors.calls import await_or_undo
from kvharbor.tenants.leases import DEFAULT_LEASE_S
from kvharbor.tenants.limits import Admission, AdmissionController, Ticket

CALL_TIMEOUT_S = 5.0
"""Longest wait for an admission call; then the request gets 503 (the actor is down)."""

DEFAULT_ACTOR_NAME = "kvharbor-admission"


@ray.remote(num_cpus=0, max_restarts=-1)
class AdmissionActor:
    """Thin Ray wrapper: each method forwards to one AdmissionController.

    Restarted by Ray when it dies (``max_restarts=-1``), with counters from zero: limits
    loosen for at most a minute; releases and renewals of tickets it no longer knows are
    no-ops. Tickets are leased (``lease_s``): one whose gateway stops renewing it is released.
    """

    def __init__(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        self._ctl = AdmissionController(lease_s=lease_s)

    def try_admit(self, tenant: str, limits: Any, prompt_tokens: int, max_tokens: int | None,
                  now: float | None = None) -> Admission:
        return self._ctl.try_admit(tenant, limits, prompt_tokens, max_tokens, now)

    def release(self, ticket: Ticket, tokens_used: int | None = None,
                now: float | None = None) -> bool:
        return self._ctl.release(ticket, tokens_used, now)

    def renew(self, ticket_ids: list[str], now: float | None = None) -> list[str]:
        return self._ctl.renew(ticket_ids, now)

    def usage(self, tenant: str, now: float | None = None) -> dict:
        return self._ctl.usage(tenant, now)

    def usage_all(self, now: float | None = None) -> dict[str, dict]:
        return self._ctl.usage_all(now)


def get_or_create_admission_actor(name: str = DEFAULT_ACTOR_NAME,
                                  namespace: str | None = "kvharbor") -> ray.actor.ActorHandle:
    """The cluster's one admission actor, created on first use (detached: outlives callers)."""
    return AdmissionActor.options(name=name, namespace=namespace, lifetime="detached",
                                  get_if_exists=True).remote()


class ActorAdmission:
    """Async facade over an AdmissionActor handle; same methods as ``LocalAdmission``."""

    def __init__(self, handle: ray.actor.ActorHandle):
        self.handle = handle

    async def try_admit(self, tenant: str, limits: Any, prompt_tokens: int,
                        max_tokens: int | None, now: float | None = None) -> Admission:
        """Raises ``TimeoutError`` after ``CALL_TIMEOUT_S`` (the slot, if taken, is given back)."""
        call = self.handle.try_admit.remote(tenant, limits, prompt_tokens, max_tokens, now)
        return await await_or_undo(call, self._release_orphan, CALL_TIMEOUT_S)

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
