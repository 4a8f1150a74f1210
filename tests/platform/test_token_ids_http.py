"""vLLM's token-id fields through the official openai client: ``return_token_ids`` (the
prompt's and each choice's token ids) and ``return_tokens_as_token_ids`` (logprobs naming
tokens by id)."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import DEMO


@pytest.fixture(scope="module")
def client(kvharbor_app):
    return openai.OpenAI(base_url=kvharbor_app.base_url + "/v1", api_key=DEMO["standard"], max_retries=0)


def test_return_token_ids_gives_the_engines_ids_streamed_or_not(client, kvharbor_app):
    """vLLM's ``return_token_ids``: the prompt's ids and each choice's output ids, the offline
    engine's for the same request; streamed, the chunks' ids join to the same and the prompt's
    come once (a completion choice's first chunk; a chat's first chunk)."""
    from kvharbor import LLM, SamplingParams

    llm = LLM(device="cpu", num_kv_blocks=64)
    kw = dict(model=kvharbor_app.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    ref = llm.generate("Tides?", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    done = client.completions.create(prompt="Tides?", n=2, **kw)
    assert [(c.prompt_token_ids, c.token_ids) for c in done.choices] == [(ref.prompt_token_ids, ref.token_ids)] * 2
    chunks = [c.choices[0] for c in client.completions.create(prompt="Tides?", stream=True, **kw) if c.choices]
    assert sum((c.token_ids for c in chunks), []) == ref.token_ids and len(ref.token_ids) == 6
    assert [c.prompt_token_ids for c in chunks if getattr(c, "prompt_token_ids", None)] == [ref.prompt_token_ids]
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Tides?"}], **kw)
    assert len(chat.prompt_token_ids) == chat.usage.prompt_tokens and len(chat.choices[0].token_ids) == 6
    streamed = list(client.chat.completions.create(messages=[{"role": "user", "content": "Tides?"}], stream=True, **kw))
    assert streamed[0].prompt_token_ids == chat.prompt_token_ids
    assert sum((c.choices[0].token_ids for c in streamed[1:] if c.choices), []) == chat.choices[0].token_ids
    assert not hasattr(client.completions.create(model=kvharbor_app.model, prompt="Tides?", max_tokens=2).choices[0],
                       "token_ids")


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(client, kvharbor_app):
    """vLLM's ``return_tokens_as_token_ids``: each logprobs token (chosen and alternatives) is
    ``token_id:<id>``, the ids ``return_token_ids`` gives; chat's bytes stay the token's text."""
    from kvharbor.engine.model_info import load_tokenizer

    tokenizer = load_tokenizer(kvharbor_app.model)
    kw = dict(model=kvharbor_app.model, max_tokens=5, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True})
    done = client.completions.create(prompt="Tides?", logprobs=2, **kw).choices[0]
    assert done.logprobs.tokens == [f"token_id:{i}" for i in done.token_ids]
    assert all(all(k.startswith("token_id:") for k in top) for top in done.logprobs.top_logprobs)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Tides?"}], logprobs=True,
                                          top_logprobs=2, **kw).choices[0]
    entries = chat.logprobs.content
    assert [e.token for e in entries] == [f"token_id:{i}" for i in chat.token_ids]
    assert [bytes(e.bytes).decode() for e in entries] == [tokenizer.decode([i]) for i in chat.token_ids]
    assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)
