"""The premium fast lane: a gateway admits pinned-class requests from local grants, no call.

Without it every request makes two control-plane calls before the engine sees it (its class
queue place, then its tenant's limits), into actors that share the host with busy replicas:
under overload those calls were most of premium's time to first token. Here each gateway
holds, per tenant of a ``pinned`` QoS class, a *grant* of that tenant's limits (request units,
token units, concurrency slots) from the admission actor, and of its class's queue places from
the class-queue actor. A request that fits in what the gateway holds is admitted by
decrementing local counters; one that does not takes the usual path (the calls), so a miss
costs what every request cost before.

Every ``period_s`` one background sync per actor reports what was used, gives back what is
idle and asks for more, sized by the recent arrivals (:meth:`FastLane.sync`)::

    admit (local)   place.free -= 1   requests -= 1   tokens -= cost   slots -= 1
    release         place.free += 1                   tokens += unused  slots += 1
    sync            report used units; give back idle ones; get up to ``want`` more

Limits stay exact across gateways (the actors count granted units as taken: see
``AdmissionController.sync_grants`` and ``ClassQueue.sync_places``), and a gateway's idle
grant does not make another gateway refuse what the limit allows: grants never take more than
half of what a limit has left, and a request the actors refuse while some gateway kept units
idle at its last sync *recalls* them. That gateway's next sync (at most ``SYNC_PERIOD_S``
away) gives every free unit back, and the refused request retries once after
``RECALL_WAIT_S`` (``Admitter._after_recall``); meanwhile no grant of that tenant is topped
up (``limits.RECALL_HOLD_S``), so the units given back are there for the retry. Only requests
at the edge of a limit pay that wait. Grants are leased like tickets: a gateway that dies
gives back its slots and places within the lease; the actors forget grants when they
restart, and the next sync tells the gateway (``known`` False) to drop its free units.

The admission actor's usage (``/admin/tenants``) reports a tenant's requests in flight
(``in_flight``: its slots taken less those the gateways held idle at their last sync),
those ``granted_idle_slots``, and ``admitted_fast_lane`` (admitted from grants, part of
``admitted_total``, counted at the gateway's next sync). ``/admin/tenants/status`` does the
same per class (``in_flight_by_qos``, ``granted_idle_places_by_qos``).

A higher class's places that a gateway held idle at its last sync do not count against a
lower class's ``max_queue`` (they are not in flight), and a lower class's refusal never
recalls them: a standard flood that meets its limit leaves premium's fast lane alone. The
lower class's count is then approximate by what premium used since that sync.

Other classes keep the exact per-request path: their shedding order (``max_queue``) is the
point of the class queue, and one gateway holding places of a crowded class would shed others.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from dataclasses import dataclass

from kvharbor.actors.calls import start_background
from kvharbor.tenants.limits import GrantReport, TenantLimits, too_big

logger = logging.getLogger("kvharbor.fast_lane")

SYNC_PERIOD_S = 0.25
HEADROOM = 4
"""A busy tenant's (or class's) free units are topped up to this many times its arrivals
since the last sync. Premium arrivals come in Poisson bursts and a sync's answer comes one
actor call later: at 2x, 12-15 % of premium requests missed their gateway's grant in a 2x
flood on the 2-core VM (``benchmarks/qos.py``); at 4x, 3-7 %."""
MIN_TARGET = 8
"""Free units a busy tenant's grant is topped up to at least."""
QUIET_SYNCS = 12
"""Syncs with no arrival after which a tenant's or class's free units are all given back
(3 s at the sync period; longer when the actors are slow to answer). A premium tenant that
sends a request every second or two keeps its grant between them: with 2 syncs (0.5 s) only
26-35 % of such a tenant's requests found one under a 2x flood, each of the others paid two
actor calls, and its p90 time to first token was 213-263 ms against 129-144 ms with 12 syncs
(89-95 % from the grant; ``benchmarks/qos.py --premium-rate 1``, seeds 61 and 62). Units held
idle are what the limits count as taken meanwhile; a refused request elsewhere recalls them."""
RECALL_WAIT_S = SYNC_PERIOD_S + 0.1
"""How long a request refused while other gateways held idle grants waits before its one
retry: their next sync (at most one period away) gives the called-back units back."""


@dataclass(slots=True, frozen=True)
class LocalTicket:
    """A request admitted from this gateway's grant (release it with ``FastLane.release``)."""

    tenant: str
    qos: str
    cost: int                 # token units taken (0 when the tenant has no token limit)
    slot: bool                # a concurrency slot taken
    epoch: int                # the grant it came from (a grant the actor forgot takes nothing back)


@dataclass(slots=True)
class _Allowance:
    """One tenant's grant as this gateway holds it (free units; requests running on slots)."""

    limits: TenantLimits
    version: int
    requests: int = 0
    tokens: int = 0
    slots: int = 0
    on_slots: int = 0             # running requests holding a slot of the grant
    running: int = 0              # requests admitted here and not yet released
    void: tuple[int, int, int] = (0, 0, 0)   # free units of old limits, given back next sync
    used_requests: int = 0        # admitted since the last report
    used_tokens: int = 0          # net of refunds, since the last report
    held: bool = False            # the admission actor has a grant for us
    epoch: int = 0                # bumped when the actor forgot our grant
    arrivals: int = 0             # requests seen since the last sync (admitted here or not)
    max_cost: int = 1
    quiet: int = 0

    def needs(self) -> tuple[bool, bool, bool]:
        lim = self.limits
        return (lim.requests_per_minute is not None,
                lim.tokens_per_minute is not None or lim.daily_token_budget is not None,
                lim.max_concurrent_requests is not None)

    def busy(self) -> bool:
        """Whether the syncs still have this tenant's business to settle: a grant held,
        requests running on it, use not yet reported, or old units to give back."""
        return bool(self.held or self.running or self.used_requests or self.used_tokens
                    or any(self.void))


@dataclass(slots=True)
class _Places:
    """One class's granted queue places as this gateway holds them."""

    limit: int
    version: int
    free: int = 0
    in_use: int = 0
    void: int = 0                 # free places of an old max_queue, given back next sync
    held: bool = False
    epoch: int = 0
    arrivals: int = 0
    quiet: int = 0


class FastLane:
    """One per gateway replica. ``sync_grants(holder, reports)`` and ``sync_places(holder,
    priorities, reports)`` are async calls into the admission and class-queue actors."""

    def __init__(self, sync_grants, sync_places, registry, period_s: float = SYNC_PERIOD_S,
                 timeout_s: float = 5.0) -> None:
        self._sync_grants, self._sync_places = sync_grants, sync_places
        self.registry, self.period_s, self.timeout_s = registry, period_s, timeout_s
        self.holder = f"gw-{secrets.token_hex(6)}"
        self.tenants: dict[str, _Allowance] = {}
        self.places: dict[str, _Places] = {}
        self.admitted = 0                 # requests admitted here, for stats and tests
        self._epochs = itertools.count(1)  # a ticket only gives back to the grant it came from
        self._syncing = asyncio.Lock()     # one sync at a time: each report is a delta
        self._recalled = False             # an actor called back idle units this round
        self._seq = 0                      # numbers the syncs: a lost answer is asked again
        self._pending_tenants: tuple | None = None   # (seq, reports, allowances) not answered
        self._pending_places: tuple | None = None    # (seq, reports, places) not answered
        self._task: asyncio.Task | None = None
        self._soon = asyncio.Event()       # a first arrival: the next sync is not to wait

    # ---- the request path (no await: nothing here waits) -------------------------------------
    def take_place(self, principal) -> int | None:
        """A queue place of the principal's class from the grant: the grant's epoch, to pass
        to ``leave_place``; None: ask the actor."""
        if not principal.qos.pinned:
            return None
        places = self.places.get(principal.qos_name)
        if places is None:
            places = self.places[principal.qos_name] = _Places(
                principal.qos.max_queue, self.registry.version, epoch=next(self._epochs))
            self._hurry()
        elif places.version != self.registry.version:    # reload: count under the new limit
            places.limit, places.version = principal.qos.max_queue, self.registry.version
            places.void, places.free = places.void + places.free, 0
        places.arrivals += 1
        self._wake()
        if places.free < 1:
            return None
        places.free -= 1
        places.in_use += 1
        return places.epoch

    def leave_place(self, qos: str, epoch: int) -> None:
        places = self.places.get(qos)
        if places is not None and places.epoch == epoch:
            places.in_use -= 1
            places.free += 1

    def admit(self, principal, prompt_tokens: int, max_tokens: int, n: int = 1) -> LocalTicket | None:
        """Admit from the tenant's grant (``prompt_tokens + n * max_tokens`` of it), or None (the
        actor decides: misses, refusals, 400s)."""
        if not principal.qos.pinned:
            return None
        lim = TenantLimits.coerce(principal.limits)
        a = self.tenants.get(principal.tenant)
        if a is None:
            a = self._allowance(principal.tenant, lim, None)
            self._hurry()
        elif a.version != self.registry.version:
            a = self._allowance(principal.tenant, lim, a)
        cost = prompt_tokens + n * max_tokens
        a.arrivals += 1
        a.max_cost = max(a.max_cost, cost)
        self._wake()
        if too_big(lim, prompt_tokens, max_tokens, n) is not None:
            return None
        need_r, need_t, need_s = a.needs()
        if (need_r and a.requests < 1) or (need_t and a.tokens < cost) or (need_s and a.slots < 1):
            return None
        a.requests -= need_r
        a.slots -= need_s
        a.on_slots += need_s
        if need_t:
            a.tokens -= cost
            a.used_tokens += cost
        a.used_requests += 1
        a.running += 1
        self.admitted += 1
        return LocalTicket(principal.tenant, principal.qos_name, cost if need_t else 0, need_s,
                           a.epoch)

    def release(self, ticket: LocalTicket, tokens_used: int) -> None:
        a = self.tenants.get(ticket.tenant)
        if a is None or a.epoch != ticket.epoch:
            return
        a.running -= 1
        if ticket.slot:
            a.on_slots -= 1
            a.slots += 1
        if ticket.cost:
            # Negative if the request used more than it reserved (prompt + n x max_tokens
            # covers what it can generate; the books stay exact whatever a caller reserved):
            # the overrun is charged, as the actor path charges it. Free tokens may go below
            # 0 until the next report.
            unused = ticket.cost - tokens_used
            a.tokens += unused
            a.used_tokens -= unused
        else:
            # No token limit, so nothing was reserved; what was used still counts in the
            # tenant's tokens_today (the actor path charges it too): at the next sync.
            a.used_tokens += tokens_used
            self._wake()

    def _allowance(self, tenant: str, lim: TenantLimits, old: _Allowance | None) -> _Allowance:
        """A fresh allowance under the current limits; an old one's free units are given back
        at the next sync (it stays listed under the tenant until then)."""
        if old is None:
            a = self.tenants[tenant] = _Allowance(lim, self.registry.version, epoch=next(self._epochs))
            return a
        # Limits changed (reload): the free units were granted under the old limits and are
        # not used again; the next sync gives them back and asks anew under the new limits.
        r, t, s = old.void
        old.void = (r + old.requests, t + old.tokens, s + old.slots)
        old.requests = old.tokens = old.slots = 0
        old.limits, old.version = lim, self.registry.version
        return old

    def voided(self, tenant: str) -> bool:
        """Whether this gateway holds units of the tenant's old limits not yet given back (a
        reload): the actor counts them, so it must have them back before it decides."""
        a = self.tenants.get(tenant)
        return a is not None and any(a.void)

    # ---- the background sync -----------------------------------------------------------------
    def _wake(self) -> None:
        if self._task is None or self._task.done():
            self._task = start_background(self._run())

    def holding(self) -> bool:
        return self._pending_tenants is not None or self._pending_places is not None or \
            any(a.busy() for a in self.tenants.values()) or \
            any(p.held or p.in_use or p.void for p in self.places.values())

    def _hurry(self) -> None:
        """A tenant or class this gateway holds nothing for has arrived (the first request, or
        the first after a quiet spell): sync now rather than at the end of the period, so its
        next request finds a grant. At most once per quiet spell per tenant and class."""
        self._soon.set()
        self._wake()

    async def _run(self) -> None:
        self._soon.clear()
        await self.sync()
        while self.holding() or any(a.arrivals for a in self.tenants.values()) \
                or any(p.arrivals for p in self.places.values()):
            try:                           # a period, cut short by a first arrival
                await asyncio.wait_for(self._soon.wait(), self.period_s)
            except TimeoutError:
                pass
            self._soon.clear()
            await self.sync()

    async def sync(self) -> None:
        """One round: both actors in parallel; a failed call is logged and tried next period
        (the grants' leases, renewed by these calls, last ``lease_s``). It runs to its end
        even if the caller is cancelled (a request whose client left): a report half applied
        would leave the actor counting units this gateway no longer holds."""
        await asyncio.shield(start_background(self._sync_round()))

    async def _sync_round(self) -> None:
        async with self._syncing:
            self._recalled = True
            while self._recalled:          # a recall is given back in the same sync
                self._recalled = False
                await asyncio.gather(self._sync_tenants(), self._sync_class_places())

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def _sync_tenants(self) -> None:
        if self._pending_tenants is not None:      # the last one's answer was lost: ask again
            seq, reports, sent = self._pending_tenants
        else:
            reports, sent = [], []
            for tenant, a in self.tenants.items():
                report = self._tenant_report(tenant, a)
                if report is not None:
                    reports.append(report)
                    sent.append(a)
            if not reports:
                return
            seq = self._next_seq()
        try:
            answers = await asyncio.wait_for(self._sync_grants(self.holder, reports, seq),
                                             self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - sent again (same seq) next period
            logger.warning("grant sync failed (%r); retrying in %.2f s", exc, self.period_s)
            self._pending_tenants = (seq, reports, sent)
            return
        self._pending_tenants = None
        for a, answer in zip(sent, answers):
            if not answer.known:           # the actor forgot us (restart, expiry): start over
                a.requests = a.tokens = a.slots = a.on_slots = a.running = 0
                a.held = False
                a.epoch = next(self._epochs)
                continue
            if answer.recall:              # someone was refused: every free unit goes back
                v = a.void
                a.void = (v[0] + a.requests, v[1] + a.tokens, v[2] + a.slots)
                a.requests = a.tokens = a.slots = 0
                self._recalled = True
            a.requests += answer.requests
            a.tokens += answer.tokens
            a.slots += answer.slots
            # The actor's grant is our free units, the slots in use and unreported use.
            a.held = bool(a.requests or a.tokens or a.slots or a.on_slots or a.used_requests)
        for tenant in [t for t, a in self.tenants.items() if not (a.busy() or a.arrivals)]:
            del self.tenants[tenant]

    def _tenant_report(self, tenant: str, a: _Allowance) -> GrantReport | None:
        """What to settle and ask for; takes the reported units out of the local counters."""
        arrivals, a.arrivals = a.arrivals, 0
        a.quiet = 0 if arrivals else a.quiet + 1
        # Overruns took more than the grant holds: the debt is in ``used_tokens``, which the
        # actor charges beyond the grant, so the free tokens start again from 0.
        a.tokens = max(0, a.tokens)
        need_r, need_t, need_s = a.needs()
        target = 0 if a.quiet >= QUIET_SYNCS else max(MIN_TARGET, HEADROOM * arrivals)
        t_r = target if need_r else 0
        t_t = target * a.max_cost if need_t else 0
        t_s = target if need_s else 0
        back_r = a.requests - t_r if a.requests > 2 * t_r else 0
        back_t = a.tokens - t_t if a.tokens > 2 * t_t else 0
        back_s = a.slots - t_s if a.slots > 2 * t_s else 0
        a.requests -= back_r
        a.tokens -= back_t
        a.slots -= back_s
        void, a.void = a.void, (0, 0, 0)
        back_r, back_t, back_s = back_r + void[0], back_t + void[1], back_s + void[2]
        want_r, want_t, want_s = (max(0, t_r - a.requests), max(0, t_t - a.tokens),
                                  max(0, t_s - a.slots))
        report = GrantReport(tenant, a.limits, a.used_requests, a.used_tokens, back_r, back_t,
                             back_s, want_r, want_t, want_s, held=a.held,
                             idle=(a.requests, a.tokens, a.slots))
        a.used_requests = a.used_tokens = 0
        if not (report.used_requests or report.used_tokens or back_r or back_t or back_s
                or want_r or want_t or want_s or a.held):
            return None
        if a.quiet >= QUIET_SYNCS:
            a.max_cost = 1
        return report

    async def _sync_class_places(self) -> None:
        if self._pending_places is not None:       # the last one's answer was lost: ask again
            seq, reports, sent = self._pending_places
        else:
            seq, reports, sent = self._place_reports()
            if not reports:
                return
        priorities = {name: q.priority for name, q in self.registry.config.qos_classes.items()}
        try:
            answers = await asyncio.wait_for(
                self._sync_places(self.holder, priorities, reports, seq), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - sent again (same seq) next period
            logger.warning("place sync failed (%r); retrying in %.2f s", exc, self.period_s)
            self._pending_places = (seq, reports, sent)
            return
        self._pending_places = None
        for p, (_, added, known, recall) in zip(sent, answers):
            if not known:                  # the actor forgot us: places in use are its loss
                p.free = p.in_use = 0
                p.epoch = next(self._epochs)
            if recall:
                p.void, p.free = p.void + p.free, 0
                self._recalled = True
            p.free += added
            p.held = p.free + p.in_use > 0
        # A class whose grant is all given back and that saw no arrival is forgotten.
        for qos in [q for q, p in self.places.items()
                    if not (p.free or p.in_use or p.void or p.arrivals) and p.quiet >= QUIET_SYNCS]:
            del self.places[qos]

    def _place_reports(self) -> tuple[int, list, list]:
        """What to settle and ask for per class; takes given-back places out of ``free``."""
        reports, sent = [], []
        for qos, p in self.places.items():
            arrivals, p.arrivals = p.arrivals, 0
            p.quiet = 0 if arrivals else p.quiet + 1
            target = 0 if p.quiet >= QUIET_SYNCS else max(MIN_TARGET, HEADROOM * arrivals)
            back = p.free - target if p.free > 2 * target else 0
            p.free -= back
            back, p.void = back + p.void, 0
            want = max(0, target - p.free)
            if not (back or want or p.held):
                continue
            reports.append((qos, p.limit, back, want, p.held, p.free))
            sent.append(p)
        return (self._next_seq() if reports else 0), reports, sent
