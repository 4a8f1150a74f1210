"""The Responses API's translation to and from the chat route (``responses_api``) and its store
(``response_store``), without a server: input items -> chat messages, a chat answer or stream ->
output items and events (reasoning, text, calls), the store's tenant scope and memory bound."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from kvharbor.platform.error_body import APIError
from kvharbor.platform.response_store import ResponseStore
from kvharbor.platform.responses_api import ResponsesRequest, Turn

EVENT = TypeAdapter(ResponseStreamEvent)


def _turn(**fields) -> Turn:
    return Turn(ResponsesRequest.model_validate({"input": "hi", **fields}), "m", [], 16)


def _messages(turn: Turn) -> list[dict]:
    return [m.for_template() for m in turn.chat.messages]


def test_input_items_become_the_chat_messages_a_template_reads():
    sent_back = [  # an earlier response's output, as the SDK dumps it (newer fields null)
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}],
         "encrypted_content": None, "status": "completed"},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "phase": None,
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": None}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{\"a\": 1}",
         "status": "completed", "async": None, "namespace": None},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
        {"role": "developer", "content": "Answer now."}]
    turn = _turn(input=sent_back, instructions="Be brief.",
                 tools=[{"type": "function", "name": n} for n in "fg"], tool_choice="none")
    assert _messages(turn) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "reasoning": "think", "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}}]},
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
        {"role": "tool", "content": "2", "tool_call_id": "c2"},
        {"role": "developer", "content": "Answer now."}]
    assert turn.conversation[0] == {"role": "user", "content": "Weather?"}    # instructions are not carried
    assert [t.function.name for t in turn.chat.tools] == ["f", "g"] and turn.chat.tool_choice == "none"


def test_request_fields_map_onto_chats():
    turn = _turn(max_output_tokens=7, temperature=0.5, top_p=0.9, reasoning={"effort": "none", "summary": "auto"},
                 text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                 include=["message.output_text.logprobs"], top_logprobs=3, stream=True)
    chat = turn.chat
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.logprobs, chat.top_logprobs) == (7, 0.5, 0.9, True, 3)
    assert chat.reasoning_effort == "none" and chat.template_variables()["enable_thinking"] is False
    assert chat.structured() == {"json": {"type": "object"}} and chat.include_usage()
    assert _turn().chat.logprobs is False and _turn().chat.top_logprobs is None
    assert all(_turn(tool_choice=c).chat.tools is None for c in ("auto", "none"))   # no tools: nothing to call


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),                    # no tools
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, None),     # no arguments
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x", "role": "user"}]}, None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, None),
    ({"background": True, "stream": True}, None), ({"store": True, "conversation": "conv_1"}, None),
])
def test_what_cannot_be_served_is_refused_before_any_work(fields, param):
    with pytest.raises((APIError, ValidationError)) as refused:
        _turn(**fields)
    if param is not None:
        assert refused.value.param == param


def _chat_answer(message: dict, finish: str = "stop", logprobs=None) -> dict:
    return {"id": "chatcmpl-1", "model": "served", "kvharbor": {"replica_id": "r"},
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish,
                         "logprobs": logprobs}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 9, "total_tokens": 49,
                      "prompt_tokens_details": {"cached_tokens": 16},
                      "completion_tokens_details": {"reasoning_tokens": 4}}}


def test_a_whole_answer_becomes_output_items_and_the_next_turns_history():
    turn = _turn(tools=[{"type": "function", "name": "f"}])
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    out = asyncio.run(turn.answer(_chat_answer({"content": "ok", "reasoning": "so", "tool_calls": calls})))
    Response.model_validate(out)
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call"]
    assert out["output"][0]["content"][0]["text"] == "so" and out["output"][2]["call_id"] == "call_1"
    assert out["model"] == "served" and out["status"] == "completed" and out["tool_choice"] == "auto"
    assert out["usage"] == {"input_tokens": 40, "output_tokens": 9, "total_tokens": 49,
                            "input_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 16},
                            "output_tokens_details": {"reasoning_tokens": 4}}
    assert turn.history() == [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "ok", "reasoning": "so", "tool_calls": calls}]
    cut = asyncio.run(_turn(include_reasoning=False).answer(_chat_answer({"content": "", "reasoning": "x"}, "length")))
    assert [i["type"] for i in cut["output"]] == ["message"] and cut["output"][0]["content"][0]["text"] == ""
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def _chunk(delta: dict | None = None, finish=None, usage=None, logprobs=None) -> dict:
    out = {"id": "chatcmpl-1", "model": "served", "choices": [] if delta is None else [
        {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}
    return {**out, "usage": usage} if usage else out


def _events(turn: Turn, chunks: list) -> list[dict]:
    async def source():
        for c in chunks:
            yield c

    async def collect():
        return [e async for e in turn.events(source())]
    out = []
    for text in asyncio.run(collect()):
        kind, data = text.split("\n")[:2]
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENT.validate_python(event)               # the SDK's own event shapes
        out.append(event)
    return out


def test_a_stream_opens_and_closes_one_item_at_a_time():
    usage = _chat_answer({})["usage"]
    stored = []

    async def store(turn, response):
        stored.append(response)
    turn = _turn(tools=[{"type": "function", "name": "f"}])
    turn.on_done = store
    events = _events(turn, [
        _chunk({"role": "assistant", "content": ""}), _chunk({"reasoning": "th"}), _chunk({"reasoning": "ink"}),
        _chunk({"content": "A"}), _chunk({"content": "B"}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "f", "arguments": "{\"a\""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, finish="tool_calls"),
        _chunk(usage=usage), "[DONE]"])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"].removeprefix("response.") for e in events]
    assert kinds == ["created", "in_progress",
                     "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.delta",
                     "reasoning_text.done", "content_part.done", "output_item.done",
                     "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
                     "output_text.done", "content_part.done", "output_item.done",
                     "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
                     "function_call_arguments.done", "output_item.done", "completed"]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert final["output"][2]["arguments"] == "{\"a\": 1}" and final["usage"]["output_tokens"] == 9
    assert all(i["status"] == "completed" for i in final["output"]) and stored == [final]
    assert events[2]["item"]["content"] == [] and events[2]["item"]["status"] == "in_progress"


def test_a_stream_that_fails_midway_ends_failed_and_is_not_stored():
    turn = _turn()
    turn.on_done = pytest.fail                  # never called
    events = _events(turn, [_chunk({"content": "A"}), {"error": {"message": "replica lost", "type": "server_error",
                                                                "param": None, "code": "replica_failed"}}, "[DONE]"])
    kinds = [e["type"] for e in events]
    assert kinds[-3:] == ["response.output_item.done", "error", "response.failed"]
    assert events[-3]["item"]["status"] == "incomplete"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "replica lost"}
    assert events[-2]["code"] == "replica_failed"


def test_an_empty_stream_answers_one_empty_message_and_an_early_error_raises():
    events = _events(_turn(), [_chunk({"role": "assistant", "content": ""}), _chunk({}, finish="length"), "[DONE]"])
    assert events[-1]["type"] == "response.incomplete"
    assert [i["content"][0]["text"] for i in events[-1]["response"]["output"]] == [""]

    async def failing():
        raise APIError(400, "lower max_tokens", param="max_tokens")
        yield

    async def first():
        return await anext(aiter(_turn().events(failing())))
    with pytest.raises(APIError) as refused:    # before any event: the HTTP status answers it
        asyncio.run(first())
    assert (refused.value.param, refused.value.message) == ("max_output_tokens", "lower max_output_tokens")


def test_streamed_logprobs_reach_each_delta_and_the_final_text():
    lp = [{"token": "A", "logprob": -0.5, "bytes": [65], "top_logprobs": []}]
    events = _events(_turn(include=["message.output_text.logprobs"]), [
        _chunk({"content": "A"}, logprobs={"content": lp}), _chunk({"content": "A"}, logprobs={"content": lp}),
        _chunk({}, finish="stop"), "[DONE]"])
    assert [e["logprobs"] for e in events if e["type"] == "response.output_text.delta"] == [lp, lp]
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == lp + lp
    assert [e["logprobs"] for e in events if e["type"] == "response.output_text.done"] == [lp + lp]


def test_the_store_keeps_each_tenants_own_within_its_bound():
    store = ResponseStore(max_bytes=2000)
    big = "x" * 500
    for i in range(3):
        assert store.put("a", {"id": f"r{i}", "text": big}, [{"content": big}])
    assert len(store) == 1 and store.used <= 2000            # each ~1 kB: the older ones went
    assert store.get("a", "r2") is not None and store.get("a", "r0") is None
    assert store.get("b", "r2") is None and not store.delete("b", "r2")      # another tenant's
    assert not store.put("a", {"id": "huge", "text": "x" * 3000}, [])
    small = ResponseStore(max_bytes=2000)
    for i in range(3):
        small.put("a", {"id": f"s{i}"}, [])
    small.get("a", "s0")                                     # read: s1 is now the least recently used
    assert small.used == 3 * 16                              # '{"id": "s0"}', '[]' and no input items '[]'
    small.put("a", {"id": "t", "text": "x" * 1940}, [])      # 1967 bytes: one small entry must go
    assert [k for k in ("s0", "s1", "s2", "t") if small.get("a", k)] == ["s0", "s2", "t"]
    assert small.used == sum(e[3] for e in small._entries.values())
    assert store.delete("a", "r2") and store.used == 0 and store.get("a", "r2") is None
