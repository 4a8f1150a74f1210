"""The pinned region: reserved for pinned QoS classes, never taken by others."""

from __future__ import annotations

import random

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor import LLM, SamplingParams
from kvharbor.engine.block_pool import PINNED
from kvharbor.engine.pinned_sizer import PinnedSizer


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _assert_no_standard_holds_pinned(llm: LLM) -> None:
    for req in llm.engine.scheduler.running:
        if req.qos != "premium":
            assert all(b.region != PINNED for b in req.blocks), f"{req.qos} request holds a pinned block"


def test_standard_flood_never_takes_pinned_blocks_and_premium_still_runs():
    llm = LLM(device="cpu", num_kv_blocks=64, pinned_kv_blocks=16, max_num_batched_tokens=512)
    engine = llm.engine
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(12):                      # 12 x 6 blocks > 48 shared blocks
        engine.add_request(f"std-{i}", _prompt(95, i), sp, tenant="flood", qos="standard")
    for _ in range(3):
        engine.step()
        _assert_no_standard_holds_pinned(llm)
    stats = llm.stats()
    assert stats["shared_blocks_free"] <= 2, "the flood should hold (almost) every shared block"
    assert stats["pinned_blocks_used"] == 0
    engine.add_request("premium-0", _prompt(100, 99), sp, tenant="vip", qos="premium")
    done = {}
    steps = 0
    while "premium-0" not in done:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        _assert_no_standard_holds_pinned(llm)
        engine.check_integrity()
        steps += 1
    # The premium request was admitted at once and ran alongside the flood.
    assert steps <= sp.max_tokens + 2
    assert len(done["premium-0"].token_ids) == sp.max_tokens
    while engine.has_unfinished():
        engine.step()
        _assert_no_standard_holds_pinned(llm)
    engine.check_integrity()
    assert llm.stats()["pinned_blocks_used"] == 0


def test_premium_borrows_shared_when_pinned_region_is_full():
    """A 13-block premium request with a 4-block pinned region takes all 4 pinned blocks first
    and borrows 9 shared ones; a standard request beside it takes no pinned block."""
    llm = LLM(device="cpu", num_kv_blocks=64, pinned_kv_blocks=4)
    engine = llm.engine
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("premium", _prompt(200, 1), sp, qos="premium")
    engine.add_request("standard", _prompt(40, 2), sp, qos="standard")
    engine.step()
    by_id = {r.request_id: r for r in engine.scheduler.running}
    regions = [b.region for b in by_id["premium"].blocks]
    assert regions.count(PINNED) == 4 and len(regions) == 13, regions
    assert llm.stats()["pinned_blocks_used"] == 4
    _assert_no_standard_holds_pinned(llm)
    while engine.has_unfinished():
        engine.step()
    llm.check_integrity()
    assert llm.stats()["pinned_blocks_used"] == 0


def test_pinned_prefix_survives_a_flood_that_evicts_everything_else():
    llm = LLM(device="cpu", num_kv_blocks=48, pinned_kv_blocks=16)
    system = _prompt(128, 7)
    assert llm.engine.pin_prefix(system, qos="premium") == 8
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([_prompt(300, s) for s in range(10, 20)], sp, qos="standard")   # churn
    out = llm.generate([system + _prompt(10, 3)], sp, qos="premium")[0]
    assert out.num_cached_tokens == 128
    assert llm.stats()["pinned_blocks_used"] >= 8
    llm.check_integrity()


def test_pinning_a_long_prefix_keeps_to_the_step_token_budget_and_answers_as_computed():
    """A replica pins tenants' prefixes between steps (a tenants.yaml reload): each forward of
    a 300-token prefix holds at most max_num_batched_tokens, as a step's would, and a request
    over the pinned prefix answers as one over the same prefix computed with it."""
    llm = LLM(device="cpu", num_kv_blocks=64, pinned_kv_blocks=24, max_num_batched_tokens=64)
    runner, sizes = llm.engine.runner, []
    forward = runner.forward_logits
    runner.forward_logits = lambda batch: sizes.append(sum(s.num_new_tokens for s in batch)) or forward(batch)
    system = _prompt(300, 5)
    assert llm.engine.pin_prefix(system, qos="premium") == 300 // 16
    assert sizes == [64, 64, 64, 64, 44]
    runner.forward_logits = forward
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = llm.generate([system + _prompt(20, 6)], sp, qos="premium")[0]
    cold = LLM(device="cpu", num_kv_blocks=64).generate([system + _prompt(20, 6)], sp)[0]
    assert out.num_cached_tokens == 288 and out.outputs[0].token_ids == cold.outputs[0].token_ids


def test_region_resizes_from_free_blocks():
    llm = LLM(device="cpu", num_kv_blocks=64, pinned_kv_blocks=8)
    pool = llm.engine.pool
    assert pool.resize_pinned(20) == 20
    assert llm.stats()["pinned_blocks_total"] == 20
    assert pool.resize_pinned(4) == 4
    pool.check_integrity()
    held = pool.allocate(7, pinned=True)                # 4 pinned + 3 borrowed shared
    assert pool.resize_pinned(8) == 8 and pool.free["pinned"].num_free == 4
    more = pool.allocate(3, pinned=True)
    assert pool.resize_pinned(2) == 7                   # every free pinned block goes, down to the last
    pool.release(held + more)
    assert pool.resize_pinned(2) == 2
    pool.check_integrity()


def test_pinned_prefix_survives_a_flood_of_other_premium_requests():
    """Premium requests compete for the pinned region among themselves (and overflow it into
    shared blocks); the pinned system prompt's blocks are never evicted by them."""
    llm = LLM(device="cpu", num_kv_blocks=64, pinned_kv_blocks=16, max_num_batched_tokens=512)
    system = _prompt(96, 7)
    assert llm.engine.pin_prefix(system, qos="premium") == 6
    pinned_ids = {b.block_id for b in llm.engine.pinned_prefixes[0]}
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    flood = [_prompt(150, s) for s in range(30, 42)]          # 12 x 10 blocks >> 10 free pinned
    outs = llm.generate(flood, sp, tenant="other-vip", qos="premium")
    assert all(len(o.token_ids) == 6 for o in outs)
    assert llm.stats()["evictions"] > 0, "the flood should have evicted cached blocks"
    llm.check_integrity()
    out = llm.generate([system + _prompt(20, 3)], sp, qos="premium")[0]
    assert out.num_cached_tokens == 96
    assert {b.block_id for b in llm.engine.pinned_prefixes[0]} == pinned_ids
    assert all(llm.engine.pool.blocks[i].region == PINNED for i in pinned_ids)


def test_sizer_targets_the_window_peak_with_headroom_and_shrinks_only_after_a_delay():
    sizer = PinnedSizer(floor=4, ceiling=100, window_s=10.0, headroom=1.25, shrink_after_s=5.0)
    sizer.observe(40, now=0.0)
    sizer.observe(8, now=0.5)
    assert sizer.target() == 50                       # ceil(peak 40 x 1.25)
    assert sizer.decide(4, now=1.0) == 50             # grows at once
    sizer.observe(0, now=11.0)                        # the peak left the window
    assert sizer.target() == 4
    assert sizer.decide(50, now=11.0) == 50           # below target: keeps its blocks ...
    assert sizer.decide(50, now=15.9) == 50
    assert sizer.decide(50, now=16.0) == 4            # ... until shrink_after_s have passed
    sizer.observe(1000, now=17.0)
    assert sizer.target() == 100                      # clamped to the ceiling


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12)), min_size=1, max_size=60),
       st.integers(1, 6))
def test_the_sizers_peak_is_the_largest_demand_inside_its_window(samples, window):
    """Against a recount after every sample: demands that rise and fall by one, repeat, or
    jump (the monotonic deque must drop every older sample not above the new one)."""
    sizer = PinnedSizer(floor=0, ceiling=1000, window_s=float(window))
    seen, now = [], 0.0
    for gap, demand in samples:
        now += gap
        sizer.observe(demand, now)
        seen.append((now, demand))
        assert sizer.peak == max(d for t, d in seen if t >= now - window)


def test_a_shrink_waits_its_full_delay_after_demand_came_back_in_between():
    """Demand dips, returns, dips again: the second dip waits ``shrink_after_s`` from its own
    start, not from the first dip's."""
    sizer = PinnedSizer(floor=4, ceiling=100, window_s=1.0, headroom=1.0, shrink_after_s=5.0)
    sizer.observe(40, now=0.0)
    sizer.observe(0, now=2.0)                         # first dip
    assert sizer.decide(40, now=2.0) == 40
    sizer.observe(40, now=3.0)                        # demand is back: the dip is over
    assert sizer.decide(40, now=3.0) == 40
    sizer.observe(0, now=6.5)                         # second dip
    assert sizer.decide(40, now=7.5) == 40            # 5.5 s after the first dip's start
    assert sizer.decide(40, now=12.4) == 40
    assert sizer.decide(40, now=12.5) == 4            # 5 s after this one's


def test_the_region_grows_only_into_free_blocks_that_running_shared_requests_can_spare():
    """A 25-block premium request pushes the region's target up (load sizing, ceiling 36 of
    40 blocks) while four standard requests are about to need a third block each: the
    region grows into the free shared blocks but leaves each running shared request one, so
    none of them is preempted for it. Growing into all of them cost two preemptions."""
    llm = LLM(device="cpu", num_kv_blocks=40, pinned_kv_blocks=4, pinned_kv_blocks_max=36)
    e = llm.engine
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    for i in range(4):
        e.add_request(f"standard-{i}", _prompt(31, i), sp(12), qos="standard")
    e.add_request("premium", _prompt(400, 9), sp(2), qos="premium")
    done, grown = {}, 0
    while e.has_unfinished():
        done.update({o.request_id: len(o.token_ids) for o in e.step() if o.finished})
        grown = max(grown, e.pool.num_pinned)
        e.check_integrity()
    assert grown >= 28                                  # the region did grow into shared blocks
    assert e.scheduler.num_preemptions == 0
    assert done == {**{f"standard-{i}": 12 for i in range(4)}, "premium": 2}


def test_a_shared_class_request_that_fits_only_while_the_region_is_small_is_refused():
    """With the region at 4 of 40 blocks but allowed to grow to 30 (load sizing), a standard
    request of 21 blocks fits today and not once premium demand grows the region: it is
    refused at once, with a message that says why; a premium request as long is accepted
    (it may use the region)."""
    llm = LLM(device="cpu", num_kv_blocks=40, pinned_kv_blocks=4, pinned_kv_blocks_max=30)
    e = llm.engine
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match=r"needs 21 KV blocks but only 10 exist for QoS class 'standard'.*"
                                         r"and the pinned region do not count"):
        e.add_request("standard", _prompt(320, 1), sp, qos="standard")
    e.add_request("premium", _prompt(320, 1), sp, qos="premium")
    while e.has_unfinished():
        e.step()
    llm.check_integrity()


def test_two_pinned_prefixes_that_share_blocks_count_each_block_once():
    """A second pinned prompt that starts with the first (a tenant's system prompt and a
    longer one built on it) pins the shared blocks again: they are held forever once, so
    capacity loses 12 blocks, not 8 + 12."""
    llm = LLM(device="cpu", num_kv_blocks=64, pinned_kv_blocks=16)
    e, system = llm.engine, _prompt(128, 7)
    assert e.pin_prefix(system, qos="premium") == 8
    assert e.pin_prefix(system + _prompt(64, 8), qos="premium") == 12
    assert e.pool.permanent == {PINNED: 12, "shared": 0}
    assert e.pool.capacity(True) == 64 - 12
    llm.check_integrity()
