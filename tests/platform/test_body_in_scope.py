"""The body in the scope: Serve's proxy reads a small generation body of a key a gateway has
vouched for and sends it inside the request's scope (``auth_gate.BODY_IN_SCOPE``), so the
gateway needs no call back to the proxy for it; the gateway reads it from there and still sees
the client's disconnect."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvharbor.platform.auth_gate import (BODY_IN_SCOPE, HINT_REQUEST, HINT_RESPONSE, AuthGateMiddleware,
                                         body_from_scope, encode_hint)
from kvharbor.platform.proxy_guard import ProxyGuardMiddleware, with_body_in_scope
from tests.platform.test_proxy_guard import HINTS, drive, proxy


class Downstream:
    """Stands for Serve's proxy app behind the guard: records the scope and every message
    its receive gives until the body ends, answers 200 (with the key's hint when asked)."""

    def __init__(self) -> None:
        self.scopes: list[dict] = []
        self.messages: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        self.scopes.append(scope)
        while True:
            message = await receive()
            self.messages.append(message)
            if not message.get("more_body"):
                break
        headers = dict(scope["headers"])
        key = headers.get(b"authorization", b"").decode()[7:]
        hint = [(HINT_RESPONSE, HINTS[key])] if HINT_REQUEST in headers and key in HINTS else []
        await send({"type": "http.response.start", "status": 200, "headers": hint})
        await send({"type": "http.response.body", "body": b"{}"})


@pytest.mark.parametrize("guard_on", [True, False])
def test_the_proxy_sends_a_small_body_of_a_known_key_inside_the_scope(guard_on, monkeypatch):
    """Once a gateway has vouched for the key (its hint), a generation body up to
    MAX_BODY_IN_SCOPE rides in the scope and the downstream receive gives an empty body (no
    call back to the proxy for it). A key not known yet, a bigger body, another path, or the
    guard turned off: the body streams as before (the gateway checks the key first)."""
    import kvharbor.platform.proxy_guard as pg

    down = Downstream()
    mw = proxy(down) if guard_on else ProxyGuardMiddleware(down, lag_ms=None)
    monkeypatch.setattr(pg, "MAX_BODY_IN_SCOPE", 4000)
    small, big = b'{"prompt": "' + b"x" * 100 + b'"}', b'{"prompt": "' + b"y" * 5000 + b'"}'
    sends = ((small, "/app/v1/completions"), (small, "/app/v1/completions"),
             (big, "/app/v1/chat/completions"), (small, "/app/v1/sessions"))

    async def scenario(client):
        auth = {"Authorization": "Bearer standard-key", "content-type": "application/json"}
        for body, path in sends:
            assert (await client.post(path, content=body, headers=auth)).status_code == 200

    drive(mw, scenario)
    in_scope = [BODY_IN_SCOPE in (scope.get("extensions") or {}) for scope in down.scopes]
    streamed = b"".join(m.get("body", b"") for m in down.messages)
    if guard_on:
        assert in_scope == [False, True, False, False]
        assert down.scopes[1]["extensions"][BODY_IN_SCOPE] == small
        assert down.messages[1] == {"type": "http.request", "body": b"", "more_body": False}
        assert streamed == small + big + small
    else:
        assert in_scope == [False] * 4 and streamed == b"".join(body for body, _ in sends)


def test_the_gateway_reads_a_body_from_the_scope_and_still_sees_a_disconnect():
    """``body_from_scope``: the scope's body first, the proxy's empty body dropped, then the
    client's disconnect; without a body in the scope, receive is left as it is."""
    sent = [{"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"}]

    async def receive():
        return sent.pop(0)

    async def scenario():
        wrapped = body_from_scope({"extensions": {BODY_IN_SCOPE: b'{"a": 1}'}}, receive)
        return await wrapped(), await wrapped()

    body, after = asyncio.run(scenario())
    assert body == {"type": "http.request", "body": b'{"a": 1}', "more_body": False}
    assert after == {"type": "http.disconnect"} and sent == []
    assert body_from_scope({"extensions": {}}, receive) is receive
    assert body_from_scope({}, receive) is receive


def _in_scope(messages: list[dict], length: int | None):
    """``with_body_in_scope`` over a client that sends ``messages`` (then disconnects) with a
    Content-Length of ``length`` -> (the body in the scope or None, what the downstream's
    first two receives give, how many client messages were read)."""
    pending = list(messages)

    async def receive():
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    headers = [] if length is None else [(b"content-length", str(length).encode())]

    async def scenario():
        scope, downstream = await with_body_in_scope({"type": "http", "headers": headers}, receive)
        return ((scope.get("extensions") or {}).get(BODY_IN_SCOPE),
                [await downstream(), await downstream()], len(messages) - len(pending))
    return asyncio.run(scenario())


def test_the_proxy_reads_a_whole_small_body_and_passes_a_partial_or_large_one_on(monkeypatch):
    """A body in chunks is joined in the scope and the downstream then sees an empty body and
    the client's disconnect; a client gone mid-body leaves nothing in the scope (a truncated
    body must not pass for a whole one); a body over MAX_BODY_IN_SCOPE, or without a length,
    is not read here."""
    import kvharbor.platform.proxy_guard as pg

    monkeypatch.setattr(pg, "MAX_BODY_IN_SCOPE", 10)
    part = lambda body, more: {"type": "http.request", "body": body, "more_body": more}  # noqa: E731
    disconnect, empty = {"type": "http.disconnect"}, part(b"", False)
    assert _in_scope([part(b"01234", True), part(b"56789", False)], 10) == \
        (b"0123456789", [empty, disconnect], 2)
    whole = {"type": "http.request", "body": b"0123456789"}            # ASGI: more_body False
    assert _in_scope([whole], 10) == (b"0123456789", [empty, disconnect], 1)
    assert _in_scope([part(b"01234", True), disconnect], 10) == (None, [disconnect, disconnect], 2)
    big = [part(b"0123456789X", False)]
    assert _in_scope(big, 11) == (None, [big[0], disconnect], 1)
    assert _in_scope(big, None) == (None, [big[0], disconnect], 1)


def test_a_body_in_the_scope_reaches_the_handler_through_the_gateway():
    """Proxy guard -> AuthGateMiddleware -> a Starlette handler that reads JSON: the handler
    gets the client's body, which came in the scope (the downstream receive's body is empty)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    bodies: list = []

    async def completions(request):
        bodies.append(await request.json())
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.state.authenticate = lambda key, path: SimpleNamespace(tenant="globex")
    app.state.guard_hint = lambda key, path: encode_hint(1.0, "globex")
    app.add_middleware(AuthGateMiddleware)
    received: list = []

    async def serve_like(scope, receive, send):          # Serve's proxy + replica, no Ray
        async def recorded():
            message = await receive()
            received.append(message)
            return message
        await app(scope, recorded, send)

    mw = proxy(serve_like)

    async def scenario(client):
        answers = []
        for prompt in ("learn", "hello"):          # the first answer teaches the proxy the key
            received.clear()
            answers.append(await client.post("/v1/completions", json={"prompt": prompt},
                                             headers={"Authorization": "Bearer k"}))
        return answers

    learn, answer = drive(mw, scenario)
    assert learn.status_code == answer.status_code == 200
    assert bodies == [{"prompt": "learn"}, {"prompt": "hello"}]
    assert all(m.get("body", b"") == b"" for m in received)       # the second came in the scope
