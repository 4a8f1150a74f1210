"""The OpenAI-shaped error body every gateway error is answered with
(``{"error": {"message", "type", "param", "code"}}``), the exception that carries one, and
the error responses a route declares in /openapi.json."""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field


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


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}


def _field_path(loc) -> str:
    """``("body", "prompt", "function-after[...]", 0)`` -> ``"prompt.0"`` (no union member tags)."""
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or
             (p not in _TYPE_TAGS and "[" not in str(p) and "-" not in str(p))]
    return ".".join(parts)


def invalid_body(errors: list[dict]) -> APIError:
    """The 400 for a request body's validation ``errors`` (pydantic's, each ``loc`` starting
    with ``"body"``): the first decides; a union field's alternatives are named together."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, "request body is not valid JSON: send a JSON object encoded as UTF-8")
    where = _field_path(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unknown field '{where}': this route does not take it; remove it "
                        "(see /openapi.json for the fields)", "unknown_field", where)
    if not where and first.get("type") == "value_error":        # a model validator's (FieldError: its field)
        return APIError(400, str(first.get("msg", "invalid request")).removeprefix("Value error, "),
                        param=getattr(first.get("ctx", {}).get("error"), "param", None))
    if not where:
        return APIError(400, "request body must be a JSON object (UTF-8 encoded) with the fields of this route")
    # a union field (``prompt: str | list[int]``) fails once per alternative: name them all
    field = where.split(".")[0]
    reasons = [f"{path}: {e.get('msg', 'invalid').removeprefix('Value error, ')}" for e in errors
               if (path := _field_path(e.get("loc", ()))).split(".")[0] == field]
    return APIError(400, " or ".join(dict.fromkeys(reasons)), param=where)


class FieldError(ValueError):
    """A check across a request's fields (a model validator) that one field fails: the 400's
    ``param`` names it (a plain ``ValueError`` there has no field to name)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
          413: "request_too_large",
          429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "error")


def error_dict(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """The OpenAI error body of a ``status`` answer (what ``error_response`` sends)."""
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code or error_type(status)}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_dict(status, message, code, param), status_code=status, headers=headers)


def retry_headers(wait_s: float) -> dict[str, str]:
    """The headers telling a client when to retry: ``Retry-After`` in whole seconds (HTTP's
    form: rounded up, at least 1) and ``retry-after-ms``, the wait itself, which OpenAI's
    clients read first. A rate limit that clears in 40 ms then costs a client 40 ms, not 1 s."""
    wait_s = max(0.0, wait_s)
    return {"Retry-After": str(max(1, math.ceil(wait_s))), "retry-after-ms": str(max(1, math.ceil(wait_s * 1000)))}


_ERROR_WHY = {400: "Invalid request (the message names the field to fix).",
              401: "Missing, unknown, expired or revoked API key.",
              403: "The key may not do this.", 404: "Unknown model or session.",
              409: "Conflict: the target already exists (e.g. a session id in use).",
              413: "Request body too large.",
              429: "Rate limit, budget, concurrency or class queue full (see Retry-After and retry-after-ms).",
              500: "Internal error.", 503: "No replica could serve it (see Retry-After)."}


def error_responses(*statuses: int) -> dict:
    """``responses=`` for a FastAPI route: these statuses, each with ``ErrorResponse``."""
    return {s: {"model": ErrorResponse, "description": _ERROR_WHY[s]} for s in statuses}
