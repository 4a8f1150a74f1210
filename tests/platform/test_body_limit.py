"""BodyLimitMiddleware at the ASGI level: the limit is the app's ``max_body_bytes`` (the
gateway's setting), a body over it is a 413 whether it was announced or streamed, and the
handler never sees it. (tests/reliability/test_bad_input.py sends the same over a socket to
the running app, at the default 4 MiB.)"""

from __future__ import annotations

import pytest

from kvharbor.platform.body_limit import BodyLimitMiddleware
from tests.conftest import asgi_post


def _app(limit: int):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    handled: list[int] = []

    async def completions(request):
        handled.append(len(await request.body()))
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.state.max_body_bytes = limit
    app.state.handled = handled
    app.add_middleware(BodyLimitMiddleware)
    return app


def _post(app, chunks: list[bytes], declare: bool) -> tuple[int, str, dict, int]:
    """``asgi_post`` with its Content-Length when ``declare``, else streamed without one."""
    headers = [(b"content-type", b"application/json")]
    if declare:
        headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
    return asgi_post(app, "/v1/completions", chunks, headers)


@pytest.mark.parametrize("declare", [True, False], ids=["content-length", "chunked"])
def test_the_limit_is_the_apps_and_an_over_limit_body_never_reaches_the_handler(declare):
    """An announced size is refused before a byte of the body is read; a streamed one when
    the chunk that crosses the limit arrives. Either way the connection closes (the client's
    unread bytes must not be taken for its next request)."""
    app = _app(limit=2000)
    status, body, _, _ = _post(app, [b"x" * 1000, b"x" * 1000], declare)      # exactly the limit
    assert status == 200 and app.state.handled == [2000], body
    status, body, headers, reads = _post(app, [b"x" * 1000, b"x" * 1000, b"x"], declare)
    assert status == 413 and app.state.handled == [2000], body
    assert "limit of 2000 bytes" in body or "the limit is 2000 bytes" in body, body
    assert headers[b"connection"] == b"close" and reads == (0 if declare else 3), (headers, reads)


def test_a_body_that_crosses_the_limit_after_the_answer_started_is_not_answered_twice():
    """A handler that starts its response and then reads a body over the limit: the 413
    cannot replace an answer already begun, so the error propagates (the server closes the
    connection) and no second ``http.response.start`` is sent."""
    import asyncio

    from kvharbor.platform.body_limit import BodyTooLarge

    async def streaming_first(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while (await receive()).get("more_body"):
            pass

    streaming_first.state = type("State", (), {"max_body_bytes": 1500})()
    chunks = iter([b"x" * 1000, b"x" * 1000])

    async def receive():
        return {"type": "http.request", "body": next(chunks), "more_body": True}

    sent = []

    async def send(message):
        sent.append(message["type"])

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "app": streaming_first}
    with pytest.raises(BodyTooLarge):
        asyncio.run(BodyLimitMiddleware(streaming_first)(scope, receive, send))
    assert sent == ["http.response.start"]


def _reading_app():
    """A bare ASGI app with no error handler of its own (nothing inside turns the middleware's
    error into a response): it reads the whole body and answers 200 with its length."""
    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})
    return app


def test_a_body_over_the_default_limit_read_by_a_bare_app_gets_the_openai_413():
    """No ``max_body_bytes`` on the app: the limit is 4 MiB. A streamed body that crosses it
    inside an app that has no handler for the error still gets the 413 in OpenAI's shape."""
    import json

    app = BodyLimitMiddleware(_reading_app())
    mib4 = 4 * 1024 * 1024
    chunk = [(b"content-type", b"application/json")]
    assert asgi_post(app, "/v1/completions", [b"x" * (mib4 // 2)] * 2, chunk)[:2] == (200, str(mib4))
    status, body, headers, _ = asgi_post(app, "/v1/completions", [b"x" * (mib4 // 2)] * 2 + [b"x"], chunk)
    assert status == 413 and headers[b"connection"] == b"close", body
    assert json.loads(body)["error"]["code"] == "request_too_large", body


def test_lifespan_and_other_scopes_reach_the_app_untouched():
    import asyncio

    seen = []

    async def app(scope, receive, send):
        seen.append((scope["type"], await receive()))

    async def receive():
        return {"type": "lifespan.startup"}

    asyncio.run(BodyLimitMiddleware(app)({"type": "lifespan"}, receive, lambda m: None))
    assert seen == [("lifespan", {"type": "lifespan.startup"})]
