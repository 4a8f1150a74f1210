"""One prefill per shared prefix in flight: a waiting request whose next prompt blocks a request
ahead of it is computing this step sits the step out and takes them as a prefix hit after, so a
burst of copies of one prompt (an agent's concurrent calls) computes the shared prefix once."""

from __future__ import annotations

from kvharbor import LLM
from kvharbor.engine.block_pool import BlockPool
from kvharbor.engine.kv_cache_manager import KVCacheManager
from kvharbor.engine.request import Request, SamplingParams
from kvharbor.engine.scheduler import Scheduler

from .conftest import greedy
from .conftest import random_prompt as _p
from .test_scheduler_backlog import _step

BS = 4


def _sched(budget: int = 64, num_blocks: int = 64, pinned: int = 0,
           prefix_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, pinned), BS, prefix_caching=prefix_caching)
    sched = Scheduler(kv, budget, 8)
    sched._now = [0.0]
    sched.clock = lambda: sched._now[0]
    return sched


def _req(rid: str, prompt: list[int], seq: int, priority: int = 2, qos: str = "standard",
         pinned: bool = False, max_tokens: int = 2) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), tenant="t", qos=qos,
                   priority=priority, pinned=pinned, arrival_seq=seq)


def test_a_burst_of_one_prefix_computes_it_once_and_answers_the_same():
    """Six prompts sharing a 256-token prefix in one ``generate``: one computes the prefix,
    the other five take it as a hit (before, five of six computed it, all in one step), and
    every answer is what the prompt gets alone on a fresh engine."""
    prefix = _p(256, 1)
    prompts = [prefix + _p(20, 10 + i) for i in range(6)]
    llm = LLM(device="cpu", num_kv_blocks=256)
    outs = llm.generate(prompts, greedy(6))
    cached = sorted(o.num_cached_tokens for o in outs)
    assert cached[0] == 0 and all(c == 256 for c in cached[1:]), cached
    assert llm.engine.scheduler.num_prefix_waits >= 5
    llm.check_integrity()
    alone = LLM(device="cpu", num_kv_blocks=256)
    for prompt, out in zip(prompts, outs):
        assert alone.generate([prompt], greedy(6))[0].token_ids == out.token_ids


def test_the_copy_waits_one_step_and_others_are_not_held_back():
    sched = _sched(budget=128)
    shared = list(range(1, 41))                         # 10 full blocks
    a, b = _req("a", shared + [50], 0), _req("b", shared + [51], 1)
    other = _req("c", list(range(60, 101)), 2)
    for r in (a, b, other):
        sched.add(r)
    assert dict(_step(sched)) == {"a": 41, "c": 41}     # b sat out; c, behind it, did not
    assert sched.num_prefix_waits == 1
    assert _step(sched)[-1] == ("b", 1)                 # then: 40 of its 41 tokens a hit
    assert b.num_cached_tokens == 40


def test_a_copy_waits_for_the_chunk_that_fills_its_prefix():
    """An 81-token prompt prefilled 48 tokens a step: in the second step its last chunk leaves
    budget over, and its copy (12 blocks a hit by then) waits for the 8 blocks that chunk
    fills instead of computing them beside it; it starts with 80 of its 81 tokens cached."""
    sched = _sched(budget=48)
    shared = list(range(1, 81))
    a, b = _req("a", shared + [90], 0), _req("b", shared + [91], 1)
    sched.add(a)
    sched.add(b)
    steps = [_step(sched) for _ in range(3)]
    assert steps[:2] == [[("a", 48)], [("a", 33)]], steps
    assert ("b", 1) in steps[2] and b.num_cached_tokens == 80
    assert sched.num_prefix_waits == 1


def test_prompts_sharing_less_than_32_tokens_do_not_wait():
    """A shared opening shorter than ``MIN_SHARED_PREFIX_TOKENS`` (a chat template's first
    block) is computed again rather than waited for; so is the rest of a copy's prompt when
    less than that is left to share."""
    sched = _sched(budget=128)
    template = list(range(1, 25))                       # 6 blocks = 24 tokens
    a, b = _req("a", template + list(range(30, 50)), 0), _req("b", template + list(range(60, 80)), 1)
    sched.add(a)
    sched.add(b)
    assert dict(_step(sched)) == {"a": 44, "b": 44}
    assert sched.num_prefix_waits == 0

    sched = _sched(budget=36)
    shared = list(range(1, 41))
    a, b = _req("a", shared + [50], 0), _req("b", shared + [51], 1)
    sched.add(a)
    sched.add(b)
    assert _step(sched) == [("a", 36)]
    assert dict(_step(sched)) == {"a": 5, "b": 5}       # b: 36 a hit, one block left to share
    assert sched.num_prefix_waits == 0 and b.num_cached_tokens == 36


def test_a_pinned_prefill_does_not_hold_back_a_class_that_cannot_use_its_blocks():
    """Blocks only a pinned class computes may land in the pinned region, which an unpinned
    request cannot hold: it computes the prefix itself. A pinned copy of an unpinned request's
    prompt waits (the shared blocks are usable by any class)."""
    shared = list(range(1, 41))
    sched = _sched(pinned=16)
    gold = _req("g", shared + [50], 0, priority=3, qos="premium", pinned=True)
    std = _req("s", shared + [51], 1)
    sched.add(gold)
    sched.add(std)
    assert dict(_step(sched)) == {"g": 41, "s": 23}     # s computes it too (the budget's rest)
    assert sched.num_prefix_waits == 0

    sched = _sched(pinned=16)
    first = _req("s1", shared + [50], 0, priority=3, qos="premium")   # unpinned, ahead
    gold = _req("g", shared + [51], 1, priority=3, qos="premium", pinned=True)
    sched.add(first)
    sched.add(gold)
    assert dict(_step(sched)) == {"s1": 41}
    assert dict(_step(sched))["g"] == 1 and gold.num_cached_tokens == 40


def test_a_higher_class_never_waits_for_a_lower_class_computing_its_prefix():
    """A standard request mid-prefill of a long prompt, then a premium copy arrives: the premium
    request is scheduled at once (it comes before the lower class in every step's order)."""
    sched = _sched(budget=12)
    shared = list(range(1, 41))
    std = _req("s", shared + [50], 0)
    sched.add(std)
    _step(sched)
    gold = _req("g", shared + [51], 1, priority=3, qos="premium")
    sched.add(gold)
    assert _step(sched)[0] == ("g", 12)     # its first chunk now; 12 tokens were a hit
    assert gold.num_cached_tokens == 12 and sched.num_prefix_waits == 0


def test_a_request_that_must_compute_its_prompt_itself_does_not_wait():
    """A copy asking for prompt logprobs must run its prompt (no hit can cover it): it starts
    beside the first at once instead of waiting for blocks it would not read."""
    sched = _sched(budget=128)
    shared = list(range(1, 42))
    a, b = _req("a", shared, 0), _req("b", list(shared), 1)
    b.prompt_lps = [None]                   # what the engine sets when prompt_logprobs is asked
    sched.add(a)
    sched.add(b)
    assert dict(_step(sched)) == {"a": 41, "b": 41}
    assert sched.num_prefix_waits == 0


def test_without_prefix_caching_nothing_waits():
    sched = _sched(budget=128, prefix_caching=False)
    shared = list(range(1, 41))
    sched.add(_req("a", shared + [50], 0))
    sched.add(_req("b", shared + [51], 1))
    assert dict(_step(sched)) == {"a": 41, "b": 41}
    assert sched.num_prefix_waits == 0


def test_a_block_an_unpinned_request_fills_counts_as_shared_whoever_noted_it_first():
    """Two requests filling the same blocks in one step (both running mid-prefill): if either
    is unpinned the blocks go to the shared region, usable by every class, in either order."""
    sched = _sched()
    shared = list(range(1, 41))
    for order in ((True, False), (False, True)):
        computing: dict = {}
        for i, pinned in enumerate(order):
            req = _req(f"r{i}", shared + [50 + i], i, pinned=pinned)
            sched.kv.get_computed_blocks(req)            # hashes its blocks
            sched._note_computing(req, 0, computing)
        assert len(computing) == 10 and not any(computing.values()), order
