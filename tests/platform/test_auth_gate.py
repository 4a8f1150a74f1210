"""The gateway's key check in front of every route (kvharbor.platform.auth_gate): which paths
it guards, which ``Authorization`` headers carry a key, what it leaves the handler, and when a
refused body is drained."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvharbor.platform.auth_gate import AuthGateMiddleware, drained
from tests.conftest import WrongKey, asgi_post


def _gated_app():
    """A Starlette app behind the gate whose only good key is ``good``; each handler answers
    what the gate left it in the request's state. -> (app, the paths ``authenticate`` saw)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def handler(request):
        state = request.scope.get("state") or {}
        principal = state.get("principal")
        return JSONResponse({"tenant": getattr(principal, "tenant", None),
                             "marks": sorted(state.get("ingress", {}))})

    paths = ["/healthz", "/v1/models", "/v1/completions", "/admin/tenants", "/tokenize", "/detokenize"]
    app = Starlette(routes=[Route(p, handler, methods=["GET", "POST"]) for p in paths])
    app.state.max_body_bytes = 1 << 20
    checked: list[str] = []

    def authenticate(key, path):
        checked.append(path)
        if key != "good":
            raise WrongKey()
        return SimpleNamespace(tenant="acme")

    app.state.authenticate = authenticate
    app.add_middleware(AuthGateMiddleware)
    return app, checked


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/admin/tenants", "/tokenize", "/detokenize"])
def test_every_protected_path_refuses_a_wrong_key_before_reading_the_body(path):
    """The API, admin and token routes: a wrong key is a 401 with none of the body read and the
    connection closed; the right key reaches the handler with the principal and the ingress
    mark, after exactly one key check."""
    app, checked = _gated_app()
    status, _, headers, reads = asgi_post(app, path, [b"x" * 1000] * 4, [(b"authorization", b"Bearer nope")])
    assert (status, reads, headers.get(b"connection")) == (401, 0, b"close")
    checked.clear()
    status, body, _, _ = asgi_post(app, path, [b"{}"], [(b"authorization", b"Bearer good")])
    assert status == 200 and body == '{"tenant":"acme","marks":["received"]}'
    assert checked == [path]


def test_health_passes_without_a_key_and_without_a_check():
    app, checked = _gated_app()
    status, body, _, _ = asgi_post(app, "/healthz", [b""], [])
    assert status == 200 and body == '{"tenant":null,"marks":[]}' and checked == []


@pytest.mark.parametrize(("header", "status"), [
    (b"Bearer good", 200), (b"bearer good", 200), (b"BEARER  good ", 200),   # the scheme is case-blind
    (b"Digest good", 401), (b"Basic good", 401), (b"good", 401), (b"Bearer", 401),
])
def test_only_a_bearer_scheme_carries_the_key(header, status):
    """RFC 7235: the scheme's case does not matter; any other scheme is no key at all (a 7-letter
    one such as ``Digest`` must not pass its token as if it were ``Bearer``'s)."""
    app, _ = _gated_app()
    assert asgi_post(app, "/v1/models", [b""], [(b"authorization", header)])[0] == status


def test_a_drain_gives_up_on_a_client_that_left_or_a_last_chunk_over_the_limit():
    """``drained`` is True only for a whole body within the limit: a disconnect mid-body, or a
    final chunk that crosses the limit, is False (the refusal then closes the connection)."""
    def run(messages, limit):
        async def receive():
            return messages.pop(0)
        return asyncio.run(drained(receive, limit))

    more = {"type": "http.request", "body": b"x" * 10, "more_body": True}
    last = {"type": "http.request", "body": b"x" * 10, "more_body": False}
    assert run([more, last], 20) is True
    assert run([more, {"type": "http.disconnect"}], 100) is False
    assert run([more, last], 19) is False
    assert run([more, more, last], 15) is False
