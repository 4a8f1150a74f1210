"""A step's scheduling cost does not grow with the backlog, and the order it walks is the
full order's: per class, the waiting requests a step may reach (``max_num_seqs`` that could
ever fit; no step admits more) in tenant-counter, then arrival order."""

from __future__ import annotations

import copy
import random

from kvharbor.engine.block_pool import BlockPool
from kvharbor.engine.kv_cache_manager import KVCacheManager
from kvharbor.engine.request import Request, SamplingParams
from kvharbor.engine.scheduler import Scheduler, StepOrder

BS = 4
CLASSES = ((3, "premium", True), (2, "standard", False), (1, "batch", False))   # priority, qos, pinned


def _scheduler(num_blocks: int, max_num_seqs: int, pinned: int = 0) -> Scheduler:
    sched = Scheduler(KVCacheManager(BlockPool(num_blocks, pinned), BS), 48, max_num_seqs)
    sched.low_priority_prefill_cap = 12
    sched.step_target_s = {3: 0.02}
    sched.preemptible = {"premium": False}
    now = [0.0]

    def clock() -> float:        # deterministic: a step "takes" 1 ms per token scheduled
        return now[0]
    sched.clock, sched._now = clock, now
    return sched


def _full_order(sched: Scheduler) -> StepOrder:
    """The order before backlogs were bounded: every request, sorted each step."""
    running = sorted(sched.running, key=lambda r: (-r.priority, r.arrival_seq))
    fair = (lambda r: 0.0) if sched.fcfs else sched.fair.key
    waiting = sorted(sched.waiting, key=lambda r: (-r.priority, fair(r), r.arrival_seq))
    classes = {}
    for r in waiting:
        classes.setdefault(r.priority, []).append(r)
    return StepOrder(running, {p: iter(reqs) for p, reqs in classes.items()})


def _new(rng: random.Random, seq: int) -> Request:
    priority, qos, pinned = rng.choice(CLASSES)
    prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
    max_tokens = 1000 if rng.random() < 0.25 else rng.randrange(1, 8)     # 1000: never fits
    return Request(f"r{seq}", prompt, SamplingParams(max_tokens=max_tokens),
                   tenant=f"t{rng.randrange(3)}", qos=qos, priority=priority, pinned=pinned,
                   arrival_seq=seq)


def _step(sched: Scheduler) -> list[tuple[str, int]]:
    """Schedule and "run" one step: scheduled tokens computed, a token sampled where the
    request caught up, finished requests removed. Returns what was scheduled."""
    out = sched.schedule()
    assert not {i.request.request_id for i in out.scheduled} & {r.request_id for r in out.preempted}, \
        "a step scheduled a request it preempted"
    for item in out.scheduled:
        req = item.request
        req.num_computed_tokens += item.num_new_tokens
        sched.kv.cache_full_blocks(req)
        if req.num_computed_tokens == req.num_tokens:
            req.all_token_ids.append(req.num_tokens % 3)
            if req.num_tokens - len(req.prompt_token_ids) >= req.sampling.max_tokens:
                sched.remove(req)
    sched._now[0] += 0.001 * sum(i.num_new_tokens for i in out.scheduled)
    return [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] + \
        [("preempted " + r.request_id, 0) for r in out.preempted]


def _count_lookups(sched: Scheduler) -> list[int]:
    """Count ``sched``'s prefix lookups from now on, in the returned one-item list."""
    lookups, lookup = [0], sched.kv.get_computed_blocks

    def counted(req):
        lookups[0] += 1
        return lookup(req)
    sched.kv.get_computed_blocks = counted
    return lookups


def test_bounded_walk_schedules_exactly_what_the_full_sort_did():
    """Twin schedulers on the same random arrivals (three classes, three tenants each, a
    small pool, 4 seats, backlogs of dozens, some requests that can never fit and are
    skipped forever): one walks the bounded order, the other the full sorted backlog. Every
    step schedules and preempts the same requests, the same tokens."""
    compared = 0
    for seed in range(40):
        rng = random.Random(seed)
        fast, full = _scheduler(40, 4, pinned=6), _scheduler(40, 4, pinned=6)
        full._order = lambda s=full: _full_order(s)
        seq = 0
        for _ in range(60):
            for _ in range(rng.choice((0, 0, 1, 3, 8))):
                req = _new(rng, seq)
                seq += 1
                fast.add(req)
                full.add(copy.deepcopy(req))
            assert _step(fast) == _step(full), seed
            compared += 1
            assert [r.request_id for r in fast.waiting] == [r.request_id for r in full.waiting]
        assert len(fast.waiting) > 4 * 3, "no backlog beyond what the walk takes"
    assert compared == 40 * 60


def test_a_steps_lookups_do_not_grow_with_the_backlog():
    """300 or 3,000 batch requests of five tenants waiting for 8 seats: three steps make the
    same prefix lookups and fairness reads either way (sorting the backlog read every
    waiting request's counter each step, and a lookup walked every one the cap skipped)."""
    counts = []
    for backlog in (300, 3000):
        sched = _scheduler(4096, 8)
        sched.low_priority_prefill_cap = None
        rng = random.Random(7)
        for i in range(backlog):
            sched.add(Request(f"b{i}", [rng.randrange(3) for _ in range(20)],
                              SamplingParams(max_tokens=4), tenant=f"t{i % 5}", qos="batch",
                              priority=1, arrival_seq=i))
        calls = {"lookup": 0, "fair": 0}
        lookup, key = sched.kv.get_computed_blocks, sched.fair.key

        def counted_lookup(req, _f=lookup):
            calls["lookup"] += 1
            return _f(req)

        def counted_key(req, _f=key):
            calls["fair"] += 1
            return _f(req)
        sched.kv.get_computed_blocks, sched.fair.key = counted_lookup, counted_key
        for _ in range(3):
            _step(sched)
        assert sched.running and len(sched.waiting) > backlog - 16
        counts.append(calls)
    assert counts[0] == counts[1], counts
    assert counts[0]["lookup"] <= 3 * 8


def test_waiting_lower_classes_are_not_looked_up_once_their_prefill_cap_is_spent():
    """A premium request decoding and 300 batch requests waiting, 12 prefill tokens a step
    for lower classes: once a step's cap is spent, no later batch request costs a prefix
    lookup (it could get no token)."""
    sched = _scheduler(4096, 8)
    sched.max_num_batched_tokens = 256
    sched.add(Request("p", [1, 2], SamplingParams(max_tokens=40), qos="premium", priority=3,
                      pinned=True, arrival_seq=0))
    for i in range(300):
        sched.add(Request(f"b{i}", [i % 3] * 20, SamplingParams(max_tokens=4), qos="batch",
                          priority=1, arrival_seq=i + 1))
    lookups = _count_lookups(sched)
    _step(sched)
    for _ in range(10):
        lookups[0] = 0
        scheduled = dict(_step(sched))
        assert scheduled["p"] == 1 and len(scheduled) > 1          # batch work goes on too
        assert lookups[0] <= 4, lookups       # walking its 8 would look up to 8 up


def test_a_step_merges_no_more_of_the_backlog_than_it_walks():
    """256 seats, 2,000 batch requests of 20 tokens waiting, 48 tokens a step: a step admits
    three at most, and checks no more than the requests it walks (merging 256 of the backlog
    for each step cost ~0.25 ms of a 2.6 ms step in qos_engine.py's 2x flood)."""
    sched = _scheduler(4096, 256)
    sched.low_priority_prefill_cap = None
    for i in range(2000):
        sched.add(Request(f"b{i}", list(range(i, i + 20)), SamplingParams(max_tokens=4), tenant=f"t{i % 5}",
                          qos="batch", priority=1, arrival_seq=i))
    checks, fits_ever = [0], sched.kv.fits_ever

    def counted(req, capacity):
        checks[0] += 1
        return fits_ever(req, capacity)
    sched.kv.fits_ever = counted
    for _ in range(3):
        before, admitted = checks[0], len(sched.running)
        _step(sched)
        admitted = len(sched.running) - admitted
        assert 1 <= admitted <= 3
        assert checks[0] - before <= admitted + 1, checks


def test_a_burst_of_one_prompt_walks_no_more_of_it_than_a_step_could_admit():
    """500 copies of one 40-token prompt arrive together for 8 seats: the first computes the
    prompt and the others sit the step out for it (one prefill per prefix in flight), and the
    step looks up no more of them than the 8 it could admit (walking on, it looked up all
    500, each hashing its prompt, although none of them could run this step)."""
    sched = _scheduler(4096, 8)
    for i in range(500):
        sched.add(Request(f"c{i}", list(range(40)), SamplingParams(max_tokens=4), qos="batch",
                          priority=1, arrival_seq=i))
    lookups = _count_lookups(sched)
    assert _step(sched) == [("c0", 40)]
    assert sched.num_prefix_waits == 7 and lookups[0] == 8, (sched.num_prefix_waits, lookups)
