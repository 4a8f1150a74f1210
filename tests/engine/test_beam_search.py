"""Beam search (``LLM.beam_search``, ``kvharbor.engine.beam_search``): the sequences and scores
transformers' own beam search finds, on two architectures; width 1 is greedy; the rule for end
tokens (EOS, ``stop_token_ids``, ``min_tokens``), the length penalty and the text; rounds read
the beams' prefixes from the prefix cache; bad parameters are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import GenerationConfig

from kvharbor import LLM, BeamSearchParams, SamplingParams
from kvharbor.engine.beam_search import BeamSearch


@pytest.fixture(scope="module", params=["kvharbor/tiny-llama", "kvharbor/tiny-qwen2"])
def llm(request):
    return LLM(model=request.param, device="cpu", num_kv_blocks=256, max_num_batched_tokens=64)


def transformers_beams(llm, ids: list[int], width: int, new_tokens: int):
    """transformers' beam search with no end token (as ``ignore_eos``): its sequences and scores."""
    config = GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=new_tokens, eos_token_id=10**6,   # no token ends a beam
                              pad_token_id=0, length_penalty=1.0, output_scores=True,
                              return_dict_in_generate=True)
    with torch.no_grad():
        out = llm.hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    generation_config=config)
    return [s[len(ids):].tolist() for s in out.sequences], out.sequences_scores.tolist()


@pytest.mark.parametrize("prompt,width,new_tokens", [("Hello there", 4, 12), ("The quick brown fox", 3, 10),
                                                     ("a", 2, 20)])
def test_beams_are_transformers_beams(llm, prompt, width, new_tokens):
    ids = llm.encode(prompt)
    want, scores = transformers_beams(llm, ids, width, new_tokens)
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=new_tokens, ignore_eos=True,
                                                        length_penalty=0.0))
    assert [s.tokens[len(ids):] for s in out.sequences] == want
    # transformers divides by the generated length; every beam here has new_tokens of them
    assert [s.cum_logprob / new_tokens for s in out.sequences] == pytest.approx(scores, abs=1e-4)
    assert all(s.tokens[:len(ids)] == ids and s.finish_reason == "length" for s in out.sequences)
    assert [s.text for s in out.sequences] == [llm.tokenizer.decode(s.tokens, skip_special_tokens=True)
                                               for s in out.sequences]


def test_width_one_is_greedy_and_sums_the_tokens_logprobs(llm):
    prompts = ["Once upon a time", "1, 2, 3,"]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=0))
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=9, ignore_eos=True))
    for g, out in zip(greedy, outs):
        (seq,) = out.sequences
        assert seq.tokens[len(g.prompt_token_ids):] == list(g.outputs[0].token_ids)
        assert seq.cum_logprob == pytest.approx(sum(lp.logprob for lp in g.logprobs), abs=1e-4)
        assert [lp for lp, _ in seq.logprobs] == pytest.approx([lp.logprob for lp in g.logprobs], abs=1e-4)


def test_prompts_searched_together_or_one_at_a_time_agree_and_reuse_the_cache(llm):
    prompts = ["It was the best of times", "It was the worst of times, it was", {"prompt": "Call me Ishmael."}]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    before = llm.stats()["prefix_hit_tokens"]
    together = llm.beam_search(prompts, params)
    # after the first round, each beam's request reads at least its prompt's full blocks from the cache
    full = sum(len(llm.encode(p)) // 16 * 16 for p in prompts)
    assert full >= 32 and llm.stats()["prefix_hit_tokens"] - before >= full * params.beam_width * (params.max_tokens - 1)
    apart = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in apart]
    assert llm.engine.scheduler.running == [] and not llm.engine.has_unfinished()
    llm.check_integrity()


def candidates(*pairs):
    return [tuple(pairs)]


def test_end_tokens_complete_a_beam_after_min_tokens():
    eos, stop = 9, 7
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3, stop_token_ids=[stop], min_tokens=1),
                        eos_ids={eos}, eos_id=eos)
    assert search.num_candidates == 4 and search.prompts() == [[1, 2]]
    search.advance(candidates((eos, -0.1), (3, -0.5), (4, -0.7), (5, -2.0)))   # round 1: EOS too early
    assert search.completed == [] and [b.tokens for b in search.beams] == [[1, 2, 3], [1, 2, 4]]
    search.advance([((eos, -0.2), (stop, -0.3), (5, -1.0), (6, -3.0)),          # beam [1,2,3] (-0.5)
                    ((5, -0.1), (6, -0.4), (eos, -2.0), (8, -2.5))])            # beam [1,2,4] (-0.7)
    assert [(s.tokens, s.finish_reason, s.stop_reason) for s in search.completed] == [
        ([1, 2, 3, eos], "stop", None), ([1, 2, 3, stop], "stop", stop), ([1, 2, 4, eos], "stop", None)]
    assert [b.tokens for b in search.beams] == [[1, 2, 4, 5], [1, 2, 4, 6]]   # -0.8, -1.1 beat -1.5
    assert search.prompts() == [[1, 2, 4, 5], [1, 2, 4, 6]] and not search.done
    search.advance([((3, -0.1),), ((3, -0.2),)])
    assert search.done and search.prompts() == [] and all(b.finish_reason == "length" for b in search.beams)
    assert search.text_ids(search.completed[1]) == [3]              # the stop token is not text
    with pytest.raises(ValueError, match="2 live beams"):
        search.advance([((3, -0.1),)])
    with pytest.raises(ValueError):                                 # done: no further round
        search.advance([((3, -0.1),), ((3, -0.2),)])
    live = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3), eos_ids={eos}, eos_id=eos)
    with pytest.raises(ValueError, match="1 live beams, got 2"):      # live: one set per beam
        live.advance([((3, -0.1),), ((4, -0.2),)])


def test_token_id_0_may_end_a_beam():
    search = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=2, stop_token_ids=[0]), eos_ids=set())
    search.advance(candidates((0, -0.1), (5, -0.2)))
    assert [(s.tokens, s.stop_reason) for s in search.completed] == [([1, 0], 0)]


@pytest.mark.parametrize("penalty,best", [(0.0, [1, 2, 3, 9]), (2.0, [1, 2, 3, 4, 5])])
def test_the_length_penalty_ranks_finished_and_longer_beams(penalty, best):
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=1, max_tokens=3, length_penalty=penalty),
                        eos_ids={9}, eos_id=9)
    search.advance([((3, -1.0), (8, -3.0))])
    search.advance([((9, -0.5), (4, -0.6))])      # [1,2,3,9] completes at -1.5 (length 3: EOS not counted)
    search.advance([((5, -0.3),)])                # [1,2,3,4,5] runs out at -1.9 (length 5)
    assert search.score(search.completed[0]) == pytest.approx(-1.5 / 3 ** penalty)
    assert search.score(search.beams[0]) == pytest.approx(-1.9 / 5 ** penalty)
    assert [s.tokens for s in search.best()] == [best]


def test_stop_token_ids_end_beams_and_the_text_leaves_them_out(llm):
    prompt = "Hello there"
    ids = llm.encode(prompt)
    first = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))[0].outputs[0].token_ids[0]
    # the most likely first token ends a beam at once; with no length penalty nothing longer beats it
    params = BeamSearchParams(beam_width=3, max_tokens=8, stop_token_ids=[first], ignore_eos=True, length_penalty=0.0)
    (out,) = llm.beam_search([prompt], params)
    best = out.sequences[0]
    assert (best.tokens, best.finish_reason, best.stop_reason) == (ids + [first], "stop", first)
    assert best.text == llm.tokenizer.decode(ids, skip_special_tokens=True)
    for seq in out.sequences:               # the stop token ends a beam: it is never inside one
        made = seq.tokens[len(ids):]
        assert first not in made[:-1] and (made[-1] == first) == (seq.finish_reason == "stop")
    (kept,) = llm.beam_search([prompt], dataclasses.replace(params, include_stop_str_in_output=True))
    assert kept.sequences[0].text == llm.tokenizer.decode(ids + [first], skip_special_tokens=True) != best.text


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0, max_tokens=4), r"beam_width must be an integer in \[1, 10\], got 0"),
    (dict(beam_width=11, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature must be >= 0"),
    (dict(beam_width=2, max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, stop_token_ids=[-1]), "stop_token_ids")])
def test_bad_parameters_are_refused(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.beam_search(["hi"], BeamSearchParams(**kwargs))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search(["hi"], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()


def test_each_bound_itself_is_accepted():
    BeamSearchParams(beam_width=10, max_tokens=4, min_tokens=4, temperature=0.0, stop_token_ids=[0]).validate()
