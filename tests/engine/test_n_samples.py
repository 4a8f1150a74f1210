"""``SamplingParams(n=k)`` in ``LLM.generate``: k samples per prompt in ``RequestOutput.outputs``,
as vLLM's offline API returns them."""

from __future__ import annotations

import pytest

from kvharbor import LLM, SamplingParams
from kvharbor.engine.request import CompletionOutput, sibling_seed


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kv_blocks=64)


def _sampled(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True, **kw)


def test_each_prompt_gets_n_samples_each_as_its_own_seeded_request(llm):
    outs = llm.generate(["Once upon", "The function"], _sampled(seed=5, n=3, logprobs=1))
    assert len(outs) == 2
    for prompt, out in zip(["Once upon", "The function"], outs):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        # sample j is what one request with sample j's seed generates: reproducible, and the
        # caller's seed is sample 0's
        alone = [llm.generate([prompt], _sampled(seed=sibling_seed(5, j), logprobs=1))[0]
                 for j in range(3)]
        assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
        assert [c.text for c in out.outputs] == [a.text for a in alone]
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3, "the samples are not distinct"
        assert (out.token_ids, out.text) == (out.outputs[0].token_ids, out.outputs[0].text)
        for c in out.outputs:
            assert len(c.logprobs) == 6 and c.finish_reason == "length"
            assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs))
    assert not llm.engine.has_unfinished()


def test_greedy_samples_are_all_the_greedy_output(llm):
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = llm.generate(["Once upon"], greedy)[0]
    (out,) = llm.generate(["Once upon"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, n=2))
    assert [c.token_ids for c in out.outputs] == [want.token_ids] * 2


def test_one_sample_is_the_output_itself(llm):
    (out,) = llm.generate(["Once upon"], SamplingParams(max_tokens=3, temperature=0))
    assert out.outputs == [CompletionOutput(0, out.text, out.token_ids, out.finish_reason)]


def test_an_engine_request_is_one_sample(llm):
    with pytest.raises(ValueError, match="n=2: an engine request is one sample"):
        llm.engine.add_request("two", [3, 4, 5], SamplingParams(max_tokens=2, n=2))
    assert not llm.engine.has_unfinished()


def test_the_other_samples_reuse_sample_0s_prompt_kv(llm):
    """Samples 1..n-1 are queued once sample 0 has its first token, as HTTP's ``n`` does: its
    prompt's full blocks are cached then, and they are not computed again."""
    prompt = list(range(100, 170))                  # 70 tokens: 4 full blocks of 16
    before = llm.stats()["prefix_hit_tokens"]
    llm.generate([prompt], SamplingParams(max_tokens=2, n=3))
    assert llm.stats()["prefix_hit_tokens"] - before == 2 * 64


def test_the_samples_run_together_not_one_after_another(llm, monkeypatch):
    step, steps = llm.engine.step, []
    monkeypatch.setattr(llm.engine, "step", lambda: steps.append(1) or step())
    llm.generate([list(range(3, 40))], SamplingParams(max_tokens=8, ignore_eos=True, n=3, seed=1))
    assert len(steps) < 2 * 8, "the other samples waited for sample 0 to finish"


def test_a_session_turn_with_n_samples_continues_with_sample_0(llm):
    """The session holds sample 0's prompt + output, which the next turn extends, past a flood
    of other prompts that evicts what no session holds."""
    prompt = llm.encode("Once upon a time, in a village by the sea, there lived an ol")
    assert len(prompt) == 60                        # + 21 generated: 5 blocks of KV, 2 per sample
    out = llm.generate([prompt], SamplingParams(max_tokens=21, ignore_eos=True, n=3, seed=3),
                       session_id="n-turns")[0]
    assert len({tuple(c.token_ids[:4]) for c in out.outputs}) == 3, "the samples share blocks"
    for k in range(12):                             # 84 blocks through a 64-block cache
        llm.generate([[7 + k] * 100], SamplingParams(max_tokens=2))
    turn = llm.generate([prompt + out.outputs[0].token_ids + [5]], SamplingParams(max_tokens=2),
                        session_id="n-turns")[0]
    assert turn.num_cached_tokens == 80
    assert llm.end_session("n-turns")


def test_an_interrupted_call_leaves_none_of_its_requests_queued(llm, monkeypatch):
    step, calls = llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Once upon", "The function"], SamplingParams(max_tokens=8, ignore_eos=True, n=2))
    assert not llm.engine.has_unfinished()
    monkeypatch.undo()
    assert len(llm.generate(["Once upon"], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_a_request_aborted_outside_the_call_ends_it_with_an_error_not_a_spin(llm, monkeypatch):
    step, calls = llm.engine.step, []

    def aborting():
        calls.append(1)
        assert len(calls) < 1000, "generate kept stepping an engine with nothing left to run"
        for rid in list(llm.engine.requests):
            llm.engine.abort(rid)
        return step()

    monkeypatch.setattr(llm.engine, "step", aborting)
    with pytest.raises(RuntimeError, match=r"ended without a final output"):
        llm.generate(["Once upon"], SamplingParams(max_tokens=4, n=2))
    assert not llm.engine.has_unfinished()
