"""A premium arrival cuts a lower-class step in flight short instead of waiting for it, and the
cut step loses nothing: every request still gets exactly the tokens it gets uninterrupted."""

from __future__ import annotations

import pytest

from kvharbor import LLM, SamplingParams
from kvharbor.config import DEFAULT_QOS
from kvharbor.engine.step_budget import StepInterrupt, StepInterrupted

from .conftest import greedy as _sp
from .conftest import install_announcer
from .conftest import random_prompt as _p


def _engine(scheduling: str = "priority", budgeted: tuple[str, ...] = ("premium",),
            model_path: str = "auto"):
    classes = {k: q.model_copy(update={"step_target_ms": 20.0 if k in budgeted else None})
               for k, q in DEFAULT_QOS.items()}
    return LLM(device="cpu", num_kv_blocks=256, qos_classes=classes, scheduling=scheduling,
               max_num_batched_tokens=96, low_priority_prefill_cap=None, model_path=model_path).engine


def _run(engine, steps_before_premium: int, cut_at: int | None) -> dict[str, list[int]]:
    """Two batch requests sharing a 160-token prefix (prefilled in 96-token chunks), then a
    premium request; with ``cut_at`` its arrival is announced inside the step in flight."""
    hook = install_announcer(engine)
    shared = _p(160, 1)
    engine.add_request("b0", shared + _p(40, 2), _sp(12), tenant="x", qos="batch")
    engine.add_request("b1", shared + _p(30, 3), _sp(12), tenant="y", qos="batch")
    tokens: dict[str, list[int]] = {}
    for _ in range(steps_before_premium):
        for o in engine.step():
            tokens[o.request_id] = o.token_ids
        engine.check_integrity()
    before = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
    vtokens = dict(engine.scheduler.fair.vtokens)
    if cut_at is not None:
        hook.due = [("premium", cut_at)]
        assert engine.step() == [], "the cut step returned outputs"
        assert engine.interrupt.num_interrupted == 1
        assert engine.stats()["steps_interrupted"] == 1
        assert {r.request_id: r.num_computed_tokens for r in engine.scheduler.running} == before, \
            "the cut step advanced a request"
        assert engine.scheduler.fair.vtokens == vtokens, "the cut step was charged to its tenants"
        engine.check_integrity()
    engine.interrupt.clear()
    engine.add_request("p", _p(20, 4), _sp(6), tenant="acme", qos="premium")
    first = engine.step()
    assert "p" in {o.request_id for o in first}, "premium did not get its first token next step"
    for o in first:
        tokens[o.request_id] = o.token_ids
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] = o.token_ids
        engine.check_integrity()
    # A newcomer on the same prefix hits blocks the cut step wrote into: they must be whole.
    engine.add_request("b2", shared + _p(40, 2), _sp(12), tenant="z", qos="batch")
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] = o.token_ids
    return tokens


@pytest.mark.parametrize("model_path", ["kvharbor", "transformers"])
def test_a_premium_arrival_cuts_a_batch_prefill_step_and_every_token_stays_exact(model_path):
    engine = _engine(model_path=model_path)
    assert (engine.runner.fast is None) == (model_path == "transformers")
    want = _run(engine, steps_before_premium=1, cut_at=None)
    # kvharbor's own forward may also be cut before a layer's MLP (transformers' only at attention)
    points = (0, 2, (1, "mlp"), (2, "mlp")) if model_path == "kvharbor" else (0, 2)
    for at in points:
        got = _run(_engine(model_path=model_path), steps_before_premium=1, cut_at=at)
        assert got == want, f"cut at {at}: tokens differ from the uncut run"
    assert want["b0"] == want["b2"]


def test_a_premium_arrival_cuts_a_decode_step_and_every_token_stays_exact():
    want = _run(_engine(), steps_before_premium=5, cut_at=None)
    for at in (1, (2, "mlp")):
        assert _run(_engine(), steps_before_premium=5, cut_at=at) == want, f"cut at {at}"


def _one_step_with_announcement(engine, qos: str) -> int:
    install_announcer(engine).due = [(qos, 1)]
    engine.step()
    return engine.interrupt.num_interrupted


def test_no_cut_for_a_peer_prefill_a_lower_class_or_fcfs():
    e = _engine()
    e.add_request("p0", _p(60, 5), _sp(4), qos="premium")
    e.add_request("b0", _p(60, 6), _sp(4), qos="batch")
    assert _one_step_with_announcement(e, "premium") == 0, "cut a step computing a premium prompt"

    e = _engine()
    e.add_request("p0", _p(20, 5), _sp(8), qos="premium")
    e.step()                                         # its prompt: the step after only decodes
    assert _one_step_with_announcement(e, "premium") == 0, "cut a step of premium decodes only"

    e = _engine(budgeted=("premium", "standard"))
    e.add_request("b0", _p(60, 6), _sp(4), qos="batch")
    assert _one_step_with_announcement(e, "standard") == 0, \
        "a class below the top latency-budgeted one cut a step"
    assert _one_step_with_announcement(e, "premium") == 1

    e = _engine(scheduling="fcfs")
    e.add_request("b0", _p(60, 6), _sp(4), qos="batch")
    assert _one_step_with_announcement(e, "premium") == 0, "FCFS has no classes to cut for"

    e = _engine(budgeted=())
    e.add_request("b0", _p(60, 6), _sp(4), qos="batch")
    assert _one_step_with_announcement(e, "premium") == 0, "a class without a step target cut a step"


@pytest.mark.parametrize(("at", "cuts"), [((2, "mlp"), True), (3, False), ((3, "mlp"), False)])
def test_a_cut_comes_only_in_the_first_three_quarters_of_the_half_layers(at, cuts):
    """Cut points come before each layer's attention and before its MLP; a step is cut only
    before the first 6 of the builtin model's 8 half-layers (the last at the third layer's
    MLP: an arrival there used to wait for half the step)."""
    e = _engine()
    assert e.runner.num_layers == 4 and e.interrupt.cutoff == 6
    e.add_request("b0", _p(60, 6), _sp(4), qos="batch")
    install_announcer(e).due = [("premium", at)]
    e.step()
    assert e.interrupt.num_interrupted == int(cuts), \
        f"announced at {at}: {'not cut' if cuts else 'cut in its last quarter'}"


def test_an_attention_check_is_the_first_half_of_its_layer_on_an_odd_cutoff():
    """A model of 5 layers has 10 half-layers and cuts before the first 7: before layer 3's
    attention (half-layer 6) a step may still be cut, before its MLP (7) no longer."""
    cut = StepInterrupt(num_layers=5)
    cut.interruptible = frozenset({2})
    cut.protected = 0                        # a step of priority-0 work is armed
    cut.announce(2)                          # a priority-2 request arrived
    assert cut.cutoff == 7
    cut.check(3, before_mlp=True)            # too late: nothing raised
    with pytest.raises(StepInterrupted):
        cut.check(3)
    assert cut.num_interrupted == 1


def test_a_spent_step_budget_stops_the_walk_over_a_lower_class_backlog():
    """Scheduling cost under a flood: once the premium step budget is spent, the scheduler
    stops instead of looking up the prefix of every waiting lower-class request."""
    e = _engine()
    e.scheduler.cost.coef = [0.002, 0.001, 0.001]            # 1 ms per token: budget is tight
    e.scheduler._learn_step_cost = lambda now: None
    for i in range(200):
        e.add_request(f"b{i}", _p(30, 100 + i), _sp(2), qos="batch")
    e.add_request("p", _p(20, 4), _sp(2), qos="premium")
    lookups = 0
    lookup = e.kv.get_computed_blocks

    def counting(req):
        nonlocal lookups
        lookups += 1
        return lookup(req)
    e.kv.get_computed_blocks = counting
    e.step()
    assert lookups <= 3, f"{lookups} prefix lookups for one step over a 200-request backlog"


def test_a_cut_prefill_step_leaves_the_prompt_logprobs_as_uninterrupted():
    """The cut step had planned prompt-logprob rows for the request's chunk; they are not
    scored on top of the next step's own: each prompt token is scored once, as without a cut."""
    def prompt_logprobs(cut: bool) -> list:
        e = _engine()
        hook = install_announcer(e)
        e.add_request("b", _p(200, 5), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                      prompt_logprobs=1), qos="batch")
        e.step()                                      # the first 96-token chunk
        if cut:
            hook.due = [("premium", 1)]
            assert e.step() == [] and e.interrupt.num_interrupted == 1
            e.interrupt.clear()
        outs = [o for _ in range(10) for o in e.step() if o.finished]
        return [(lp.logprob, *lp.top[0]) for lp in outs[0].prompt_logprobs[1:]]

    whole, cut = prompt_logprobs(cut=False), prompt_logprobs(cut=True)
    assert len(whole) == len(cut) == 199
    assert [c[1] for c in cut] == [w[1] for w in whole]
    # Each engine measures its own GEMM paths at start: logprobs 1e-6 apart, not equal.
    assert [x for c in cut for x in c] == pytest.approx([x for w in whole for x in w], abs=1e-4)
