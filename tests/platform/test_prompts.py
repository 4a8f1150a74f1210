"""The gateway's prompt checks without Ray (``kvharbor.platform.prompts``): each bad field is a
400 naming it, ``max_tokens`` defaults and bounds against the context, large bodies tokenized
off the event loop. The builtin byte-level tokenizer: 1 letter = 1 token, 259 ids."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvharbor.engine.tokenizer import byte_tokenizer
from kvharbor.platform.error_body import APIError
from kvharbor.platform.openai_protocol import ChatRequest, CompletionRequest
from kvharbor.platform.prompts import TOKENIZE_ON_LOOP_BYTES, Prompts
from tests.conftest import prompt_principal as tenant

CONTEXT = 64


@pytest.fixture(scope="module")
def prompts() -> Prompts:
    return Prompts(byte_tokenizer(), CONTEXT)


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(**{"model": "m", "prompt": "hello", **fields})


def limits(prompts: Prompts, body, chat: bool = False, cap: int | None = None) -> tuple[int, bool]:
    ids = prompts.completion_ids(body) if not chat else [prompts.fit_chat(body, tenant()).token_ids]
    return prompts.limits(body, ids, chat, tenant(cap))


def refused(call, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as caught:
        call(*args, **kwargs)
    assert caught.value.status == 400
    return caught.value


def test_large_or_unsized_bodies_are_tokenized_off_the_event_loop(prompts):
    async def where(size):
        return await prompts.off_loop(lambda: threading.current_thread().name, size)

    names = [asyncio.run(where(size)) for size in (10, TOKENIZE_ON_LOOP_BYTES, TOKENIZE_ON_LOOP_BYTES + 1, None)]
    assert names[:2] == [threading.current_thread().name] * 2
    assert all(name.startswith("kvharbor-tokenize") for name in names[2:]), names


def test_token_ids_must_be_in_the_vocabulary(prompts):
    vocab = len(prompts.tokenizer)
    prompts.check_token_ids([0, vocab - 1], "x")
    prompts.check_token_ids([], "x")
    for bad in ([vocab], [-1], [3, vocab + 5], [5, -1]):      # a negative id among good ones too
        assert refused(prompts.check_token_ids, bad, "stop_token_ids").param == "stop_token_ids"
    error = refused(prompts.completion_ids, completion(prompt=[[1, 2], [3, vocab]]))
    assert error.param == "prompt.1" and f"[0, {vocab})" in error.message
    assert refused(prompts.completion_ids, completion(prompt=[vocab])).param == "prompt"
    assert prompts.completion_ids(completion(prompt=["ab", "c"])) == [[97, 98], [99]]
    assert prompts.completion_ids(completion(prompt=[[5, 6]])) == [[5, 6]]
    for field, value in (("stop_token_ids", [vocab]), ("logit_bias", {str(vocab): 1}), ("allowed_token_ids", [vocab])):
        assert refused(limits, prompts, completion(**{field: value})).param == field


def test_max_tokens_defaults_to_16_for_completions_and_the_rest_of_the_context_for_chat(prompts):
    assert limits(prompts, completion()) == (16, False)
    assert limits(prompts, completion(), cap=8) == (8, False)                  # the tenant's cap
    assert limits(prompts, completion(prompt="x" * (CONTEXT - 5))) == (5, False)   # the room left
    room = CONTEXT - len(prompts.completion_ids(completion())[0])
    assert limits(prompts, completion(max_tokens=None)) == (room, False)       # null: vLLM's rest
    assert limits(prompts, completion(max_tokens=None), cap=20) == (20, False)
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    room = CONTEXT - len(prompts.fit_chat(chat, tenant()).token_ids)
    assert 0 < room < 256
    assert limits(prompts, chat, chat=True) == (room, False)
    assert limits(prompts, chat, chat=True, cap=room - 3) == (room - 3, False)


def test_max_tokens_is_checked_against_the_longest_prompts_room(prompts):
    batch = completion(prompt=["x" * 10, "y" * 40, "z"], max_tokens=CONTEXT - 40)
    assert limits(prompts, batch) == (CONTEXT - 40, False)
    error = refused(limits, prompts, batch.model_copy(update={"max_tokens": CONTEXT - 39}))
    assert (error.code, error.param) == ("context_length_exceeded", "max_tokens")
    assert "prompt.1 (40 tokens)" in error.message and f"at most {CONTEXT - 40}" in error.message
    error = refused(limits, prompts, completion(max_tokens=0))
    assert error.param == "max_tokens" and "echo" in error.message


def test_a_prompt_must_have_a_token_and_leave_room_for_one(prompts):
    assert limits(prompts, completion(prompt="x" * (CONTEXT - 1), max_tokens=1)) == (1, False)
    error = refused(limits, prompts, completion(prompt="x" * CONTEXT))
    assert (error.code, error.param) == ("context_length_exceeded", "prompt")
    assert refused(limits, prompts, completion(prompt=["a", ""])).param == "prompt.1"
    assert "at least one token" in refused(limits, prompts, completion(prompt=[])).message


def test_echo_with_max_tokens_0_is_the_prompt_alone(prompts):
    assert limits(prompts, completion(echo=True, max_tokens=0)) == (1, True)
    assert limits(prompts, completion(echo=True, max_tokens=3)) == (3, False)
    error = refused(limits, prompts, completion(echo=True, max_tokens=0, min_tokens=1))
    assert error.param == "min_tokens" and "max_tokens (0)" in error.message


def test_min_tokens_may_equal_max_tokens_but_not_exceed_it(prompts):
    assert limits(prompts, completion(max_tokens=4, min_tokens=4)) == (4, False)
    assert refused(limits, prompts, completion(max_tokens=4, min_tokens=5)).param == "min_tokens"
    assert refused(limits, prompts, completion(min_tokens=17)).param == "min_tokens"   # default 16


def test_echo_gives_a_text_prompt_as_sent_and_token_ids_decoded(prompts):
    tok = prompts.tokenizer
    sent = f"as {tok.all_special_tokens[0]} sent"                # a special token's text: not dropped
    for prompt, echoed in (([sent, "b"], [sent, "b"]), ([tok.all_special_ids[0], 104, 105], ["hi"])):
        body = completion(prompt=prompt)
        assert prompts.echo_texts(body, prompts.completion_ids(body)) == echoed


def test_a_chat_is_truncated_for_the_answer_it_asks_for_only_when_the_tenant_chose_it(prompts):
    """``truncate_oldest`` keeps room for ``max_tokens`` (or the tenant's default answer):
    the oldest turns go; with ``reject`` nothing is dropped (the length check refuses it)."""
    turns = [{"role": "user", "content": "a" * 12}, {"role": "assistant", "content": "b" * 12},
             {"role": "user", "content": "c" * 12}]
    context = 128
    prompts = Prompts(prompts.tokenizer, context)
    chat = ChatRequest(model="m", messages=turns)
    whole = len(prompts.fit_chat(chat, tenant()).token_ids)
    last = len(prompts.render([turns[-1]]))
    want = context - last                           # the last turn fits exactly
    assert last < whole <= context

    def fitted(max_tokens, overflow="truncate_oldest", cap=None) -> int:
        body = chat if max_tokens is None else chat.model_copy(update={"max_tokens": max_tokens})
        return len(prompts.fit_chat(body, tenant(cap, overflow)).token_ids)

    assert fitted(want) == last
    assert fitted(want + 1) == whole                # not even the last turn fits: left to the length check
    assert fitted(context - whole) == whole         # it fits whole: nothing dropped
    assert fitted(None, cap=want) == last           # the tenant's default answer
    assert fitted(want, "reject") == whole


def test_chat_template_kwargs_reach_the_template_on_chat_and_tokenize():
    """A template with a ``thinking`` switch (as Qwen3's enable_thinking): chat's prompt and
    /tokenize's ids both get it; a name the template is already given is refused by the model."""
    from kvharbor.platform.openai_protocol import TokenizeRequest

    tokenizer = byte_tokenizer()
    tokenizer.chat_template += "{% if thinking %}<think>{% endif %}"
    own = Prompts(tokenizer, 4096)
    messages = [{"role": "user", "content": "hi"}]
    plain = own.fit_chat(ChatRequest(model="m", messages=messages), tenant()).token_ids
    body = ChatRequest(model="m", messages=messages, chat_template_kwargs={"thinking": True})
    thinking = own.fit_chat(body, tenant()).token_ids
    assert thinking == plain + list(b"<think>")
    counted = own.chat_ids(TokenizeRequest(model="m", messages=messages, chat_template_kwargs={"thinking": True}))
    assert counted == thinking
    for bad in ({"tools": []}, {"bos_token": "x"}, {"1x": 1}, {"namespace": 1}):
        with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
            ChatRequest(model="m", messages=messages, chat_template_kwargs=bad)
    tokenizer.chat_template += "{{ thinking + 1 }}"             # a variable of the wrong type
    broken = ChatRequest(model="m", messages=messages, chat_template_kwargs={"thinking": "yes"})
    assert refused(own.fit_chat, broken, tenant()).param == "chat_template_kwargs"


def test_reasoning_effort_reaches_the_template_and_none_turns_thinking_off():
    """vLLM's ``reasoning_effort``: the template reads it, and ``"none"`` sets
    ``enable_thinking`` false unless ``chat_template_kwargs`` sets it."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template += ("{{ reasoning_effort or '-' }}"
                                "{% if enable_thinking is defined and not enable_thinking %}/nothink{% endif %}")
    own = Prompts(tokenizer, 4096)
    messages = [{"role": "user", "content": "hi"}]

    def tail(**body) -> str:
        return bytes(own.fit_chat(ChatRequest(model="m", messages=messages, **body), tenant()).token_ids[-14:]).decode()

    assert tail().endswith("-") and tail(reasoning_effort="high").endswith("high")
    assert tail(reasoning_effort="none").endswith("none/nothink")
    assert tail(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}).endswith("none")


def test_add_special_tokens_as_vllm_a_text_prompt_gets_them_a_chat_only_when_asked():
    """A tokenizer that puts BOS (<s>, id 257) before a text, as Llama's does: completions add
    it unless ``add_special_tokens`` is false; chat leaves it to the template unless true
    (then it is added on top, as vLLM's); /tokenize follows the route it stands for."""
    from tokenizers import processors

    from kvharbor.platform.openai_protocol import TokenizeRequest

    tokenizer = byte_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 257)])
    own = Prompts(tokenizer, 4096)
    assert own.completion_ids(completion(prompt="ab")) == [[257, 97, 98]]
    assert own.completion_ids(completion(prompt="ab", add_special_tokens=False)) == [[97, 98]]
    assert own.completion_ids(completion(prompt=[97, 98], add_special_tokens=True)) == [[97, 98]]
    messages = [{"role": "user", "content": "hi"}]
    chat = ChatRequest(model="m", messages=messages)
    templated = own.fit_chat(chat, tenant()).token_ids
    assert templated[0] != 257 and templated == own.render(messages)
    with_bos = own.fit_chat(chat.model_copy(update={"add_special_tokens": True}), tenant()).token_ids
    assert with_bos == [257, *templated]
    assert own.tokenize_ids(TokenizeRequest(model="m", prompt="ab")) == [257, 97, 98]
    assert own.tokenize_ids(TokenizeRequest(model="m", prompt="ab", add_special_tokens=False)) == [97, 98]
    assert own.tokenize_ids(TokenizeRequest(model="m", messages=messages)) == templated
    assert own.tokenize_ids(TokenizeRequest(model="m", messages=messages, add_special_tokens=True)) == with_bos


def test_truncate_prompt_tokens_keeps_the_last_k_the_first_k_on_the_right_and_minus_one_fits_the_context(prompts):
    ids = [list(range(1, 71)), [7, 8]]                   # 70 tokens: over the context of 64
    assert prompts.truncate(completion(), ids) == ids
    assert prompts.truncate(completion(truncate_prompt_tokens=3), ids) == [[68, 69, 70], [7, 8]]
    assert prompts.truncate(completion(truncate_prompt_tokens=3, truncation_side="left"), ids)[0] == [68, 69, 70]
    assert prompts.truncate(completion(truncate_prompt_tokens=3, truncation_side="right"), ids)[0] == [1, 2, 3]
    kept = prompts.truncate(completion(truncate_prompt_tokens=-1), ids)[0]
    assert kept == list(range(8, 71)) and len(kept) == CONTEXT - 1      # room for one token


def test_bad_words_that_ban_every_allowed_token_are_refused_at_the_gateway(prompts):
    error = refused(limits, prompts, completion(bad_words=["a"], allowed_token_ids=[97]))
    assert error.param == "bad_words" and "nothing could be generated" in error.message
    assert limits(prompts, completion(bad_words=["a"], allowed_token_ids=[97, 98]))[0] == 16
