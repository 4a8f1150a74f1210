"""The gateway's side of admission: class queue, tenant limits, leases, timeouts.

Order per request (``Admitter``)::

    early(principal, rid)            before the prompt is tokenized
      1. a tenant this gateway saw refused for a limit that cannot have cleared yet
         (requests_per_minute, daily_token_budget) -> 429 at once, no actor call
      2. the gateway's overload guard (non-pinned classes, ``overload_guard``)
                                                        -> 429 overloaded, no actor call
      3. class queue place (max_queue)                  -> 429 queue_full
    ...tokenize, length checks (400; the place is given back)...
    admit(principal, rid, prompt, max_tokens)
      4. tenant limits: rate, tokens, budget, concurrency -> 429 / 400

Requests of ``pinned`` classes (premium) first try the gateway's fast lane
(``kvharbor.platform.fast_lane``): steps 3 and 4 from this gateway's grants of the class's
places and the tenant's limits, no actor call. What does not fit there takes the calls.

Step 1 is exact in one direction: refills only happen with time, and other gateways only
consume more, so a tenant refused until ``t`` stays refused until ``t``; a reload of
tenants.yaml (a raised limit) clears the memory. A rate-limited tenant therefore costs a
dict lookup per request, not a tokenization.

Every actor call has a timeout (``CALL_TIMEOUT_S``); an actor that does not answer (down,
restarting) gives 503 with Retry-After, never a hang or a 500. Tickets and queue places are
leased (``kvharbor.tenants.leases``) and renewed here every ``lease_s / 3``, so those of a
gateway replica that dies come back within ``lease_s``.
"""

from __future__ import annotations

import asyncio
import time

from ray.exceptions import RayActorError

from kvharbor.actors.calls import await_or_undo
from kvharbor.platform import rate_headers
from kvharbor.platform.error_body import APIError, retry_headers
from kvharbor.platform.fast_lane import RECALL_WAIT_S, FastLane, LocalTicket
from kvharbor.platform.overload_guard import OverloadGuard
from kvharbor.tenants.admission_actor import CALL_TIMEOUT_S
from kvharbor.tenants.leases import DEFAULT_LEASE_S, LeaseKeeper

STICKY_LIMITS = ("requests_per_minute", "daily_token_budget")
"""Refusals that nothing but time clears (remembered per tenant until ``retry_after``)."""


def unavailable(what: str, code: str = "admission_unavailable") -> APIError:
    """The 503 for a control-plane actor (``what``) that did not answer in time."""
    return APIError(503, f"the {what} did not answer within {CALL_TIMEOUT_S:g} s; retry the request",
                    code, headers={"Retry-After": "1"})


class Admitter:
    """One per gateway replica. ``admission``: ``ActorAdmission``; ``class_queue``: actor handle."""

    def __init__(self, admission, class_queue, registry, metrics, lease_s: float = DEFAULT_LEASE_S,
                 guard: OverloadGuard | None = None) -> None:
        self.admission, self.class_queue, self.registry, self.metrics = admission, class_queue, registry, metrics
        self.guard = guard or OverloadGuard(None)
        self.tickets = LeaseKeeper(admission.renew, lease_s / 3)
        self.places = LeaseKeeper(lambda ids: class_queue.renew.remote(ids), lease_s / 3)
        self._refused: dict[str, tuple[float, int, APIError]] = {}   # tenant -> (until, version, 429)
        self.lane = FastLane(admission.sync_grants,
                             lambda holder, prios, reports, seq: class_queue.sync_places.remote(
                                 holder, prios, reports, seq), registry)
        self._lane_places: dict[str, int] = {}    # rid -> grant epoch of its fast-lane place

    # ---- before tokenization -----------------------------------------------------------------
    async def early(self, principal, rid: str) -> None:
        """Steps 1 to 3; on success the caller owns a queue place (``leave`` gives it back)."""
        refused = self._refused.get(principal.tenant)
        if refused is not None:
            until, version, error = refused
            if time.time() < until and version == self.registry.version:
                self.metrics.rate_limited(principal.tenant, error.code)
                raise APIError(429, error.message, error.code, headers=retry_headers(until - time.time()))
            self._refused.pop(principal.tenant, None)
        self.guard.enter(rid, principal.qos, self.registry.config.qos_classes, principal.tenant)
        try:
            epoch = self.lane.take_place(principal)
            if epoch is not None:
                self._lane_places[rid] = epoch
                return
            await self._enter_queue(principal, rid)
        except BaseException:
            self.guard.leave(rid)
            raise

    async def _enter_queue(self, principal, rid: str) -> None:
        classes = self.registry.config.qos_classes
        priorities = {name: q.priority for name, q in classes.items()}
        limit = principal.qos.max_queue
        for attempt in range(2):
            call = self.class_queue.enter_or_recall.remote(principal.qos_name, priorities, limit, rid)
            try:
                ahead, recalled = await await_or_undo(
                    call, lambda answer: answer[0] is None and self.leave(principal.qos_name, rid),
                    CALL_TIMEOUT_S)
            except (TimeoutError, RayActorError):
                raise unavailable("class queue") from None
            if ahead is None or not recalled or attempt:
                break
            await self._after_recall()      # fast-lane places idle elsewhere are coming back
        if ahead is not None:
            self.metrics.rate_limited(principal.tenant, "queue_full")
            raise APIError(429, f"the queue of QoS class {principal.qos_name!r} is full: {ahead} "
                           f"requests of this or higher classes are in flight (max_queue {limit}); "
                           "retry later", "queue_full", headers={"Retry-After": "1"})
        self.places.hold(rid)

    def leave(self, qos: str, rid: str) -> None:
        """Give the queue place back (exactly once per place taken)."""
        self.guard.leave(rid)
        epoch = self._lane_places.pop(rid, None)
        if epoch is not None:
            self.lane.leave_place(qos, epoch)
            return
        self.places.drop(rid)
        self.class_queue.leave.remote(qos, rid)

    # ---- after tokenization ------------------------------------------------------------------
    async def admit(self, principal, rid: str, prompt_tokens: int, max_tokens: int, n: int = 1):
        """Step 3: the ticket (leased) reserving ``prompt_tokens + n * max_tokens``, or the
        429/400; the queue place is given back on refusal."""
        tenant, qos = principal.tenant, principal.qos_name
        local = self.lane.admit(principal, prompt_tokens, max_tokens, n)
        if local is not None:
            self.metrics.admitted(tenant, qos, "fast_lane")
            return local
        try:
            if self.lane.voided(tenant):      # a reload: give back the old grant first
                await self.lane.sync()
            admission = await self.admission.try_admit(tenant, principal.limits, prompt_tokens,
                                                       max_tokens, n=n)
            if admission.recalled:            # fast-lane units idle elsewhere are coming back
                await self._after_recall()
                admission = await self.admission.try_admit(tenant, principal.limits, prompt_tokens,
                                                           max_tokens, n=n)
        except (TimeoutError, RayActorError):
            self.leave(qos, rid)
            raise unavailable("admission service") from None
        except BaseException:
            self.leave(qos, rid)
            raise
        rate_headers.note(admission.rates)
        if admission.ok:
            self.metrics.admitted(tenant, qos, "actor")
            self.tickets.hold(admission.ticket.ticket_id)
            return admission.ticket
        self.leave(qos, rid)
        headers = {}
        if admission.status == 429:
            self.metrics.rate_limited(tenant, admission.limit or "other")
            headers = retry_headers(admission.retry_after_s if admission.retry_after_s is not None else 1.0)
        error = APIError(admission.status, admission.reason, admission.limit or "rate_limited", headers=headers)
        if admission.status == 429 and admission.limit in STICKY_LIMITS and admission.retry_after_s:
            self._refused[tenant] = (time.time() + admission.retry_after_s, self.registry.version, error)
        raise error

    async def _after_recall(self) -> None:
        """A refusal that called back idle fast-lane grants: give back ours now, and wait for
        the other gateways' next sync (``RECALL_WAIT_S``) before the one retry."""
        await self.lane.sync()
        await asyncio.sleep(RECALL_WAIT_S)

    async def release(self, ticket, tokens_used: int) -> None:
        if isinstance(ticket, LocalTicket):
            self.lane.release(ticket, tokens_used)
            return
        self.tickets.drop(ticket.ticket_id)
        await self.admission.release(ticket, tokens_used)
