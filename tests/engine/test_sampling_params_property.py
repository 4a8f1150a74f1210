"""Property test: whatever ``SamplingParams`` a Python caller builds (wrong types, NaN,
infinities, numpy numbers, out-of-range values), ``LLM.generate`` either refuses the call with
a ValueError and keeps none of it, or runs it to the end beside a greedy request whose tokens
it leaves unchanged. A value that passed validation and then failed the engine step used to
fail every request of that step."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvharbor import LLM, SamplingParams

ODD = st.sampled_from([None, math.nan, math.inf, -math.inf, "1", True, np.float32(0.5), np.int64(2)])
VALID = {                               # what a careful caller passes
    "max_tokens": st.one_of(st.integers(1, 6), st.builds(np.int64, st.integers(1, 6))),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(0, 300),
    "top_p": st.floats(0.01, 1),
    "min_p": st.floats(0, 1),
    "seed": st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 258), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 3),
    "logit_bias": st.dictionaries(st.integers(0, 258), st.floats(-100, 100), max_size=3),
    "n": st.integers(1, 3),
    "include_stop_str_in_output": st.booleans(),
    "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 258), min_size=1, max_size=4)),
    "bad_words": st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "truncate_prompt_tokens": st.one_of(st.none(), st.integers(1, 8)),
    "skip_special_tokens": st.booleans(),
}
ANY = st.one_of(ODD, st.integers(-2**64, 2**64), st.floats(-300, 300), st.text(max_size=2),
                st.lists(st.one_of(st.integers(-2, 300), st.floats(0, 5), st.text(max_size=2), ODD), max_size=3),
                st.dictionaries(st.one_of(st.integers(-2, 300), st.text(max_size=2)), st.one_of(st.floats(-150, 150), ODD), max_size=2))
# A careful caller's fields with at most two of them set to anything at all.
PARAMS = st.tuples(st.fixed_dictionaries({}, optional=VALID),
                   st.dictionaries(st.sampled_from(sorted(VALID)), ANY, max_size=2)).map(lambda t: {**t[0], **t[1]})
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROMPT = [3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def llm():
    llm = LLM(device="cpu", num_kv_blocks=64, max_model_len=256)
    return llm, llm.generate([PROMPT], GREEDY)[0].token_ids


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(PARAMS, min_size=1, max_size=3))
def test_params_are_refused_up_front_or_served_without_hurting_the_batch(llm, fields):
    llm, want = llm
    params = [GREEDY] + [SamplingParams(**f) for f in fields]
    try:
        outs = llm.generate([PROMPT] * len(params), params)
    except ValueError:
        event("refused")
        assert not llm.engine.has_unfinished(), "a refused call left requests queued"
        return
    event(f"served {len(params)}")
    assert outs[0].token_ids == want, "an accepted request changed a greedy neighbour's tokens"
    for out, sp in zip(outs, params):
        assert len(out.outputs) == sp.n
        for sample in out.outputs:
            assert sample.finish_reason in ("length", "stop") and len(sample.token_ids) <= sp.max_tokens
            if sp.allowed_token_ids is not None:
                allowed = set(map(int, sp.allowed_token_ids))
                assert set(sample.token_ids[:-1]) <= allowed, "a token outside allowed_token_ids"
                can_ban_all = bool(sp.bad_words or sp.min_tokens)   # a step may ban every allowed id
                assert sample.token_ids[-1] in allowed or can_ban_all and sample.finish_reason == "stop"
    assert not llm.engine.has_unfinished()
    llm.engine.check_integrity()
