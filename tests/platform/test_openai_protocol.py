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
