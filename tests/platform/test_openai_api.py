"""The gateway through the official openai client: completions and chat, streamed and not
(logprobs and echo: test_openai_logprobs.py)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.conftest import DEMO, LORA


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


def test_models_lists_the_served_model(client, kvharbor_app):
    ids = [m.id for m in client.models.list().data]
    assert ids == [kvharbor_app.model, LORA]


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
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert whole.usage.completion_tokens == 8
    # as OpenAI and vLLM stream it: the role once, in a first delta of no content
    assert [d.role for d in deltas] == ["assistant"] + [None] * (len(deltas) - 1)
    assert deltas[0].content == ""


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


@pytest.mark.parametrize("scheme", ["bearer", "BEARER"])
def test_the_auth_scheme_is_case_insensitive(kvharbor_app, scheme):
    """RFC 9110: the scheme of ``Authorization`` is case-insensitive; a client that sends
    ``bearer <key>`` is served."""
    r = httpx.post(kvharbor_app.base_url + "/v1/completions",
                   headers={"Authorization": f"{scheme} {DEMO['standard']}"},
                   json={"model": kvharbor_app.model, "prompt": "x", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


def test_unknown_model_is_404_and_context_overflow_is_400(client, kvharbor_app):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context of 4096 tokens"):
        client.completions.create(model=kvharbor_app.model, prompt="x", max_tokens=5000)


# ---- fields of the OpenAI spec that kvharbor does not implement are refused by name ------------
@pytest.mark.parametrize("field,value", [
    ("best_of", 3), ("suffix", " the end"),
])
def test_unsupported_completion_fields_are_400_naming_the_field(client, kvharbor_app, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=kvharbor_app.model, prompt="hi", max_tokens=2, **{field: value})
    err = info.value.body
    assert err["param"] == field and field in err["message"] and "not supported" in err["message"], err


@pytest.mark.parametrize("field,value", [
    ("store", True),
    ("metadata", {"k": "v"}), ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "extreme"), ("verbosity", "low"), ("web_search_options", {}),
    ("service_tier", "priority"),
])
def test_unsupported_chat_fields_are_400_naming_the_field(client, kvharbor_app, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=kvharbor_app.model, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}], **{field: value})
    err = info.value.body
    assert err["param"] == field and field in err["message"], err


def test_default_valued_fields_an_sdk_may_send_are_accepted(client, kvharbor_app):
    """Neutral values (0 penalties, empty bias, text format, n=1, user ids) ask for nothing."""
    out = client.chat.completions.create(
        model=kvharbor_app.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        frequency_penalty=0, presence_penalty=0, logit_bias={}, response_format={"type": "text"},
        n=1, user="u1", store=False, tools=[], tool_choice="none", service_tier="auto",
        stream=False, stream_options=None, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2
    out = client.completions.create(model=kvharbor_app.model, prompt="hi", max_tokens=2, echo=False,
                                    best_of=1, frequency_penalty=0.0, user="u1", suffix=None,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_unknown_fields_are_400_naming_the_field(client, kvharbor_app):
    with pytest.raises(openai.BadRequestError, match="unknown field 'temprature'") as info:
        client.completions.create(model=kvharbor_app.model, prompt="hi", extra_body={"temprature": 0})
    assert info.value.body["param"] == "temprature"
    with pytest.raises(openai.BadRequestError, match="messages.0.nmae"):
        client.chat.completions.create(model=kvharbor_app.model,
                                       messages=[{"role": "user", "content": "hi", "nmae": "x"}])


def test_an_sdk_reply_can_be_appended_to_the_history(client, kvharbor_app):
    """The SDK's assistant message carries null refusal/tool_calls/audio: those are accepted."""
    messages = [{"role": "user", "content": "Hello!"}]
    first = client.chat.completions.create(model=kvharbor_app.model, messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "And?"}]
    assert messages[1]["refusal"] is None and "tool_calls" in messages[1]
    again = client.chat.completions.create(model=kvharbor_app.model, messages=messages, max_tokens=4)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens


def test_max_completion_tokens_limits_the_answer(client, kvharbor_app):
    out = client.chat.completions.create(model=kvharbor_app.model, max_completion_tokens=5,
                                         messages=[{"role": "user", "content": "Count"}],
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.chat.completions.create(model=kvharbor_app.model, max_completion_tokens=5, max_tokens=6,
                                       messages=[{"role": "user", "content": "Count"}])


def test_models_retrieve(client, kvharbor_app):
    card = client.models.retrieve(kvharbor_app.model)
    assert card.id == kvharbor_app.model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found" and "gpt-4o" in info.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key="nope",
                      max_retries=0).models.retrieve(kvharbor_app.model)


def test_server_side_abort_is_finish_reason_abort_not_stop(client, kvharbor_app):
    """A request stopped by the server (LLMReplica.abort) ends with "abort", as vLLM reports it."""
    from tests.conftest import live_replica_ids

    stream = client.completions.create(model=kvharbor_app.model, prompt="Long story", max_tokens=3000,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    handle = kvharbor_app.replica_handle()
    stopped = [handle.abort.remote(chunks[0].id, replica_id=rid).result(timeout_s=30) for rid in live_replica_ids()]
    assert sum(stopped) == 1, stopped
    chunks += list(stream)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["abort"], reasons
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) < 3000


# ---- n > 1 ------------------------------------------------------------------------------------
def test_n_choices_share_the_prompts_kv(client, kvharbor_app):
    from tests.reliability.helpers import rand_text, replica_stats

    prompt = rand_text(100, 4242)                    # 6 full blocks of 16 tokens, never seen before
    hits_before = {s["replica_id"]: s["prefix_hit_tokens"] for s in replica_stats(kvharbor_app)}
    out = client.completions.create(model=kvharbor_app.model, prompt=prompt, n=3, max_tokens=8,
                                    temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.prompt_tokens == 100 and out.usage.completion_tokens == 24
    assert len({c.text for c in out.choices}) > 1, "seeded siblings must not repeat each other"
    hits = {s["replica_id"]: s["prefix_hit_tokens"] - hits_before[s["replica_id"]]
            for s in replica_stats(kvharbor_app)}
    assert hits[out.kvharbor["replica_id"]] >= 2 * 96, hits        # both siblings reused 6 blocks
    again = client.completions.create(model=kvharbor_app.model, prompt=prompt, n=3, max_tokens=8,
                                      temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]     # seeds per choice


def test_n_choices_streamed(client, kvharbor_app):
    chunks = list(client.chat.completions.create(
        model=kvharbor_app.model, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]
    assert chunks[-1].usage.completion_tokens == 10
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model=kvharbor_app.model, prompt="x", n=9)


def test_stop_token_ids_end_the_answer_before_the_stop_tokens_text(client, kvharbor_app):
    """vLLM's ``stop_token_ids``: the answer ends at the first of them, without its text,
    streamed or not, on both routes; an id outside the vocabulary is a 400 naming the field."""
    from kvharbor.engine.model_info import load_tokenizer

    tokenizer = load_tokenizer(kvharbor_app.model)
    kw = dict(model=kvharbor_app.model, max_tokens=12, temperature=0)
    free = client.completions.create(prompt="The harbor at dawn", extra_body={"ignore_eos": True}, **kw)
    ids = tokenizer(free.choices[0].text)["input_ids"]
    stop = ids[5]
    stopped = client.completions.create(prompt="The harbor at dawn", extra_body={"ignore_eos": True,
                                        "stop_token_ids": [stop]}, **kw)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == tokenizer.decode(ids[:ids.index(stop)])
    assert stopped.usage.completion_tokens == ids.index(stop) + 1       # the stop token was generated
    streamed = client.completions.create(prompt="The harbor at dawn", stream=True, extra_body={
        "ignore_eos": True, "stop_token_ids": [stop]}, **kw)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == stopped.choices[0].text
    messages = [{"role": "user", "content": "Tides?"}]
    chat = client.chat.completions.create(messages=messages, extra_body={"ignore_eos": True}, **kw)
    chat_ids = tokenizer(chat.choices[0].message.content)["input_ids"]
    chat_stopped = client.chat.completions.create(messages=messages, extra_body={
        "ignore_eos": True, "stop_token_ids": [chat_ids[3]]}, **kw)
    assert chat_stopped.choices[0].message.content == tokenizer.decode(chat_ids[:chat_ids.index(chat_ids[3])])
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        client.completions.create(prompt="x", extra_body={"stop_token_ids": [10**6]}, **kw)


def test_stop_strings_cut_the_answer_and_include_stop_str_in_output_keeps_them(client, kvharbor_app):
    """A stop string ends the answer before it, or, with vLLM's include_stop_str_in_output, just
    after it; streamed or not, on both routes."""
    kw = dict(model=kvharbor_app.model, max_tokens=16, temperature=0)
    free = client.completions.create(prompt="The harbor at dawn", extra_body={"ignore_eos": True}, **kw)
    text = free.choices[0].text
    stop = text[6:9]
    at = text.find(stop)
    for keep, expected in ((False, text[:at]), (True, text[:at + len(stop)])):
        extra = {"ignore_eos": True, "include_stop_str_in_output": keep}
        out = client.completions.create(prompt="The harbor at dawn", stop=[stop], extra_body=extra, **kw)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")
        streamed = client.completions.create(prompt="The harbor at dawn", stop=stop, stream=True,
                                             extra_body=extra, **kw)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    messages = [{"role": "user", "content": "Tides?"}]
    chat = client.chat.completions.create(messages=messages, extra_body={"ignore_eos": True}, **kw)
    answer = chat.choices[0].message.content
    stop = answer[4:7]
    kept = client.chat.completions.create(messages=messages, stop=stop, extra_body={
        "ignore_eos": True, "include_stop_str_in_output": True}, **kw)
    assert kept.choices[0].message.content == answer[:answer.find(stop) + len(stop)]
    with pytest.raises(openai.BadRequestError, match="include_stop_str_in_output"):
        client.completions.create(prompt="x", extra_body={"include_stop_str_in_output": "maybe"}, **kw)


def test_allowed_token_ids_and_bad_words_answer_as_the_offline_engine(client, kvharbor_app):
    """vLLM's allowed_token_ids and bad_words over HTTP: the answer is the offline engine's with
    the same restriction, on both routes; a restriction nothing can satisfy is a 400 naming it."""
    from kvharbor import LLM, SamplingParams

    llm = LLM(device="cpu", num_kv_blocks=64)
    kw = dict(model=kvharbor_app.model, max_tokens=12, temperature=0)
    free = client.completions.create(prompt="The harbor at dawn", extra_body={"ignore_eos": True}, **kw)
    word = free.choices[0].text.split()[1]
    allowed = sorted(set(llm.encode("harbor tides")))
    for extra in ({"bad_words": [word]}, {"allowed_token_ids": allowed}):
        out = client.completions.create(prompt="The harbor at dawn", extra_body={"ignore_eos": True, **extra}, **kw)
        ref = llm.generate(["The harbor at dawn"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                                   **extra))[0]
        assert out.choices[0].text == ref.text != free.choices[0].text
        assert word not in out.choices[0].text if "bad_words" in extra else set(ref.token_ids) <= set(allowed)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Tides?"}], extra_body={
        "ignore_eos": True, "allowed_token_ids": allowed}, **kw)
    assert set(llm.encode(chat.choices[0].message.content)) <= set(allowed)
    for extra, field in (({"bad_words": ["a"], "allowed_token_ids": [97]}, "bad_words"),
                         ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [" "]}, "bad_words")):
        with pytest.raises(openai.BadRequestError, match=field) as e:
            client.completions.create(prompt="x", extra_body=extra, **kw)
        assert e.value.body["param"] == field


def test_truncate_prompt_tokens_answers_as_the_prompts_last_tokens(client, kvharbor_app):
    """vLLM's truncate_prompt_tokens: the answer and usage are those of the prompt's last k
    tokens (echo shows them), on both routes; a prompt beyond the context fits once cut."""
    from kvharbor.engine.model_info import load_tokenizer

    tokenizer = load_tokenizer(kvharbor_app.model)
    kw = dict(model=kvharbor_app.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    text = "The harbor at dawn, where the ships wait for the tide"
    ids = tokenizer(text)["input_ids"]
    tail = client.completions.create(prompt=ids[-9:], **kw)
    cut = client.completions.create(prompt=text, echo=True, **{**kw, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 9}})
    assert cut.usage.prompt_tokens == 9
    assert cut.choices[0].text == tokenizer.decode(ids[-9:]) + tail.choices[0].text
    long = client.completions.create(prompt=text * 400, **{**kw, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 9}})
    assert (long.usage.prompt_tokens, long.usage.completion_tokens) == (9, 6)
    messages = [{"role": "user", "content": text}]
    chat = client.chat.completions.create(messages=messages, **{**kw, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 5}})
    assert chat.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(prompt=text, **{**kw, "extra_body": {"truncate_prompt_tokens": 0}})
    head = client.completions.create(prompt=ids[:9], **kw)            # truncation_side "right": the first k
    right = client.completions.create(prompt=text, **{**kw, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 9, "truncation_side": "right"}})
    assert right.choices[0].text == head.choices[0].text != tail.choices[0].text
    fill = client.completions.create(prompt=text * 400, **{**kw, "max_tokens": 1, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": -1}})              # -1: the context less one token
    context = client.models.retrieve(kvharbor_app.model).max_model_len
    assert (fill.usage.prompt_tokens, fill.usage.completion_tokens) == (context - 1, 1)


def test_chat_continues_the_final_message_as_the_offline_engine(client, kvharbor_app):
    """vLLM's continue_final_message: the answer carries on from the last message's text, as
    the offline engine's on the same text; add_generation_prompt false ends the prompt with the
    last message's turn; continuing needs add_generation_prompt false and text to continue."""
    from kvharbor import LLM, SamplingParams

    llm = LLM(device="cpu", num_kv_blocks=64)
    kw = dict(model=kvharbor_app.model, max_tokens=6, temperature=0)
    chat = [{"role": "user", "content": "Tides?"}, {"role": "assistant", "content": [{"type": "text", "text": "The tide"}]}]
    text = "<|user|>\nTides?\n<|assistant|>\nThe tide"
    out = client.chat.completions.create(messages=chat, **kw, extra_body={
        "ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True})
    ref = llm.generate(text, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    closed = client.chat.completions.create(messages=chat, **kw, extra_body={"add_generation_prompt": False})
    assert closed.usage.prompt_tokens == len(llm.encode(text + "\n"))
    # vLLM's echo: the continued message's text before the answer, streamed or not
    echo = {"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    echoed = client.chat.completions.create(messages=chat, **kw, extra_body=echo)
    streamed = client.chat.completions.create(messages=chat, **kw, extra_body=echo, stream=True)
    assert echoed.choices[0].message.content == "The tide" + ref.text
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "The tide" + ref.text
    opened = client.chat.completions.create(messages=chat[:1], **kw, extra_body={"echo": True, "ignore_eos": True})
    plain = client.chat.completions.create(messages=chat[:1], **kw, extra_body={"ignore_eos": True})
    assert opened.choices[0].message.content == plain.choices[0].message.content   # a user's turn: no echo
    for extra, last in (({"continue_final_message": True}, "The tide"),
                        ({"continue_final_message": True, "add_generation_prompt": False}, " ")):
        with pytest.raises(openai.BadRequestError, match="continue_final_message needs add_generation_prompt"):
            client.chat.completions.create(messages=chat[:1] + [{"role": "assistant", "content": last}],
                                           extra_body=extra, **kw)


def test_skip_special_tokens_false_spells_them_out(client, kvharbor_app):
    """vLLM's skip_special_tokens: a forced end-of-sequence token (not stopping) is left out of
    the text by default and spelt out with false, streamed or not."""
    from kvharbor.engine.model_info import load_tokenizer

    tokenizer = load_tokenizer(kvharbor_app.model)
    kw = dict(model=kvharbor_app.model, prompt="The harbor", max_tokens=3, temperature=0,
              logit_bias={str(tokenizer.eos_token_id): 100})
    assert client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].text == ""
    extra = {"ignore_eos": True, "skip_special_tokens": False}
    assert client.completions.create(extra_body=extra, **kw).choices[0].text == tokenizer.eos_token * 3
    streamed = client.completions.create(stream=True, extra_body=extra, **kw)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == tokenizer.eos_token * 3


def test_chat_template_kwargs_are_taken_and_reserved_names_refused(client, kvharbor_app):
    """vLLM's chat_template_kwargs pass to the template (the builtin one reads none, so the
    prompt is unchanged; tests/platform/test_prompts.py shows one read); a name the template is
    already given is a 400 naming the field."""
    kw = dict(model=kvharbor_app.model, max_tokens=2, temperature=0, messages=[{"role": "user", "content": "hi"}])
    plain = client.chat.completions.create(**kw)
    extra = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert extra.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set") as e:
        client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.body["param"].startswith("chat_template_kwargs")


# ---- penalties, logit_bias, min_tokens, min_p -------------------------------------------------
def test_penalties_and_logit_bias_answer_as_the_offline_engine(client, kvharbor_app):
    """OpenAI's frequency / presence penalties and logit_bias, vLLM's repetition_penalty: the
    answer over HTTP is the offline engine's with the same parameters (which
    tests/engine/test_logits_processors.py checks against transformers), on both routes."""
    from kvharbor import LLM, SamplingParams
    from kvharbor.engine.model_info import load_tokenizer

    tokenizer = load_tokenizer(kvharbor_app.model)
    llm = LLM(device="cpu", num_kv_blocks=64)
    prompt = "The harbor at dawn"
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    cases = [dict(frequency_penalty=1.5, presence_penalty=0.5), dict(presence_penalty=-2.0),
             dict(repetition_penalty=1.8), dict(logit_bias={plain.token_ids[0]: -100, 42: 4.5})]
    for kw in cases:
        ref = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **kw))[0]
        assert ref.token_ids != plain.token_ids, kw
        openai_kw = {k: v for k, v in kw.items() if k != "repetition_penalty"}
        if "logit_bias" in kw:
            openai_kw["logit_bias"] = {str(t): b for t, b in kw["logit_bias"].items()}
        extra = {"ignore_eos": True, **({"repetition_penalty": kw["repetition_penalty"]}
                                        if "repetition_penalty" in kw else {})}
        out = client.completions.create(model=kvharbor_app.model, prompt=prompt, max_tokens=12,
                                        temperature=0, extra_body=extra, **openai_kw)
        assert out.choices[0].text == ref.text, kw
    forced = tokenizer.encode("a", add_special_tokens=False)[0]
    chat = client.chat.completions.create(model=kvharbor_app.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0.7, seed=3,
                                          logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == "aaaaa"


def test_min_tokens_holds_back_eos_over_http(client, kvharbor_app):
    """vLLM's ``min_tokens``: EOS (here forced by logit_bias) cannot end the answer earlier."""
    from kvharbor.engine.model_info import load_tokenizer

    eos = load_tokenizer(kvharbor_app.model).eos_token_id
    kw = dict(model=kvharbor_app.model, prompt="hi", max_tokens=8, temperature=0, logit_bias={str(eos): 100})
    assert client.completions.create(**kw).usage.completion_tokens == 1
    held = client.completions.create(**kw, extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True},
                                              extra_body={"min_tokens": 3}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == held.choices[0].text
    assert streamed[-1].usage.completion_tokens == 4


def test_min_p_one_samples_the_most_likely_token(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, prompt="Ships and tides", max_tokens=10, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    sampled = [client.completions.create(temperature=1.0, seed=s, **kw).choices[0].text for s in (1, 2)]
    assert greedy not in sampled
    kw["extra_body"] = {"ignore_eos": True, "min_p": 1.0}
    assert [client.completions.create(temperature=1.0, seed=s, **kw).choices[0].text for s in (1, 2)] == [greedy] * 2


@pytest.mark.parametrize("body,param,words", [
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", ("max_tokens (8)",)),
    ({"min_tokens": 17}, "min_tokens", ("max_tokens (16)",)),           # the completions default
    ({"logit_bias": {"1000000": 5}}, "logit_bias", ("[0, ",)),
    ({"logit_bias": {"five": 5}}, "logit_bias", ("digits",)),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", ("100",)),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", ("300",)),
    ({"frequency_penalty": 2.5}, "frequency_penalty", ("2",)),
    ({"presence_penalty": -3}, "presence_penalty", ("-2",)),
    ({"repetition_penalty": 0}, "repetition_penalty", ("greater than 0",)),
    ({"min_p": 1.5}, "min_p", ("1",)),
])
def test_sampling_parameters_out_of_range_are_400_by_name(kvharbor_app, body, param, words):
    r = httpx.post(kvharbor_app.base_url + "/v1/completions", headers={"Authorization": f"Bearer {DEMO['standard']}"},
                   json={"model": kvharbor_app.model, "prompt": "hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err


# ---- a batch of prompts -----------------------------------------------------------------------
def test_a_batch_of_prompts_answers_each_as_a_request_of_its_own(client, kvharbor_app):
    """``prompt`` as a list of texts or of token-id lists: one choice per prompt (``n`` per prompt,
    choice ``p * n + j``), each the same as the prompt sent alone, usage summed over prompts."""
    from kvharbor.engine.model_info import load_tokenizer

    kw = dict(model=kvharbor_app.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    prompts = ["The tide", "A harbor master", "Ships"]
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    batch = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 3 * 6
    ids = [list(load_tokenizer(kvharbor_app.model)(p)["input_ids"]) for p in prompts]
    assert [c.text for c in client.completions.create(prompt=ids, **kw).choices] == [c.text for c in batch.choices]

    sampled = dict(model=kvharbor_app.model, max_tokens=6, n=2, seed=11, extra_body={"ignore_eos": True})
    grouped = client.completions.create(prompt=prompts[:2], **sampled)
    assert [c.index for c in grouped.choices] == [0, 1, 2, 3]
    for p in range(2):
        own = client.completions.create(prompt=prompts[p], **sampled)
        assert [c.text for c in grouped.choices[2 * p:2 * p + 2]] == [c.text for c in own.choices]

    chunks = list(client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **kw))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == [c.text for c in batch.choices]
    assert chunks[-1].usage.prompt_tokens == batch.usage.prompt_tokens


# ---- /tokenize and /detokenize ----------------------------------------------------------------
def test_tokenize_counts_what_the_generation_routes_count(client, kvharbor_app):
    """``/tokenize`` gives the ids (and count) a completion's prompt or a chat's rendered
    messages become, so a tenant can size a request against its budget before sending it;
    ``/detokenize`` turns ids back into text."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tides?"}]
    with kvharbor_app.client(DEMO["standard"]) as c:
        text = c.post("/tokenize", json={"model": kvharbor_app.model, "prompt": "Harbor lights"}).json()
        chat = c.post("/tokenize", json={"model": kvharbor_app.model, "messages": messages}).json()
        bare = c.post("/tokenize", json={"model": kvharbor_app.model, "messages": messages,
                                         "add_generation_prompt": False}).json()
        cont = c.post("/tokenize", json={"model": kvharbor_app.model, "messages": messages,
                                         "add_generation_prompt": False, "continue_final_message": True}).json()
        back = c.post("/detokenize", json={"model": kvharbor_app.model, "tokens": text["tokens"]}).json()
    kw = dict(model=kvharbor_app.model, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt="Harbor lights", **kw)
    by_ids = client.completions.create(prompt=text["tokens"], **kw)
    assert text["count"] == len(text["tokens"]) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert text["max_model_len"] == 4096
    assert chat["count"] == client.chat.completions.create(messages=messages, **kw).usage.prompt_tokens
    assert bare["tokens"] == chat["tokens"][:bare["count"]] and bare["count"] < chat["count"]
    assert cont["tokens"] == bare["tokens"][:-1] and cont["count"] == bare["count"] - 1   # no "\n" after "Tides?"
    assert back == {"prompt": "Harbor lights"}


@pytest.mark.parametrize("route,body,status,param", [
    ("/tokenize", {}, 400, None), ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, None),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"), ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
])
def test_tokenize_and_detokenize_refuse_bad_input_by_name(kvharbor_app, route, body, status, param):
    with kvharbor_app.client(DEMO["standard"]) as c:
        r = c.post(route, json={"model": kvharbor_app.model, **body})
        anonymous = httpx.post(kvharbor_app.base_url + route, json={"model": kvharbor_app.model, "prompt": "a"})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert status != 400 or "prompt" in r.json()["error"]["message"] or param in r.json()["error"]["message"]
    assert anonymous.status_code == 401, anonymous.text


# ---- where the time went ----------------------------------------------------------------------
PHASES = ["parse", "queue", "tokenize", "admit", "first_token", "replica", "hops"]


def phases() -> list[str]:
    """The phases of this session's app: ``proxy`` too behind Serve's proxy (its guard stamps)."""
    from tests.conftest import INGRESS

    return PHASES + (["proxy"] if INGRESS[0] == "proxy" else [])


def test_the_response_says_where_the_time_to_first_token_went(kvharbor_app):
    """``kvharbor.timings_ms``: every phase present and non-negative, the replica's share inside
    the gateway's first-token wait, and the app's phases inside the client's wall time."""
    with kvharbor_app.client() as c:
        start = time.perf_counter()
        body = c.post("/v1/completions", json={"model": kvharbor_app.model, "prompt": "timings",
                                                "max_tokens": 1}).json()
        wall_ms = (time.perf_counter() - start) * 1000
        timings = body["kvharbor"]["timings_ms"]
        assert sorted(timings) == sorted(phases()), timings
        assert all(v >= 0 for v in timings.values()), timings
        assert timings["replica"] <= timings["first_token"]
        assert abs(timings["replica"] + timings["hops"] - timings["first_token"]) < 0.01
        app_ms = sum(timings.get(p, 0.0) for p in ("proxy", "parse", "queue", "tokenize", "admit",
                                                    "first_token"))
        assert app_ms < wall_ms, (timings, wall_ms)

        with c.stream("POST", "/v1/chat/completions", json={
                "model": kvharbor_app.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        usage_chunk = json.loads(chunks[-1][6:])
        assert "usage" in usage_chunk and sorted(usage_chunk["kvharbor"]["timings_ms"]) == sorted(phases())
