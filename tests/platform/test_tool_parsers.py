"""``tool_choice: "auto"`` with the hermes parser (vLLM's ``--enable-auto-tool-choice
--tool-call-parser hermes``): a model's ``<tool_call>{json}</tool_call>`` blocks become
``tool_calls``, the text before them the content; a stream, cut anywhere, says the same; a
server without a parser refuses "auto" (``test_tool_calls_http.py``) and one started with it
serves it (``test_serve_run.py``)."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvharbor.config import PlatformConfig
from kvharbor.engine.tokenizer import byte_tokenizer
from kvharbor.platform.tool_parsers import StreamParser, parse
from tests.platform.test_generation_run import _answering_run
from tests.platform.test_prompt_batches import Stream

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


def functions(calls) -> list[dict]:
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [c["function"] for c in calls]


def test_calls_and_the_content_before_them():
    content, calls = parse("Let me look." + WEATHER + "\n" + NOW)
    assert content == "Let me look."
    assert functions(calls) == [{"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
                                {"name": "now", "arguments": "{}"}]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text, content, names", [
    ("Oslo is cold.", "Oslo is cold.", None),                          # no call: all content
    (WEATHER, None, ["get_weather"]),                                   # no text before: null content
    (WEATHER + " and then some", None, ["get_weather"]),                # text after the calls: dropped
    ('x<tool_call>{"name": "now", "arguments": {"a": "é"}}', "x", ["now"]),  # the last block unclosed
    ("x<tool_call>{'name': 'now'}</tool_call>", "x<tool_call>{'name': 'now'}</tool_call>", None),  # not JSON
    (WEATHER + '<tool_call>{"arguments": {}}</tool_call>', None, None),   # a block without a name
    ('<tool_call>{"name": "now"}</tool_call>', None, None),              # nor arguments (vLLM's KeyError)
    ('<tool_call>["now"]</tool_call>', None, None),                     # not an object
])
def test_what_is_a_call_and_what_is_content(text, content, names):
    """As vLLM's hermes parser: any block that is not a JSON object with a name and arguments makes the whole
    text the content (``content`` None in the table: the text itself)."""
    got_content, calls = parse(text)
    if names is None:
        assert calls is None and got_content == text
    else:
        assert got_content == content and [f["name"] for f in functions(calls)] == names
    if names == ["now"]:
        assert json.loads(functions(calls)[0]["arguments"]) == {"a": "é"}
        assert "é" in functions(calls)[0]["arguments"]                  # not \u-escaped, as vLLM's


def streamed(pieces: list[str]) -> tuple[str, list[dict], list[str]]:
    """The content and calls a stream of ``pieces`` sends, and the content of each piece."""
    parser, content, calls, sent = StreamParser(), "", [], []
    for i, piece in enumerate(pieces):
        text, new = parser.feed(piece, last=i == len(pieces) - 1)
        content, calls, sent = content + text, calls + new, sent + [text]
    assert parser.calls == len(calls)
    return content, calls, sent


TEXTS = st.text(alphabet="ab <>/_\n{}", max_size=12).filter(lambda t: "<tool_call>" not in t)
CALLS = st.lists(st.sampled_from([WEATHER, NOW]), max_size=3)


@settings(max_examples=300, deadline=None)
@given(before=TEXTS, calls=CALLS, between=st.sampled_from(["", "\n", "\n\n"]), data=st.data())
def test_a_stream_cut_anywhere_sends_what_the_whole_answer_says(before, calls, between, data):
    text = before + between.join(calls)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a] or [""]
    content, got, _ = streamed(pieces)
    want_content, want = parse(text)
    assert functions(got) == functions(want or [])
    assert content == (want_content or "")


def test_a_stream_holds_back_only_what_could_begin_a_call():
    _, _, sent = streamed(["Hi <", "tool", "_c", "ow!"])
    assert sent == ["Hi ", "", "", "<tool_cow!"]
    _, calls, sent = streamed(["Hi <tool", "_call>", '{"name": "now", "arguments": {}}', "</tool_call>", "\n"])
    assert sent == ["Hi ", "", "", "", ""] and functions(calls) == [{"name": "now", "arguments": "{}"}]


@pytest.mark.parametrize("cut", [None, len(NOW), len(NOW) + 5])
def test_a_stray_closing_tag_between_calls_is_dropped_as_parse_drops_it(cut):
    text = NOW + "</tool_call>" + WEATHER
    pieces = [text] if cut is None else [text[:cut], text[cut:]]
    content, calls, _ = streamed(pieces)
    assert parse(text)[0] is None and content == ""
    assert [f["name"] for f in functions(calls)] == [f["name"] for f in functions(parse(text)[1])] == [
        "now", "get_weather"]


def test_a_streamed_block_that_is_no_call_is_sent_as_text():
    """A stream cannot take back calls it sent, so a bad block after them goes out as the
    text it is (the whole answer, unstreamed, is then all content)."""
    content, calls, _ = streamed([NOW, "<tool_call>oops</tool_call>", "<tool_call>{"])
    assert [f["name"] for f in functions(calls)] == ["now"]
    assert content == "<tool_call>oops</tool_call><tool_call>{"


class CallingStream(Stream):
    """A model answering with text, then a call split across events (token ``i`` of them
    scored ``-i``)."""

    async def _events(self):
        for i, piece in enumerate(["Checking", " <tool_", WEATHER[6:30], WEATHER[30:], "\n", NOW]):
            yield {"token_ids": [65 + i], "text": piece, "finish_reason": "stop" if i == 5 else None,
                   "replica_id": self.replica, "logprobs": [(-float(i), [(65 + i, -float(i))])]}


def test_an_auto_answer_has_its_content_and_calls_and_ends_with_tool_calls():
    answer = asyncio.run(_answering_run(lambda request: CallingStream, tool_mode="auto").complete())
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking "
    assert [f["name"] for f in functions(choice["message"]["tool_calls"])] == ["get_weather", "now"]
    plain = asyncio.run(_answering_run(lambda request: Stream, tool_mode="auto").complete())["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "ab"} and plain["finish_reason"] == "length"


def test_an_auto_stream_sends_content_then_each_call_with_its_index():
    async def chunks():
        return [c async for c in _answering_run(lambda request: CallingStream, tool_mode="auto").stream_chunks(False)]

    out = asyncio.run(chunks())
    assert out[-1] == "[DONE]"
    deltas = [c["choices"][0] for c in out[1:-1]]
    assert all(d["delta"].get("content") or d["delta"].get("tool_calls") for d in deltas), deltas   # none empty
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Checking "
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "now")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    assert [d["finish_reason"] for d in deltas] == [None] * (len(deltas) - 1) + ["tool_calls"]


def test_an_auto_streams_logprobs_reach_the_client_once_each_in_order():
    """Events whose text is held back (a possible call, an open block) send no chunk; their
    tokens' logprobs go out with the next chunk that is sent."""
    async def chunks():
        run = _answering_run(lambda request: CallingStream, tool_mode="auto", logprobs=1, tokenizer=byte_tokenizer())
        return [c async for c in run.stream_chunks(False)]

    out = asyncio.run(chunks())
    scored = [e["logprob"] for c in out[1:-1] for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert scored == [0.0, -1.0, -2.0, -3.0, -4.0, -5.0]


def test_parallel_tool_calls_false_keeps_the_first_call():
    """vLLM's ``parallel_tool_calls: false`` on an ``auto`` answer: its first call only,
    streamed or not (``required`` is constrained to one: ``test_tool_calls_http.py``)."""
    answer = asyncio.run(_answering_run(lambda request: CallingStream, tool_mode="auto", one_call=True).complete())
    choice = answer["choices"][0]
    assert [f["name"] for f in functions(choice["message"]["tool_calls"])] == ["get_weather"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking "

    async def chunks():
        run = _answering_run(lambda request: CallingStream, tool_mode="auto", one_call=True)
        return [c async for c in run.stream_chunks(False)]

    deltas = [c["choices"][0] for c in asyncio.run(chunks())[1:-1]]
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_the_parser_is_a_server_option_with_vllms_names():
    on = PlatformConfig(enable_auto_tool_choice="true", tool_call_parser="hermes")
    assert (on.enable_auto_tool_choice, on.tool_call_parser) == (True, "hermes")
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs tool_call_parser"):
        PlatformConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        PlatformConfig(enable_auto_tool_choice=True, tool_call_parser="mistral")
