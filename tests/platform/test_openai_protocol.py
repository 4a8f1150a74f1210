"""The OpenAI request models on their own (no app): what they accept and how they read it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvharbor.platform.openai_protocol import ChatRequest, CompletionRequest


def chat(content, **extra) -> ChatRequest:
    return ChatRequest(model="m", messages=[{"role": "user", "content": content}], **extra)


def test_a_message_of_text_parts_reads_as_their_concatenation():
    message = chat([{"type": "text", "text": "Hello, "}, {"type": "text", "text": "harbor"}]).messages[0]
    assert message.text() == "Hello, harbor"
    assert chat("plain").messages[0].text() == "plain"


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])
def test_a_seed_outside_64_bits_is_refused(seed):
    with pytest.raises(ValidationError, match="seed"):
        CompletionRequest(model="m", prompt="hi", seed=seed)
    assert CompletionRequest(model="m", prompt="hi", seed=-(2**63)).seed == -(2**63)


@pytest.mark.parametrize("prompt,prompts", [
    ("hi", ["hi"]), ([1, 2], [[1, 2]]), ([], [[]]),
    (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]), (["solo"], ["solo"]),
])
def test_a_completions_prompt_is_one_prompt_or_a_batch(prompt, prompts):
    """A text or a token-id list is one prompt; a list of texts or of token-id lists is a batch
    (OpenAI's four shapes of ``prompt``)."""
    request = CompletionRequest(model="m", prompt=prompt)
    assert request.prompts() == prompts
    assert request.batched == (isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int))


@pytest.mark.parametrize("prompt,n,message", [
    (["a"] * 33, 1, "at most 32 prompts, got 33"),
    (["a"] * 9, 8, "9 prompts x n=8 is 72 choices; at most 64"),
    (["a", 3], 1, "must be a text, a list of token ids, or a batch"),
    ([["a"]], 1, "must be a text, a list of token ids, or a batch"),
    ([1.5], 1, "must be a text, a list of token ids, or a batch"),
    (42, 1, "must be a text, a list of token ids, or a batch"),
    ([[1], [1] * 131_073], 1, "at most 131072 ids, got 131073"),
    ([3, -1], 1, "token ids are >= 0, got -1"), ([[3], [-2]], 1, "token ids are >= 0, got -2"),
])
def test_a_badly_shaped_prompt_or_batch_is_refused_with_one_message(prompt, n, message):
    """One reason, naming the limit, rather than one complaint per shape ``prompt`` may take."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest(model="m", prompt=prompt, n=n)
    errors = info.value.errors()
    assert len(errors) == 1 and message in errors[0]["msg"], errors
    assert CompletionRequest(model="m", prompt=["a"] * 32, n=2).prompts() == ["a"] * 32     # 64 choices


NULLABLE = {"temperature": 1.0, "top_p": 1.0, "n": 1, "stream": False, "frequency_penalty": 0.0,
            "presence_penalty": 0.0, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}


@pytest.mark.parametrize("make", [lambda **kw: CompletionRequest(model="m", prompt="hi", **kw),
                                  lambda **kw: chat("hi", **kw)], ids=["completions", "chat"])
def test_an_explicit_null_reads_as_the_default(make):
    """SDKs send null for fields a user left unset: the request then runs with the defaults
    (the engine takes numbers, never None)."""
    request = make(**{field: None for field in NULLABLE})
    assert {field: getattr(request, field) for field in NULLABLE} == NULLABLE
