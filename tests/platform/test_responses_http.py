"""OpenAI's Responses API (``/v1/responses``) through the official client: the answer is the chat
route's for the same conversation (instructions as the system message), whole or streamed as
Responses events; stored responses continue with ``previous_response_id`` and are read and
deleted by their own tenant only; tools, JSON schemas and logprobs map onto chat's; the fields
kvharbor does not implement are 400s naming them."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response

from tests.conftest import DEMO, TEST_KEYS

ASK = "Name three colours."
RIVERS = "List the rivers of Norway."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["Oslo", "Lima", "Pune"]}}}}


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


def _checked(raw) -> Response:
    """The response as the SDK's model validates it (every required field, every shape)."""
    return Response.model_validate(raw.model_dump(by_alias=True) if hasattr(raw, "model_dump") else raw)


def test_a_response_is_the_chat_answer_to_the_same_conversation(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, temperature=0, max_output_tokens=12)
    out = _checked(client.responses.create(input=ASK, instructions="Be brief.", **kw))
    chat = client.chat.completions.create(model=kvharbor_app.model, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    assert out.id.startswith("resp_") and out.object == "response" and out.model == chat.model
    assert [item.type for item in out.output] == ["message"]
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert chat.choices[0].finish_reason == "length"     # 12 tokens cut this model's answer
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.instructions == "Be brief." and out.max_output_tokens == 12


def test_a_stream_is_the_responses_event_sequence_of_the_same_answer(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, input=ASK, temperature=0, max_output_tokens=16)
    whole = _checked(client.responses.create(**kw))
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == whole.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    final = _checked(events[-1].response)
    assert final.output_text == whole.output_text and final.output[0].id == item_id
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == "incomplete"
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_previous_response_id_continues_a_stored_conversation(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, temperature=0, max_output_tokens=8)
    first = _checked(client.responses.create(input=RIVERS, instructions="Answer in English.", **kw))
    second = _checked(client.responses.create(input="And two more?", previous_response_id=first.id, **kw))
    chat = client.chat.completions.create(model=kvharbor_app.model, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": RIVERS}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And two more?"}])     # instructions are not carried over (OpenAI's rule)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    # a later turn reads the second turn's KV from the prefix cache (no other test sends RIVERS
    # first; the first turn's prompt differs: it starts with its instructions)
    third = _checked(client.responses.create(input="Which rivers flow north?", previous_response_id=second.id, **kw))
    assert third.usage.input_tokens_details.cached_tokens >= 16
    assert _checked(client.responses.retrieve(first.id)).output_text == first.output_text
    other = openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["premium"], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)              # another tenant's
    with pytest.raises(openai.NotFoundError) as missing:
        other.responses.create(input="hi", previous_response_id=first.id, **kw)
    assert missing.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert client.responses.retrieve(second.id).id == second.id
    unstored = client.responses.create(input=ASK, store=False, **kw)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_calls_and_their_outputs_round_trip(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, temperature=0, max_output_tokens=100, tools=[WEATHER],
              tool_choice={"type": "function", "name": "get_weather"})
    out = _checked(client.responses.create(input="Weather in Oslo?", **kw))
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    assert out.status == "completed" and out.incomplete_details is None
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    streamed = list(client.responses.create(input="Weather in Oslo?", stream=True, **kw))
    args = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(args) == 1 and args[0].arguments == calls[0].arguments
    history = [{"role": "user", "content": "Weather in Oslo?"}, *calls,     # the SDK's own items, sent back
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}]
    after = _checked(client.responses.create(input=history, model=kvharbor_app.model, temperature=0,
                                             max_output_tokens=8, tools=[WEATHER], tool_choice="none"))
    chat = client.chat.completions.create(model=kvharbor_app.model, temperature=0, max_tokens=8, tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none",
        messages=[{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function",
                   "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                  {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 21 C"}])
    assert after.output_text == chat.choices[0].message.content
    assert after.usage.input_tokens == chat.usage.prompt_tokens


def test_a_json_schema_format_and_logprobs(client, kvharbor_app):
    schema = {"type": "object", "additionalProperties": False, "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    out = _checked(client.responses.create(
        model=kvharbor_app.model, input="A digit?", temperature=0, max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "digit", "schema": schema}},
        include=["message.output_text.logprobs"], top_logprobs=2))
    jsonschema.validate(json.loads(out.output_text), schema)
    part = out.output[0].content[0]
    assert len(part.logprobs) == out.usage.output_tokens
    assert "".join(lp.token for lp in part.logprobs).removesuffix("</s>") == part.text    # EOS scored too
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert out.text.format.type == "json_schema"
    plain = _checked(client.responses.create(model=kvharbor_app.model, input="A digit?", max_output_tokens=4))
    assert plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize("extra, param", [
    ({"background": True, "store": False}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"truncation": "middle"}, "truncation"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),         # chat's checks, in this API's names
    ({"input": "word " * 5000}, "input"),
    ({"stream": True, "input": "word " * 5000}, "input"),
])
def test_what_is_not_served_is_a_clear_error(kvharbor_app, extra, param):
    with kvharbor_app.client(DEMO["standard"]) as http:
        r = http.post("/v1/responses", json={"model": kvharbor_app.model, "input": "hi", **extra})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"].startswith(param), r.text
    assert "max_tokens" not in r.json()["error"]["message"].replace("max_tokens_per", "")


def test_a_tenants_token_cap_is_named_in_this_apis_terms(kvharbor_app):
    with kvharbor_app.client(TEST_KEYS["capped"]) as http:
        r = http.post("/v1/responses", json={"model": kvharbor_app.model, "input": "hi", "max_output_tokens": 100})
    assert r.status_code == 400 and "max_output_tokens=100" in r.json()["error"]["message"], r.text


def test_one_store_serves_every_gateway_and_the_lane_takes_only_its_classes(kvharbor_app):
    """A response stored through the premium lane (its own gateway process) is read and continued
    through the main port; the lane refuses other classes' Responses requests as any generation."""
    kw = dict(model=kvharbor_app.model, temperature=0, max_output_tokens=4)
    on_lane, on_main = (openai.OpenAI(base_url=url + "/v1", api_key=DEMO["premium"], max_retries=0)
                        for url in (kvharbor_app.lane_url, kvharbor_app.base_url))
    first = on_lane.responses.create(input=ASK, **kw)
    assert on_main.responses.retrieve(first.id).output_text == first.output_text
    second = on_main.responses.create(input="More?", previous_response_id=first.id, **kw)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    with kvharbor_app.client(DEMO["standard"], lane=True) as lane:
        r = lane.post("/v1/responses", json={"model": kvharbor_app.model, "input": "hi"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "wrong_endpoint", r.text


def test_truncation_auto_drops_the_oldest_items_of_a_conversation_too_long(kvharbor_app):
    """OpenAI's ``truncation: "auto"``: the oldest turns go (a tenant's ``truncate_oldest`` for
    one request); without it, the same input is a 400 naming ``input``."""
    from tests.platform.test_context_overflow import chat

    body = {"model": kvharbor_app.model, "input": chat(12, size=400), "max_output_tokens": 4}   # ~10,000 tokens
    with kvharbor_app.client(DEMO["standard"]) as http:
        cut = http.post("/v1/responses", json={**body, "truncation": "auto"})
        refused = http.post("/v1/responses", json=body)
    assert cut.status_code == 200, cut.text
    dropped = int(cut.headers["x-truncated-tokens"])
    assert dropped == cut.json()["kvharbor"]["truncated_prompt_tokens"] > 5000
    assert cut.json()["usage"]["input_tokens"] + 4 <= 4096 and cut.json()["truncation"] == "auto"
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input", refused.text
