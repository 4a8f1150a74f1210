"""Per-tenant admission control: rate limits, token budgets and concurrency (no Ray here).

``AdmissionController.try_admit`` decides, atomically under one lock, whether a request may
start, and reserves what it may consume; ``release`` returns the unused part when it ends::

    try_admit(prompt=P, max_tokens=M)       release(ticket, tokens_used=U)
      requests bucket  -= 1                   (nothing: a request was made)
      tokens bucket    -= P + M               += (P + M) - U   (refund, capped at capacity)
      tokens today     += P + M               -= (P + M) - U   (same UTC day only)
      in flight        += 1                   -= 1

Limits (``None`` = unlimited), checked every call against the limits passed in, so a reload of
``tenants.yaml`` takes effect on the next request:

* ``max_tokens_per_request``: ``max_tokens`` above it -> 400 (the message names the limit).
* ``max_concurrent_requests``: in-flight count -> 429, ``retry_after_s`` = 1 (a hint).
* ``requests_per_minute`` / ``tokens_per_minute``: token buckets holding up to one minute's
  worth, refilled continuously (rate = limit / 60 per second), so a tenant may burst a full
  minute's allowance and then runs at the steady rate -> 429 with the exact wait.
* ``daily_token_budget``: tokens per UTC day -> 429 until the next UTC midnight.
* A request that could never fit (cost above a bucket's capacity or the whole daily budget)
  -> 400 instead of a 429 that would never clear.

When several limits refuse at once, the answer carries the longest wait.

Several gateway replicas
------------------------
A controller is exact only for the callers that share it. Gateways therefore share one
controller through :class:`kvharbor.tenants.admission_actor.AdmissionActor`, one named,
detached Ray actor: its methods run one at a time, so every replica sees the same buckets,
budgets and in-flight counts, and the limits hold exactly however many replicas there are.
The cost is one actor call per admission and one per release (sub-millisecond on one node).
If that actor restarts, its counters start from zero (limits loosen for at most a minute; the
daily budget restarts). A gateway that must not depend on the actor can use
:class:`LocalAdmission` with each limit divided by the replica count (approximate).

Times are Unix seconds (``time.time()``), injectable through ``now=`` or ``clock=``.
"""

from __future__ import annotations

import itertools
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvharbor.tenants.leases import LeaseTable
from kvharbor.tenants.schema import TenantLimits

SECONDS_PER_DAY = 86_400
CONCURRENCY_RETRY_S = 1.0


@dataclass(slots=True, frozen=True)
class Ticket:
    """Proof of admission; pass it to ``release`` exactly once when the request ends."""

    ticket_id: str
    tenant: str
    reserved_tokens: int
    day: int                    # UTC day number the tokens were charged to


@dataclass(slots=True, frozen=True)
class Admission:
    """Outcome of ``try_admit``. ``status``: 200 admitted, 400 never admissible, 429 later."""

    ok: bool
    status: int
    reason: str = ""
    retry_after_s: float | None = None
    ticket: Ticket | None = None
    limit: str | None = None     # which limit refused, e.g. "requests_per_minute"
    recalled: bool = False       # a 429 while gateways held idle grants, now called back:
                                 # a retry after their next sync may be admitted
    rates: dict | None = None    # {"requests" / "tokens": (units left, s until full)} after
                                 # this admission or refusal, for the limits the tenant has


@dataclass(slots=True)
class _Bucket:
    """Token bucket: ``level`` units now, at most ``capacity``, refilled at capacity/60 per s."""

    level: float
    updated_s: float

    def refill(self, capacity: int, now: float, granted: int = 0) -> None:
        """Refill up to ``capacity - granted``: units granted to gateways (``Grant``) count as
        taken until they are reported used or given back, so level + granted <= capacity."""
        ceiling = float(capacity - granted)
        if now > self.updated_s:
            self.level = min(ceiling, self.level + (now - self.updated_s) * capacity / 60)
            self.updated_s = now
        self.level = min(self.level, ceiling)

    def wait_s(self, cost: float, capacity: int) -> float:
        """Seconds until ``cost`` units are available (0 if they are now)."""
        return max(0.0, (cost - self.level) * 60 / capacity)


@dataclass(slots=True)
class _TenantState:
    limits: TenantLimits
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    in_flight: int = 0
    day: int = 0
    tokens_today: int = 0
    admitted_total: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    admitted_fast_lane: int = 0  # of admitted_total: admitted by a gateway from its grant
    granted_requests: int = 0   # request units held by gateways' grants (sum over holders)
    granted_tokens: int = 0     # token units held by gateways' grants
    top_up_after: float = 0.0   # no grant top-ups before this (a recall's retry comes first)


@dataclass(slots=True)
class Grant:
    """What one gateway (``holder``) holds of one tenant's limits, to admit without a call.

    ``requests`` / ``tokens``: units taken from the tenant's buckets (tokens also charged to
    ``day``'s budget) and not yet reported used; ``slots``: concurrency slots, counted in the
    tenant's ``in_flight`` (the gateway's free slots plus its requests running on them).
    """

    requests: int = 0
    tokens: int = 0
    slots: int = 0
    day: int = 0
    idle: tuple[int, int, int] = (0, 0, 0)   # free requests, tokens, slots at its last sync
    recall: bool = False          # another caller was refused meanwhile: call them back


@dataclass(slots=True, frozen=True)
class GrantReport:
    """One tenant's line in a gateway's ``sync_grants`` call.

    ``used_*``: what the gateway admitted since its last report (tokens net of refunds, plus
    what requests used beyond their reservation, which may exceed the grant: that is charged);
    ``back_*``: free units it gives back; ``want_*``: units it asks for on top of what it
    keeps. ``held``: whether it believes it holds a grant (False on its first report).
    """

    tenant: str
    limits: Any
    used_requests: int = 0
    used_tokens: int = 0
    back_requests: int = 0
    back_tokens: int = 0
    back_slots: int = 0
    want_requests: int = 0
    want_tokens: int = 0
    want_slots: int = 0
    held: bool = False
    idle: tuple[int, int, int] = (0, 0, 0)   # free requests, tokens, slots it keeps


@dataclass(slots=True, frozen=True)
class GrantAnswer:
    """Units added to the gateway's allowance; ``known`` False: the controller held no grant
    for it (restart or lease expiry), so the gateway's free units are void and it starts over;
    ``recall`` True: a request was refused while they were idle, so give every free unit back."""

    tenant: str
    requests: int = 0
    tokens: int = 0
    slots: int = 0
    known: bool = True
    recall: bool = False


GRANT_SHARE = 2
"""A grant takes at most 1/GRANT_SHARE of what a limit has left, so a gateway never holds a
limit's last units: near a limit every admission goes through the controller (exact)."""
RECALL_HOLD_S = 1.0
"""After a refusal recalled idle grants, no grant of that tenant is topped up for this long, so
the units given back are still there when the refused request retries (the gateway's
``RECALL_WAIT_S`` later) instead of going straight back into a grant."""


def _sync_bucket(bucket: _Bucket | None, capacity: int | None, now: float,
                 granted: int = 0) -> _Bucket | None:
    """Bring a bucket up to ``now``; create it full when a limit appears, drop it when removed."""
    if capacity is None:
        return None
    if bucket is None:
        return _Bucket(float(capacity - granted), now)
    bucket.refill(capacity, now, granted)
    return bucket


class AdmissionController:
    """Thread-safe per-tenant limits. Every method is O(1) and non-blocking (async-safe)."""

    def __init__(self, clock: Callable[[], float] = time.time, lease_s: float | None = None,
                 lease_clock: Callable[[], float] = time.monotonic):
        """``lease_s``: a ticket not renewed (:meth:`renew`) for this long is released as if
        its request had used every reserved token (None: tickets never expire). Leases run
        on ``lease_clock`` (real time), not on the ``now`` passed for the limits' arithmetic."""
        self._clock = clock
        self._lease_clock = lease_clock
        self._lock = threading.Lock()
        self._tenants: dict[str, _TenantState] = {}
        self._active: dict[str, Ticket] = {}
        self._leases = LeaseTable(lease_s) if lease_s else None
        self.expired_total = 0
        self._nonce = secrets.token_hex(4)
        self._ids = itertools.count(1)
        self._grants: dict[str, dict[str, Grant]] = {}          # holder -> tenant -> grant
        self._answered: dict[str, tuple[int, list]] = {}         # holder -> (seq, its answers)
        self._holders = LeaseTable(lease_s) if lease_s else None  # holder -> holder

    def try_admit(self, tenant: str, limits: Any, prompt_tokens: int, max_tokens: int | None,
                  now: float | None = None, n: int = 1) -> Admission:
        """Admit one request or say why not; it reserves ``prompt_tokens + n * max_tokens``.

        Args:
            tenant: tenant name.
            limits: a :class:`TenantLimits`, a ``TenantConfig`` or a dict of the five limits.
            prompt_tokens: tokens in the prompt.
            max_tokens: completion tokens requested; None = ``max_tokens_per_request`` (or 0).
            now: Unix seconds; defaults to the controller's clock.
            n: the request's choices (OpenAI's ``n``): each may generate ``max_tokens``.
        """
        lim = TenantLimits.coerce(limits)
        now = self._clock() if now is None else now
        if max_tokens is None:
            max_tokens = lim.max_tokens_per_request or 0
        cost = prompt_tokens + n * max_tokens
        with self._lock:
            self._expire(now)
            st = self._sync(tenant, lim, now)
            denial = too_big(lim, prompt_tokens, max_tokens, n) or _denial(st, lim, cost, now)
            if denial is not None:
                st.rejected[denial.limit] = st.rejected.get(denial.limit, 0) + 1
                if denial.status == 429 and self._recall(tenant, st, lim, cost):
                    st.top_up_after = now + RECALL_HOLD_S
                    denial = replace(denial, recalled=True)
                return replace(denial, rates=_rates(st, lim)) if denial.status == 429 else denial
            st.in_flight += 1
            st.admitted_total += 1
            st.tokens_today += cost
            if st.requests is not None:
                st.requests.level -= 1
            if st.tokens is not None:
                st.tokens.level -= cost
            ticket = Ticket(f"{self._nonce}-{next(self._ids)}", tenant, cost, st.day)
            self._active[ticket.ticket_id] = ticket
            if self._leases is not None:
                self._leases.add(ticket.ticket_id, ticket, self._lease_clock())
            rates = _rates(st, lim)
        return Admission(ok=True, status=200, reason="admitted", ticket=ticket, rates=rates)

    def release(self, ticket: Ticket, tokens_used: int | None = None,
                now: float | None = None) -> bool:
        """End an admitted request; refund reserved tokens it did not use.

        Args:
            ticket: from the admission; a second release of it is ignored.
            tokens_used: prompt + generated tokens actually consumed; None = all reserved.
        Returns:
            True if the ticket was active.
        """
        now = self._clock() if now is None else now
        with self._lock:
            return self._release(ticket, tokens_used, now)

    def renew(self, ticket_ids: list[str], now: float | None = None) -> list[str]:
        """Extend the leases of these tickets; returns the ids no longer active (expired or
        released: their slots are back). Without leases every active id is kept."""
        now = self._clock() if now is None else now
        with self._lock:
            self._expire(now)
            if self._leases is None:
                return [t for t in ticket_ids if t not in self._active]
            return self._leases.renew(ticket_ids, self._lease_clock())

    def _expire(self, now: float) -> None:
        """Release the tickets and grants whose lease ran out (their holder died); lock held."""
        if self._leases is None:
            return
        for ticket in self._leases.expire(self._lease_clock()):
            if self._release(ticket, None, now):
                self.expired_total += 1
        for holder in self._holders.expire(self._lease_clock()):
            self._answered.pop(holder, None)
            for tenant, grant in self._grants.pop(holder, {}).items():
                self._drop_grant(tenant, grant)
                self.expired_total += 1

    # ---- grants: gateways admitting without a call ----------------------------------------
    def sync_grants(self, holder: str, reports: list[GrantReport], seq: int = 0,
                    now: float | None = None) -> list[GrantAnswer]:
        """Settle a gateway's grants and top them up; renews its lease (one call per period).

        ``seq`` numbers the gateway's syncs: a sync it sends again (its answer was lost, e.g.
        a timeout after this ran) gets the answer it had, without being applied twice.

        For each report: its used units leave the grant (a request admitted from a grant
        counts as admitted here now), its given-back units return to the limits, then it
        gets up to what it wants, at most 1/``GRANT_SHARE`` of what each limit has left.
        Exact: granted units count as taken (buckets refill to ``capacity - granted``, slots
        are in ``in_flight``, tokens are charged to the day), so limits hold across gateways.
        Tokens a gateway refunds into its grant raise ``granted``; the next refill clamps the
        bucket under the new ceiling before any decision. A gateway's idle grant would make
        another refuse early; a refusal therefore recalls idle grants (``try_admit``).
        """
        now = self._clock() if now is None else now
        answers = []
        with self._lock:
            self._expire(now)
            done = self._answered.get(holder)
            if seq and done is not None and done[0] == seq:
                return done[1]
            if self._holders is not None:
                self._holders.add(holder, holder, self._lease_clock())
            grants = self._grants.setdefault(holder, {})
            for r in reports:
                answers.append(self._sync_grant(grants, r, now))
            if grants:
                self._answered[holder] = (seq, answers)
            else:
                self._grants.pop(holder, None)
                self._answered.pop(holder, None)
                if self._holders is not None:
                    self._holders.pop(holder)
        return answers

    def _sync_grant(self, grants: dict[str, Grant], r: GrantReport, now: float) -> GrantAnswer:
        lim = TenantLimits.coerce(r.limits)
        st = self._sync(r.tenant, lim, now)
        grant = grants.get(r.tenant)
        if grant is None:
            if r.held:                    # restarted or expired: whatever it holds is void
                return GrantAnswer(r.tenant, known=False)
            grant = grants[r.tenant] = Grant(day=st.day)
        # What was used: it stays taken; only the grant's claim on it ends.
        used_r, used_t = min(r.used_requests, grant.requests), min(r.used_tokens, grant.tokens)
        grant.requests -= used_r
        grant.tokens -= used_t
        st.granted_requests -= used_r
        st.granted_tokens -= used_t
        st.admitted_total += r.used_requests
        st.admitted_fast_lane += r.used_requests
        overrun = r.used_tokens - used_t   # requests that used more than they reserved
        if overrun > 0:                    # beyond the grant: charged as ``_release`` charges it
            st.tokens_today += overrun
            if st.tokens is not None:
                st.tokens.level -= overrun
        if grant.day != st.day:           # a new UTC day: what is still held is today's
            st.tokens_today += grant.tokens
            grant.day = st.day
        # Given back: as if never granted.
        _move(st, grant, -min(r.back_requests, grant.requests), -min(r.back_tokens, grant.tokens),
              -min(r.back_slots, grant.slots))
        recall, grant.recall = grant.recall, False
        if recall or now < st.top_up_after:   # give back first; no top-up while a recalled
            grant.idle = r.idle               # request has yet to retry
            if grant.requests == grant.tokens == grant.slots == 0:
                del grants[r.tenant]
            return GrantAnswer(r.tenant, recall=recall)
        # Top-up.
        add_r = _share(r.want_requests, None if st.requests is None else st.requests.level)
        budget_left = (None if lim.daily_token_budget is None
                       else lim.daily_token_budget - st.tokens_today)
        add_t = _share(r.want_tokens, None if st.tokens is None else st.tokens.level, budget_left)
        slots_left = (None if lim.max_concurrent_requests is None
                      else lim.max_concurrent_requests - st.in_flight)
        add_s = _share(r.want_slots, slots_left)
        _move(st, grant, add_r, add_t, add_s)
        grant.idle = (r.idle[0] + add_r, r.idle[1] + add_t, r.idle[2] + add_s)
        if grant.requests == grant.tokens == grant.slots == 0:
            del grants[r.tenant]
        return GrantAnswer(r.tenant, add_r, add_t, add_s)

    def _recall(self, tenant: str, st: _TenantState, lim: TenantLimits, cost: int) -> bool:
        """Call back the tenant's grants that were idle at their last sync, if what they hold
        would have admitted the refused request (lock held)."""
        idle = self._idle_grants(tenant)
        free_r, free_t, free_s = (sum(g.idle[i] for g in idle) for i in range(3))
        helps = (
            (lim.max_concurrent_requests is None
             or st.in_flight - free_s < lim.max_concurrent_requests)
            and (st.requests is None or st.requests.level + free_r >= 1)
            and (st.tokens is None or st.tokens.level + free_t >= cost)
            and (lim.daily_token_budget is None
                 or st.tokens_today - free_t + cost <= lim.daily_token_budget))
        if not (idle and helps):
            return False
        for grant in idle:
            grant.recall = True
        return True

    def _idle_grants(self, tenant: str) -> list[Grant]:
        """The tenant's grants (one per gateway) that held idle units at their last sync (lock held)."""
        return [g for grants in self._grants.values()
                if (g := grants.get(tenant)) is not None and any(g.idle)]

    def _drop_grant(self, tenant: str, grant: Grant) -> None:
        """A holder that died: its slots come back; its unused units count as used."""
        st = self._tenants[tenant]
        st.in_flight -= grant.slots
        st.granted_requests -= grant.requests
        st.granted_tokens -= grant.tokens

    def _release(self, ticket: Ticket, tokens_used: int | None, now: float) -> bool:
        if self._leases is not None:
            self._leases.pop(ticket.ticket_id)
        if self._active.pop(ticket.ticket_id, None) is None:
            return False
        st = self._tenants[ticket.tenant]
        st.in_flight -= 1
        unused = ticket.reserved_tokens - (ticket.reserved_tokens if tokens_used is None
                                           else tokens_used)
        if st.day == ticket.day:
            st.tokens_today = max(0, st.tokens_today - unused)
        cap = st.limits.tokens_per_minute
        if st.tokens is not None and cap is not None:
            st.tokens.refill(cap, now, st.granted_tokens)
            st.tokens.level = min(float(cap - st.granted_tokens), st.tokens.level + unused)
        return True

    def usage(self, tenant: str, now: float | None = None) -> dict:
        """Current counters of one tenant (zeros for a tenant never seen)."""
        now = self._clock() if now is None else now
        with self._lock:
            self._expire(now)
            st = self._tenants.get(tenant)
            if st is None:
                blank = _TenantState(TenantLimits(), day=int(now // SECONDS_PER_DAY))
                return _usage_dict(tenant, blank, now)
            self._sync(tenant, st.limits, now)
            idle_slots = sum(g.idle[2] for g in self._idle_grants(tenant))
            return _usage_dict(tenant, st, now, idle_slots)

    def usage_all(self, now: float | None = None) -> dict[str, dict]:
        """``usage`` of every tenant seen so far, by tenant name."""
        with self._lock:
            names = list(self._tenants)
        return {name: self.usage(name, now) for name in names}

    def _sync(self, tenant: str, lim: TenantLimits, now: float) -> _TenantState:
        st = self._tenants.get(tenant)
        if st is None:
            st = self._tenants[tenant] = _TenantState(lim, day=int(now // SECONDS_PER_DAY))
        st.limits = lim
        st.requests = _sync_bucket(st.requests, lim.requests_per_minute, now, st.granted_requests)
        st.tokens = _sync_bucket(st.tokens, lim.tokens_per_minute, now, st.granted_tokens)
        day = int(now // SECONDS_PER_DAY)
        if day > st.day:
            st.day, st.tokens_today = day, 0
        return st


def too_big(lim: TenantLimits, prompt_tokens: int, max_tokens: int, n: int = 1) -> Admission | None:
    """400 for a request (of ``n`` choices: prompts x n for a batch) that no amount of
    waiting would admit."""
    cost = prompt_tokens + n * max_tokens
    asked = f"max_tokens {max_tokens}" if n == 1 else f"{n} choices x max_tokens {max_tokens}"
    if lim.max_tokens_per_request is not None and max_tokens > lim.max_tokens_per_request:
        return _reject(400, "max_tokens_per_request",
                       f"max_tokens={max_tokens} exceeds this tenant's max_tokens_per_request="
                       f"{lim.max_tokens_per_request}; lower max_tokens")
    for name, cap in (("tokens_per_minute", lim.tokens_per_minute),
                      ("daily_token_budget", lim.daily_token_budget)):
        if cap is not None and cost > cap:
            return _reject(400, name, f"request needs {cost} tokens (prompt {prompt_tokens} + "
                           f"{asked}) but this tenant's {name} is {cap}; shorten the prompt or "
                           f"lower max_tokens{'' if n == 1 else ', n or the number of prompts'}")
    return None


def _rates(st: _TenantState, lim: TenantLimits) -> dict:
    """What the tenant's per-minute buckets hold now: units left (whole, not below 0) and
    seconds until the bucket is full again at its refill rate."""
    out = {}
    for unit, bucket, cap in (("requests", st.requests, lim.requests_per_minute),
                              ("tokens", st.tokens, lim.tokens_per_minute)):
        if bucket is not None and cap:
            out[unit] = (max(0, math.floor(bucket.level)), bucket.wait_s(cap, cap))
    return out


def _denial(st: _TenantState, lim: TenantLimits, cost: int, now: float) -> Admission | None:
    """The 429 with the longest wait among the limits that refuse now, or None."""
    waits: list[tuple[float, str, str]] = []
    if lim.max_concurrent_requests is not None and st.in_flight >= lim.max_concurrent_requests:
        waits.append((CONCURRENCY_RETRY_S, "max_concurrent_requests",
                      f"{st.in_flight} requests in flight; max_concurrent_requests is "
                      f"{lim.max_concurrent_requests}"))
    if st.requests is not None and st.requests.level < 1:
        waits.append((st.requests.wait_s(1, lim.requests_per_minute), "requests_per_minute",
                      f"requests_per_minute={lim.requests_per_minute} reached"))
    if st.tokens is not None and st.tokens.level < cost:
        waits.append((st.tokens.wait_s(cost, lim.tokens_per_minute), "tokens_per_minute",
                      f"tokens_per_minute={lim.tokens_per_minute} reached"))
    budget = lim.daily_token_budget
    if budget is not None and st.tokens_today + cost > budget:
        midnight = (st.day + 1) * SECONDS_PER_DAY
        waits.append((max(0.0, midnight - now), "daily_token_budget",
                      f"daily_token_budget={budget} would be exceeded "
                      f"({st.tokens_today} used today); resets at 00:00 UTC"))
    if not waits:
        return None
    wait, name, reason = max(waits, key=lambda w: w[0])
    when = f"{wait:.1f} s" if wait >= 1 else f"{math.ceil(wait * 1000)} ms"
    return _reject(429, name, f"{reason}; retry in {when}", retry_after_s=wait)


def _move(st: _TenantState, grant: Grant, requests: int, tokens: int, slots: int) -> None:
    """Move units from the tenant's limits into ``grant`` (negative: back out of it).
    Granted units count as taken: out of the buckets, charged to today's tokens, slots in
    ``in_flight``."""
    grant.requests += requests
    grant.tokens += tokens
    grant.slots += slots
    st.granted_requests += requests
    st.granted_tokens += tokens
    st.in_flight += slots
    st.tokens_today = max(0, st.tokens_today + tokens)
    if st.requests is not None:
        st.requests.level -= requests
    if st.tokens is not None:
        st.tokens.level -= tokens


def _share(want: int, *left: float | None) -> int:
    """Units to grant: ``want``, at most 1/GRANT_SHARE of each limited amount left."""
    n = max(0, want)
    for amount in left:
        if amount is not None:
            n = min(n, max(0, int(amount // GRANT_SHARE)))
    return n


def _reject(status: int, limit: str, reason: str, retry_after_s: float | None = None) -> Admission:
    return Admission(ok=False, status=status, reason=reason, retry_after_s=retry_after_s,
                     limit=limit)


def _usage_dict(tenant: str, st: _TenantState, now: float, idle_slots: int = 0) -> dict:
    """``in_flight``: requests (the slots counted taken less those gateways held idle in their
    grants at their last sync, ``granted_idle_slots``)."""
    level = (lambda b: None if b is None else max(0.0, b.level))
    idle_slots = min(idle_slots, st.in_flight)
    return {"tenant": tenant, "in_flight": st.in_flight - idle_slots, "granted_idle_slots": idle_slots,
            "admitted_total": st.admitted_total,
            "admitted_fast_lane": st.admitted_fast_lane,
            "rejected": dict(st.rejected), "utc_day": time.strftime(
                "%Y-%m-%d", time.gmtime(st.day * SECONDS_PER_DAY)),
            "tokens_today": st.tokens_today, "requests_available": level(st.requests),
            "tokens_available": level(st.tokens), "limits": st.limits.as_dict(), "at": now}


class LocalAdmission:
    """Async facade over an in-process controller (same methods as ``ActorAdmission``)."""

    def __init__(self, controller: AdmissionController | None = None):
        self.controller = controller or AdmissionController()

    async def try_admit(self, tenant: str, limits: Any, prompt_tokens: int,
                        max_tokens: int | None, now: float | None = None, n: int = 1) -> Admission:
        return self.controller.try_admit(tenant, limits, prompt_tokens, max_tokens, now, n)

    async def release(self, ticket: Ticket, tokens_used: int | None = None,
                      now: float | None = None) -> bool:
        return self.controller.release(ticket, tokens_used, now)

    async def renew(self, ticket_ids: list[str]) -> list[str]:
        return self.controller.renew(ticket_ids)

    async def usage(self, tenant: str, now: float | None = None) -> dict:
        return self.controller.usage(tenant, now)

    async def usage_all(self, now: float | None = None) -> dict[str, dict]:
        return self.controller.usage_all(now)

    async def sync_grants(self, holder: str, reports: list[GrantReport],
                          seq: int = 0) -> list[GrantAnswer]:
        return self.controller.sync_grants(holder, reports, seq)
