"""Scheduler order: QoS priority, per-tenant fairness inside a class, preemption direction."""

from __future__ import annotations

import random

import pytest

from kvharbor import LLM, SamplingParams


def _p(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


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
