"""Structured outputs of a thinking model (an engine with a ``reasoning_parser``, vLLM's): the
grammar waits for the end of the reasoning (``</think>``) and then constrains the answer; a
prompt that already closed the reasoning is constrained from its first token.

The tiny model never writes ``</think>`` by itself, so the first tokens of an answer are
scripted (each sampled token replaced before the engine appends it); what follows them is the
model's own, masked by the grammar once the script closed the reasoning."""

from __future__ import annotations

from collections import deque

import pytest

from kvharbor import LLM, SamplingParams
from kvharbor.engine.logits_processors import depends_on_outputs

from .conftest import random_prompt
from .test_structured_output import SPECS, holds, oracle

THOUGHT = list(b"hmm, ok</think>")      # the byte tokenizer: one token per byte


def _scripted(llm, script: list[int], monkeypatch) -> None:
    """Every request's first ``len(script)`` tokens are ``script``'s."""
    left: dict[str, deque] = {}
    append = llm.engine._append_token

    def forced(req, token, logprobs=None):
        queue = left.setdefault(req.request_id, deque(script))
        return append(req, queue.popleft() if queue else token, logprobs)

    monkeypatch.setattr(llm.engine, "_append_token", forced)


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_the_grammar_constrains_the_answer_after_the_reasoning(kind, monkeypatch):
    llm = LLM(device="cpu", num_kv_blocks=64, reasoning_parser="deepseek_r1")
    _scripted(llm, THOUGHT, monkeypatch)
    prompt = random_prompt(12, seed=3)
    out = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0, structured_outputs=SPECS[kind]))[0]
    assert out.token_ids[:len(THOUGHT)] == THOUGHT
    assert out.token_ids[len(THOUGHT):] == oracle(llm, prompt + THOUGHT, SPECS[kind], 60 - len(THOUGHT))
    answer = out.text.removeprefix(bytes(THOUGHT).decode())
    assert out.finish_reason == "stop" and holds(kind, answer), out.text
    assert out.num_reasoning_tokens == len(THOUGHT)         # up to the token that closed </think>


def test_without_a_reasoning_parser_the_grammar_holds_from_the_first_token(monkeypatch):
    """The same scripted reasoning breaks the grammar at once (so the test above could not pass
    with the grammar applied from the start)."""
    llm = LLM(device="cpu", num_kv_blocks=64)
    _scripted(llm, THOUGHT, monkeypatch)
    out = llm.generate([random_prompt(12, seed=3)],
                       SamplingParams(max_tokens=60, temperature=0, structured_outputs=SPECS["regex"]))[0]
    assert out.finish_reason == "abort" and out.token_ids == list(b"hmm,")  # "," breaks [a-z]{3}-
    assert out.num_reasoning_tokens == 0                    # no parser: nothing counted


def test_a_prompt_that_closed_the_reasoning_is_constrained_from_the_first_token():
    """Qwen3's template with thinking off ends the prompt with an empty ``<think></think>``:
    the answer is constrained at once, as without a parser; one that opens ``<think>`` is not."""
    closed = random_prompt(12, seed=4) + list(b"<think>\n\n</think>\n\n")
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=SPECS["choice"])
    thinking = LLM(device="cpu", num_kv_blocks=64, reasoning_parser="qwen3")
    plain = LLM(device="cpu", num_kv_blocks=64)
    ours, theirs = (m.generate([closed], params)[0] for m in (thinking, plain))
    assert ours.token_ids == theirs.token_ids and holds("choice", ours.text)
    assert ours.num_reasoning_tokens == 0
    opened = random_prompt(12, seed=4) + list(b"<think>\n")
    free = thinking.generate([opened], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    held = thinking.generate([opened], params)[0]
    assert held.token_ids == free.token_ids and not holds("choice", held.text)
    assert free.num_reasoning_tokens == held.num_reasoning_tokens == 40     # never closed: all thought


def test_a_request_waiting_for_its_grammar_is_not_run_ahead(monkeypatch):
    """Its next logits depend on whether its last token closed the reasoning; once it did,
    only the grammar's own dependence remains (nothing is left waiting)."""
    llm = LLM(device="cpu", num_kv_blocks=64, reasoning_parser="deepseek_r1")
    _scripted(llm, THOUGHT, monkeypatch)
    req = llm.engine.add_request("r", random_prompt(12, seed=5),
                                 SamplingParams(max_tokens=30, structured_outputs=SPECS["regex"]))
    assert req.matcher is None and req.grammar_wait is not None and depends_on_outputs(req)
    while req.num_output_tokens < len(THOUGHT):
        llm.engine.step()
    assert req.matcher is not None and req.grammar_wait is None and not req.reasoning


def test_only_a_thinking_budget_holds_a_thinking_request_back_from_running_ahead(monkeypatch):
    """A request that is thinking with no budget reads nothing of its output to pick its next
    token: it runs ahead and drafts like any other. One with a budget counts its thought, until
    the reasoning closes."""
    llm = LLM(device="cpu", num_kv_blocks=64, reasoning_parser="deepseek_r1")
    _scripted(llm, THOUGHT, monkeypatch)
    prompt = random_prompt(12, seed=5)
    free = llm.engine.add_request("free", prompt, SamplingParams(max_tokens=30))
    budgeted = llm.engine.add_request("budgeted", prompt, SamplingParams(max_tokens=30, thinking_token_budget=20))
    assert free.reasoning and budgeted.reasoning
    assert not depends_on_outputs(free) and depends_on_outputs(budgeted)
    while budgeted.num_output_tokens < len(THOUGHT):
        llm.engine.step()
    assert not budgeted.reasoning and not depends_on_outputs(budgeted)


END = list(b"</think>")


def test_a_spent_thinking_budget_closes_the_reasoning_and_the_answer_follows():
    """vLLM's ``thinking_token_budget``: after that many tokens of thought the engine forces
    ``</think>``; what follows is the model's own answer (its grammar's, when it has one)."""
    llm = LLM(device="cpu", num_kv_blocks=64, reasoning_parser="deepseek_r1")
    plain = LLM(device="cpu", num_kv_blocks=64)
    prompt = random_prompt(12, seed=6)
    greedy = dict(max_tokens=30, temperature=0, ignore_eos=True)
    free = llm.generate([prompt], SamplingParams(**greedy))[0]
    assert free.num_reasoning_tokens == 30 and bytes(END).decode() not in free.text    # never closes by itself
    out = llm.generate([prompt], SamplingParams(**greedy, thinking_token_budget=5))[0]
    thought = out.token_ids[:5 + len(END)]
    assert thought == free.token_ids[:5] + END and out.num_reasoning_tokens == 5 + len(END)
    rest = plain.generate([prompt + thought], SamplingParams(**{**greedy, "max_tokens": 30 - len(thought)}))[0]
    assert out.token_ids[len(thought):] == rest.token_ids
    assert llm.generate([prompt], SamplingParams(**greedy, thinking_token_budget=0))[0].token_ids[:len(END)] == END
    shaped = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, thinking_token_budget=3,
                                                   structured_outputs=SPECS["regex"]))[0]
    assert shaped.token_ids[3:3 + len(END)] == END
    assert holds("regex", shaped.text.split(bytes(END).decode(), 1)[1]) and shaped.finish_reason == "stop"
    assert llm.generate([prompt], SamplingParams(**greedy, thinking_token_budget=-1))[0].token_ids == free.token_ids


def test_a_thinking_budget_needs_a_reasoning_parser():
    plain = LLM(device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="reasoning_parser"):
        plain.generate([[5, 6]], SamplingParams(thinking_token_budget=4))
    assert plain.generate([[5, 6]], SamplingParams(max_tokens=2, thinking_token_budget=-1))[0].token_ids  # none
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-2).validate()
