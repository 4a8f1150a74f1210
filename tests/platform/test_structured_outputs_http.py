"""Structured outputs over HTTP: OpenAI's ``response_format`` (json_object, json_schema) and
vLLM's ``structured_outputs`` (json, regex, choice, grammar) on both routes, streamed and not,
answer what the offline engine answers with the same spec; a spec that does not parse is a 400
naming the field, before anything is routed."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import DEMO

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
          "properties": {"name": {"enum": ["ark", "brig", "cog"]}, "size": {"type": "integer", "minimum": 1, "maximum": 9}}}


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


@pytest.fixture(scope="module")
def offline():
    from kvharbor import LLM

    return LLM(device="cpu", num_kv_blocks=64)


def offline_text(offline, prompt: str, spec: dict, **kw) -> str:
    from kvharbor import SamplingParams

    return offline.generate([prompt], SamplingParams(temperature=0, structured_outputs=spec, **kw))[0].text


def test_chat_json_schema_answers_json_of_that_schema(client, kvharbor_app):
    """(This small model pads JSON with whitespace runs up to their bound: hence the room.)"""
    fmt = {"type": "json_schema", "json_schema": {"name": "ship", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Describe a ship"}]
    out = client.chat.completions.create(model=kvharbor_app.model, messages=messages, max_tokens=250,
                                         temperature=0, response_format=fmt)
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=kvharbor_app.model, messages=messages, max_tokens=250,
                                              temperature=0, response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    sampled = client.chat.completions.create(model=kvharbor_app.model, messages=messages, max_tokens=250,
                                             temperature=1.0, seed=7, n=3, response_format=fmt)
    assert [c.finish_reason for c in sampled.choices] == ["stop"] * 3
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_structured_outputs_answer_as_the_offline_engine(client, kvharbor_app, offline):
    """Each kind of vLLM's ``structured_outputs`` and OpenAI's json_object: the completion over
    HTTP is the offline engine's with the same spec (tests/engine/test_structured_output.py
    checks that against the model), and it holds."""
    prompt = "Cargo manifest:"
    cases = [({"choice": ["salt", "silk", "spice", "tea"]}, lambda t: t in ("salt", "silk", "spice", "tea")),
             ({"regex": r"[A-Z]{2}-\d{3}"}, lambda t: re.fullmatch(r"[A-Z]{2}-\d{3}", t)),
             ({"json": SCHEMA, "disable_any_whitespace": True}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
             ({"grammar": 'root ::= "port " [a-z]+ "."'}, lambda t: re.fullmatch(r"port [a-z]+\.", t))]
    for spec, holds in cases:
        out = client.completions.create(model=kvharbor_app.model, prompt=prompt, max_tokens=30, temperature=0,
                                        extra_body={"structured_outputs": spec})
        text = out.choices[0].text
        assert text == offline_text(offline, prompt, spec, max_tokens=30), spec
        if out.choices[0].finish_reason == "stop":
            assert holds(text), (spec, text)
    out = client.completions.create(model=kvharbor_app.model, prompt=prompt, max_tokens=30, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].text == offline_text(offline, prompt, {"json_object": True}, max_tokens=30)
    assert out.choices[0].text.startswith("{")
    free = client.completions.create(model=kvharbor_app.model, prompt=prompt, max_tokens=30, temperature=0)
    assert free.choices[0].text not in ("salt", "silk", "spice", "tea")


def test_a_batch_of_prompts_and_n_choices_each_follow_the_spec(client, kvharbor_app):
    spec = {"choice": ["north", "south", "east", "west"]}
    out = client.completions.create(model=kvharbor_app.model, prompt=["Wind from the", "Sail"], n=3,
                                    max_tokens=10, temperature=1.0, seed=11, extra_body={"structured_outputs": spec})
    assert len(out.choices) == 6
    assert all(c.text in spec["choice"] and c.finish_reason == "stop" for c in out.choices), out.choices


def _post(kvharbor_app, route: str, body: dict) -> httpx.Response:
    base = {"model": kvharbor_app.model, "max_tokens": 4}
    base.update({"prompt": "hi"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    return httpx.post(f"{kvharbor_app.base_url}/v1/{route}" if route == "completions"
                      else f"{kvharbor_app.base_url}/v1/chat/completions",
                      headers={"Authorization": f"Bearer {DEMO['standard']}"}, json={**base, **body}, timeout=30)


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("body,param,words", [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", ("regex does not compile", "parenthesis")),
    ({"structured_outputs": {"json": {"type": 5}}}, "structured_outputs", ("json does not compile",)),
    ({"structured_outputs": {"grammar": "start ::= 'a'"}}, "structured_outputs", ("grammar does not compile",)),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", ("exactly one of",)),
    ({"structured_outputs": {}}, "structured_outputs", ("exactly one of",)),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ("at least 1",)),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern", ("unknown field",)),
    ({"response_format": {"type": "json_schema"}}, "response_format", ("json_schema is required",)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     ("json_schema.schema is required",)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", ("json_schema.schema does not compile",)),
    ({"response_format": {"type": "xml"}}, "response_format.type", ("json_schema",)),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     ("not both",)),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", ("min_tokens cannot",)),
])
def test_bad_specs_are_400_by_name(kvharbor_app, route, body, param, words):
    r = _post(kvharbor_app, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err


def test_text_format_and_nulls_ask_for_nothing(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, prompt="Tides", max_tokens=6, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw, extra_body={"response_format": {"type": "text"}}).choices[0].text == free
    assert client.completions.create(**kw, extra_body={"structured_outputs": None}).choices[0].text == free
