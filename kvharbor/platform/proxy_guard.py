"""The overload guard in Serve's HTTP proxy: shed lower classes before the gateway call.

Through Serve's proxy (kvharbor's default ingress), every request crosses one Python process
before any gateway sees it: the proxy parses the HTTP request, calls a gateway replica over
Ray and relays every response chunk. At twice the capacity of the engines the gateways'
guard (``overload_guard``) refuses most lower-class arrivals, but each refusal has already
cost the proxy a Ray round trip to a gateway, and premium requests wait behind those in the
proxy's event loop (on 2 cores at 86-90 req/s, hundreds of milliseconds: docs/benchmarks.md,
"QoS").

This module sheds in the proxy, as an ASGI middleware that Serve installs there
(``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names ``proxy_middlewares``;
``kvharbor.platform.ingress`` sets it when the cluster starts). A request is refused with
429 ``overloaded`` by the proxy, without a call to any gateway, when

- a gateway's guard shed a request of its class, or of a class with a larger share, less
  than ``ECHO_S`` ago (the gateway's 429 carries ``SHED_HEADER``): the gateways' signal, and
  the one that binds on a 2-core host; or
- the proxy's own guard (an ``OverloadGuard`` on the proxy's event-loop lag, the same rule as
  a gateway's) is at its limit for the class.

The proxy does not read tenants.yaml. It learns each API key's class from the gateway: a
request the proxy forwards carries ``HINT_REQUEST`` and the gateway's answer carries
``HINT_RESPONSE`` (the class's share of the limit, or ``pinned``, and the tenant), which the
proxy removes before the client sees it; it asks again ``HINT_TTL_S`` after (a class changed
in tenants.yaml applies here by then). A key not seen yet is forwarded (the gateway still
checks everything and its own guard still applies); keys are held as digests, at most
``MAX_KEYS`` of them, least recently used first out. Only generation paths (completions and
chat completions, under any route prefix) are considered; everything else passes untouched.

The body of a generation request whose key a gateway has vouched for (a hint is held; up to
``MAX_BODY_IN_SCOPE``, with a Content-Length) is read here and sent inside the request's scope
(``auth_gate.BODY_IN_SCOPE``): otherwise the gateway fetches it with a Ray call back to this
proxy, which under load waits behind the proxy's other work (50-200 ms for premium requests in
a 2x flood here, ``timings_ms.parse``). Any other request streams its body as before, so a
wrong key still gets its 401 before a byte of its body is read.

Every generation request the proxy forwards carries ``PROXY_AT`` (when the proxy received
it; a client's own value is replaced), guard on or off: the gateway reports the wait between
the proxy and itself as the ``proxy`` phase of ``kvharbor.timings_ms``.

``KVHARBOR_PROXY_OVERLOAD_LAG_MS`` (read when the proxy starts) sets the lag target, default
the gateway's default; ``off`` turns the proxy's guard off (``build_app``'s
``overload_lag_ms=null`` does, for a cluster it starts).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from collections import OrderedDict

from kvharbor.platform.auth_gate import (BODY_IN_SCOPE, GENERATION_PATHS, HINT_REQUEST, HINT_RESPONSE,
                                         PROXY_AT, bearer_key, decode_hint, drained)
from kvharbor.platform.body_limit import content_length
from kvharbor.platform.error_body import APIError
from kvharbor.platform.ingress import PROXY_LAG_VAR as LAG_VAR
from kvharbor.platform.overload_guard import DEFAULT_LAG_TARGET_MS, SHED_HEADER, WINDOW_S, OverloadGuard

logger = logging.getLogger("kvharbor")

SHED = SHED_HEADER.lower().encode("latin-1")
ECHO_S = WINDOW_S
"""After a gateway sheds a class, the proxy sheds that class and those below it for this long
(one window of the gateway's guard, in which its limit does not move): those requests then
cost no gateway call. The first request after it goes to a gateway again."""
HINT_TTL_S = 5.0
"""A key's class is asked of the gateway again this long after it was learned (a class
changed in tenants.yaml applies here within that; a gateway's answer costs it a second key
lookup and a header)."""
MAX_KEYS = 10_000
MAX_DRAIN_BYTES = 1 << 20
"""A refused request's body up to this size is read and dropped so the client keeps its
connection; a bigger one gets ``connection: close``."""


def lag_target_ms(environ=os.environ) -> float | None:
    """The proxy guard's lag target from ``LAG_VAR`` (None: off).

    Raises:
        ValueError: the variable is neither a positive number nor ``off``.
    """
    raw = environ.get(LAG_VAR, "").strip().lower()
    if not raw:
        return DEFAULT_LAG_TARGET_MS
    if raw in ("off", "none", "null"):
        return None
    value = float(raw)
    if value <= 0:
        raise ValueError(f"{LAG_VAR} must be a positive number of ms or 'off', got {raw!r}")
    return value


MAX_BODY_IN_SCOPE = 1 << 20
"""Bodies up to this many bytes travel in the scope; larger or chunked ones stream as before."""


async def with_body_in_scope(scope: dict, receive):
    """(scope, receive) for the downstream app: a body of at most ``MAX_BODY_IN_SCOPE`` bytes
    read now and put in the scope, and a receive that gives an empty body, then the
    client's messages (its disconnect). Anything else is passed on untouched."""
    length = content_length(scope)
    if length is None or length > MAX_BODY_IN_SCOPE:
        return scope, receive
    chunks, first = [], None
    while True:
        message = await receive()
        if message["type"] != "http.request":            # the client left mid-body
            first = message
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    if first is None:
        extensions = {**(scope.get("extensions") or {}), BODY_IN_SCOPE: b"".join(chunks)}
        scope = dict(scope, extensions=extensions)
        first = {"type": "http.request", "body": b"", "more_body": False}
    pending = True

    async def replay():
        nonlocal pending
        if pending:
            pending = False
            return first
        return await receive()
    return scope, replay


def stamped(scope: dict) -> dict:
    """``scope`` with its ``PROXY_AT`` header set to now (any other value removed)."""
    headers = [(k, v) for k, v in scope.get("headers", ()) if k != PROXY_AT]
    return dict(scope, headers=[*headers, (PROXY_AT, f"{time.time():.6f}".encode())])


class ProxyGuardMiddleware:
    """Pure ASGI middleware around Serve's proxy app; one guard per proxy process."""

    def __init__(self, app, lag_ms: float | None = DEFAULT_LAG_TARGET_MS, metrics=None) -> None:
        self.app = app
        self.guard = OverloadGuard(lag_ms, metrics=metrics, where="proxy")
        self.hints: OrderedDict[bytes, tuple[float | None, str, float]] = OrderedDict()
        self._ids = itertools.count()
        self.echo_share = 0.0          # classes of share <= this are shed here ...
        self.echo_until = 0.0          # ... until then (time.monotonic())

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or not scope.get("path", "").endswith(GENERATION_PATHS)):
            await self.app(scope, receive, send)
            return
        scope = stamped(scope)
        key = bearer_key(scope.get("headers", ()))
        if not self.guard.enabled or key is None:
            await self.app(scope, receive, send)
            return
        digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
        hint = self.hints.get(digest)
        rid, now = next(self._ids), time.monotonic()
        if hint is not None:
            self.hints.move_to_end(digest)
            share, tenant, _ = hint
            try:
                if share is not None and share <= self.echo_share and now < self.echo_until:
                    raise self.guard.refusal("a gateway is shedding this QoS class", tenant)
                self.guard.enter_share(rid, share, tenant)
            except APIError as refused:
                await self._refuse(refused, scope, receive, send)
                return
        if hint is None or now - hint[2] > HINT_TTL_S:       # ask the gateway (again)
            scope = dict(scope, headers=[*scope.get("headers", ()), (HINT_REQUEST, b"1")])

        async def relay(message) -> None:
            if message["type"] == "http.response.start":
                message = self._learn(digest, hint, message)
            await send(message)

        try:
            if hint is not None:             # a gateway knows this key: its body can come along
                scope, receive = await with_body_in_scope(scope, receive)
            await self.app(scope, receive, relay)
        finally:
            self.guard.leave(rid)

    def _learn(self, digest: bytes, known, message: dict) -> dict:
        """Take the gateway's hint, if any, out of the response headers and remember it; a
        429 the gateway's guard answered (``SHED_HEADER``) for a key whose class is known
        (``known``: the hint held when the request came) sheds the class here for
        ``ECHO_S``."""
        headers, hint, shed = [], None, False
        for name, value in message.get("headers", ()):
            name = name.lower()
            if name == HINT_RESPONSE:
                hint = decode_hint(value)
                continue
            shed = shed or name == SHED
            headers.append((name, value))
        now = time.monotonic()
        if hint is not None:
            known = (*hint, now)
            self.hints[digest] = known
            self.hints.move_to_end(digest)
            while len(self.hints) > MAX_KEYS:
                self.hints.popitem(last=False)
            message = dict(message, headers=headers)
        if shed and message.get("status") == 429 and known is not None and known[0] is not None:
            self.echo_share = known[0] if now >= self.echo_until else max(self.echo_share, known[0])
            self.echo_until = now + ECHO_S
        return message

    @staticmethod
    async def _refuse(refused: APIError, scope, receive, send) -> None:
        response = refused.response()
        if not await drained(receive, MAX_DRAIN_BYTES):
            response.headers["connection"] = "close"     # the unread body is not drained
        await response(scope, receive, send)


def proxy_middlewares() -> list:
    """What Serve's proxy calls at start (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``):
    the guard middleware, or nothing when ``LAG_VAR`` turns it off."""
    from starlette.middleware import Middleware  # noqa: PLC0415

    from kvharbor.observability.metrics import get_metrics  # noqa: PLC0415

    lag_ms = lag_target_ms()
    if lag_ms is None:
        return []
    logger.info("kvharbor: overload guard in Serve's proxy, lag target %.1f ms", lag_ms)
    return [Middleware(ProxyGuardMiddleware, lag_ms=lag_ms, metrics=get_metrics())]


__all__ = ["ProxyGuardMiddleware", "proxy_middlewares", "lag_target_ms"]
