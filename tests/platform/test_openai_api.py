"""The gateway through the official openai client: completions and chat, streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import DEMO


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


def test_models_lists_the_served_model(client, kvharbor_app):
    ids = [m.id for m in client.models.list().data]
    assert ids == [kvharbor_app.model]


def test_completion_matches_offline_engine(client, kvharbor_app):
    from kvharbor import LLM, SamplingParams

    out = client.completions.create(model=kvharbor_app.model, prompt="The harbor at dawn",
                                    max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    llm = LLM(device="cpu", num_kv_blocks=64)
    ref = llm.generate(["The harbor at dawn"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streamed_completion_equals_non_streamed(client, kvharbor_app):
    kwargs = dict(model=kvharbor_app.model, prompt="Ships and tides", max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streamed_and_not(client, kvharbor_app):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    whole = client.chat.completions.create(model=kvharbor_app.model, messages=messages, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=kvharbor_app.model, messages=messages, max_tokens=8,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 8


def test_sse_ends_with_done(kvharbor_app):
    with kvharbor_app.client(DEMO["batch"]) as c:
        r = c.post("/v1/completions", json={"model": kvharbor_app.model, "prompt": "x", "max_tokens": 3,
                                             "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"


@pytest.mark.parametrize("key,status,code", [("nope", 401, "invalid_api_key"), (None, 401, "invalid_api_key")])
def test_bad_keys_are_401(kvharbor_app, key, status, code):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(kvharbor_app.base_url + "/v1/completions", headers=headers,
                   json={"model": kvharbor_app.model, "prompt": "x"})
    assert r.status_code == status
    assert r.json()["error"]["code"] == code


def test_unknown_model_is_404_and_context_overflow_is_400(client, kvharbor_app):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context of 4096 tokens"):
        client.completions.create(model=kvharbor_app.model, prompt="x", max_tokens=5000)
