"""vLLM's ``chat_template``: a checkpoint whose tokenizer has none can still chat, with a
template given at start (``chat_template=`` of ``LLM`` / ``build_app``) or per call
(``LLM.chat``); without one, chat is refused with what to do, offline and over HTTP (400)."""

from __future__ import annotations

import pytest
import torch

from kvharbor import LLM, SamplingParams
from kvharbor.engine.model_info import NO_CHAT_TEMPLATE, chat_template_text
from kvharbor.engine.models import load_model
from kvharbor.engine.tokenizer import byte_tokenizer
from kvharbor.platform.error_body import APIError
from kvharbor.platform.prompts import Prompts

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
MESSAGES = [{"role": "user", "content": "Hi there"}]


def test_a_template_is_a_jinja_files_path_or_the_template_and_a_bad_one_fails_at_start(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert chat_template_text(str(path)) == chat_template_text(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        chat_template_text(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        chat_template_text("{% for m in messages %}")


@pytest.fixture(scope="module")
def bare_checkpoint(tmp_path_factory) -> str:
    """tiny-llama saved with a tokenizer that has no chat template (as many base models)."""
    path = tmp_path_factory.mktemp("bare")
    load_model("kvharbor/tiny-llama", torch.float32, torch.device("cpu"), 0).model.save_pretrained(path)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_checkpoint_without_a_template_chats_with_one_given_at_start_or_per_call(bare_checkpoint, tmp_path):
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    bare = LLM(model=bare_checkpoint, device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="has no chat template"):
        bare.chat(MESSAGES, sp)
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    per_call = bare.chat(MESSAGES, sp, chat_template=str(path))[0]
    at_start = LLM(model=bare_checkpoint, device="cpu", num_kv_blocks=64, chat_template=str(path)).chat(MESSAGES, sp)[0]
    want = bare.generate(["<user>Hi there\n<assistant>"], sp)[0]
    assert per_call.prompt_token_ids == at_start.prompt_token_ids == want.prompt_token_ids
    assert per_call.outputs[0].text == at_start.outputs[0].text == want.outputs[0].text


def test_the_gateway_refuses_a_chat_without_a_template_with_a_400_saying_what_to_do():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(APIError) as refused:
        Prompts(tokenizer, 4096).render(MESSAGES)
    assert refused.value.status == 400 and NO_CHAT_TEMPLATE in str(refused.value.message)
    tokenizer.chat_template = TEMPLATE
    assert Prompts(tokenizer, 4096).render(MESSAGES) == list(b"<user>Hi there\n<assistant>")


def test_offline_chat_shows_the_model_its_tools_through_the_template(bare_checkpoint):
    """``LLM.chat(tools=...)`` (vLLM's): the template renders the tools into the prompt, the
    same prompt the gateway builds for a chat request with those tools."""
    from tests.platform.test_tool_calls import TEMPLATE as TOOLS_TEMPLATE, TOOLS

    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = LLM(model=bare_checkpoint, device="cpu", num_kv_blocks=64, chat_template=TOOLS_TEMPLATE)
    with_tools, without = llm.chat(MESSAGES, sp, tools=TOOLS)[0], llm.chat(MESSAGES, sp)[0]
    text = llm.tokenizer.decode(with_tools.prompt_token_ids)
    assert text.startswith("TOOLS get_weather") and "TOOLS" not in llm.tokenizer.decode(without.prompt_token_ids)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    assert with_tools.prompt_token_ids == Prompts(tokenizer, 4096).render(MESSAGES, tools=TOOLS)
