"""The OpenAI request models on their own (no app): what they accept and how they read it."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from kvharbor.platform.error_body import error_response
from kvharbor.platform.openai_protocol import (GREEDY_BELOW, MAX_CHOICES, MAX_PROMPT_TOKEN_IDS, MAX_STOP_CHARS,
                                               MAX_STOP_STRINGS, ChatRequest, CompletionRequest,
                                               DetokenizeRequest, TokenizeRequest, bound_token_ids)


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


NULLABLE = {"n": 1, "stream": False, "min_tokens": 0}
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "min_p": 0.0, "repetition_penalty": 1.0}


@pytest.mark.parametrize("make", [lambda **kw: CompletionRequest(model="m", prompt="hi", **kw),
                                  lambda **kw: chat("hi", **kw)], ids=["completions", "chat"])
def test_an_explicit_null_reads_as_the_default(make):
    """SDKs send null for fields a user left unset: the request then runs with the defaults
    (the engine takes numbers, never None): the sampling fields the model's default (see
    tests/engine/test_generation_config.py), here none, so the neutral values."""
    request = make(**{field: None for field in [*NULLABLE, *SAMPLING]})
    assert {field: getattr(request, field) for field in NULLABLE} == NULLABLE
    assert request.sampling_values({}) == SAMPLING


@pytest.mark.parametrize("bias,why", [
    ({"1234567890": 1.0}, "strings of digits"),          # 10 digits: beyond any vocabulary's ids
    ({"\u0661\u0662": 1.0}, "strings of digits"),        # Arabic-Indic digits: int() reads them as 12
    ({"5": 100.5}, "less than or equal to 100"), ({"5": -101}, "greater than or equal to -100"),
    ({str(i): 1.0 for i in range(301)}, "at most 300"),
])
def test_logit_bias_takes_ascii_token_ids_and_biases_within_100(bias, why):
    with pytest.raises(ValidationError, match=why):
        CompletionRequest(model="m", prompt="hi", logit_bias=bias)
    edge = {"123456789": 100.0, "7": -100.0, **{str(i): 0.5 for i in range(1000, 1298)}}     # 300 entries
    taken = CompletionRequest(model="m", prompt="hi", logit_bias=edge).logit_bias
    assert len(taken) == 300 and (taken[123456789], taken[7]) == (100.0, -100.0)


@pytest.mark.parametrize(("field", "bad", "good"), [
    ("top_p", 0.0, 1e-9), ("top_k", -1, 0), ("stop_token_ids", [1] * 65, [1] * 64), ("logprobs", 21, 20),
    ("min_p", 1.01, 1.0), ("min_tokens", -1, 0), ("frequency_penalty", 2.01, -2.0),
    ("repetition_penalty", 0.0, 1e-9), ("repetition_penalty", float("inf"), 2.0),
])
def test_each_sampling_bound_refuses_just_past_it(field, bad, good):
    """The bounds the API reference states, each checked at its edge (a value one step past is
    refused naming the field; the edge itself runs)."""
    with pytest.raises(ValidationError, match=field):
        CompletionRequest(model="m", prompt="hi", **{field: bad})
    assert getattr(CompletionRequest(model="m", prompt="hi", **{field: good}), field) == good


@pytest.mark.parametrize(("bad", "good", "message"), [
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, {"stop": ["s"] * MAX_STOP_STRINGS}, "stop strings"),
    ({"stop": "s" * (MAX_STOP_CHARS + 1)}, {"stop": "s" * MAX_STOP_CHARS}, "characters"),
    ({"prompt": ["a"] * 13, "n": 5}, {"prompt": ["a"] * 16, "n": 4}, "choices"),   # 65, 64
], ids=["stop_strings", "stop_chars", "choices"])
def test_each_request_size_bound_refuses_just_past_it(bad, good, message):
    """Stop strings (count and length) and a batch's choices (prompts x n), at their edges."""
    assert MAX_CHOICES == 64
    with pytest.raises(ValidationError, match=message):
        CompletionRequest(model="m", **{"prompt": "hi", **bad})
    CompletionRequest(model="m", **{"prompt": "hi", **good})


@pytest.mark.parametrize("make", [lambda t: CompletionRequest(model="m", prompt=t), chat],
                         ids=["prompt", "message"])
def test_a_lone_surrogate_is_refused_where_it_is(make):
    """JSON can carry "\\ud800", which no tokenizer takes: refused with its position."""
    with pytest.raises(ValidationError, match="lone surrogate at character 1"):
        make("a\ud800b")


def test_a_temperature_below_the_greedy_bound_is_greedy():
    """Below GREEDY_BELOW the logits would overflow when divided: such a request is greedy."""
    assert chat("hi", temperature=GREEDY_BELOW / 2).temperature == 0.0
    assert chat("hi", temperature=GREEDY_BELOW).temperature == GREEDY_BELOW


def test_continuous_usage_only_with_include_usage():
    """vLLM's ``continuous_usage_stats`` adds usage to every chunk only when the final usage
    chunk is asked for too."""
    def streamed(**options):
        return chat("hi", stream=True, stream_options=options)
    assert streamed(include_usage=True, continuous_usage_stats=True).continuous_usage()
    assert not streamed(continuous_usage_stats=True).continuous_usage()
    assert not streamed(include_usage=True).continuous_usage()


def test_max_completion_tokens_is_max_tokens_and_the_two_must_agree():
    assert chat("hi", max_completion_tokens=5).max_tokens == 5
    assert chat("hi", max_completion_tokens=5, max_tokens=5).max_tokens == 5
    with pytest.raises(ValidationError, match="max_tokens and max_completion_tokens differ"):
        chat("hi", max_completion_tokens=5, max_tokens=6)


@pytest.mark.parametrize(("extra", "why"), [
    (dict(top_logprobs=2), "top_logprobs needs logprobs"),
    (dict(min_tokens=2, response_format={"type": "json_object"}), "min_tokens cannot be combined"),
    (dict(top_logprobs=21, logprobs=True), "top_logprobs"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
          response_format={"type": "json_object"}), "tool calls .tool_choice. cannot be combined"),
])
def test_chat_options_that_do_not_go_together_are_refused(extra, why):
    with pytest.raises(ValidationError, match=why):
        chat("hi", **extra)


def test_only_an_assistant_message_carries_tool_calls():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert ChatRequest(model="m", messages=[{"role": "assistant", "content": None, "tool_calls": [call]}])
    with pytest.raises(ValidationError, match="only an assistant message carries tool_calls"):
        ChatRequest(model="m", messages=[{"role": "user", "content": "hi", "tool_calls": [call]}])


@pytest.mark.parametrize("body", [{}, {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]},
                                  {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}])
def test_tokenize_takes_one_prompt_or_one_chat(body):
    with pytest.raises(ValidationError, match="exactly one of prompt|tools go with messages"):
        TokenizeRequest(model="m", **body)
    assert TokenizeRequest(model="m", prompt="hi").messages is None


def test_detokenize_takes_at_most_the_prompt_bound():
    with pytest.raises(ValidationError, match="tokens"):
        DetokenizeRequest(model="m", tokens=[1] * (MAX_PROMPT_TOKEN_IDS + 1))
    assert len(DetokenizeRequest(model="m", tokens=[1] * MAX_PROMPT_TOKEN_IDS).tokens) == MAX_PROMPT_TOKEN_IDS


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (401, "authentication_error"),
                                              (413, "request_too_large"), (429, "rate_limit_error"),
                                              (503, "service_unavailable"), (418, "error")])
def test_an_error_body_has_openais_type_and_a_code(status, kind):
    """OpenAI's SDKs read ``error.type``; with no code given, the code is the type."""
    body = json.loads(error_response(status, "why").body)
    assert body == {"error": {"message": "why", "type": kind, "param": None, "code": kind}}
    assert json.loads(error_response(status, "why", "over_quota").body)["error"]["code"] == "over_quota"


def test_the_schema_bounds_every_token_id_by_the_vocabulary():
    """The OpenAPI schema a client (or a fuzzer) reads: the largest valid id is vocab_size - 1,
    wherever a token id sits (prompt lists, stop_token_ids, detokenize)."""
    schema = {"properties": {"a": {"type": "integer", "x-token-id": True},
                             "b": {"anyOf": [{"items": {"type": "integer", "x-token-id": True}}]}}}
    bound_token_ids(schema, 256)
    assert schema["properties"]["a"] == {"type": "integer", "maximum": 255}
    assert schema["properties"]["b"]["anyOf"][0]["items"] == {"type": "integer", "maximum": 255}


def test_a_tool_call_id_and_a_chat_to_tokenize_have_bounds():
    with pytest.raises(ValidationError, match="tool_call_id"):
        ChatRequest(model="m", messages=[{"role": "tool", "content": "42", "tool_call_id": "c" * 257}])
    assert ChatRequest(model="m", messages=[{"role": "tool", "content": "42", "tool_call_id": "c" * 256}])
    with pytest.raises(ValidationError, match="messages"):
        TokenizeRequest(model="m", messages=[])


def _request_models() -> list[type[BaseModel]]:
    """Every model a route's body is read into, with the models nested in their fields."""
    from kvharbor.platform.batches_api import BatchCreateRequest
    from kvharbor.platform.embeddings import EmbeddingRequest
    from kvharbor.platform.responses_api import ResponsesRequest
    from kvharbor.platform.scoring import RerankRequest, ScoreRequest
    from kvharbor.platform.sessions_api import FlushRequest, ForkRequest

    todo = [ChatRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, ResponsesRequest,
            EmbeddingRequest, RerankRequest, ScoreRequest, BatchCreateRequest, ForkRequest, FlushRequest]
    seen: list[type[BaseModel]] = []

    def nested(tp):
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            yield tp
        for arg in typing.get_args(tp):
            yield from nested(arg)

    while todo:
        model = todo.pop()
        if model not in seen:
            seen.append(model)
            todo += [m for f in model.model_fields.values() for m in nested(f.annotation)]
    return seen


def _json_types(schema: dict) -> set[str]:
    return {schema.get("type")} | {s.get("type") for s in schema.get("anyOf", ())}


def _field_reader(model: type[BaseModel], field) -> TypeAdapter:
    """What ``model`` does with one field's value (its type, its validators, the model's config;
    not the model's validators, which want a whole body)."""
    tp = typing.Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return TypeAdapter(tp, config=model.model_config)


def _refuses(reader: TypeAdapter, value) -> bool:
    try:
        reader.validate_python(value)
    except ValidationError:
        return True
    return False


WRONG = {"boolean": (0, 1.0, "true", "no"), "integer": ("5", 2.0, True), "number": ("0.5", True)}
"""Values of another JSON type that pydantic's lax mode would read as the declared one."""


def test_every_request_field_takes_values_of_its_declared_json_type_only():
    """A field the OpenAPI schema declares boolean, integer or number refuses the values of
    other JSON types that read as one (pydantic's default reads ``"5"`` as 5 and ``0.0`` as false:
    a fuzzer's ``stream_options: {"k": 0.0}`` on /v1/responses was answered 200), and a boolean
    field takes true or false (an unsupported one at least its neutral value)."""
    checked = []
    for model in _request_models():
        properties = model.model_json_schema()["properties"]
        for name, field in model.model_fields.items():
            declared = _json_types(properties[field.alias or name])
            reader = None
            for kind, wrong in WRONG.items():
                if kind not in declared or (kind == "integer" and "number" in declared):
                    continue
                reader = reader or _field_reader(model, field)
                checked.append(f"{model.__name__}.{name}")
                for value in wrong:
                    if not (kind == "number" and type(value) is int):
                        assert _refuses(reader, value), (model.__name__, name, value)
            if "boolean" in declared:
                assert not all(_refuses(reader, v) for v in (True, False)), (model.__name__, name)
    assert len(checked) >= 80 and "ResponseStreamOptions.include_obfuscation" in checked, checked


def test_every_request_model_names_a_field_it_does_not_have():
    """Down to the models nested in a body (a tool, a named tool choice, a history message's
    call), a field the model lacks is refused by name, not dropped: a client's typo
    (``"fucntion"``, ``"argument"``) must not be answered as if it were not there."""
    models = _request_models()
    for model in models:
        body = {name: typing.get_args(f.annotation)[0] for name, f in model.model_fields.items()
                if typing.get_origin(f.annotation) is typing.Literal}     # past a check of `type`
        with pytest.raises(ValidationError) as info:
            model.model_validate({**body, "zz_not_a_field": 1})
        assert any(e["type"] == "extra_forbidden" and e["loc"] == ("zz_not_a_field",)
                   for e in info.value.errors()), model.__name__
    names = {m.__name__ for m in models}
    assert {"Tool", "FunctionDef", "NamedToolChoice", "NamedFunction", "ToolCall", "CalledFunction"} <= names
