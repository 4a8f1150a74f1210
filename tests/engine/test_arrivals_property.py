"""Property test: random arrivals of every QoS class (with a pinned prefix, a small cache,
few seats and a small token budget) keep the engine's invariants after every step, and
every request finishes: nothing starves, nothing stalls."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvharbor import LLM, SamplingParams

from .conftest import install_announcer

CLASSES = ("premium", "standard", "batch")
ARRIVAL = st.tuples(st.integers(0, 12),                  # step at which it arrives
                    st.sampled_from(CLASSES), st.sampled_from(["a", "b", "c"]),
                    st.integers(1, 90),                  # prompt tokens
                    st.integers(1, 12),                  # max_tokens
                    st.booleans())                       # starts with the pinned prefix


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kv_blocks=40, pinned_kv_blocks=8, max_num_seqs=4,
               max_num_batched_tokens=64)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ARRIVAL, min_size=1, max_size=14))
def test_random_arrivals_keep_integrity_and_all_finish(llm, arrivals):
    e = llm.engine
    if not e.pinned_prefixes:
        e.pin_prefix(list(range(32)), qos="premium")          # 2 blocks held forever
    arrivals = sorted(arrivals, key=lambda a: a[0])
    want, done = {}, {}
    step, i = 0, 0
    while i < len(arrivals) or e.has_unfinished():
        while i < len(arrivals) and arrivals[i][0] <= step:
            _, qos, tenant, n, max_tokens, shared = arrivals[i]
            prompt = (list(range(32)) if shared else []) + [(i * 7 + j) % 250 for j in range(n)]
            rid = f"r{i}"
            e.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                      ignore_eos=True), tenant=tenant, qos=qos)
            want[rid] = max_tokens
            i += 1
        for out in e.step():
            if out.finished:
                done[out.request_id] = len(out.token_ids)
        e.check_integrity()
        step += 1
        assert step < 600, f"starved or stalled: unfinished {sorted(set(want) - set(done))}"
    assert done == want
    stats = e.stats()
    assert stats["blocks_used"] == 2 and stats["num_running"] == stats["num_waiting"] == 0


@pytest.fixture(scope="module")
def budgeted():
    from kvharbor.config import DEFAULT_QOS

    classes = {k: q.model_copy(update={"step_target_ms": 20.0 if k == "premium" else None})
               for k, q in DEFAULT_QOS.items()}
    return LLM(device="cpu", num_kv_blocks=40, pinned_kv_blocks=8, max_num_seqs=4,
               max_num_batched_tokens=64, qos_classes=classes)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ARRIVAL, min_size=1, max_size=14), st.lists(st.integers(0, 3), min_size=14, max_size=14))
def test_random_arrivals_with_step_cuts_keep_integrity_and_exact_tokens(budgeted, arrivals, layers):
    """As above, but each arrival is announced from inside the step before it (at a random
    layer), as the replica's event loop does, so premium arrivals cut lower-class steps short;
    every request still gets exactly the tokens it gets alone."""
    e = budgeted.engine
    if not e.pinned_prefixes:
        e.pin_prefix(list(range(32)), qos="premium")
    hook = install_announcer(e)
    arrivals = sorted(arrivals, key=lambda a: a[0])
    prompts, want, done = {}, {}, {}
    step, i = 0, 0
    while i < len(arrivals) or e.has_unfinished():
        hook.clear()                                    # before draining, as the replica does
        while i < len(arrivals) and arrivals[i][0] <= step:
            _, qos, tenant, n, max_tokens, shared = arrivals[i]
            rid = f"r{i}"
            prompts[rid] = (list(range(32)) if shared else []) + [(i * 7 + j) % 250 for j in range(n)]
            e.add_request(rid, prompts[rid], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                            ignore_eos=True), tenant=tenant, qos=qos)
            want[rid] = max_tokens
            i += 1
        hook.due = [(a[1], layers[k % len(layers)]) for k, a in enumerate(arrivals[i:], i)
                    if a[0] == step + 1]                 # next step's arrivals, announced now
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        e.check_integrity()
        step += 1
        assert step < 600, f"starved or stalled: unfinished {sorted(set(want) - set(done))}"
    assert {rid: len(t) for rid, t in done.items()} == want
    for rid, tokens in done.items():
        alone = budgeted.generate([prompts[rid]], SamplingParams(max_tokens=want[rid], temperature=0,
                                                                 ignore_eos=True))[0]
        assert alone.token_ids == tokens, f"{rid}: tokens differ from its run alone"
    stats = e.stats()
    assert stats["blocks_used"] == 2 and stats["num_running"] == stats["num_waiting"] == 0
