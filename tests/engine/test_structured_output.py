"""Structured outputs (vLLM's ``structured_outputs``): a JSON schema, any JSON object, a regex,
a choice or an EBNF grammar constrains a request's tokens, and the request stops when the
grammar is complete.

The greedy tokens are checked against an oracle written here: transformers' logits for the
whole sequence, the tokens an xgrammar matcher of the same spec forbids set to ``-inf``, the
argmax, one token at a time; in a batch where other requests are unconstrained or follow a
different grammar.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from kvharbor import LLM, SamplingParams
from kvharbor.engine.structured_output import MAX_WHITESPACE, StructuredOutputsParams

from .conftest import random_prompt

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["red", "green", "blue"]}}}
SPECS = {
    "choice": {"choice": ["yes", "no", "maybe so", "ship \"ahoy\""]},
    "regex": {"regex": r"[a-z]{3}-\d{2}"},
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "json_object": {"json_object": True, "disable_any_whitespace": True},
    "grammar": {"grammar": 'root ::= "(" item ("," item)? ")"\nitem ::= [0-9] [0-9]?'},
}


def holds(kind: str, text: str) -> bool:
    """``text`` is a complete output of ``SPECS[kind]``."""
    spec = SPECS[kind]
    if kind == "choice":
        return text in spec["choice"]
    if kind == "regex":
        return re.fullmatch(spec["regex"], text) is not None
    if kind == "grammar":
        return re.fullmatch(r"\(\d\d?(,\d\d?)?\)", text) is not None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if kind == "json_object":
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", num_kv_blocks=256)


def oracle(llm, prompt: list[int], spec: dict | None, max_tokens: int) -> list[int]:
    """Greedy tokens: the model's logits over the whole sequence, the grammar's forbidden tokens
    at ``-inf``; until EOS is taken (or, unconstrained, ``max_tokens``)."""
    matcher = None
    if spec is not None:
        info = xgr.TokenizerInfo.from_huggingface(llm.engine.tokenizer, vocab_size=llm.hf_model.config.vocab_size,
                                                  stop_token_ids=sorted(llm.engine.eos_ids))
        matcher = xgr.GrammarMatcher(StructuredOutputsParams.of(spec)._build(
            *(getattr(xgr.GrammarCompiler(info), f) for f in ("compile_json_schema", "compile_regex",
                                                              "compile_grammar"))))
    ids, out = list(prompt), []
    while len(out) < max_tokens:
        with torch.inference_mode():
            logits = llm.hf_model(torch.tensor([ids], device=llm.hf_model.device)).logits[0, -1].float().cpu()[None]
        if matcher is not None:
            bitmask = xgr.allocate_token_bitmask(1, logits.shape[1])
            matcher.fill_next_token_bitmask(bitmask, 0)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if matcher is not None:
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                break
    return out


def test_constrained_greedy_takes_the_best_allowed_token_in_a_mixed_batch(llm):
    """Each kind against the oracle, batched with an unconstrained request (which answers as it
    does alone) and with each other: masks go to their own rows, matchers advance in step."""
    kinds = list(SPECS)
    prompts = [random_prompt(9 + 5 * i, seed=40 + i) for i in range(len(kinds) + 1)]
    params = [SamplingParams(max_tokens=40, temperature=0, structured_outputs=SPECS[k]) for k in kinds]
    params.append(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    outs = llm.generate(prompts, params)
    for kind, prompt, out in zip(kinds, prompts, outs):
        assert out.token_ids == oracle(llm, prompt, SPECS[kind], 40), kind
        assert out.finish_reason == "stop" and holds(kind, out.text), (kind, out.text)
    free = llm.generate([prompts[-1]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert outs[-1].token_ids == free.token_ids == oracle(llm, prompts[-1], None, 12)


def test_the_constraint_changes_the_answer(llm):
    """The unconstrained greedy answers of these prompts break each grammar (so the tests above
    could not pass with the constraint ignored)."""
    for i, kind in enumerate(SPECS):
        free = llm.generate([random_prompt(9 + 5 * i, seed=40 + i)], SamplingParams(max_tokens=40, temperature=0))[0]
        assert not holds(kind, free.text), kind


@pytest.mark.parametrize("kind", list(SPECS))
def test_sampled_answers_hold_for_many_seeds(llm, kind):
    prompts = [random_prompt(15, seed=s) for s in range(8)]
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, structured_outputs=SPECS[kind])
              for s in range(8)]
    outs = llm.generate(prompts, params)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 4, [(o.text, o.finish_reason) for o in outs]     # some may run out of tokens
    assert all(holds(kind, o.text) for o in finished), [o.text for o in finished]
    if kind == "choice":
        assert len({o.text for o in outs}) > 1              # sampling still picks among the allowed


def test_an_answer_cut_by_max_tokens_is_a_prefix_and_says_length(llm):
    out = llm.generate([random_prompt(12, seed=3)], SamplingParams(
        max_tokens=4, temperature=0, structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and out.text.startswith('{"')


def test_preempted_requests_keep_their_grammar_state():
    """Requests preempted and recomputed (a pool too small for all) answer as with room."""
    prompts = [random_prompt(30, seed=70 + i) for i in range(6)]
    params = [SamplingParams(max_tokens=40, temperature=0, structured_outputs={"regex": r"[a-z ]{20,40}"})
              for _ in prompts]
    roomy = LLM(device="cpu", num_kv_blocks=256).generate(prompts, params)
    tight = LLM(device="cpu", num_kv_blocks=14, block_size=16)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert all(re.fullmatch(r"[a-z ]{20,40}", o.text) for o in outs)


@pytest.mark.parametrize("spec,words", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"regex": "("}, "structured_outputs.regex does not compile"),
    ({"json": {"type": 5}}, "structured_outputs.json does not compile"),
    ({"grammar": "start ::= 'a'"}, "structured_outputs.grammar does not compile"),
    ({"choice": []}, "non-empty list"),
    ({"json_object": False}, "exactly one of"),
    ({"pattern": "a"}, "unknown fields ['pattern']"),
    ({"choice": ["a", ""]}, "non-empty list of non-empty strings"),
    ({"json_object": "yes"}, "json_object must be true"),
    ({"json": {"enum": ["x" * 70_000]}}, "structured_outputs.json is longer than 65536 characters"),
    ({"choice": ["ab"] * 12_000}, "structured_outputs.choice is longer than 65536 characters"),
    ({"regex": 5}, "structured_outputs.regex must be a string"),
    ({"json": ["a"]}, "structured_outputs.json must be a JSON schema"),
])
def test_bad_specs_are_refused_by_name(llm, spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate(["hi"], SamplingParams(structured_outputs=spec))
    assert not llm.engine.requests


@pytest.mark.parametrize("spec", [{"regex": "("}, {"grammar": "start ::= 'a'"}, {"json": {"type": 5}}])
def test_compile_errors_read_without_xgrammars_source_location(llm, spec):
    """xgrammar prefixes its errors with a time and its C++ source line; the client is told
    what is wrong with its spec, not where xgrammar noticed."""
    with pytest.raises(ValueError, match="does not compile: ") as refused:
        llm.generate(["hi"], SamplingParams(structured_outputs=spec))
    assert not re.search(r"\[\d+:\d+:\d+\]|\.cc:\d+", str(refused.value)), str(refused.value)


def test_min_tokens_cannot_hold_back_the_end_of_a_grammar(llm):
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        llm.generate(["hi"], SamplingParams(min_tokens=2, structured_outputs={"choice": ["a"]}))


def test_a_complete_grammar_ends_the_answer_even_with_ignore_eos(llm):
    out = llm.generate([random_prompt(10, seed=5)], SamplingParams(
        max_tokens=30, temperature=0, ignore_eos=True, structured_outputs=SPECS["choice"]))[0]
    assert out.finish_reason == "stop" and out.text in SPECS["choice"]["choice"]
    assert out.token_ids[-1] in llm.engine.eos_ids           # the grammar's end is its EOS


def test_the_params_object_and_its_dict_answer_alike(llm):
    from kvharbor import StructuredOutputsParams

    prompt = random_prompt(11, seed=8)
    as_dict = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, structured_outputs=SPECS["regex"]))[0]
    as_obj = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0,
                                                   structured_outputs=StructuredOutputsParams(regex=SPECS["regex"]["regex"])))[0]
    assert as_obj.token_ids == as_dict.token_ids and holds("regex", as_obj.text)


@pytest.mark.parametrize("spec", [{"json_object": True}, {"json": SCHEMA}])
def test_json_whitespace_runs_are_bounded(llm, spec):
    """Whitespace between JSON tokens is allowed, at most ``MAX_WHITESPACE`` in a row: with
    spaces and newlines forced by ``logit_bias``, every run between tokens stops there and a
    JSON token follows, instead of blanks until ``max_tokens``."""
    blanks = {t: 100.0 for t in (llm.engine.tokenizer.encode(" \n", add_special_tokens=False))}
    out = llm.generate([random_prompt(10, seed=3)], SamplingParams(
        max_tokens=3 * MAX_WHITESPACE, temperature=0, logit_bias=blanks, structured_outputs=spec))[0]
    between = re.sub(r'"(?:[^"\\]|\\.)*"?', '""', out.text)     # strings' own blanks are content
    runs = [len(r) for r in re.findall(r"\s+", between)]
    assert max(runs) == MAX_WHITESPACE, (runs, out.text)


def test_compact_json_has_no_blanks_and_keys_in_the_schemas_order(llm):
    """``disable_any_whitespace``: not a blank in the answer, though ``logit_bias`` pushes
    spaces and newlines; the object's keys come in the schema's property order (ok, n, tag,
    not sorted)."""
    blanks = {t: 100.0 for t in (llm.engine.tokenizer.encode(" \n", add_special_tokens=False))}
    out = llm.generate([random_prompt(10, seed=3)], SamplingParams(
        max_tokens=60, temperature=0, logit_bias=blanks, structured_outputs=SPECS["json"]))[0]
    assert out.finish_reason == "stop" and holds("json", out.text), out.text
    assert not re.search(r"\s", out.text), out.text
    assert list(json.loads(out.text)) == ["ok", "n", "tag"]
