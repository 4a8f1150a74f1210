"""OpenAI's Responses API (``POST /v1/responses``) served on the chat path, as vLLM serves it.

A request becomes a chat request (``ChatRequest``), so tenants, QoS, the prefix cache, tools,
reasoning and structured outputs work as they do on ``/v1/chat/completions``:
``instructions`` -> the first (system) message; ``input`` items -> messages (a ``function_call``
-> an assistant message's ``tool_calls``, a ``function_call_output`` -> a ``tool`` message, a
``reasoning`` item -> the next assistant message's ``reasoning``); ``text.format`` ->
``response_format``; ``reasoning.effort`` -> ``reasoning_effort``; function ``tools`` -> chat's.
The answer comes back as output items (``reasoning``, ``message``, ``function_call``), with
``status: "incomplete"`` when ``max_output_tokens`` cut it; a stream is the Responses event
sequence (``response.created`` ... ``response.completed``), every event numbered.

With ``store`` (the default, as OpenAI's) the response and its conversation are kept by the
``ResponseStore`` actor (``response_store``) for ``previous_response_id`` and
``GET /v1/responses/{id}``; a tenant reads only its own. As OpenAI's API, ``instructions`` are
not carried to the next turn. ``background`` runs it after the answer (``responses_background``).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .error_body import APIError, FieldError, invalid_body
from .json_types import REQUEST_FIELDS
from .openai_protocol import (CACHE_KEY_DOC, CACHE_RETENTION_DOC, MAX_MESSAGES, MAX_TOP_LOGPROBS, CacheKey,
                              CacheRetention, ChatRequest, LogitBias, NullOnlyDict, Text, unsupported)
from .service_tier import DOC as SERVICE_TIER_DOC, ServiceTier
from .tool_calls import MAX_TOOLS, NAME

ITEM_FIELDS = {"message": {"role", "content", "phase"}, "function_call": {"call_id", "name", "arguments"},
               "function_call_output": {"call_id", "output"}, "reasoning": {"summary", "content", "encrypted_content"}}
"""Each input item type's fields (besides ``type``, ``id`` and ``status``); the first ones
listed by ``_REQUIRED`` must be present."""
_REQUIRED = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
             "function_call_output": ("call_id", "output"), "reasoning": ()}


def _no_nulls(data):
    """A null field is an absent one: the SDK's models dump every field they know, newer ones
    (that kvharbor does not read) as null, when an earlier response's output is sent back."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class Part(BaseModel):
    """A text part of an input item (``output_text`` / ``reasoning_text`` when an earlier
    response's output is sent back as input)."""

    model_config = REQUEST_FIELDS
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"] = Field(
        description="Text parts only (no images or files).")
    text: Text
    annotations: unsupported(list[dict] | None, []) = Field(None, description="Only [] or null.")
    logprobs: list[dict] | None = Field(None, description="Accepted and ignored (an output_text sent back).")

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        return _no_nulls(data)


class InputItem(BaseModel):
    """One ``input`` item: a message (``type`` may be left out), a function call an earlier
    response made, a call's output, or a reasoning item. ``id`` and ``status`` are accepted
    (items of an earlier response's ``output``) and not used."""

    model_config = REQUEST_FIELDS
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Text | list[Part] | None = None
    call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, pattern=NAME)
    arguments: Text | None = None
    output: Text | list[Part] | None = None
    summary: list[Part] | None = None
    encrypted_content: unsupported(str | None) = Field(None, description="Only null: no reasoning is encrypted here.")
    phase: Literal["commentary", "final_answer"] | None = Field(None, description="Accepted and ignored.")

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        return _no_nulls(data)

    @model_validator(mode="after")
    def _fields_of_its_type(self):
        given = {f for f in self.model_fields_set - {"type", "id", "status"} if getattr(self, f) is not None}
        stray = sorted(given - ITEM_FIELDS[self.type])
        if stray:
            raise ValueError(f"a {self.type} item has no field {stray[0]} (its fields: "
                             f"{', '.join(sorted(ITEM_FIELDS[self.type]))})")
        missing = [f for f in _REQUIRED[self.type] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {' and '.join(missing)}")
        return self


def _text(value: str | list[Part] | None) -> str:
    return value if isinstance(value, str) else "".join(p.text for p in value or ())


class FunctionTool(BaseModel):
    model_config = REQUEST_FIELDS
    type: Literal["function"] = Field(description="Only function tools (no built-in tools).")
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict | None = Field(None, description="A JSON schema of its arguments; none: any object.")
    strict: bool | None = Field(None, description="Accepted: the arguments always follow the schema.")

    @model_validator(mode="before")
    @classmethod
    def _a_function(cls, data):
        if isinstance(data, dict) and data.get("type") != "function":
            raise ValueError(f"only function tools are served (type \"function\"), not {data.get('type')!r}: "
                             "no built-in tools (web search, file search, code interpreter, ...)")
        return data


class NamedFunction(BaseModel):
    model_config = REQUEST_FIELDS
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(**REQUEST_FIELDS, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64, description="json_schema: a name for the schema (not used).")
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="json_schema: the JSON schema the output follows.")
    strict: bool | None = None

    def response_format(self) -> dict:
        """Chat's ``response_format`` for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name or "output", "schema": self.schema_, "description": self.description,
                "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(BaseModel):
    model_config = REQUEST_FIELDS
    format: TextFormat | None = None
    verbosity: unsupported(str | None, "medium") = None


class ReasoningConfig(BaseModel):
    model_config = REQUEST_FIELDS
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="Given to the chat template as reasoning_effort (\"none\" turns thinking off).")
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="Accepted; no summary is written: the reasoning item carries the reasoning's text.")
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="summary's old name.")


class ResponseStreamOptions(BaseModel):
    model_config = REQUEST_FIELDS
    include_obfuscation: bool | None = Field(None, description="Accepted: no obfuscation padding is sent.")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Unknown fields, and OpenAI's that kvharbor does not implement
    (built-in tools, background, prompt templates, conversations), are a 400 naming them."""

    model_config = REQUEST_FIELDS
    model: Text | None = Field(None, description="Model id, as listed by /v1/models (default: the served model).")
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)] = Field(
        description="A user message's text, or a list of items (messages, function calls and their outputs, "
                    "reasoning), e.g. an earlier response's output followed by the next message.")
    instructions: Text | None = Field(None, description="A system message before the input (not carried "
                                      "to a response that continues this one).")
    previous_response_id: str | None = Field(None, max_length=256, description="Continue a stored response "
                                             "of this tenant: its input and output come before this input.")
    store: bool | None = Field(True, description="Keep the response (GET /v1/responses/{id}, previous_response_id).")
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate (reasoning included).")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="vLLM's.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="vLLM's.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: LogitBias | None = Field(None, description="vLLM's: token id (as a string) to a bias in [-100, 100].")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include_reasoning: bool = Field(True, description="vLLM's: false leaves the reasoning item out.")
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = Field(
        None, description="message.output_text.logprobs: each output_text carries its tokens' logprobs "
                          "(with top_logprobs alternatives); reasoning.encrypted_content: accepted, nothing is encrypted.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool | None = False
    stream_options: ResponseStreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = Field(None, description="Accepted and ignored.")
    safety_identifier: str | None = Field(None, description="Accepted and ignored.")
    prompt_cache_key: CacheKey = Field(None, description=CACHE_KEY_DOC)
    prompt_cache_retention: CacheRetention = Field(None, description=CACHE_RETENTION_DOC)
    service_tier: ServiceTier | None = Field(None, description=SERVICE_TIER_DOC)
    truncation: Literal["auto", "disabled"] | None = Field(None, description="\"auto\": a conversation too "
                                                          "long for the context drops its oldest items (the "
                                                          "instructions stay), as a truncate_oldest tenant's chats.")
    background: bool | None = Field(False, description="Answer at once with the response queued, run it in the "
                                    "background; poll GET /v1/responses/{id}, cancel with POST .../cancel. Needs "
                                    "store (the default); not with stream.")
    max_tool_calls: unsupported(int | None) = None
    prompt: NullOnlyDict = None
    conversation: unsupported(str | dict | None) = None

    @field_validator("store", "stream", "background", mode="after")
    @classmethod
    def _null_is_the_default(cls, value, info):
        return cls.model_fields[info.field_name].default if value is None else value

    @model_validator(mode="after")
    def _background_is_stored_and_not_streamed(self):
        if self.background and not self.store:
            raise FieldError("background", "a background response is read back from the store: send store true "
                             "(the default) with background, or leave background out")
        if self.background and self.stream:
            raise FieldError("background", "a background response is not streamed: poll GET /v1/responses/{id}, "
                             "or send stream without background")
        return self

    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())


_ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(items: str | list[InputItem]) -> list[dict]:
    """``input`` as OpenAI lists a response's input items: each with an ``id`` (its own, else a
    new one), a message's text as one ``input_text`` part (``output_text`` for an assistant's)."""
    if isinstance(items, str):
        items = [InputItem(role="user", content=items)]
    out = []
    for item in items:
        listed = {"id": item.id or _id(_ITEM_IDS[item.type]), **item.model_dump(exclude_none=True, exclude={"id"})}
        if item.type == "message":
            kind = "output_text" if item.role == "assistant" else "input_text"
            parts = [{"type": kind, "text": item.content}] if isinstance(item.content, str) else listed["content"]
            listed.update(content=parts, status=item.status or "completed")
        out.append(listed)
    return out


def input_messages(items: str | list[InputItem]) -> list[dict]:
    """Chat messages of ``input`` (``ChatMessage`` fields)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    thought = None
    for item in items:
        if item.type == "reasoning":
            thought = (thought or "") + _text(item.content) + ("" if item.content else _text(item.summary))
            continue
        if item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            continue
        if item.type == "message" and item.role != "assistant":
            messages.append({"role": item.role, "content": _text(item.content)})
            continue
        last = messages[-1] if messages else None
        if item.type == "function_call" and last and last["role"] == "assistant" and thought is None:
            message = last                  # the calls of one answer: one assistant message
        else:
            message = {"role": "assistant", "content": None}
            messages.append(message)
        if thought is not None:
            message["reasoning"], thought = thought, None
        if item.type == "message":
            message["content"] = _text(item.content)
        else:
            message.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
    if thought is not None:
        messages.append({"role": "assistant", "content": None, "reasoning": thought})
    return messages


_CHAT_PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
                "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


def responses_error(error: Exception) -> Exception:
    """A chat route's error in the Responses API's names (``max_tokens`` -> ``max_output_tokens``,
    ``messages`` -> ``input``, ...); ``error`` itself, changed in place."""
    if getattr(error, "message", None):
        error.message = re.sub(r"\bmax_tokens\b", "max_output_tokens", error.message)
    param = getattr(error, "param", None)
    if param is not None:
        head, dot, rest = param.partition(".")
        error.param = _CHAT_PARAMS.get(head, head) + dot + rest
    return error


def chat_request(body: ResponsesRequest, model: str, history: list[dict]) -> tuple[ChatRequest, list[dict]]:
    """The chat request ``body`` is served as, and the conversation it continues with its
    input (without ``instructions``: the history the next response of it starts from)."""
    conversation = history + input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    want_logprobs = body.wants_logprobs()
    fields = {
        "model": model, "messages": system + conversation, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "logit_bias": body.logit_bias and {str(k): v for k, v in body.logit_bias.items()}, "seed": body.seed,
        "stream": body.stream, "stream_options": {"include_usage": True} if body.stream else None,
        "parallel_tool_calls": body.parallel_tool_calls, "include_reasoning": body.include_reasoning,
        "skip_special_tokens": body.skip_special_tokens, "include_stop_str_in_output": body.include_stop_str_in_output,
        "logprobs": want_logprobs, "top_logprobs": body.top_logprobs if want_logprobs else None,
        "reasoning_effort": body.reasoning and body.reasoning.effort, "service_tier": body.service_tier,
        "prompt_cache_key": body.prompt_cache_key, "prompt_cache_retention": body.prompt_cache_retention,
        "response_format": body.text and body.text.format and body.text.format.response_format(),
    }
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for t in body.tools]
    choice = body.tool_choice
    if choice is not None and body.tools:
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    elif choice not in (None, "auto", "none"):         # without tools: nothing to call, as asked
        raise APIError(400, "tool_choice needs tools to call (send tools, or leave tool_choice out)",
                       param="tool_choice")
    try:
        return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None}), conversation
    except ValidationError as e:               # chat's checks across fields, in this API's names
        raise responses_error(invalid_body([{**d, "loc": ("body", *d["loc"])} for d in e.errors()])) from None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(chat: dict | None, block_size: int) -> dict | None:
    if chat is None:
        return None
    cached = chat.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    prompt = chat["prompt_tokens"]
    return {"input_tokens": prompt, "output_tokens": chat["completion_tokens"], "total_tokens": chat["total_tokens"],
            # the prompt's whole blocks computed now and left in the prefix cache
            "input_tokens_details": {"cached_tokens": cached,
                                     "cache_write_tokens": max(0, prompt // block_size * block_size - cached)},
            "output_tokens_details": {"reasoning_tokens":
                                      (chat.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)}}


def _logprobs(choice_logprobs: dict | None) -> list[dict]:
    return list((choice_logprobs or {}).get("content") or ())


class Turn:
    """One response: its request, the conversation it continues, and its answer as Responses
    shapes (``answer`` for a whole chat answer, ``events`` for a chat stream)."""

    def __init__(self, body: ResponsesRequest, model: str, history: list[dict], block_size: int) -> None:
        self.body, self.model, self.block_size = body, model, block_size
        self.chat, self.conversation = chat_request(body, model, history)
        self.id, self.created = _id("resp"), int(time.time())
        self.output: list[dict] = []
        self.service_tier = "default"         # as the chat answer reports it (service_tier.answered_tier)
        self.inputs = input_items(body.input)  # kept with a stored response (GET .../input_items)
        self.on_done = None
        """``async (turn, response) -> None``, awaited before the answer or the last event
        (the store); set by the gateway."""

    def response(self, status: str, usage: dict | None = None, finish: str | None = None,
                 extra: dict | None = None) -> dict:
        body = self.body
        if status == "completed" and finish == "length":
            status = "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "background": bool(body.background), "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "max_tool_calls": None, "metadata": body.metadata or {}, "model": self.model,
                "output": self.output, "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "prompt_cache_key": body.prompt_cache_key,
                "prompt_cache_retention": body.prompt_cache_retention,
                "reasoning": body.reasoning.model_dump() if body.reasoning else None,
                "service_tier": self.service_tier, "store": body.store, "temperature": body.temperature,
                "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                         if body.text and body.text.format else {"type": "text"}},
                "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction)
                                else body.tool_choice or ("auto" if body.tools else "none")),
                "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
                "top_logprobs": body.top_logprobs, "top_p": body.top_p, "truncation": body.truncation or "disabled",
                "usage": _usage(usage, self.block_size), "user": body.user, **(extra or {})}

    def history(self) -> list[dict]:
        """The conversation a response continuing this one starts from: its input and output."""
        message: dict = {"role": "assistant", "content": None}
        for item in self.output:
            if item["type"] == "reasoning":
                message["reasoning"] = item["content"][0]["text"]
            elif item["type"] == "message":
                message["content"] = item["content"][0]["text"]
            else:
                message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        said = message["content"] is not None or "reasoning" in message or "tool_calls" in message
        return self.conversation + ([message] if said else [])

    async def _done(self, response: dict) -> None:
        if self.on_done is not None:
            await self.on_done(self, response)

    # ---- a whole answer ----------------------------------------------------------------------
    async def answer(self, chat: dict) -> dict:
        """The response of a whole chat answer."""
        self.model = chat.get("model", self.model)       # the name answers give (the base model's first)
        self.service_tier = chat.get("service_tier", self.service_tier)
        choice = chat["choices"][0]
        message = choice["message"]
        if message.get("reasoning") and self.body.include_reasoning:
            self.output.append(_reasoning_item(_id("rs"), message["reasoning"], "completed"))
        calls = message.get("tool_calls") or []
        if message.get("content") or not self.output and not calls:     # an empty answer: one empty message
            self.output.append(_message_item(_id("msg"), message.get("content") or "", "completed",
                                             _logprobs(choice.get("logprobs"))))
        for call in calls:
            self.output.append(_call_item(_id("fc"), call["id"], call["function"]["name"],
                                          call["function"]["arguments"], "completed"))
        response = self.response("completed", chat.get("usage"), choice.get("finish_reason"),
                                 {"kvharbor": chat.get("kvharbor")})
        await self._done(response)
        return response

    # ---- a stream ----------------------------------------------------------------------------
    async def events(self, chunks):
        """Responses SSE events of a chat stream's ``chunks`` (dicts, ``"[DONE]"`` last). Nothing
        is sent before the first chunk: an error before it is raised (the HTTP status answers it)."""
        chunks = aiter(chunks)
        try:
            first = await anext(chunks)
        except APIError as e:
            raise responses_error(e) from None
        if isinstance(first, dict):
            self.model = first.get("model", self.model)
            self.service_tier = first.get("service_tier", self.service_tier)
        stream = _Events(self)
        yield stream.event("response.created", response=self.response("in_progress"))
        yield stream.event("response.in_progress", response=self.response("in_progress"))
        usage = finish = extra = None
        chunk = first
        while chunk != "[DONE]":
            if "error" in chunk:
                for e in stream.close("incomplete"):
                    yield e
                error = chunk["error"]
                yield stream.event("error", code=error.get("code"), message=error["message"], param=error.get("param"))
                failed = self.response("failed")
                failed["error"] = {"code": _FAILED_CODES.get(error.get("type"), "server_error"), "message": error["message"]}
                yield stream.event("response.failed", response=failed)
                return
            usage, extra = chunk.get("usage") or usage, chunk.get("kvharbor") or extra
            for c in chunk["choices"]:
                finish = c.get("finish_reason") or finish
                for e in stream.delta(c.get("delta") or {}, _logprobs(c.get("logprobs"))):
                    yield e
            chunk = await anext(chunks, "[DONE]")
        if not self.output:                        # an empty answer: one empty message, as unstreamed
            for e in stream.delta({}, [], empty=True):
                yield e
        for e in stream.close("completed"):
            yield e
        response = self.response("completed", usage, finish, {"kvharbor": extra})
        await self._done(response)
        yield stream.event(f"response.{response['status']}", response=response)


_FAILED_CODES = {"rate_limit_error": "rate_limit_exceeded", "invalid_request_error": "invalid_prompt"}
"""A failed response's ``error.code`` (OpenAI's few) by the chat error's ``type``; the ``error``
event before it carries kvharbor's own code."""


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}


def _message_item(item_id: str, text: str, status: str, logprobs: list) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class _Events:
    """The Responses events of one stream, numbered; one output item open at a time."""

    def __init__(self, turn: Turn) -> None:
        self.turn, self.seq = turn, 0
        self.open: dict | None = None               # the item being streamed
        self.calls: dict[int, dict] = {}            # chat's tool-call index -> its item

    def event(self, kind: str, **fields) -> str:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(out)}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.turn.output) - 1}

    def _start(self, item: dict) -> list[str]:
        out = self.close("completed")
        self.turn.output.append(item)
        self.open = item
        out.append(self.event("response.output_item.added", output_index=len(self.turn.output) - 1,
                              item={**item, "content": []} if "content" in item else dict(item)))
        if "content" in item:
            part = {**item["content"][0]}
            if item["type"] == "message":
                part["logprobs"] = []
            out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def delta(self, delta: dict, logprobs: list, empty: bool = False) -> list[str]:
        out = self._start(_message_item(_id("msg"), "", "in_progress", [])) if empty else []
        if delta.get("reasoning") and self.turn.body.include_reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._start(_reasoning_item(_id("rs"), "", "in_progress"))
            self.open["content"][0]["text"] += delta["reasoning"]
            out.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0,
                                  delta=delta["reasoning"]))
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self._start(_message_item(_id("msg"), "", "in_progress", []))
            part = self.open["content"][0]
            part["text"] += delta["content"]
            part["logprobs"] += logprobs
            out.append(self.event("response.output_text.delta", **self._where(), content_index=0,
                                  delta=delta["content"], logprobs=logprobs))
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call["index"] not in self.calls:
                out += self._start(_call_item(_id("fc"), call.get("id") or _id("call"), function.get("name", ""),
                                              "", "in_progress"))
                self.calls[call["index"]] = self.open
            item = self.calls[call["index"]]
            if function.get("arguments"):
                item["arguments"] += function["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.turn.output.index(item), delta=function["arguments"]))
        return out

    def close(self, status: str) -> list[str]:
        """End the open item (``status``), with its ``.done`` events."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self.turn.output.index(item)}
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "message":
                out.append(self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                      logprobs=part["logprobs"]))
            else:
                out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return out
