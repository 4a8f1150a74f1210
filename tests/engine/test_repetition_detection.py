"""vLLM's ``repetition_detection``: an output ends at the first token where its tail is a pattern
repeated ``min_count`` times (``finish_reason`` "repetition"), never inside the prompt or before
``min_tokens``; what it would have generated up to there is unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvharbor import LLM, SamplingParams
from kvharbor.engine.repetition import RepetitionDetectionParams
from kvharbor.engine.request import repeated


def _first_loop(ids: list[int], low: int, high: int, count: int, start: int = 0) -> int | None:
    """Brute force: the first length n > ``start`` at which ``ids[:n]`` ends with a block of
    ``size`` tokens repeated ``count`` times, for a size in [low, high]."""
    for n in range(max(start, 1), len(ids) + 1):
        for size in range(low, high + 1):
            blocks = [ids[n - (k + 1) * size:n - k * size] for k in range(count)]
            if size * count <= n and all(b == blocks[0] for b in blocks):
                return n
    return None


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kv_blocks=64)


def test_an_output_ends_where_it_first_repeats_itself(llm):
    free = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=64, temperature=0))
    spec = {"max_pattern_size": 8, "min_count": 2}
    cut = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=64, temperature=0, repetition_detection=spec))
    ended = 0
    for whole, part in zip(free, cut):
        ids, out = list(whole.outputs[0].token_ids), part.outputs[0]
        loop = _first_loop(ids, 1, 8, 2)
        assert list(out.token_ids) == ids[:loop or len(ids)]            # the same tokens, up to the loop
        if loop is None or loop == len(ids):                            # the length limit wins on its token
            assert (out.finish_reason, out.stop_reason) == ("length", None)
        else:
            ended += 1
            assert (out.finish_reason, out.stop_reason) == ("repetition", "repetition_detected")
            assert part.finished and out.text == llm.tokenizer.decode(ids[:loop])
    assert ended >= 1                                                   # this model loops on one of them


def test_a_loop_is_looked_for_only_once_min_tokens_are_out_and_never_in_the_prompt(llm):
    ids = list(llm.generate("Hello", SamplingParams(max_tokens=64, temperature=0))[0].outputs[0].token_ids)
    first = _first_loop(ids, 1, 8, 2)
    later = _first_loop(ids, 1, 8, 2, start=first + 1)
    assert first is not None and later is not None
    out = llm.generate("Hello", SamplingParams(max_tokens=64, temperature=0, min_tokens=first + 1,
                                               repetition_detection={"max_pattern_size": 8, "min_count": 2}))[0]
    assert len(out.outputs[0].token_ids) == later
    # a prompt that ends in a loop: only the output's tokens are looked at
    spec = RepetitionDetectionParams.of({"max_pattern_size": 2, "min_count": 2})
    req = SimpleNamespace(sampling=SimpleNamespace(repetition_detection=spec, min_tokens=0), num_output_tokens=1,
                          all_token_ids=[1, 2, 1, 2, 1], stop_reason=None)    # prompt 1 2 1 2, output 1
    assert not repeated(req) and req.stop_reason is None
    req.all_token_ids, req.num_output_tokens = [1, 2, 1, 2, 1, 2], 2               # output 1 2: not yet twice
    assert not repeated(req)
    req.all_token_ids, req.num_output_tokens = [1, 2, 1, 2, 1, 2, 1, 2], 4
    assert repeated(req) and req.stop_reason == "repetition_detected"


def test_the_pattern_rule():
    r = RepetitionDetectionParams.of({"max_pattern_size": 4, "min_count": 3})
    assert r.found([1, 2, 3, 1, 2, 3, 1, 2, 3]) and r.found([7, 5, 5, 5])
    assert not r.found([9, 1, 2, 3, 1, 2, 3]) and not r.found([1, 2, 1, 2, 1, 3])
    assert not r.found([1, 2, 3, 1, 2, 3, 1, 2, 3], within=8)            # the first 3 is the prompt's
    sized = RepetitionDetectionParams(max_pattern_size=4, min_pattern_size=2, min_count=3)
    assert not sized.found([5, 5, 5]) and sized.found([5, 5, 5, 5, 5, 5])
    assert not RepetitionDetectionParams(5, 5, 2).found([1, 2, 3, 4, 1, 2, 3, 4])


@pytest.mark.parametrize("spec, words", [
    ({"max_pattern_size": 4, "min_count": 1}, "min_count"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size <= max_pattern_size"),
    ({"max_pattern_size": -1}, ">= 0"),
    ({"max_pattern_size": 2.5, "min_count": 2}, "integers"),
    ({"max_size": 2}, "no field 'max_size'"),
])
def test_a_spec_that_cannot_work_is_refused(spec, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(repetition_detection=spec).validate()


def test_off_is_none():
    params = SamplingParams(repetition_detection={"max_pattern_size": 0})
    params.validate()
    assert params.repetition_detection is None
