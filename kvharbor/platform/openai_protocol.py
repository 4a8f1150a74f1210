"""OpenAI-compatible request bodies and error responses for the gateway."""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a final chunk with token usage.")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(description="Model id, as listed by /v1/models.")
    max_tokens: int | None = Field(None, description="Most tokens to generate (>= 1). Default 16 (completions) or the rest of the context (chat), capped by the tenant's max_tokens_per_request.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens (0: off). Not in OpenAI's API.")
    n: int = Field(1, ge=1, le=1, description="Only 1 is supported.")
    stream: bool = Field(False, description="Stream Server-Sent Events ending in `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    stop: str | list[str] | None = Field(None, description="Stop strings (up to 8).")
    seed: int | None = Field(None, description="Seed for reproducible sampling.")
    ignore_eos: bool = Field(False, description="Keep generating after the end-of-sequence token.")
    user: str | None = Field(None, description="End-user id (ignored).")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(description="Text, or a list of token ids.")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"] = Field(description="Author role.")
    content: str | list[dict] = Field(description="Text, or a list of {type: text, text} parts.")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far (at least one message).")


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
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "service_unavailable", 500: "server_error"}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _TYPES.get(status, "error"),
                      "param": param, "code": code or _TYPES.get(status, "error")}}
    return JSONResponse(body, status_code=status, headers=headers)
