"""Decode steps run ahead (``async_scheduling``) give the same outputs as steps that wait.

With ``async_scheduling`` the engine launches the next decode step before it reads the tokens
of the one in flight (its input ids gathered from them on the device), and collects those
while the next step computes. On a CPU nothing is captured (``DecodeGraphs(capture=False)``)
and nothing overlaps, but the bookkeeping is the same: a request that stops at a collected
token had one more token computed that must be dropped (never streamed, never cached), new
arrivals, aborts, logprobs and a full pool must fall back to steps that wait. Each test runs
one workload both ways and compares every streamed delta, final output, cached block and the
pool's invariants.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvharbor import LLM, SamplingParams
from kvharbor.engine.decode_graphs import DecodeGraphs


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def device(request) -> str:
    """Every test on the CPU (graphs not captured) and, where there is one, on a GPU: the
    engine's own captured graphs, float32, where a step launched ahead really overlaps."""
    return request.param


def make_llm(model: str, run_ahead: bool, device: str = "cpu", **kw) -> LLM:
    if device == "cuda":
        llm = LLM(model=model, device="cuda", dtype="float32", **kw)
        assert llm.engine.runner.graphs is not None and llm.engine.async_scheduling
    else:
        llm = LLM(model=model, device="cpu", **kw)
        runner = llm.engine.runner
        runner.graphs = DecodeGraphs(runner, llm.engine.config.max_num_seqs,
                                     llm.engine.max_model_len, capture=False)
    llm.engine.async_scheduling = run_ahead
    return llm


def drive(llm: LLM, arrivals: dict[int, list], aborts: dict[int, list[str]] | None = None,
          check_every_step: bool = True) -> dict:
    """Step until done; ``arrivals[k]``: ``(id, prompt, sampling)`` added before step ``k``,
    ``aborts[k]``: ids aborted before step ``k``. Returns per request the concatenated
    streamed ids and text, the final output, and the step's cached blocks at the end."""
    engine = llm.engine
    streamed: dict[str, list] = {}
    text: dict[str, str] = {}
    final: dict[str, tuple] = {}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for rid, prompt, sp in arrivals.get(step, []):
            engine.add_request(rid, prompt, sp)
        for rid in (aborts or {}).get(step, []):
            engine.abort(rid)
        for out in engine.step():
            assert out.request_id not in final, f"{out.request_id} streamed after it finished"
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            text[out.request_id] = text.get(out.request_id, "") + out.new_text
            if out.finish_reason is not None:
                final[out.request_id] = (list(out.token_ids), out.text, out.finish_reason)
        if check_every_step:
            llm.check_integrity()
        step += 1
        assert step < 2000, "the engine did not finish"
    return dict(streamed=streamed, text=text, final=final,
                cached=engine.cached_block_hashes(), steps_ahead=engine.steps_ahead)


def prompts(seed: int, n: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def same_both_ways(model: str, device: str, arrivals, aborts=None, **kw) -> tuple[dict, dict]:
    """Run both ways; the same outputs. A request aborted at step ``k`` had one token in
    flight when run ahead: its stream may be the waiting run's less that one token."""
    ahead = drive(make_llm(model, True, device, **kw), arrivals, aborts)
    wait = drive(make_llm(model, False, device, **kw), arrivals, aborts)
    assert wait["steps_ahead"] == 0
    assert ahead["final"] == wait["final"]
    aborted = {rid for ids in (aborts or {}).values() for rid in ids}
    for rid, ids in wait["streamed"].items():
        got = ahead["streamed"].get(rid, [])
        if rid in aborted:
            assert got == ids[:len(got)] and len(got) >= len(ids) - 1, rid
        else:
            assert got == ids, rid
            assert ahead["text"][rid] == wait["text"][rid], rid
    assert ahead["cached"] == wait["cached"]
    for rid, (ids, text, _) in ahead["final"].items():      # nothing extra was streamed
        assert ahead["streamed"].get(rid, []) == ids[len(ids) - len(ahead["streamed"].get(rid, [])):]
    return ahead, wait


@pytest.mark.parametrize("model", ["kvharbor/tiny-llama", "kvharbor/tiny-mistral"])
def test_stops_at_tokens_strings_and_lengths_match_steps_that_wait(model, device):
    """Requests stop at a stop token, a stop string, EOS or their length at different steps
    while the rest decode ahead; the stopped ones' extra computed token never shows."""
    ps = prompts(1, 10)
    arrivals = {0: []}
    probe = make_llm(model, False, device, num_kv_blocks=512)
    greedy = probe.generate(ps, SamplingParams(max_tokens=24, temperature=0.0))
    for i, (p, out) in enumerate(zip(ps, greedy)):
        ids = out.token_ids
        if i % 3 == 0 and len(ids) > 6:          # stop at a token it produces mid-way
            sp = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[ids[4 + i % 5]])
        elif i % 3 == 1 and len(out.text) > 8:   # stop at a string it produces mid-way
            sp = SamplingParams(max_tokens=24, temperature=0.0, stop=[out.text[5:8]])
        else:
            sp = SamplingParams(max_tokens=4 + 2 * i, temperature=0.0)
        arrivals[0].append((f"r{i}", p, sp))
    ahead, _ = same_both_ways(model, device, arrivals, num_kv_blocks=512)
    reasons = {r for _, _, r in ahead["final"].values()}
    assert "stop" in reasons and "length" in reasons
    assert ahead["steps_ahead"] >= 10


def test_arrivals_and_aborts_mid_decode_match_steps_that_wait(device):
    """Arrivals make the engine collect and schedule normally (prefills join), aborts drop a
    request whose token is in flight; afterwards decoding runs ahead again."""
    ps = prompts(2, 12)
    sp = [SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True) for i in range(12)]
    arrivals = {0: [(f"r{i}", ps[i], sp[i]) for i in range(4)],
                6: [(f"r{i}", ps[i], sp[i]) for i in range(4, 8)],
                13: [(f"r{i}", ps[i], sp[i]) for i in range(8, 12)]}
    aborts = {9: ["r1", "r5"], 16: ["r9"]}
    ahead, _ = same_both_ways("kvharbor/tiny-llama", device, arrivals, aborts, num_kv_blocks=512)
    assert ahead["steps_ahead"] >= 10
    assert {"r1", "r5", "r9"}.isdisjoint(ahead["final"])


def test_a_full_pool_falls_back_to_scheduling_with_preemption(device):
    """Too few blocks for every request to grow: a step that cannot get its next block is
    not run ahead; the scheduler preempts as it would, and the outputs are the same."""
    ps = prompts(3, 8, 20, 40)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"r{i}", p, sp) for i, p in enumerate(ps)]}
    kw = dict(num_kv_blocks=24, block_size=8)
    ahead, _ = same_both_ways("kvharbor/tiny-llama", device, arrivals, **kw)
    assert ahead["steps_ahead"] > 0
    llm = make_llm("kvharbor/tiny-llama", True, device, **kw)
    drive(llm, arrivals)
    assert llm.engine.scheduler.num_preemptions > 0


def test_seeded_sampling_matches_steps_that_wait(device):
    """Sampled rows draw on the device from each request's own generator, once per step."""
    ps = prompts(4, 6)
    arrivals = {0: [(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9,
                                                 top_k=40, seed=100 + i))
                    for i, p in enumerate(ps)]}
    ahead, _ = same_both_ways("kvharbor/tiny-llama", device, arrivals, num_kv_blocks=512)
    assert ahead["steps_ahead"] >= 5


def test_logprobs_are_not_run_ahead(device):
    """Logprobs need the step's logits, which the next replay overwrites."""
    ps = prompts(5, 4)
    llm = make_llm("kvharbor/tiny-llama", True, device, num_kv_blocks=512)
    for i, p in enumerate(ps):
        llm.engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.0,
                                                          ignore_eos=True, logprobs=2 if i == 0 else None))
    outs = {}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_logprobs or [])
    assert llm.engine.steps_ahead == 0 and len(outs["r0"]) == 8


def test_penalties_and_min_tokens_wait_for_the_token_in_flight(device):
    """A penalty, and ``min_tokens`` until it is reached, read the tokens generated so far: a
    step launched before the token in flight is read would miss it. Such requests decode in
    steps that wait (once ``min_tokens`` is behind a request it may run ahead again), and give
    what they give when every step waits."""
    ps = prompts(9, 6)
    probe = make_llm("kvharbor/tiny-llama", False, device, num_kv_blocks=512)
    first = [o.token_ids[0] for o in probe.generate(ps, SamplingParams(max_tokens=1, temperature=0.0))]
    kinds = [dict(frequency_penalty=1.2), dict(presence_penalty=0.8), dict(repetition_penalty=1.6),
             dict(frequency_penalty=-1.0, repetition_penalty=0.8)]
    penalized = {0: [(f"r{i}", p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **kinds[i % 4]))
                     for i, p in enumerate(ps)]}
    ahead, _ = same_both_ways("kvharbor/tiny-llama", device, penalized, num_kv_blocks=512)
    assert ahead["steps_ahead"] == 0
    held = {0: [(f"r{i}", p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, min_tokens=8,
                                             stop_token_ids=[first[i]]))
                for i, p in enumerate(ps)]}
    ahead, _ = same_both_ways("kvharbor/tiny-llama", device, held, num_kv_blocks=512)
    assert all(first[i] not in ids[:8] for i, (ids, _, _) in enumerate(
        ahead["final"][f"r{i}"] for i in range(len(ps))))
    assert 0 < ahead["steps_ahead"] <= 16 - 8


def test_logit_bias_and_min_p_run_ahead(device):
    """Neither depends on the tokens so far: they decode ahead and match steps that wait."""
    ps = prompts(10, 4)
    arrivals = {0: [(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.9, seed=i, min_p=0.2,
                                                 logit_bias={40 + i: 4.0, 7: -100.0}, ignore_eos=True))
                    for i, p in enumerate(ps)]}
    ahead, _ = same_both_ways("kvharbor/tiny-llama", device, arrivals, num_kv_blocks=512)
    assert ahead["steps_ahead"] >= 8


@pytest.mark.parametrize("target_s", [None, 1e-9], ids=["no-step-target", "step-target-trims"])
def test_two_classes_decode_ahead_together_and_match_steps_that_wait(device, target_s):
    """Premium and standard requests decoding together run ahead when the premium step
    budget would leave every decode in (no target); with a target that trims, the
    scheduler trims as it does when steps wait. Outputs equal steps that wait either way.
    (Which steps may run ahead under a budget: ``trims_decodes``, tested below.)"""
    ps = prompts(8, 4)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    results = []
    for ahead in (True, False):
        llm = make_llm("kvharbor/tiny-llama", ahead, device, num_kv_blocks=512)
        engine, sched = llm.engine, llm.engine.scheduler
        top = engine.config.qos_classes["premium"].priority
        sched.step_target_s = {} if target_s is None else {top: target_s}
        mixed_ahead = []
        launch = engine.runner.launch

        def spy(batch, ahead=0, prev=None, launch=launch, mixed_ahead=mixed_ahead):
            if ahead:
                mixed_ahead.append(len({item.request.qos for item in batch}) > 1)
            return launch(batch, ahead, prev)

        engine.runner.launch = spy
        for i, p in enumerate(ps):
            engine.add_request(f"r{i}", p, sp, qos="premium" if i == 0 else "standard")
        final = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out.token_ids
        results.append((final, any(mixed_ahead), sched.num_trimmed))
    (ahead_out, mixed, trimmed), (wait_out, _, wait_trimmed) = results
    assert ahead_out == wait_out and len(ahead_out) == 4
    if target_s is None:
        assert mixed and trimmed == 0
    else:
        assert trimmed > 0 and wait_trimmed > 0


def test_the_engines_trim_check_agrees_with_the_scheduler():
    """``trims_decodes`` (asked before a step runs ahead) is True exactly when ``schedule``
    leaves out a running decode, over step targets and class mixes."""
    outcomes = set()
    for n_std in (1, 3, 6):
        for target in (1e-9, 1e-3, 3e-3, 5e-3, 2e-2, 1.0):
            llm = make_llm("kvharbor/tiny-llama", False, "cpu", num_kv_blocks=512)
            engine, sched = llm.engine, llm.engine.scheduler
            for i, p in enumerate(prompts(9, n_std + 1)):
                engine.add_request(f"r{i}", p, SamplingParams(max_tokens=20, temperature=0.0),
                                   qos="premium" if i == 0 else "standard")
            engine.step()                                  # every prompt prefilled
            engine.step()
            sched.step_target_s = {engine.config.qos_classes["premium"].priority: target}
            # The next schedule() would first learn the last step's duration (the time since
            # it, spent here) into the cost model: both sides judge with the same model.
            sched.untimed()
            running = list(sched.running)
            assert len(running) == n_std + 1
            predicted = sched.trims_decodes(running)
            plan = sched.schedule()
            assert predicted == (len(plan.scheduled) < len(running)), (n_std, target)
            outcomes.add(predicted)
    assert outcomes == {True, False}                      # both cases occurred


def test_the_next_step_is_launched_before_the_tokens_in_flight_are_read(monkeypatch, device):
    """The overlap itself: in a steady decode, each step launches the next decode step and
    only then reads the tokens of the one before (on a GPU the read waits for that step, and
    the host's work on them runs while the next one computes)."""
    from kvharbor.engine.decode_graphs import Launched

    llm = make_llm("kvharbor/tiny-llama", True, device, num_kv_blocks=512)
    engine, runner = llm.engine, llm.engine.runner
    for i, p in enumerate(prompts(6, 4)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    order = []
    launch, read = runner.launch, Launched.tokens_on_host

    def spy_launch(batch, ahead=0, prev=None):
        order.append(("launch", ahead))
        return launch(batch, ahead, prev)

    def spy_read(self):
        order.append(("read",))
        return read(self)

    runner.launch = spy_launch
    monkeypatch.setattr(Launched, "tokens_on_host", spy_read)
    while engine.has_unfinished():
        engine.step()
    assert order[:2] == [("launch", 0), ("launch", 1)]
    assert order[2:14] == [("read",), ("launch", 1)] * 6
    assert order[-1] == ("read",) and engine.steps_ahead == order.count(("launch", 1))
