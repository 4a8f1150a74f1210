"""Continuous batching with QoS priorities, per-tenant fairness, chunked prefill, preemption.

Each step walks requests in one order and gives each as many tokens as the step's budget
allows (a prompt longer than the budget is prefilled in chunks over several steps)::

    order = (higher priority first,
             running before waiting,
             waiting: lower tenant virtual-token counter first (fairness inside a class),
             earlier arrival first)

While requests of a higher class are unfinished (or were, within ``prefill_cap_hold_s``),
requests of lower classes get at most ``low_priority_prefill_cap`` prefill tokens per step
in total (their decodes still run). Steps stay short while premium traffic is about, so a
premium arrival waits for a short step, not for another class's 2048-token prefill chunk,
and premium decodes keep their pace. The higher class's own prefill is never capped.

When blocks run out, victims are *running* requests later in that order that have not been
scheduled yet in this step, so a step never undoes work; ``PreemptionPolicy`` picks among them
(lowest priority, then least lost work, then latest arrival). A waiting request may only
preempt strictly lower classes; a running one may preempt equal or lower ones, and otherwise
is preempted itself. Preemption frees the victim's blocks, after recording a copy of them to
host memory when the policy swaps (its full blocks also stay in the prefix cache, so
recompute is mostly prefix hits).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .kv_cache_manager import KVCacheManager, PrefixHit
from .model_runner import ScheduledRequest
from .preemption import PreemptionPolicy
from .request import Request, Status


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class FairShare:
    """Virtual token counters per (QoS class, tenant): who has been served least goes first.

    A tenant that becomes active starts at the smallest counter among active tenants of its
    class, so idling earns no credit.
    """

    def __init__(self) -> None:
        self.vtokens: dict[tuple[str, str], float] = {}

    def key(self, req: Request) -> float:
        k = (req.qos, req.tenant)
        if k not in self.vtokens:
            same = [v for (q, _), v in self.vtokens.items() if q == req.qos]
            self.vtokens[k] = min(same) if same else 0.0
        return self.vtokens[k]

    def charge(self, req: Request, tokens: int) -> None:
        self.vtokens[(req.qos, req.tenant)] = self.key(req) + tokens


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
        self.fair = FairShare()
        self.num_preemptions = 0
        self.preemptions_by_qos: dict[str, int] = {}
        self.preemptible: dict[str, bool] = {}
        self.fcfs = False               # arrival order only (no classes, no fairness)
        self.low_priority_prefill_cap: int | None = None
        self.prefill_cap_hold_s = 2.0
        self.clock = time.monotonic
        self._priority_seen: dict[int, float] = {}      # priority -> last time unfinished

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.kv.drop_swap(req)

    def _order(self) -> list[Request]:
        running = sorted(self.running, key=lambda r: (-r.priority, r.arrival_seq))
        fair = (lambda r: 0.0) if self.fcfs else self.fair.key
        waiting = sorted(self.waiting, key=lambda r: (-r.priority, fair(r), r.arrival_seq))
        merged = [(r.priority, 0, i, r) for i, r in enumerate(running)]
        merged += [(r.priority, 1, i, r) for i, r in enumerate(waiting)]
        merged.sort(key=lambda t: (-t[0], t[1], t[2]))
        return [t[3] for t in merged]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        pending = self._order()
        capped_below, low_prefill = self._prefill_cap(pending)
        num_seqs = 0
        admitting = True
        i = 0
        while i < len(pending) and budget > 0:
            req = pending[i]
            waiting = req.status != Status.RUNNING
            if waiting and (not admitting or num_seqs >= self.max_num_seqs):
                i += 1
                continue
            hit = self.kv.get_computed_blocks(req) if waiting else None
            computed = req.num_computed_tokens + (hit.num_tokens if hit else 0)
            num_new = min(req.num_tokens - computed, budget)
            capped = req.priority < capped_below and _in_prefill(req, computed)
            if capped:
                num_new = min(num_new, low_prefill)
                if num_new <= 0:
                    i += 1
                    continue
            if self._make_room(req, num_new, hit, pending, i, out):
                self._admit(req, num_new, hit, waiting)
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                if capped:
                    low_prefill -= num_new
                num_seqs += 1
                i += 1
            elif waiting:
                admitting = False      # head-of-line: do not let later arrivals overtake
                i += 1
            else:
                self._preempt(req, out)
                pending.pop(i)
        return out

    def _prefill_cap(self, pending: list[Request]) -> tuple[float, int]:
        """(priority below which prefill is capped, the cap) for this step.

        The top priority is the highest with an unfinished request now or within the last
        ``prefill_cap_hold_s`` seconds: premium traffic arrives in gaps, and a step planned
        in a gap would otherwise be a long one that the next premium arrival waits behind.
        No cap when off or in FCFS mode.
        """
        cap = self.low_priority_prefill_cap
        if cap is None or self.fcfs:
            return float("-inf"), 0
        now = self.clock()
        for r in pending:
            self._priority_seen[r.priority] = now
        horizon = now - self.prefill_cap_hold_s
        self._priority_seen = {p: t for p, t in self._priority_seen.items() if t >= horizon}
        top = max(self._priority_seen, default=None)
        if top is None or all(r.priority == top for r in pending):
            return float("-inf"), 0
        return top, cap

    def _make_room(self, req, num_new, hit: PrefixHit | None, pending, i, out) -> bool:
        """Preempt victims after position ``i`` until ``req`` fits. False if it cannot."""
        if self.kv.can_allocate(req, num_new, hit):
            return True
        waiting = req.status != Status.RUNNING
        victims = [v for v in pending[i + 1:] if v.status == Status.RUNNING and
                   (v.priority < req.priority if waiting else v.priority <= req.priority) and
                   (not waiting or self.preemptible.get(v.qos, True))]
        null = self.kv.pool.null_block
        reclaimable = sum(b is not null for v in victims for b in v.blocks)
        if self.kv.blocks_needed(req, num_new, hit) > self.kv.pool.num_free(req.pinned) + reclaimable:
            return False
        while victims and not self.kv.can_allocate(req, num_new, hit):
            victim = self.policy.choose_victim(victims)
            victims.remove(victim)
            pending.remove(victim)
            self._preempt(victim, out)
        return self.kv.can_allocate(req, num_new, hit)

    def _admit(self, req: Request, num_new: int, hit: PrefixHit | None, waiting: bool) -> None:
        self.kv.allocate(req, num_new, hit)
        if waiting:
            self.waiting.remove(req)
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
        self.waiting.append(req)
        out.preempted.append(req)


def _in_prefill(req: Request, computed: int) -> bool:
    """True while part of the prompt (or, after preemption, of the output) is not computed."""
    return req.num_tokens - computed > 1
