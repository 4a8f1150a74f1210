"""vLLM's request and answer fields through the official openai client: ``prompt_logprobs``
(each prompt token's score given the tokens before it, its rank in the vocabulary and the most
likely tokens there, the offline engine's numbers; on completions' choices and chat's
response), ``stop_reason`` (which stop token id or stop string ended each choice) and
``thinking_token_budget`` (refused without a reasoning parser); and those it does not implement,
which take only their neutral values."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import DEMO


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


def _expected(scored, ids, decode, k: int) -> list:
    """vLLM's field from the offline engine's ``TokenLogprobs``: the prompt token first, then
    the k best (ranks 1..k)."""
    out = [None]
    for t, lp in zip(ids[1:], scored[1:]):
        entry = {str(t): (lp.rank, decode([t]))}
        entry.update((str(i), (r, decode([i]))) for r, (i, _) in enumerate(lp.top[:k], start=1))
        out.append(entry)
    return out


def _shape(field) -> list:
    return [None if pos is None else {key: (v["rank"], v["decoded_token"]) for key, v in pos.items()}
            for pos in field]


def test_prompt_logprobs_are_the_engines_with_ranks(client, kvharbor_app):
    from kvharbor import LLM, SamplingParams
    from kvharbor.engine.model_info import load_tokenizer

    decode = load_tokenizer(kvharbor_app.model).decode
    llm = LLM(device="cpu", num_kv_blocks=64)
    ref = llm.generate("Tides rise and fall?", SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert any(lp is not None and lp.rank > 2 for lp in ref.prompt_logprobs)   # some token outside the top 2
    kw = dict(model=kvharbor_app.model, max_tokens=2, temperature=0)
    for _ in range(2):                      # the second time the prompt is in the prefix cache
        done = client.completions.create(prompt="Tides rise and fall?", n=2, extra_body={"prompt_logprobs": 2}, **kw)
        for choice in done.choices:
            field = choice.prompt_logprobs
            assert len(field) == len(ref.prompt_token_ids) == done.usage.prompt_tokens
            assert _shape(field) == _expected(ref.prompt_logprobs, ref.prompt_token_ids, decode, 2)
            assert [list(pos)[0] for pos in field[1:]] == [str(t) for t in ref.prompt_token_ids[1:]]
            assert all(abs(pos[str(t)]["logprob"] - lp.logprob) < 1e-4
                       for pos, t, lp in zip(field[1:], ref.prompt_token_ids[1:], ref.prompt_logprobs[1:]))
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Tides?"}],
                                          extra_body={"prompt_logprobs": 0}, **kw)
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens and chat.prompt_logprobs[0] is None
    assert all(len(pos) == 1 and list(pos.values())[0]["rank"] >= 1 for pos in chat.prompt_logprobs[1:])
    plain = client.completions.create(prompt="Tides?", **kw)
    assert getattr(plain.choices[0], "prompt_logprobs", None) is None


def test_echo_with_logprobs_answers_prompt_logprobs_and_keeps_its_own_count(client, kvharbor_app):
    """As vLLM: completions' echo with logprobs also answers prompt_logprobs; asking for more
    prompt alternatives than logprobs leaves the echoed logprobs object at logprobs + 1."""
    kw = dict(model=kvharbor_app.model, prompt="Tides rise and fall?", max_tokens=2, temperature=0, echo=True, logprobs=1)
    echoed = client.completions.create(**kw).choices[0]
    assert all(len(pos) <= 2 for pos in echoed.prompt_logprobs[1:])
    wide = client.completions.create(**kw, extra_body={"prompt_logprobs": 4}).choices[0]
    assert any(len(pos) == 5 for pos in wide.prompt_logprobs[1:])
    assert wide.logprobs.top_logprobs == echoed.logprobs.top_logprobs
    assert all(top is None or len(top) <= 2 for top in wide.logprobs.top_logprobs)


def test_chat_echo_answers_prompt_logprobs_with_top_logprobs_alternatives(client, kvharbor_app):
    """vLLM's chat: ``echo`` without ``prompt_logprobs`` scores the prompt with ``top_logprobs``
    alternatives; a stream with echo is not refused (nothing to answer it with)."""
    kw = dict(model=kvharbor_app.model, messages=[{"role": "user", "content": "Tides?"}], max_tokens=2,
              temperature=0, logprobs=True, top_logprobs=2)
    echoed = client.chat.completions.create(**kw, extra_body={"echo": True})
    assert len(echoed.prompt_logprobs) == echoed.usage.prompt_tokens and echoed.prompt_logprobs[0] is None
    assert all(len(pos) in (2, 3) for pos in echoed.prompt_logprobs[1:])       # the token, then ranks 1-2
    assert any(len(pos) == 3 for pos in echoed.prompt_logprobs[1:])
    assert getattr(client.chat.completions.create(**kw), "prompt_logprobs", None) is None
    assert list(client.chat.completions.create(**kw, stream=True, extra_body={"echo": True}))


def test_prompt_logprobs_on_a_stream_is_refused_as_vllm_does(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, prompt="Tides?", max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs") as refused:
        client.completions.create(**kw, extra_body={"prompt_logprobs": 1})
    assert refused.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=kvharbor_app.model, prompt="Tides?", extra_body={"prompt_logprobs": 21})
    long = {**kw, "prompt": "Tides rise and fall, and the harbor waits for them. " * 6}
    client.completions.create(**{**long, "stream": False})                  # now in the prefix cache
    chunks = list(client.completions.create(**long, extra_body={"prompt_logprobs": 0},
                                            stream_options={"include_usage": True}))
    assert chunks and all(getattr(c.choices[0], "prompt_logprobs", None) is None for c in chunks if c.choices)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0     # nothing scored: the cache serves it


def test_stop_reason_is_the_stop_token_or_string_streamed_or_not(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, max_tokens=10, temperature=0)
    free = client.completions.create(prompt="Tides?", extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
    first = free.choices[0]
    assert first.finish_reason == "length" and first.stop_reason is None
    token, word = first.token_ids[3], first.text[-2:]
    by_id = client.completions.create(prompt="Tides?", extra_body={"ignore_eos": True, "stop_token_ids": [token]}, **kw)
    assert (by_id.choices[0].finish_reason, by_id.choices[0].stop_reason) == ("stop", token)
    by_text = client.completions.create(prompt="Tides?", stop=[word], extra_body={"ignore_eos": True}, **kw)
    assert (by_text.choices[0].finish_reason, by_text.choices[0].stop_reason) == ("stop", word)
    messages = [{"role": "user", "content": "Tides?"}]
    chat = client.chat.completions.create(messages=messages, extra_body={"ignore_eos": True}, **kw)
    word = chat.choices[0].message.content[-2:]
    for stream in (False, True):
        answer = client.chat.completions.create(messages=messages, stop=word, stream=stream, n=2,
                                                extra_body={"ignore_eos": True}, **kw)
        last = answer.choices if not stream else [c.choices[0] for c in answer if c.choices and c.choices[0].finish_reason]
        assert sorted((c.index, c.finish_reason, c.stop_reason) for c in last) == [(0, "stop", word), (1, "stop", word)]
    streamed = [c.choices[0] for c in client.completions.create(prompt="Tides?", stream=True,
                                                                 extra_body={"ignore_eos": True}, **kw)]
    assert streamed[-1].finish_reason == "length" and streamed[-1].stop_reason is None
    assert all(getattr(c, "stop_reason", None) is None for c in streamed)


def test_repetition_detection_ends_a_looping_answer_as_the_engine_does(client, kvharbor_app):
    from kvharbor import LLM, SamplingParams

    spec = {"max_pattern_size": 8, "min_count": 2}
    ref = LLM(device="cpu", num_kv_blocks=64).generate(
        "Hello", SamplingParams(max_tokens=64, temperature=0, repetition_detection=spec))[0].outputs[0]
    assert ref.finish_reason == "repetition"
    kw = dict(model=kvharbor_app.model, prompt="Hello", max_tokens=64, temperature=0,
              extra_body={"repetition_detection": spec})
    done = client.completions.create(**kw).choices[0]
    assert (done.text, done.finish_reason, done.stop_reason) == (ref.text, "repetition", "repetition_detected")
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == ref.text and chunks[-1].finish_reason == "repetition"
    free = client.completions.create(**{**kw, "extra_body": None}).choices[0]
    assert free.finish_reason == "length" and free.text.startswith(ref.text) and free.text != ref.text
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**{**kw, "extra_body": {"repetition_detection": {"max_pattern_size": 4, "min_count": 1}}})
    assert refused.value.body["param"].startswith("repetition_detection") and "min_count" in refused.value.body["message"]


def test_a_thinking_budget_needs_a_server_with_a_reasoning_parser(client, kvharbor_app):
    kw = dict(model=kvharbor_app.model, messages=[{"role": "user", "content": "Tides?"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="reasoning_parser") as refused:
        client.chat.completions.create(**kw, extra_body={"thinking_token_budget": 3})
    assert refused.value.body["param"] == "thinking_token_budget"
    assert client.chat.completions.create(**kw, extra_body={"thinking_token_budget": -1}).choices   # no budget
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client.chat.completions.create(**kw, extra_body={"thinking_token_budget": -2})


def test_vllm_fields_kvharbor_does_not_implement_take_their_neutral_values_only(client, kvharbor_app):
    """A client written for vLLM may send these with their defaults: accepted; any other value is
    a 400 naming the field (not an answer that ignored it)."""
    neutral = {"use_beam_search": False, "length_penalty": 1.0, "spaces_between_special_tokens": True, "priority": 0}
    out = client.completions.create(model=kvharbor_app.model, prompt="hi", max_tokens=2,
                                    extra_body={"ignore_eos": True, **neutral})
    assert out.usage.completion_tokens == 2
    for field, value in (("spaces_between_special_tokens", False), ("priority", 5)):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=kvharbor_app.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, extra_body={field: value})
        assert refused.value.body["param"] == field and "not supported" in refused.value.body["message"]
