"""Penalties, logit_bias, min_tokens and min_p: the sampling parameters vLLM and OpenAI's API
take, which change a request's logits before its token is picked.

The greedy tokens are checked against transformers' own ``generate`` with the matching logits
processors (its repetition penalty, minimum new tokens and sequence bias, and OpenAI's
published frequency / presence formula written out as a processor), in a batch where other
requests ask for none of it.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from kvharbor import LLM, SamplingParams
from kvharbor.engine import logits_processors
from kvharbor.engine.request import Request

from .conftest import random_prompt

N = 12


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kv_blocks=256)


class OpenAIPenalties(LogitsProcessor):
    """``mu[j] - c[j] * frequency - (c[j] > 0) * presence``, ``c[j]`` counted in the output."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def hf_greedy(llm, prompt: list[int], processors: list) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        gen = llm.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                    min_new_tokens=N, do_sample=False, eos_token_id=None,
                                    pad_token_id=0, logits_processor=LogitsProcessorList(processors))
    return gen[0, len(prompt):].tolist()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, **kw)


def test_penalties_and_biases_match_transformers_in_a_mixed_batch(llm):
    prompts = [random_prompt(20 + 7 * i, seed=i) for i in range(6)]
    biased = {prompts[3][0]: 5.0, 17: 3.5, 100: -100.0}
    cases = [
        (greedy(), []),
        (greedy(repetition_penalty=1.8), [RepetitionPenaltyLogitsProcessor(1.8)]),
        (greedy(frequency_penalty=1.5, presence_penalty=0.5),
         [OpenAIPenalties(len(prompts[2]), 1.5, 0.5)]),
        (greedy(logit_bias=biased), [SequenceBiasLogitsProcessor({(k,): v for k, v in biased.items()})]),
        (greedy(presence_penalty=-1.0, repetition_penalty=0.7),   # below 1 favours repeats
         [RepetitionPenaltyLogitsProcessor(0.7), OpenAIPenalties(len(prompts[4]), 0.0, -1.0)]),
        (greedy(), []),
    ]
    outs = llm.generate(prompts, [sp for sp, _ in cases])
    plain = llm.generate(prompts, greedy())
    for i, (out, (sp, processors)) in enumerate(zip(outs, cases)):
        assert out.token_ids == hf_greedy(llm, prompts[i], processors), i
        assert (out.token_ids != plain[i].token_ids) == bool(processors), i  # each one changes the answer


def test_each_processor_on_known_logits():
    """The definitions, on numbers: a repetition penalty divides a seen token's positive logit
    and multiplies a negative one (prompt and output both count), frequency counts each
    occurrence in the output, presence once; a bias adds; min_tokens masks its held ids; a
    row that asks for nothing is untouched, and the input logits are left as they were."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]] * 3)
    raw = logits.clone()
    penalized = Request("a", [0, 1], SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                                                    presence_penalty=0.25), all_token_ids=[0, 1, 3, 3])
    biased = Request("b", [0], SamplingParams(logit_bias={4: 1.5}, min_tokens=1, max_tokens=4),
                     held_stops=(2,))
    out = logits_processors.apply(logits, [penalized, Request("c", [0, 1, 3], SamplingParams()), biased])
    assert out[0].tolist() == [1.0, -2.0, 0.5, 3.0 / 2 - 2 * 0.5 - 0.25, 0.0]
    assert out[1].tolist() == raw[1].tolist()
    assert out[2].tolist() == [2.0, -1.0, float("-inf"), 3.0, 1.5]
    assert torch.equal(logits, raw)


def test_min_tokens_masks_stop_ids_as_transformers_min_new_tokens(llm):
    prompt = random_prompt(30, seed=11)
    first = llm.generate([prompt], greedy())[0].token_ids[0]
    out = llm.generate([prompt], greedy(min_tokens=5, stop_token_ids=[first]))[0]
    ref = hf_greedy(llm, prompt, [MinNewTokensLengthLogitsProcessor(len(prompt), 5, [first])])
    assert first not in out.token_ids[:5]
    cut = ref.index(first, 5) + 1 if first in ref[5:] else N
    assert out.token_ids == ref[:cut]
    assert out.finish_reason == ("stop" if cut < N or ref[-1] == first else "length")


def test_min_tokens_holds_back_eos_unless_eos_is_ignored(llm):
    (eos,) = llm.engine.eos_ids
    forced = {eos: 100.0}                       # EOS is every step's choice
    sp = dict(max_tokens=10, temperature=0, logit_bias=forced)
    assert llm.generate(["hi"], SamplingParams(**sp))[0].token_ids == [eos]
    held = llm.generate(["hi"], SamplingParams(**sp, min_tokens=4))[0]
    assert len(held.token_ids) == 5 and eos not in held.token_ids[:4]
    assert held.token_ids[4] == eos and held.finish_reason == "stop"
    ignored = llm.generate(["hi"], SamplingParams(**sp, min_tokens=4, ignore_eos=True))[0]
    assert ignored.token_ids == [eos] * 10 and ignored.finish_reason == "length"


def test_min_tokens_holds_back_every_stop_id_at_once(llm):
    """Two stop ids and EOS, all forced by ``logit_bias``: each one stays masked until
    ``min_tokens``, so the answer runs 4 tokens of none of them and the fifth is one of them."""
    (eos,) = llm.engine.eos_ids
    stops = [7, 200]
    sp = dict(max_tokens=10, temperature=0, stop_token_ids=stops,
              logit_bias={t: 100.0 for t in stops + [eos]})
    assert llm.generate(["hi"], SamplingParams(**sp))[0].token_ids[0] in stops + [eos]
    held = llm.generate(["hi"], SamplingParams(**sp, min_tokens=4))[0]
    assert len(held.token_ids) == 5 and not set(held.token_ids[:4]) & {*stops, eos}
    assert held.token_ids[4] in stops + [eos] and held.finish_reason == "stop"


def with_logprobs(llm, prompts: list[list[int]], sp: SamplingParams) -> list[list]:
    """Each prompt's ``TokenLogprobs`` per generated token (``sp.logprobs`` set), by stepping."""
    engine, got = llm.engine, {}
    for i, p in enumerate(prompts):
        engine.add_request(f"lp{i}", p, SamplingParams(**_fields(sp)))
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_logprobs)
    return [got[f"lp{i}"] for i in range(len(prompts))]


def test_min_p_keeps_only_tokens_near_the_most_likely(llm):
    prompts = [random_prompt(16, seed=s) for s in range(4)]
    below = []
    for seed in range(3):
        sp = dict(max_tokens=16, temperature=1.0, ignore_eos=True, logprobs=1, seed=seed)
        free = with_logprobs(llm, prompts, SamplingParams(**sp))
        kept = with_logprobs(llm, prompts, SamplingParams(**sp, min_p=0.3))
        for a, b in zip(free, kept):
            below += [lp.logprob - lp.top[0][1] < math.log(0.3) for lp in a]
            # the model's own probabilities at temperature 1: each kept token within min_p of the best
            assert all(lp.logprob - lp.top[0][1] >= math.log(0.3) - 1e-5 for lp in b)
    assert any(below)                           # without min_p some tokens fell below it
    greedy_ids = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0,
                                                                            ignore_eos=True))]
    only_best = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=1.0, seed=5, min_p=1.0,
                                                     ignore_eos=True))
    assert [o.token_ids for o in only_best] == greedy_ids


def test_logprobs_stay_the_models_own(llm):
    """As vLLM's default (raw logprobs): a biased token reports the unbiased log-probability."""
    prompt = random_prompt(10, seed=3)
    (plain,) = with_logprobs(llm, [prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    best = plain[0].top[0][0]
    other = next(t for t in range(3, 250) if t != best)
    (biased,) = with_logprobs(llm, [prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5,
                                                            logit_bias={other: 100.0}))
    assert biased[0].top == plain[0].top                  # best first, unbiased
    assert biased[0].logprob < plain[0].logprob           # the biased token was picked, at its own odds
    assert llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0,
                                                 logit_bias={other: 100.0}))[0].token_ids == [other]


def _fields(sp: SamplingParams) -> dict:
    return {f: getattr(sp, f) for f in sp.__slots__}


@pytest.mark.parametrize("kw, message", [
    (dict(min_tokens=9, max_tokens=8), r"min_tokens must be an integer in \[0, max_tokens=8\]"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(repetition_penalty=0), r"repetition_penalty must be > 0"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty must be > 0"),
    (dict(logit_bias={5: 101}), r"logit_bias values must be in \[-100, 100\]"),
    (dict(logit_bias={"x": 1}), r"logit_bias maps token ids to numbers"),
    (dict(logit_bias={10**6: 1.0}), r"logit_bias token ids must be in \[0, "),
    (dict(min_tokens=2, stop_token_ids=[-1]), r"stop_token_ids token ids must be in \[0, "),
])
def test_bad_values_are_refused_by_name(llm, kw, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["hi"], SamplingParams(**{"max_tokens": 8, **kw}))
    assert not llm.engine.has_unfinished()
