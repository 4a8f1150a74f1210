"""Latency-budgeted steps: while premium is about, lower classes' work is trimmed so the
step's estimated duration stays under the premium step target; premium is never trimmed.
The cost model is learned online from measured steps."""

from __future__ import annotations

import random

import pytest

from kvharbor import LLM

from .conftest import random_prompt as _p
from .conftest import greedy as _sp
from kvharbor.config import DEFAULT_QOS
from kvharbor.engine.step_budget import (MIN_PROGRESS_TOKENS, PRIOR, StepBudget, StepCostModel,
                                         _solve3)


def _llm(target_ms: float | None) -> LLM:
    classes = dict(DEFAULT_QOS)
    classes["premium"] = classes["premium"].model_copy(update={"step_target_ms": target_ms})
    return LLM(device="cpu", num_kv_blocks=512, qos_classes=classes, low_priority_prefill_cap=None)


def _plan(engine) -> dict[str, int]:
    """The next step's plan, request id -> tokens (then run that step)."""
    seen = {}
    schedule = engine.scheduler.schedule

    def spy():
        plan = schedule()
        seen.update({s.request.request_id: s.num_new_tokens for s in plan.scheduled})
        return plan
    engine.scheduler.schedule = spy
    engine.step()
    engine.scheduler.schedule = schedule
    return seen


def _batch_decoding_then_premium(target_ms: float, llm: LLM | None = None, qos: str = "premium"):
    """An engine with a frozen cost model (2 ms + 0.1 ms/token + 1 ms/seq), 8 batch requests
    decoding, and a 30-token premium request (of class ``qos``) just added."""
    e = (llm or _llm(target_ms=target_ms)).engine
    e.scheduler.cost.coef = [0.002, 0.0001, 0.001]
    e.scheduler._learn_step_cost = lambda now: None          # frozen for the test
    for i in range(8):
        e.add_request(f"batch-{i}", _p(20, i), _sp(20), qos="batch")
    while e.scheduler.waiting:
        e.step()
    e.add_request("premium", _p(30, 99), _sp(4), qos=qos)
    return e


def test_lower_class_work_is_trimmed_to_the_premium_step_target():
    e = _batch_decoding_then_premium(target_ms=10.0)
    plan = _plan(e)
    assert plan["premium"] == 30                             # never trimmed
    est = e.scheduler.cost.estimate(sum(plan.values()), len(plan))
    assert est <= 0.010 + 1e-9, f"planned step estimated at {est * 1000:.1f} ms > 10 ms target"
    assert len(plan) < 9, "no lower-class decode was deferred"
    assert e.scheduler.num_trimmed > 0
    done = {}
    while e.has_unfinished():
        done.update({o.request_id: len(o.token_ids) for o in e.step() if o.finished})
    assert done == {"premium": 4, **{f"batch-{i}": 20 for i in range(8)}}
    e.check_integrity()


def test_classes_of_one_priority_are_held_to_the_tightest_of_their_step_targets():
    """A second top class ("gold", same priority, 100 ms target) does not loosen premium's
    10 ms: lower classes' decodes are trimmed to 10 ms whichever of the two is about."""
    for qos in ("premium", "gold"):
        classes = dict(DEFAULT_QOS)
        classes["premium"] = classes["premium"].model_copy(update={"step_target_ms": 10.0})
        classes["gold"] = classes["premium"].model_copy(update={"step_target_ms": 100.0})
        llm = LLM(device="cpu", num_kv_blocks=512, qos_classes=classes, low_priority_prefill_cap=None)
        e = _batch_decoding_then_premium(10.0, llm, qos=qos)
        assert _plan(e)["premium"] == 30
        decode = _plan(e)                    # premium decodes: 8 batch decodes would be 11.9 ms
        assert decode["premium"] == 1 and len(decode) < 9, (qos, decode)
        assert e.scheduler.cost.estimate(sum(decode.values()), len(decode)) <= 0.010 + 1e-9, qos


def test_without_a_target_every_decode_runs():
    llm = _llm(target_ms=None)
    e = llm.engine
    for i in range(8):
        e.add_request(f"batch-{i}", _p(20, i), _sp(20), qos="batch")
    while e.scheduler.waiting:
        e.step()
    e.add_request("premium", _p(30, 99), _sp(4), qos="premium")
    assert len(_plan(e)) == 9


def test_cost_model_learns_a_linear_step_cost():
    model = StepCostModel()
    rng = random.Random(0)
    for _ in range(300):
        tokens, seqs = rng.randrange(1, 2048), rng.randrange(1, 128)
        model.observe(tokens, seqs, 0.003 + 0.00002 * tokens + 0.0004 * seqs)
    for tokens, seqs in ((1, 1), (512, 8), (2048, 128)):
        true = 0.003 + 0.00002 * tokens + 0.0004 * seqs
        assert abs(model.estimate(tokens, seqs) - true) <= 0.1 * true, (tokens, seqs)


def test_lower_classes_progress_even_when_one_step_costs_more_than_the_target():
    """A slow machine (per-step overhead 50 ms > the 10 ms target): every step still gives a
    lower class some work, so a stream of premium requests cannot starve it."""
    llm = _llm(target_ms=10.0)
    e = llm.engine
    e.scheduler.cost.coef = [0.050, 0.0001, 0.001]
    e.scheduler._learn_step_cost = lambda now: None
    e.add_request("batch", _p(100, 1), _sp(6), qos="batch")
    steps, seed = 0, 100
    while "batch" in e.requests:
        if not any(r.qos == "premium" for r in e.scheduler.running + e.scheduler.waiting):
            e.add_request(f"premium-{seed}", _p(80, seed), _sp(3), qos="premium")
            seed += 1
        plan = _plan(e)
        assert any(rid.startswith("batch") for rid in plan) or "batch" not in e.requests
        steps += 1
        assert steps < 40, "the batch request starved behind premium traffic"
    e.check_integrity()


def test_a_premium_first_token_step_runs_with_only_the_minimum_lower_share():
    """The step that computes a premium prompt is its time to first token: lower classes get
    only their minimum share there, however much of the target is left; once the premium
    request decodes, lower classes fill the target again."""
    e = _batch_decoding_then_premium(target_ms=50.0)         # 8 batch decodes: ~9 ms of 48 ms
    first = _plan(e)
    assert first["premium"] == 30 and len(first) == 2, first     # premium + one lower item
    second = _plan(e)
    assert second["premium"] == 1 and len(second) == 9, second   # premium decode: all fit
    e.check_integrity()


def _budget(a: float, b: float, target_s: float) -> StepBudget:
    model = StepCostModel()
    model.coef = [a, b, 0.0]
    return StepBudget(model, target_s)


def test_a_step_overhead_above_half_the_target_still_leaves_half_of_it_to_lower_classes():
    """0.1 ms per token, 25 ms target: with 5 ms of overhead 200 tokens fit; with 20 ms of
    overhead (a slow, contended machine) half the target stays variable, 125 tokens, not 50."""
    assert 199 <= _budget(0.005, 1e-4, 0.025).room(1000) <= 200        # float rounding
    assert 124 <= _budget(0.020, 1e-4, 0.025).room(1000) <= 125


def test_a_lower_class_prefill_does_not_shrink_the_rest_of_the_step_to_the_minimum():
    """Only a top-class prefill (its first token is this step) limits lower classes to the
    minimum share; a trimmed prefill of 100 tokens leaves the rest of the variable room."""
    budget = _budget(0.005, 1e-4, 0.025)
    budget.add(100, trimmed=True, prefill=True)
    assert 99 <= budget.room(1000) <= 100                # (20 ms - 10 ms) / 0.1 ms
    budget.add(1, trimmed=False, prefill=True)
    assert budget.room(1000) == 0


def test_the_first_trimmed_item_of_a_step_gets_the_minimum_share_and_the_next_none():
    """Overhead 5x the 10 ms target and a premium first token in the step: no room is left,
    yet the first lower-class item still gets MIN_PROGRESS_TOKENS (a decode or a prefill chunk
    of that size), and the items after it nothing."""
    budget = _budget(0.050, 1e-4, 0.010)
    budget.add(30, trimmed=False, prefill=True)
    assert MIN_PROGRESS_TOKENS == 16
    assert budget.room(1000) == 16 and budget.room(5) == 5
    budget.add(16, trimmed=True, prefill=True)
    assert budget.room(1000) == 0


def test_the_room_of_one_more_request_pays_its_own_sequence_cost():
    """0.5 s per token, 2 s per sequence, 10 s target, no overhead: after a premium decode and
    one lower-class decode (2 tokens, 2 sequences), a third sequence costs 2 s itself, so
    10 - 1 - 6 = 3 s are left: 6 tokens."""
    model = StepCostModel()
    model.coef = [0.0, 0.5, 2.0]
    budget = StepBudget(model, 10.0)
    budget.add(1, trimmed=False)
    budget.add(1, trimmed=True)
    assert budget.room(100) == 6


def test_the_cost_models_solver_is_exact_also_where_it_must_swap_rows():
    """The 3x3 solve behind the fit: exact on a system whose first pivot is zero (it must
    swap rows) and on a dense one; a singular system leaves the prior."""
    want = [0.5, -2.0, 3.0]
    for m in ([[0.0, 2.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 4.0]],
              [[4.0, 1.0, 2.0], [1.0, 5.0, 1.0], [2.0, 1.0, 6.0]]):
        v = [sum(m[i][j] * want[j] for j in range(3)) for i in range(3)]
        assert _solve3(m, v) == pytest.approx(want, abs=1e-12)
    assert _solve3([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 0.0, 0.0]], [1.0, 2.0, 0.0]) == list(PRIOR)


def test_steps_that_cost_what_the_prior_says_leave_the_prior_unchanged():
    """The fit is pulled toward the prior, not elsewhere: a few measured steps that cost
    exactly what the prior predicts leave its coefficients as they were."""
    model = StepCostModel()
    for tokens, seqs in ((1, 1), (300, 4), (2048, 64)):
        model.observe(tokens, seqs, PRIOR[0] + PRIOR[1] * tokens + PRIOR[2] * seqs)
    assert model.coef == pytest.approx(list(PRIOR), rel=1e-9)


def test_a_step_whose_tokens_cost_nothing_has_room_for_any_number_of_them():
    """A learned token cost of 0 (the fit clamps a negative one there): the room is bounded
    by sequences only, so every token of the next request fits while a sequence does."""
    model = StepCostModel()
    model.coef = [0.001, 0.0, 0.002]
    budget = StepBudget(model, 0.010)
    budget.add(1, trimmed=False)
    assert budget.room(5000) == 5000


def test_the_learned_cost_model_never_has_a_negative_coefficient():
    """Steps that got faster with more sequences (noise, a warming cache) must not teach a
    negative cost per sequence: a large batch would then look free."""
    model = StepCostModel(ridge=1e-6)
    for seqs in range(1, 40):
        model.observe(tokens=100, seqs=seqs, seconds=0.05 - 0.001 * seqs)
    assert all(c >= 0.0 for c in model.coef), model.coef
    assert model.estimate(100, 1000) > 0.0


def test_an_idle_gap_between_steps_is_not_a_step_cost_sample():
    """The cost model learns a step's duration from the time to the next schedule when the
    engine steps back to back; a gap longer than a second is the engine idling (no request,
    or the replica waiting for arrivals), and counting it would make every later step look
    seconds long and trim lower classes to nothing."""
    e = _llm(target_ms=None).engine
    now = [0.0]
    e.scheduler.clock = lambda: now[0]
    e.add_request("a", _p(20, 1), _sp(8))
    e.step()
    now[0] += 0.01
    e.step()                                          # back to back: the first step is a sample
    samples = e.scheduler.cost.samples
    assert samples >= 1
    now[0] += 5.0                                     # idle
    e.step()
    assert e.scheduler.cost.samples == samples
    now[0] += 0.01
    e.step()
    assert e.scheduler.cost.samples == samples + 1


def test_a_classs_ttft_slo_budgets_its_steps_at_half_unless_step_target_ms_says_otherwise():
    """tenants.yaml's ``ttft_slo_ms`` of a class keeps steps under half of it while the class
    is about (a request waits at most about one step, then runs its own); ``step_target_ms``
    replaces that target, also when it is looser."""
    for fields, want_s in [({"ttft_slo_ms": 80.0}, 0.040), ({"ttft_slo_ms": 80.0, "step_target_ms": 5.0}, 0.005),
                           ({"ttft_slo_ms": 80.0, "step_target_ms": 60.0}, 0.060)]:
        classes = dict(DEFAULT_QOS)
        classes["premium"] = classes["premium"].model_copy(update=fields)
        llm = LLM(device="cpu", num_kv_blocks=64, qos_classes=classes)
        assert llm.engine.scheduler.step_target_s == {DEFAULT_QOS["premium"].priority: want_s}, fields


@pytest.mark.parametrize("settle", ["untimed", "abandon"])
def test_a_step_run_ahead_or_abandoned_is_no_step_cost_sample(settle):
    """``untimed`` (the step runs ahead of the next, ``async_scheduling``) and ``abandon``
    (a premium arrival cut it short) both mean the time to the next ``schedule`` is not the
    step's duration: it is not learned, and the step after is again. ``abandon`` also
    refunds the step's fairness charge: a cut step costs its tenant nothing."""
    e = _llm(target_ms=None).engine
    sched = e.scheduler
    now = [0.0]
    sched.clock = lambda: now[0]
    e.add_request("a", _p(20, 1), _sp(8))
    req = sched.waiting[0]
    plan = sched.schedule()
    assert sched.fair.key(req) == 20
    if settle == "abandon":
        sched.abandon(plan)
    else:
        sched.untimed()
    assert sched.fair.key(req) == (0 if settle == "abandon" else 20)
    now[0] += 0.01
    sched.schedule()                                 # plans the same 20 tokens again
    assert sched.cost.samples == 0
    now[0] += 0.01
    sched.schedule()
    assert sched.cost.samples == 1
