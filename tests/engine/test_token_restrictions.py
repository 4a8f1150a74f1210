"""vLLM's ``allowed_token_ids`` and ``bad_words``: tokens a request may never pick.

The greedy tokens are checked against transformers' ``generate`` with its own processors
(``PrefixConstrainedLogitsProcessor`` for the allowed ids, ``NoBadWordsLogitsProcessor`` for
the bad words' token sequences), in a batch where other requests ask for neither.
"""

from __future__ import annotations

import pytest
import torch
from transformers import NoBadWordsLogitsProcessor, PrefixConstrainedLogitsProcessor

from kvharbor import LLM, SamplingParams
from kvharbor.engine import logits_processors
from kvharbor.engine.request import Request, bad_word_ids

from .test_logits_processors import greedy, hf_greedy


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kv_blocks=256)


def reaches_into_prompt(prompt: list[int], out: list[int], seqs) -> bool:
    """Some bad word's leading tokens end inside the prompt at a step where ``out`` was being
    generated: there transformers (which looks at the prompt) and vLLM (which does not) differ."""
    for seq in seqs:
        k = len(seq) - 1
        for j in range(min(k, len(out) + 1)):        # j tokens generated, k - j of the window in the prompt
            if k - j <= len(prompt) and prompt[len(prompt) - (k - j):] + out[:j] == list(seq[:-1]):
                return True
    return False


def test_bad_words_and_allowed_token_ids_match_transformers_in_a_mixed_batch(llm):
    texts = ["The harbor at dawn", "Ships and tides", "Once upon a time", "A lighthouse keeper"]
    prompts = [llm.encode(t) for t in texts]
    free = llm.generate(prompts, greedy())
    words = [free[0].text.split()[1], free[1].text.split()[0]]     # words the free answers spell
    seqs = bad_word_ids(llm.tokenizer, words)
    allowed = sorted(set(llm.encode("harbor tides")))
    outs = llm.generate(prompts, [greedy(bad_words=words), greedy(bad_words=words),
                                  greedy(allowed_token_ids=allowed), greedy()])
    eos = llm.tokenizer.eos_token_id
    banned = NoBadWordsLogitsProcessor([list(s) for s in seqs], eos_token_id=eos)
    only = PrefixConstrainedLogitsProcessor(lambda batch, ids: allowed, num_beams=1)
    for i in (0, 1):
        assert not reaches_into_prompt(prompts[i], outs[i].token_ids, seqs)
        assert outs[i].token_ids == hf_greedy(llm, prompts[i], [banned]), i
        assert outs[i].token_ids != free[i].token_ids and words[i] not in outs[i].text, i
    assert outs[2].token_ids == hf_greedy(llm, prompts[2], [only])
    assert set(outs[2].token_ids) <= set(allowed) and outs[2].token_ids != free[2].token_ids
    assert outs[3].token_ids == free[3].token_ids


def test_a_bad_word_bans_its_last_token_only_after_its_other_tokens_in_the_output():
    """vLLM's rule on known logits: a one-token word is always banned; a longer one's last token
    only where the output so far ends with the rest (the prompt is not looked at); allowed ids
    keep their logits and no bias lifts the others."""
    logits = torch.zeros(5, 10)
    sp = SamplingParams(bad_words=["x"])            # the words themselves are not read here
    seqs = ((5,), (7, 8, 9), (3, 4))

    def req(rid, prompt, out, bad=seqs, sampling=sp):
        r = Request(rid, prompt, sampling, all_token_ids=prompt + out)
        r.bad_words = bad
        return r
    rows = [req("a", [1, 2], [7, 8]), req("b", [7, 8], []), req("c", [1], [3, 7, 8, 3]),
            req("d", [1], [2], (), SamplingParams(allowed_token_ids=[2, 6], logit_bias={1: 100, 6: 1})),
            req("e", [1], [], ((5,),))]
    out = logits_processors.apply(logits, rows)
    inf = float("-inf")
    assert [j for j in range(10) if out[0, j] == inf] == [5, 9]
    assert [j for j in range(10) if out[1, j] == inf] == [5]
    assert [j for j in range(10) if out[2, j] == inf] == [4, 5]
    assert out[3].tolist() == [inf, inf, 0.0, inf, inf, inf, 1.0, inf, inf, inf]
    assert [j for j in range(10) if out[4, j] == inf] == [5]
    assert logits_processors.depends_on_outputs(rows[0])
    assert not any(map(logits_processors.depends_on_outputs, rows[3:]))


def test_a_bad_word_is_banned_as_spelt_at_the_start_and_after_a_space():
    """A tokenizer that spells " harbor" as one token and "harbor" as two: both are banned."""
    class Spelling:
        def encode(self, text, add_special_tokens=True):
            assert not add_special_tokens
            return {"harbor": [10, 11], " harbor": [12], "tide": [13], " tide": [14, 13]}[text]
    assert bad_word_ids(Spelling(), [" harbor", "tide"]) == ((10, 11), (12,), (13,), (14, 13))


def test_sampled_tokens_stay_in_allowed_token_ids(llm):
    allowed = sorted(set(llm.encode("abc ")))
    outs = llm.generate(["The harbor"] * 3, [SamplingParams(max_tokens=12, seed=s, ignore_eos=True,
                                                           allowed_token_ids=allowed) for s in range(3)])
    assert all(set(o.token_ids) <= set(allowed) for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1


@pytest.mark.parametrize("kw, message", [
    (dict(allowed_token_ids=[]), "allowed_token_ids must name at least one token"),
    (dict(allowed_token_ids=[10**6]), r"allowed_token_ids token ids must be in \[0, "),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids must be a list of token ids"),
    (dict(bad_words=[""]), "bad_words must be a list of non-blank strings"),
    (dict(bad_words=[3]), "bad_words must be a list of non-blank strings"),
    (dict(allowed_token_ids=[97], bad_words=["a"]), "bad_words ban every one of the allowed_token_ids"),
])
def test_bad_restrictions_are_refused_by_name(llm, kw, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["hi"], SamplingParams(max_tokens=4, **kw))
    assert not llm.engine.has_unfinished()
    assert llm.generate(["hi"], SamplingParams(max_tokens=4, bad_words="a"))[0].text.count("a") == 0


def test_a_step_where_every_allowed_id_is_banned_ends_the_request(llm):
    """Only "a" allowed and "aa" a bad word: after one "a" nothing may follow, so the request
    stops there (its text keeps no token outside the allowed ids), as it does when min_tokens
    holds back the only allowed id; a neighbour in the batch is untouched."""
    eos = llm.tokenizer.eos_token_id
    plain = llm.generate(["The harbor"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    outs = llm.generate(["The harbor"] * 3, [
        SamplingParams(max_tokens=6, temperature=0.7, seed=1, allowed_token_ids=[97], bad_words=["aa"]),
        SamplingParams(max_tokens=6, min_tokens=2, allowed_token_ids=[eos]),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)])
    assert (outs[0].text, outs[0].finish_reason, outs[0].token_ids[0]) == ("a", "stop", 97)
    assert len(outs[0].token_ids) == 2
    assert (outs[1].text, outs[1].finish_reason, len(outs[1].token_ids)) == ("", "stop", 1)
    assert outs[2].token_ids == plain.token_ids
