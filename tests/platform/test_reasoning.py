"""A thinking model's reasoning apart from its answer (vLLM's ``--reasoning-parser deepseek_r1``
and ``qwen3``): the message's ``reasoning`` is what the model wrote inside ``<think>``, the
content what follows; a stream cut anywhere says the same; a reasoning message sent back in
the history reaches the chat template. Served over HTTP in ``test_serve_run.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor.config import PlatformConfig
from kvharbor.engine.tokenizer import byte_tokenizer
from kvharbor.platform.gateway import Gateway
from kvharbor.platform.openai_protocol import ChatMessage, ChatRequest
from kvharbor.platform.reasoning import ReasoningStream, split
from tests.platform.test_generation_run import _answering_run
from tests.platform.test_prompt_batches import Stream


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("deepseek_r1", "<think>\nLet me see.\n</think>\n\nIt is 4.", "\nLet me see.\n", "\n\nIt is 4."),
    ("deepseek_r1", "Let me see.</think>It is 4.", "Let me see.", "It is 4."),    # <think> in the prompt
    ("deepseek_r1", "Still thinking when max_tokens hit", "Still thinking when max_tokens hit", None),
    ("deepseek_r1", "<think>Done.</think>", "Done.", None),                        # nothing after: null
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", 'x<tool_call>{"name": "f"}</tool_call>', 'x<tool_call>{"name": "f"}</tool_call>', None),
    ("qwen3", 'x<tool_call>{"name": "f"}</tool_call>', "x", '<tool_call>{"name": "f"}</tool_call>'),
    ("qwen3", "<think>hm</think>ok", "hm", "ok"),
    ("deepseek_r1", "\n<think>a</think>b", "a", "b"),                            # blanks before it: dropped too
    ("deepseek_r1", "x<think>y</think>z", "x<think>y", "z"),                     # only an opening <think> is one
])
def test_what_is_reasoning_and_what_is_content(parser, text, reasoning, content):
    assert split(text, parser) == (reasoning, content)


def test_qwen3_without_thinking_answers_all_content():
    assert split("<think>x</think>y", "qwen3", thinking=False) == (None, "<think>x</think>y")
    assert split("<think>x</think>y", "deepseek_r1", thinking=False) == ("x", "y")     # R1 has no switch


def streamed(pieces: list[str], parser: str, thinking: bool) -> tuple[str, str, list[tuple[str, str]]]:
    stream, sent = ReasoningStream(parser, thinking), []
    for i, piece in enumerate(pieces):
        sent.append(stream.feed(piece, last=i == len(pieces) - 1))
    return "".join(r for r, _ in sent), "".join(c for _, c in sent), sent


PARTS = st.lists(st.sampled_from(["<think>", "</think>", "<tool_call>", "a", " ", "b\n", "<", "think", "/", ">"]),
                 max_size=10).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=PARTS, parser=st.sampled_from(["deepseek_r1", "qwen3"]), thinking=st.booleans(), data=st.data())
def test_a_stream_cut_anywhere_sends_what_the_whole_answer_says(text, parser, thinking, data):
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a] or [""]
    said, content, _ = streamed(pieces, parser, thinking)
    want_said, want_content = split(text, parser, thinking)
    assert (said, content) == (want_said or "", want_content or "")


def test_a_stream_holds_back_only_what_could_begin_a_tag():
    _, _, sent = streamed(["<th", "ink>Hmm <", "/thi", "nk>Yes"], "deepseek_r1", True)
    assert sent == [("", ""), ("Hmm ", ""), ("", ""), ("", "Yes")]
    _, _, sent = streamed(["a<b", "c</", "x"], "deepseek_r1", True)
    assert sent == [("a<b", ""), ("c", ""), ("</x", "")]


class ThinkingStream(Stream):
    """A Qwen3 answer: reasoning, then a call (token ``i`` scored ``-i``)."""

    async def _events(self):
        pieces = ["<think>", "I should", " call it.<", "/think>\n\nOn it.", '<tool_call>{"name": "now", ',
                  '"arguments": {}}</tool_call>']
        for i, piece in enumerate(pieces):
            yield {"token_ids": [65 + i], "text": piece, "finish_reason": "stop" if i == len(pieces) - 1 else None,
                   "replica_id": self.replica, "logprobs": [(-float(i), [(65 + i, -float(i))])]}


def test_an_answer_carries_its_reasoning_content_and_calls():
    run = _answering_run(lambda request: ThinkingStream, tool_mode="auto", reasoning=("qwen3", True, True))
    choice = asyncio.run(run.complete())["choices"][0]
    message = choice["message"]
    assert (message["reasoning"], message["content"]) == ("I should call it.", "\n\nOn it.")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["now"]
    assert choice["finish_reason"] == "tool_calls"
    plain = asyncio.run(_answering_run(lambda request: Stream, chat=True, reasoning=("qwen3", True, True)).complete())
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": None, "reasoning": "ab"}
    still = asyncio.run(_answering_run(lambda request: Stream, tool_mode="auto", reasoning=("qwen3", True, True)).complete())
    assert still["choices"][0]["message"] == {"role": "assistant", "content": None, "reasoning": "ab"}
    off = asyncio.run(_answering_run(lambda request: Stream, chat=True, reasoning=("qwen3", False, True)).complete())
    assert off["choices"][0]["message"] == {"role": "assistant", "content": "ab", "reasoning": None}


def test_include_reasoning_false_leaves_it_out():
    """vLLM's ``include_reasoning: false``: the content alone, streamed or not."""
    run = _answering_run(lambda request: ThinkingStream, tool_mode="auto", reasoning=("qwen3", True, False))
    message = asyncio.run(run.complete())["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (None, "\n\nOn it.")

    async def chunks():
        run = _answering_run(lambda request: ThinkingStream, tool_mode="auto", reasoning=("qwen3", True, False))
        return [c async for c in run.stream_chunks(False)]

    deltas = [c["choices"][0]["delta"] for c in asyncio.run(chunks())[1:-1]]
    assert not any("reasoning" in d for d in deltas) and all(deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nOn it."


def test_a_stream_sends_reasoning_then_content_then_the_call_each_token_scored_once():
    async def chunks():
        run = _answering_run(lambda request: ThinkingStream, tool_mode="auto", reasoning=("qwen3", True, True),
                             logprobs=1, tokenizer=byte_tokenizer())
        return [c async for c in run.stream_chunks(False)]

    out = asyncio.run(chunks())
    deltas = [c["choices"][0] for c in out[1:-1]]
    assert all(d["delta"] for d in deltas)
    assert deltas[0]["delta"] == {"reasoning": "I should"}          # no empty content beside it
    assert "".join(d["delta"].get("reasoning", "") for d in deltas) == "I should call it."
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "\n\nOn it."
    assert [c["function"]["name"] for d in deltas for c in d["delta"].get("tool_calls", [])] == ["now"]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    scored = [e["logprob"] for d in deltas for e in (d["logprobs"] or {"content": []})["content"]]
    assert scored == [0.0, -1.0, -2.0, -3.0, -4.0, -5.0]


def test_the_history_gives_the_template_a_messages_reasoning():
    """An answer sent back as it came (content null when it only reasoned) is accepted, and the
    template reads its reasoning under both names, as vLLM hands it over."""
    for field in ("reasoning", "reasoning_content"):
        message = ChatMessage.model_validate({"role": "assistant", "content": None, field: "because"})
        assert message.for_template() == {"role": "assistant", "content": "", "reasoning": "because",
                                          "reasoning_content": "because"}
    with pytest.raises(ValueError, match="content is required"):
        ChatMessage.model_validate({"role": "assistant", "content": None})


def test_which_chats_are_parsed():
    """Every chat of a server with a parser, structured ones too (the engine constrains what
    follows the reasoning); Qwen3's ``enable_thinking: false`` turns it off, as does
    ``reasoning_effort: "none"`` unless the kwargs say otherwise; ``include_reasoning``."""
    def parsed(parser, **body):
        request = ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
        return Gateway._reasoning(SimpleNamespace(reasoning_parser=parser), request)

    tools = [{"type": "function", "function": {"name": "now"}}]
    assert parsed("qwen3") == ("qwen3", True, True) and parsed(None) is None
    assert parsed("qwen3", chat_template_kwargs={"enable_thinking": False}) == ("qwen3", False, True)
    assert parsed("qwen3", reasoning_effort="none") == ("qwen3", False, True)
    assert parsed("qwen3", reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == (
        "qwen3", True, True)                                                            # the kwargs win
    assert parsed("qwen3", reasoning_effort="low", include_reasoning=False) == ("qwen3", True, False)
    assert parsed("deepseek_r1", tools=tools) == ("deepseek_r1", True, True)           # auto
    assert parsed("qwen3", tools=tools, tool_choice="required") == ("qwen3", True, True)
    assert parsed("qwen3", response_format={"type": "json_object"}) == ("qwen3", True, True)
    with pytest.raises(ValueError, match="deepseek_r1"):
        PlatformConfig(reasoning_parser="granite")
    assert PlatformConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"


class ForcedAfterThinking(Stream):
    """A DeepSeek-R1 answer to a forced call: reasoning (the grammar waits), then the call's
    arguments, as the engine constrains them after ``</think>`` (token ``i`` scored ``-i``)."""

    pieces = ["Let me", " think", '.</think>{"tz": ', '"UTC"}']    # the reasoning's end and the call's start

    async def _events(self):
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield {"token_ids": [65 + i], "text": piece, "finish_reason": "stop" if last else None,
                   "replica_id": self.replica, "logprobs": [(-float(i), [(65 + i, -float(i))])],
                   **({"num_reasoning_tokens": 3} if last else {})}          # the engine's count


class RequiredAfterThinking(ForcedAfterThinking):
    pieces = ["Let me", " think.</think>", '[{"name": "now", ', '"parameters": {}}]']


def test_a_forced_call_follows_the_reasoning_streamed_or_not():
    """A named function and ``required`` with a reasoning parser (the engine starts their
    grammar after ``</think>``): the message's reasoning, then the call made of what follows;
    streamed, the reasoning as it comes, then the call, each token scored once."""
    reasoning = ("deepseek_r1", True, True)
    answer = asyncio.run(_answering_run(lambda request: ForcedAfterThinking, tool_mode="now", n=2,
                                        reasoning=reasoning).complete())
    named = answer["choices"][0]["message"]
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}     # both choices
    assert named["reasoning"] == "Let me think." and named["content"] is None
    assert named["tool_calls"][0]["function"] == {"name": "now", "arguments": '{"tz": "UTC"}'}
    required = asyncio.run(_answering_run(lambda request: RequiredAfterThinking, tool_mode="required",
                                          reasoning=reasoning).complete())["choices"][0]
    assert required["message"]["reasoning"] == "Let me think." and required["finish_reason"] == "tool_calls"
    assert [c["function"] for c in required["message"]["tool_calls"]] == [{"name": "now", "arguments": "{}"}]

    async def chunks(stream, mode):
        run = _answering_run(lambda request: stream, tool_mode=mode, reasoning=reasoning,
                             logprobs=1, tokenizer=byte_tokenizer())
        return [c["choices"][0] for c in [c async for c in run.stream_chunks(False)][1:-1]]

    for stream, mode, arguments in ((ForcedAfterThinking, "now", '{"tz": "UTC"}'), (RequiredAfterThinking, "required", "{}")):
        deltas = asyncio.run(chunks(stream, mode))
        assert deltas[0]["delta"] == {"reasoning": "Let me"} and all(d["delta"] for d in deltas), deltas
        assert "".join(d["delta"].get("reasoning", "") for d in deltas) == "Let me think."
        calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
        assert calls[0]["function"]["name"] == "now" and not any("content" in d["delta"] for d in deltas)
        assert "".join(c["function"]["arguments"] for c in calls) == arguments, calls
        scored = [e["logprob"] for d in deltas for e in (d["logprobs"] or {"content": []})["content"]]
        assert scored == [-float(i) for i in range(len(stream.pieces))]
        assert deltas[-1]["finish_reason"] == ("stop" if mode == "now" else "tool_calls")


def test_usage_counts_reasoning_tokens_only_with_a_parser_and_thinking_on():
    """vLLM's ``usage.completion_tokens_details.reasoning_tokens``: the engine's count (tokens
    until the one that closed ``</think>``); 0 when the chat turned thinking off (its answer
    is all content); no such field without a parser."""
    def usage(**kw):
        return asyncio.run(_answering_run(lambda request: ForcedAfterThinking, chat=True, **kw).complete())["usage"]

    assert usage(reasoning=("deepseek_r1", True, True))["completion_tokens_details"] == {"reasoning_tokens": 3}
    assert usage(reasoning=("qwen3", False, True))["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert "completion_tokens_details" not in usage()
