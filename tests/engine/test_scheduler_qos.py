"""Scheduler order: QoS priority, per-tenant fairness inside a class, preemption direction."""

from __future__ import annotations

import pytest

from kvharbor import LLM, SamplingParams

from .conftest import random_prompt as _p


@pytest.fixture
def llm():
    return LLM(device="cpu", num_kv_blocks=128, max_num_seqs=2)


def _admission_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished():
        for req in engine.scheduler.running:
            if req.request_id not in order:
                order.append(req.request_id)
        engine.step()
    return order


def test_higher_class_admitted_first(llm):
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    e = llm.engine
    for i in range(3):
        e.add_request(f"batch-{i}", _p(20, i), sp, qos="batch")
    e.add_request("premium", _p(20, 9), sp, qos="premium")
    e.add_request("standard", _p(20, 8), sp, qos="standard")
    order = _admission_order(e)
    assert order[:2] == ["premium", "standard"]


def test_fcfs_admits_in_arrival_order_whatever_the_class_or_tenant():
    """``scheduling="fcfs"`` (the benchmarks' baseline): classes and tenants do not count."""
    e = LLM(device="cpu", num_kv_blocks=128, max_num_seqs=2, scheduling="fcfs").engine
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    arrivals = [("batch-0", "batch", "a"), ("batch-1", "batch", "a"), ("standard", "standard", "b"),
                ("batch-2", "batch", "a"), ("premium", "premium", "c")]
    for i, (rid, qos, tenant) in enumerate(arrivals):
        e.add_request(rid, _p(20, i), sp, qos=qos, tenant=tenant)
    assert _admission_order(e) == [rid for rid, _, _ in arrivals]
    assert e.scheduler.num_preemptions == 0


def test_tenants_share_a_class_fairly(llm):
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    e = llm.engine
    for i in range(6):                          # tenant "heavy" queues first ...
        e.add_request(f"heavy-{i}", _p(40, i), sp, tenant="heavy", qos="standard")
    for i in range(2):                          # ... "light" arrives later
        e.add_request(f"light-{i}", _p(40, 50 + i), sp, tenant="light", qos="standard")
    order = _admission_order(e)
    # Without fairness light would wait for all 6 heavy requests; with it, it interleaves.
    assert order.index("light-0") <= 3
    assert order.index("light-1") <= 5


def test_preemption_hits_lower_class_never_higher():
    llm = LLM(device="cpu", num_kv_blocks=22, max_num_batched_tokens=512)
    e = llm.engine
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    e.add_request("batch", _p(150, 1), sp, qos="batch")
    e.add_request("premium", _p(150, 2), sp, qos="premium")
    victims = []
    while e.has_unfinished():
        plan_before = e.scheduler.num_preemptions
        e.step()
        if e.scheduler.num_preemptions > plan_before:
            victims += [r.request_id for r in e.scheduler.waiting if r.num_preemptions]
    assert victims and set(victims) == {"batch"}
    e.check_integrity()


@pytest.mark.parametrize("cap", [None, 64])
def test_premium_prefill_caps_lower_class_prefill_in_its_step(cap):
    """While a premium prompt prefills, batch prompts get <= the cap (decodes still run)."""
    llm = LLM(device="cpu", num_kv_blocks=256, max_num_batched_tokens=1024,
              low_priority_prefill_cap=cap)
    e = llm.engine
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    e.add_request("batch-decoding", _p(30, 0), sp, qos="batch")
    e.step()                                                 # prefilled: decodes from now on
    e.add_request("batch-long", _p(900, 1), sp, qos="batch")
    e.add_request("premium", _p(300, 2), sp, qos="premium")
    scheduled: dict[str, int] = {}
    e.scheduler.schedule = _recording(e.scheduler.schedule, scheduled)
    outs = e.step()
    assert scheduled["premium"] == 300 and "premium" in {o.request_id for o in outs}
    assert scheduled["batch-decoding"] == 1                      # lower-class decodes still run
    if cap is None:
        assert scheduled["batch-long"] == 1024 - 300 - 1         # the rest of the budget
    else:
        assert scheduled.get("batch-long", 0) <= cap
    finished = {}
    while e.has_unfinished():                                    # the cap lifts afterwards
        outs = e.step()
        finished.update({o.request_id: len(o.token_ids) for o in outs if o.finish_reason})
    assert finished == {"batch-decoding": 4, "batch-long": 4, "premium": 4}
    e.check_integrity()


def _recording(schedule, into: dict[str, int]):
    def wrapped():
        plan = schedule()
        if not into:
            into.update({s.request.request_id: s.num_new_tokens for s in plan.scheduled})
        return plan
    return wrapped


def test_the_cap_holds_briefly_after_premium_traffic_then_lifts():
    """A step planned in a gap between premium requests stays short; a batch-only flood
    (no premium for longer than the hold) gets the whole step budget back."""
    llm = LLM(device="cpu", num_kv_blocks=256, max_num_batched_tokens=1024,
              low_priority_prefill_cap=64)
    e = llm.engine
    now = [0.0]
    e.scheduler.clock = lambda: now[0]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    e.add_request("premium", _p(30, 3), sp, qos="premium")
    while e.has_unfinished():
        e.step()

    def first_step_tokens(rid: str, seed: int) -> int:
        e.add_request(rid, _p(900, seed), sp, qos="batch")
        scheduled: dict[str, int] = {}
        schedule = e.scheduler.schedule
        e.scheduler.schedule = _recording(schedule, scheduled)
        e.step()
        e.scheduler.schedule = schedule
        while e.has_unfinished():
            e.step()
        return scheduled[rid]

    now[0] = 1.0                                      # inside the 2 s hold: capped
    assert first_step_tokens("batch-in-gap", 4) == 64
    now[0] = 5.0                                      # premium gone for longer: full budget
    assert first_step_tokens("batch-alone", 5) == 900
    e.check_integrity()
