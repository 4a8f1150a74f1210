"""Continuous batching with QoS priorities, per-tenant fairness, chunked prefill, preemption.

Each step walks requests in one order and gives each as many tokens as the step's budget
allows (a prompt longer than the budget is prefilled in chunks over several steps)::

    order = (higher priority first,
             running before waiting,
             waiting: lower tenant virtual-token counter first (fairness inside a class),
             earlier arrival first)

Seats: at most ``max_num_seqs`` requests run at once (a hard limit). A waiting request finding
every seat taken preempts a running request of a strictly lower, preemptible class, else waits.

While requests of a higher class are unfinished (or were, within ``prefill_cap_hold_s``),
lower classes are trimmed: at most ``low_priority_prefill_cap`` prefill tokens per step in
total (a waiting request's first step counts as prefill, however short), and the step's
estimated duration (``step_budget``) is kept under the top class's step target, by cutting
lower classes' prefill chunks and skipping their decodes for this step.
A premium arrival then waits for a short step, not for another class's 2048-token prefill.
The higher class's own work is never trimmed.

When blocks run out, victims are *running* requests later in that order that have not been
scheduled yet in this step, so a step never undoes work; ``PreemptionPolicy`` picks among them
(lowest priority, then least lost work, then latest arrival). A waiting request may only
preempt strictly lower, preemptible classes; a running one may preempt equal or lower ones,
and otherwise is preempted itself. Victims are preempted only when doing so frees enough:
*reclaimable* counts exactly the blocks that preempting them would return to a free queue
the requester may use (ref count held only by victims, pinned-region blocks only for pinned
classes, not the requester's own prefix hits).

Head of line: a waiting request that does not fit stops later waiting requests from being
admitted this step (they would take the blocks it waits for), unless it could never fit (its
whole length exceeds what its class may ever hold): then it is skipped, never blocking, and
``Engine.reject_unfittable`` fails it.

One prefill per shared prefix in flight (SGLang's in-batch prefix caching does the same): a
waiting request whose next blocks to compute (``MIN_SHARED_PREFIX_TOKENS`` of them, all of
which it could read from the cache) are ones a request scheduled ahead of it this step is
filling sits the step out, without blocking those behind it, and takes them as a prefix hit
once they are computed. Without this, a burst of six copies of one 256-token prefix arriving
together computed it five times in one step (``tests/engine/test_prefix_in_flight.py``).

Cost: a step walks the running requests and, per class, the waiting requests it reaches, at
most ``max_num_seqs`` that could ever fit (a step admits no more than that: each admission
takes a seat), merged lazily in order from per-(class, tenant) queues kept in arrival order,
and none once the step can admit no more (no seat, no memory, no prefill left for the class).
So a backlog of thousands under overload costs a step little; sorting it every step did
(``qos_engine.py`` at 2x overload, ~1,700 waiting: 2.2 ms mean, up to 63 ms per
``schedule()``), and so did merging ``max_num_seqs`` of it for a step that admitted one.
"""

from __future__ import annotations

import heapq
import time
from bisect import insort
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import attrgetter

from .fairness import FairShare
from .kv_cache_manager import KVCacheManager, PrefixHit, usable_by
from .model_runner import ScheduledRequest
from .pinned_sizer import PinnedSizer
from .preemption import PreemptionPolicy
from .request import Request, Status
from .step_budget import StepBudget, StepCostModel, in_prefill

MAX_SAMPLE_GAP_S = 1.0          # a longer gap between two schedule() calls is idle time
MIN_SHARED_PREFIX_TOKENS = 32   # a shorter prefix in flight is computed again, not waited for
_ARRIVAL = attrgetter("arrival_seq")


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class StepLimits:
    """How this step trims classes below ``top`` (no trimming when ``top`` is -inf)."""

    top: float = float("-inf")
    prefill_left: int = 0                 # lower classes' prefill tokens still allowed
    budget: StepBudget | None = None


class StepOrder:
    """One step's walk over the scheduling order, front to back: per class (highest first) its
    running requests, then its waiting ones, pulled from ``waiting[priority]`` only as the
    walk reaches them; then the running requests of classes with none waiting. A running
    request preempted earlier in the step is passed over; after ``stop_waiting`` no waiting
    request is pulled (the step admits no more), so a backlog's rest is never merged."""

    def __init__(self, running: list[Request], waiting: dict[int, Iterator[Request]]) -> None:
        self._running = running         # running at the step's start, in scheduling order
        self._waiting = waiting
        self._next = 0                  # index in _running of the first one not walked yet
        self._admitting = True
        self.priorities = {r.priority for r in running} | set(waiting)

    def stop_waiting(self) -> None:
        self._admitting = False

    def running_ahead(self) -> list[Request]:
        """Running requests the walk has not reached (the victims a step may preempt)."""
        return [r for r in self._running[self._next:] if r.status == Status.RUNNING]

    def __iter__(self) -> Iterator[Request]:
        for priority in sorted(self._waiting, reverse=True):
            yield from self._running_down_to(priority)
            waiting = self._waiting[priority]
            while self._admitting and (req := next(waiting, None)) is not None:
                yield req
        yield from self._running_down_to(float("-inf"))

    def _running_down_to(self, priority: float) -> Iterator[Request]:
        """Running requests of ``priority`` or higher not walked yet, passing over those
        preempted earlier in this step."""
        running = self._running
        while self._next < len(running) and running[self._next].priority >= priority:
            req = running[self._next]
            self._next += 1
            if req.status == Status.RUNNING:
                yield req


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes."""

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: PreemptionPolicy | None = None):
        self.kv = kv
        self.policy = policy or PreemptionPolicy(block_size=kv.block_size)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # waiting requests by (priority, qos, tenant), each queue in arrival order
        self.queues: dict[tuple[int, str, str], list[Request]] = {}
        self.fair = FairShare()
        self.num_preemptions = 0
        self.preemptions_by_qos: dict[str, int] = {}
        self.preemptible: dict[str, bool] = {}
        self.step_target_s: dict[int, float] = {}      # priority -> step target while about
        self.fcfs = False               # arrival order only (no classes, no fairness)
        self.low_priority_prefill_cap: int | None = None
        self.prefill_cap_hold_s = 2.0
        self.clock = time.monotonic
        self.cost = StepCostModel()
        self.sizer = PinnedSizer(floor=kv.pool.num_pinned)
        self.num_trimmed = 0            # lower-class items cut or skipped by the step budget
        self.num_prefix_waits = 0       # steps a waiting request sat out for its prefix in flight
        self._priority_seen: dict[int, float] = {}      # priority -> last time unfinished
        self._last: tuple[float, int, int] | None = None   # (start, tokens, seqs) of last step

    def add(self, req: Request) -> None:
        self._enqueue(req)
        self.fair.arrive(req)

    def _enqueue(self, req: Request) -> None:
        self.waiting.append(req)
        insort(self.queues.setdefault((req.priority, req.qos, req.tenant), []), req, key=_ARRIVAL)

    def _dequeue(self, req: Request) -> None:
        self.waiting.remove(req)
        key = (req.priority, req.qos, req.tenant)
        queue = self.queues[key]
        queue.remove(req)
        if not queue:
            del self.queues[key]

    def requests_by_priority(self) -> dict[int, int]:
        """Running and waiting requests per priority (O(running + waiting tenants): a backlog
        is counted by its per-tenant queues)."""
        counts: dict[int, int] = {}
        for (priority, _, _), queue in self.queues.items():
            counts[priority] = counts.get(priority, 0) + len(queue)
        for req in self.running:
            counts[req.priority] = counts.get(req.priority, 0) + 1
        return counts

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self._dequeue(req)
        else:
            return
        self.fair.leave(req)
        self.kv.free(req)
        self.kv.drop_swap(req)

    def _order(self) -> StepOrder:
        """This step's walk over the scheduling order (module doc): per class, running requests
        first, then waiting ones by tenant counter and arrival, at most ``max_num_seqs`` of
        those that could ever fit, merged only as the walk reaches them."""
        running = sorted(self.running, key=lambda r: (-r.priority, r.arrival_seq))
        classes: dict[int, list[list[Request]]] = {}
        for (priority, _, _), queue in self.queues.items():
            classes.setdefault(priority, []).append(queue)
        return StepOrder(running, {p: self._waiting_order(qs) for p, qs in classes.items()})

    def _waiting_order(self, queues: list[list[Request]]) -> Iterator[Request]:
        """One class's waiting requests in order, merged lazily from snapshots of its tenants'
        queues (by tenant counter, then arrival; admissions and preemptions during the step
        leave the walk alone), until ``max_num_seqs`` that could ever fit were given."""
        queues = [list(q) for q in queues]
        if len(queues) == 1:
            merged = iter(queues[0])
        elif self.fcfs:
            merged = heapq.merge(*queues, key=_ARRIVAL)
        else:       # a tenant's requests share its counter: one lookup per queue
            merged = (t[2] for t in heapq.merge(*(_keyed(self.fair.key(q[0]), q) for q in queues)))
        return self._fitting(merged)

    def _fitting(self, merged: Iterator[Request]) -> Iterator[Request]:
        """``merged`` until ``max_num_seqs`` that could ever fit were given (a generator of its
        own: ``_waiting_order`` must snapshot the queues and read the counters when called)."""
        fitting = 0
        for req in merged:
            fitting += not self._never_fits(req)
            yield req
            if fitting >= self.max_num_seqs:
                return

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self._learn_step_cost(now)
        self.size_pinned_region(now)
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        order = self._order()
        limits = self._limits(order.priorities, now)
        computing: dict = {}    # block hash -> only pinned requests fill it (see _joins_computing)
        for req in order:
            if budget <= 0:
                break
            waiting = req.status != Status.RUNNING
            if waiting and req.priority < limits.top and limits.prefill_left <= 0:
                # lower classes have no prefill tokens left this step: no waiting request of
                # theirs is walked (nor looked up)
                if limits.budget.room(1) == 0:
                    break
                order.stop_waiting()
                continue
            hit = self.kv.get_computed_blocks(req) if waiting else None
            computed = req.num_computed_tokens + (hit.num_tokens if hit else 0)
            if waiting and computing and self._joins_computing(req, computed, computing):
                self.num_prefix_waits += 1      # its next blocks are a hit from the next step on
                continue
            want = req.num_tokens - computed
            if req.spec_token_ids and not waiting:
                want += self._drafts_that_fit(req, want)
            num_new = self._trim(req, min(want, budget), computed, limits)
            if num_new <= 0:
                if req.priority < limits.top and limits.budget.room(1) == 0:
                    break           # the time budget is spent: no later (lower) item fits
                continue
            if waiting and not self._take_seat(req, num_new, hit, order, out):
                order.stop_waiting()
            elif self._make_room(req, num_new, hit, order, out):
                self._admit(req, num_new, hit, waiting)
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                self._charge(req, num_new, computed, limits)
                if self.waiting:            # only waiting requests read it (none: decode-only)
                    self._note_computing(req, computed, computing)
            elif waiting:
                # Head of line, unless it can never fit: then it must not block the rest.
                if not self._never_fits(req):
                    order.stop_waiting()
            else:
                self._preempt(req, out)
        self._last = (now, out.num_tokens, len(out.scheduled)) if out.scheduled else None
        return out

    # ---- one prefill per shared prefix in flight ------------------------------------------
    def _note_computing(self, req: Request, computed: int, computing: dict) -> None:
        """``req``, scheduled this step with ``computed`` tokens done, fills the full blocks
        from there to the end of its prompt (this step's chunk and the chunks after it; none
        for a decode, at most the block its token completes)."""
        bs = self.kv.block_size
        for h in req.block_hashes[computed // bs:req.num_tokens // bs]:
            computing[h] = computing.get(h, True) and req.pinned

    def _joins_computing(self, req: Request, computed: int, computing: dict) -> bool:
        """Should waiting ``req`` sit this step out? Yes when the next blocks it would
        compute, ``MIN_SHARED_PREFIX_TOKENS`` worth (a chat template's first block shared by
        different prompts is not worth a step's wait; SGLang's in-batch check has the same
        32-token threshold), are all ones requests scheduled ahead of it this step are
        filling, each a hit it may take (a block only pinned requests fill may sit in the
        pinned region) and within what a hit may cover: from the next step on
        ``get_computed_blocks`` returns them, and the shared prefix is computed once, not once
        per copy of a burst. Only requests ahead in this step's order fill
        ``computing`` (higher classes and running requests of its own class first), so a
        request never waits on a lower class's trimmed prefill, and once the computing
        request stops being scheduled (finished its prompt, preempted, aborted) nothing holds
        ``req`` back."""
        bs = self.kv.block_size
        start = computed // bs
        end = start + -(-MIN_SHARED_PREFIX_TOKENS // bs)
        if end > self.kv.max_hit_blocks(req):
            return False
        for h in req.block_hashes[start:end]:
            only_pinned = computing.get(h)
            if only_pinned is None or (only_pinned and not req.pinned):
                return False
        return True

    def _drafts_that_fit(self, req: Request, want: int) -> int:
        """Draft tokens of running ``req`` to verify this step: all of them when they need no
        new block, or when the free blocks left after theirs still give each running request
        one more; else none (drafts never preempt, nor take a block a decode needs)."""
        drafts, kv = len(req.spec_token_ids), self.kv
        extra = kv.blocks_needed(req, want + drafts)
        if extra == kv.blocks_needed(req, want) or \
                kv.pool.num_free(req.pinned) - extra >= len(self.running):
            return drafts
        req.spec_token_ids = []
        return 0

    def trims_decodes(self, reqs: list[Request]) -> bool:
        """Would ``schedule`` leave out one of ``reqs`` (the whole running set, each decoding
        one token) for a lower class's step budget? The same limits and budget ``schedule``
        applies, without scheduling (the engine asks before it runs a decode step ahead)."""
        pending = sorted(reqs, key=lambda r: (-r.priority, r.arrival_seq))
        limits = self._limits({r.priority for r in reqs}, self.clock())
        for req in pending:
            if self._trim(req, 1, req.num_computed_tokens, limits, count=False) < 1:
                return True
            self._charge(req, 1, req.num_computed_tokens, limits)
        return False

    def untimed(self) -> None:
        """The step just planned runs ahead of others (the engine's ``async_scheduling``): the
        time to the next ``schedule`` is not its duration, so it is no sample of the cost model."""
        self._last = None

    def abandon(self, out: SchedulerOutput) -> None:
        """The step ``out`` planned was cut short (``StepInterrupted``) and kept nothing: its
        requests keep their seats and blocks, their fairness charge is refunded, and the step
        is no sample of the cost model."""
        for item in out.scheduled:
            self.fair.charge(item.request, -item.num_new_tokens)
        self._last = None

    # ---- trimming lower classes (prefill cap, step time budget) ----------------------------
    def _limits(self, priorities: set[int], now: float) -> StepLimits:
        """Trimming for this step (``priorities``: of the requests it may walk): the top
        priority is the highest with an unfinished request now or within
        ``prefill_cap_hold_s`` (premium traffic arrives in gaps, and a step planned in a gap
        would otherwise be a long one the next premium arrival waits behind). No trimming
        when every pending request is of the top class, or in FCFS mode."""
        if self.fcfs:
            return StepLimits()
        for p in priorities:
            self._priority_seen[p] = now
        horizon = now - self.prefill_cap_hold_s
        self._priority_seen = {p: t for p, t in self._priority_seen.items() if t >= horizon}
        top = max(self._priority_seen, default=None)
        if top is None or priorities <= {top}:
            return StepLimits()
        cap = self.low_priority_prefill_cap
        target = min((t for p, t in self.step_target_s.items() if p in self._priority_seen
                      and any(q < p for q in self._priority_seen)), default=None)
        if cap is None and target is None:
            return StepLimits()
        return StepLimits(top, self.max_num_batched_tokens if cap is None else cap,
                          StepBudget(self.cost, target))

    def _trim(self, req: Request, num_new: int, computed: int, limits: StepLimits,
              count: bool = True) -> int:
        """Tokens ``req`` may compute this step after trimming (0: skip it this step);
        ``count``: a trim counts in ``num_trimmed`` (not when only asked, ``trims_decodes``)."""
        if req.priority >= limits.top or limits.budget is None:
            return num_new
        if _starts_or_prefills(req, computed):
            num_new = min(num_new, limits.prefill_left)
        room = limits.budget.room(num_new)
        if room < num_new and count:
            self.num_trimmed += 1
        return room

    def _charge(self, req: Request, num_new: int, computed: int, limits: StepLimits) -> None:
        if limits.budget is None:
            return
        limits.budget.add(num_new, req.priority < limits.top, in_prefill(req, computed))
        if req.priority < limits.top and _starts_or_prefills(req, computed):
            limits.prefill_left -= num_new

    def _learn_step_cost(self, now: float) -> None:
        """The previous step lasted until now, if the engine stepped back to back."""
        if self._last is not None:
            start, tokens, seqs = self._last
            if 0 < now - start <= MAX_SAMPLE_GAP_S:
                self.cost.observe(tokens, seqs, now - start)
        self._last = None

    # ---- pinned region --------------------------------------------------------------------
    def size_pinned_region(self, now: float) -> tuple[int, int]:
        """Sample pinned-class demand and move the region toward its target (called every
        step, so a resize that stopped short is retried). Returns (size, target)."""
        pool = self.kv.pool
        self.sizer.observe(pool.pinned_class_blocks(), now)
        target = self.sizer.decide(pool.num_pinned, now)
        size = target
        if target > pool.num_pinned:          # leave running shared requests a block each to grow
            keep = sum(1 for r in self.running if not r.pinned)
            size = min(target, pool.num_pinned + max(0, pool.free["shared"].num_free - keep))
        if size != pool.num_pinned:
            pool.resize_pinned(size)
        return pool.num_pinned, target

    # ---- seats and memory -----------------------------------------------------------------
    def _take_seat(self, req, num_new, hit: PrefixHit | None, order: StepOrder, out) -> bool:
        """A seat for waiting ``req`` (hard ``max_num_seqs``), preempting a strictly lower,
        preemptible running request not yet scheduled when all are taken and ``req`` would
        then fit in memory. False: no seat this step."""
        if len(self.running) < self.max_num_seqs:
            return True
        victims = [v for v in order.running_ahead() if
                   v.priority < req.priority and self.preemptible.get(v.qos, True)]
        if not victims:
            return False
        needed = self.kv.blocks_needed(req, num_new, hit) + _free_hits(hit)
        if needed > self.kv.pool.num_free(req.pinned) + self._reclaimable(req, victims, hit):
            return False
        self._preempt(self.policy.choose_victim(victims), out)
        return True

    def _make_room(self, req, num_new, hit: PrefixHit | None, order: StepOrder, out) -> bool:
        """Preempt victims the walk has not reached until ``req`` fits. False if it cannot."""
        if self.kv.can_allocate(req, num_new, hit):
            return True
        waiting = req.status != Status.RUNNING
        victims = [v for v in order.running_ahead() if
                   (v.priority < req.priority if waiting else v.priority <= req.priority) and
                   (not waiting or self.preemptible.get(v.qos, True))]
        needed = self.kv.blocks_needed(req, num_new, hit) + _free_hits(hit)
        if needed > self.kv.pool.num_free(req.pinned) + self._reclaimable(req, victims, hit):
            return False
        while victims and not self.kv.can_allocate(req, num_new, hit):
            useful = [v for v in victims if self._reclaimable(req, [v], hit)] or victims
            victim = self.policy.choose_victim(useful)
            victims.remove(victim)
            self._preempt(victim, out)
        return self.kv.can_allocate(req, num_new, hit)

    def _reclaimable(self, req: Request, victims: list[Request], hit: PrefixHit | None) -> int:
        """Blocks that preempting all ``victims`` returns to a free queue ``req`` may use:
        held by victims only (ref count == holdings among them), in a region ``req`` may
        allocate from, and not one of ``req``'s own prefix hits (touching it costs a block)."""
        null = self.kv.pool.null_block
        holds: dict[int, int] = {}
        blocks = {}
        for v in victims:
            for b in v.blocks:
                if b is not null:
                    holds[b.block_id] = holds.get(b.block_id, 0) + 1
                    blocks[b.block_id] = b
        mine = {b.block_id for b in hit.blocks} if hit else set()
        return sum(1 for bid, n in holds.items() if blocks[bid].ref_cnt == n and bid not in mine
                   and usable_by(blocks[bid], req))

    def _never_fits(self, req: Request) -> bool:
        """True when ``req``'s whole length exceeds every block its class could ever get."""
        return not self.kv.fits_ever(req, self.kv.pool.capacity(req.pinned))

    def _admit(self, req: Request, num_new: int, hit: PrefixHit | None, waiting: bool) -> None:
        self.kv.allocate(req, num_new, hit)
        if waiting:
            self._dequeue(req)
            self.running.append(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens
                self.kv.record_hit(req, hit)
            req.status = Status.RUNNING
        self.fair.charge(req, num_new)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        if self.policy.should_swap(req):
            self.kv.swap_out(req)          # False (no host room): plain recompute
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_qos[req.qos] = self.preemptions_by_qos.get(req.qos, 0) + 1
        self._enqueue(req)
        out.preempted.append(req)


def _starts_or_prefills(req: Request, computed: int) -> bool:
    """Its step counts against a lower class's prefill cap: a waiting request's first step
    (even a single token), or prompt tokens of a running one."""
    return req.status != Status.RUNNING or in_prefill(req, computed)


def _keyed(counter: float, queue: list[Request]):
    """``(counter, arrival, request)`` for each request of one tenant's queue."""
    return ((counter, r.arrival_seq, r) for r in queue)


def _free_hits(hit: PrefixHit | None) -> int:
    """Prefix-hit blocks sitting in a free queue (touching them takes them out of it)."""
    return sum(1 for b in hit.blocks if b.ref_cnt == 0) if hit else 0
