"""The gateway's error answers: every error, including malformed JSON, invalid UTF-8, unknown
routes and internal failures, is an OpenAI-shaped JSON body (``error_body.ErrorResponse``),
never a stack trace, and the OpenAPI schema declares no FastAPI 422 (validation errors are 400s).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvharbor.platform.admission_flow import unavailable
from kvharbor.platform.error_body import APIError, error_response, invalid_body
from kvharbor.tenants import TenantError

logger = logging.getLogger("kvharbor.gateway")


def install_error_handlers(api: FastAPI) -> None:
    """Answer ``api``'s errors as OpenAI-shaped bodies and drop the 422s from its schema."""

    @api.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid_body(exc.errors()).response()

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Errors raised by the framework itself: unknown route, wrong method, unparsable body."""
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message = "request body could not be parsed: send a JSON object encoded as UTF-8"
        elif exc.status_code == 404:
            message = f"no route {request.url.path!r}; see /openapi.json for the API"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path!r}"
        return error_response(exc.status_code, message, headers=exc.headers)   # a 413: request_too_large


    @api.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()


    @api.exception_handler(TenantError)
    async def _tenant_error(request: Request, exc: TenantError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code)


    @api.exception_handler(TimeoutError)
    @api.exception_handler(RayActorError)
    async def _control_plane_down(request: Request, exc: Exception) -> JSONResponse:
        """A control-plane actor (admission, class queue) did not answer: retryable, not a 500."""
        return unavailable("admission service").response()


    @api.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(500, "internal error; the request was not completed", "server_error")


    def _openapi() -> dict:
        """The schema without FastAPI's 422 entries: validation errors are answered with 400."""
        if api.openapi_schema is None:
            schema = get_openapi(title=api.title, version=api.version, description=api.description,
                                 routes=api.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            api.openapi_schema = schema
        return api.openapi_schema


    api.openapi = _openapi
