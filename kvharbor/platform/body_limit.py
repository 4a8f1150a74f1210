"""ASGI middleware: refuse request bodies over a byte limit with 413, before they are parsed.

A ``Content-Length`` above the limit is answered at once, without reading the body. A body
without one (``Transfer-Encoding: chunked``) is counted as it arrives; the first chunk that
crosses the limit stops the read, and the app's handler never runs. Either way the client
gets the OpenAI-shaped 413 body (``code: request_too_large``). The limit (bytes) is read per request from
``scope["app"].state.max_body_bytes`` (set by the Gateway), else ``default_bytes``.
"""

from __future__ import annotations

from fastapi import HTTPException

from kvharbor.platform.error_body import error_response


class BodyTooLarge(HTTPException):
    """Raised inside ``receive`` when the streamed body crosses the limit.

    An ``HTTPException`` so that FastAPI's body reader re-raises it as is (it turns other
    errors into a 400) and the app's HTTP error handler answers 413.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is over the limit of {limit} bytes: send a smaller "
                         "request", headers={"connection": "close"})


class BodyLimitMiddleware:
    """Pure ASGI middleware (no buffering; one counter per request)."""

    def __init__(self, app, default_bytes: int = 4 * 1024 * 1024) -> None:
        self.app = app
        self.default_bytes = default_bytes

    def _limit(self, scope) -> int:
        state = getattr(scope.get("app"), "state", None)
        return int(getattr(state, "max_body_bytes", None) or self.default_bytes)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope)
        declared = content_length(scope)
        if declared is not None and declared > limit:
            await _too_large(scope, receive, send, f"request body is {declared} bytes; "
                             f"the limit is {limit} bytes: send a smaller request")
            return
        seen = 0
        started = False

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as exc:      # raised where no handler turned it into a response
            if started:
                raise
            await _too_large(scope, receive, send, exc.detail)


def content_length(scope) -> int | None:
    """The request's Content-Length, or None (absent or not a number)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _too_large(scope, receive, send, message: str) -> None:
    response = error_response(413, message, "request_too_large")
    response.headers["connection"] = "close"
    await response(scope, receive, send)
