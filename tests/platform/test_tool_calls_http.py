"""Function calling on the chat route through the official client: a named function answers its
arguments, ``"required"`` one or more calls of the tools, as ``message.tool_calls`` (streamed:
one delta), each following its function's schema; the history may carry calls and their
results; the choices that cannot be served are 400s naming ``tool_choice``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import DEMO

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Oslo", "Lima", "Pune"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


def check_calls(calls, names) -> None:
    assert calls, calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_answers_its_arguments(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, messages=ASK, max_tokens=200, temperature=0, tools=[WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    assert choice.message.content is None and choice.finish_reason == "stop"
    check_calls(choice.message.tool_calls, ["get_weather"])
    assert len(choice.message.tool_calls) == 1
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert len(calls) > 2 and chunks[-1].choices[0].finish_reason == "stop"     # the arguments as they come
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in calls[1:])
    assert "".join(c.function.arguments for c in calls) == choice.message.tool_calls[0].function.arguments
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_required_streams_its_calls_in_one_delta(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, messages=ASK, max_tokens=300, temperature=1.0, seed=5, tools=[WEATHER, TIME],
              tool_choice="required")               # (greedy, this small model repeats calls until max_tokens)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert whole
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
    streamed = deltas[0].tool_calls
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == \
        [(i, c.function.name, c.function.arguments) for i, c in enumerate(whole)]


def test_parallel_tool_calls_false_answers_one_call(client, kvharbor_app):
    """vLLM's ``parallel_tool_calls: false``: ``required`` answers a list of one call (greedy,
    this model would repeat calls until ``max_tokens`` cut the list)."""
    kw = dict(model=kvharbor_app.model, messages=ASK, max_tokens=300, temperature=0, tools=[WEATHER, TIME],
              tool_choice="required")
    assert client.chat.completions.create(**kw).choices[0].finish_reason == "length"     # many, cut
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1, one
    check_calls(one.message.tool_calls, ["get_weather", "get_time"])


def test_required_answers_calls_of_the_tools(client, kvharbor_app):
    out = client.chat.completions.create(model=kvharbor_app.model, messages=ASK, max_tokens=300, temperature=1.0,
                                         seed=5, n=3, tools=[WEATHER, TIME], tool_choice="required")
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        check_calls(choice.message.tool_calls, ["get_weather", "get_time"])


def test_the_history_may_carry_calls_and_their_results(client, kvharbor_app):
    first = client.chat.completions.create(model=kvharbor_app.model, messages=ASK, max_tokens=200, temperature=0,
                                           tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "12 C, rain"}]
    out = client.chat.completions.create(model=kvharbor_app.model, messages=history, max_tokens=5, temperature=0,
                                         tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    assert out.usage.prompt_tokens > first.usage.prompt_tokens


def test_tool_choice_none_answers_text(client, kvharbor_app):
    out = client.chat.completions.create(model=kvharbor_app.model, messages=ASK, max_tokens=6, temperature=0,
                                         tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason in ("stop", "length")


def test_calls_cut_by_max_tokens(client, kvharbor_app):
    """A named function's cut arguments are still its call (as vLLM answers); a cut list of
    calls (``required``) cannot be parsed and comes back as text."""
    kw = dict(model=kvharbor_app.model, messages=ASK, max_tokens=3, temperature=0, tools=[WEATHER])
    named = client.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.tool_calls[0].function.arguments.startswith('{"')
    required = client.chat.completions.create(**kw, tool_choice="required").choices[0]
    assert required.finish_reason == "length" and required.message.tool_calls is None
    assert required.message.content.startswith("[")


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [WEATHER]}, "tool_choice", ('"auto"', "required")),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", ('"auto"',)),
    ({"tool_choice": "required"}, "tool_choice", ("needs tools",)),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     ("'nope'", "get_weather")),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "none"},
     "tools.0.function.name", ("pattern",)),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None,
     ("cannot be combined",)),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0", ("content is required",)),
])
def test_choices_that_cannot_be_served_are_400_by_name(kvharbor_app, body, param, words):
    r = httpx.post(f"{kvharbor_app.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {DEMO['standard']}"},
                   json={"model": kvharbor_app.model, "messages": ASK, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err


def test_tokenize_counts_a_chat_with_tools_as_the_chat_route_does(client, kvharbor_app):
    first = client.chat.completions.create(model=kvharbor_app.model, messages=ASK, max_tokens=200, temperature=0,
                                           tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "rain"}]
    chat = client.chat.completions.create(model=kvharbor_app.model, messages=history, max_tokens=1, temperature=0,
                                          tools=[WEATHER, TIME], tool_choice="none")
    r = httpx.post(f"{kvharbor_app.base_url}/tokenize", headers={"Authorization": f"Bearer {DEMO['standard']}"},
                   json={"model": kvharbor_app.model, "messages": history, "tools": [WEATHER, TIME]}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == chat.usage.prompt_tokens
    bad = httpx.post(f"{kvharbor_app.base_url}/tokenize", headers={"Authorization": f"Bearer {DEMO['standard']}"},
                     json={"model": kvharbor_app.model, "prompt": "hi", "tools": [WEATHER]}, timeout=30)
    assert bad.status_code == 400 and "tools go with messages" in bad.json()["error"]["message"]
