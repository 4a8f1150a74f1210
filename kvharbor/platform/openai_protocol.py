"""OpenAI-compatible request and response bodies, and the OpenAI-shaped error body.

Every error the gateway answers has the body ``{"error": {"message", "type", "param",
"code"}}`` (``ErrorResponse``); the message says what to change. Request models reject
values the engine cannot run (a seed outside 64 bits, more than 8 stop strings, non-text
content parts) so that no client input can reach the engine loop and fail it there.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
GREEDY_BELOW = 1e-5
"""Temperatures below this are treated as 0 (greedy): dividing logits by them overflows."""


def _encodable(text: str) -> str:
    """Reject lone surrogates (JSON may carry ``"\\ud800"``): they cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text must be valid Unicode; there is a lone surrogate at character "
                         f"{e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
"""A string that encodes to UTF-8 (every string the gateway tokenizes or echoes)."""


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a final chunk with token usage.")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Text = Field(description="Model id, as listed by /v1/models.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate (>= 1). Default 16 (completions) or the rest of the context (chat), capped by the tenant's max_tokens_per_request.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description=f"Sampling temperature in [0, 2]; 0 (or below {GREEDY_BELOW}) is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1].")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens (0: off). Not in OpenAI's API.")
    n: int = Field(1, ge=1, le=1, description="Only 1 is supported.")
    stream: bool = Field(False, description="Stream Server-Sent Events ending in `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    stop: Text | list[Text] | None = Field(None, description=f"Stop strings (up to {MAX_STOP_STRINGS}, each up to {MAX_STOP_CHARS} characters).")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Seed for reproducible sampling (a signed 64-bit integer).")
    ignore_eos: bool = Field(False, description="Keep generating after the end-of-sequence token.")
    user: str | None = Field(None, description="End-user id (ignored).")

    @field_validator("temperature")
    @classmethod
    def _tiny_is_greedy(cls, value: float) -> float:
        return 0.0 if value < GREEDY_BELOW else value

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop string may have at most {MAX_STOP_CHARS} characters")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: Text | list[int] = Field(description="Text, or a list of token ids (each in [0, vocabulary size)).")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: Text = Field(description="The text of this part.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"] = Field(description="Author role.")
    content: Text | list[TextPart] = Field(description="Text, or a list of {type: text, text} parts.")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far (at least one message).")


# ---- responses (documented in the OpenAPI schema; the handlers build plain dicts) --------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int = Field(description="Tokens in the prompt.")
    completion_tokens: int = Field(description="Tokens generated.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")
    prompt_tokens_details: PromptTokensDetails = Field(description="Prefix-cache hits.")


class KvharborInfo(BaseModel):
    replica_id: str | None = Field(description="The LLM replica that served the request.")


class CompletionChoice(BaseModel):
    index: int = Field(description="Always 0 (n = 1).")
    text: str = Field(description="Generated text.")
    logprobs: None = Field(None, description="Not supported (always null).")
    finish_reason: str | None = Field(description="'stop' or 'length'.")


class CompletionResponse(BaseModel):
    id: str = Field(description="Request id.")
    object: Literal["text_completion"] = Field(description="Object type.")
    created: int = Field(description="Unix seconds.")
    model: str = Field(description="Model id.")
    choices: list[CompletionChoice] = Field(description="One choice.")
    usage: Usage = Field(description="Token counts.")
    kvharbor: KvharborInfo = Field(description="Serving details.")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = Field(description="Always 'assistant'.")
    content: str = Field(description="Generated text.")


class ChatChoice(BaseModel):
    index: int = Field(description="Always 0 (n = 1).")
    message: AssistantMessage = Field(description="The answer.")
    finish_reason: str | None = Field(description="'stop' or 'length'.")


class ChatResponse(BaseModel):
    id: str = Field(description="Request id.")
    object: Literal["chat.completion"] = Field(description="Object type.")
    created: int = Field(description="Unix seconds.")
    model: str = Field(description="Model id.")
    choices: list[ChatChoice] = Field(description="One choice.")
    usage: Usage = Field(description="Token counts.")
    kvharbor: KvharborInfo = Field(description="Serving details.")


class ModelCard(BaseModel):
    id: str = Field(description="Model id.")
    object: Literal["model"] = Field(description="Object type.")
    created: int = Field(description="Unix seconds (0).")
    owned_by: str = Field(description="Owner.")
    max_model_len: int = Field(description="Context length in tokens.")


class ModelList(BaseModel):
    object: Literal["list"] = Field(description="Object type.")
    data: list[ModelCard] = Field(description="Served models.")


class ErrorBody(BaseModel):
    message: str = Field(description="What went wrong and what to change.")
    type: str = Field(description="Error class, e.g. invalid_request_error.")
    param: str | None = Field(None, description="The request field at fault, if one is.")
    code: str | None = Field(None, description="Stable machine-readable reason.")


class ErrorResponse(BaseModel):
    error: ErrorBody = Field(description="The error.")


class APIError(Exception):
    """An error the client can fix, answered as an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.code, self.param, self.headers)


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
          429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "error")


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": error_type(status),
                      "param": param, "code": code or error_type(status)}}
    return JSONResponse(body, status_code=status, headers=headers)


_ERROR_WHY = {400: "Invalid request (the message names the field to fix).",
              401: "Missing, unknown, expired or revoked API key.",
              403: "The key may not do this.", 404: "Unknown model.",
              413: "Request body too large.",
              429: "Rate limit, budget, concurrency or class queue full (see Retry-After).",
              500: "Internal error.", 503: "No replica could serve it (see Retry-After)."}


def error_responses(*statuses: int) -> dict:
    """``responses=`` for a FastAPI route: these statuses, each with ``ErrorResponse``."""
    return {s: {"model": ErrorResponse, "description": _ERROR_WHY[s]} for s in statuses}
