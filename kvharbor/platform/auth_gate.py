"""ASGI middleware: check the API key before any byte of the request body is read.

An unauthenticated client must not make the gateway read, parse or validate its body (a
4 MiB body with a wrong key costs one header lookup and a 401). For every path under a
protected prefix the ``Authorization: Bearer`` key is checked with
``scope["app"].state.authenticate(key, path)`` (set by the Gateway), which returns the
principal or raises an error with ``status``, ``message`` and ``code`` (``TenantError``). The
principal is left in ``scope["state"]["principal"]`` for the route handler, which therefore
does not check the key again. Paths outside the prefixes (``/healthz``, ``/openapi.json``)
pass untouched, as does everything when no ``authenticate`` is set (the app outside Serve).

A request that Serve's proxy guard forwarded (``HINT_REQUEST``) gets ``HINT_RESPONSE`` on its
answer, from ``scope["app"].state.guard_hint(key, path)``: the proxy learns the key's class
from it (``proxy_guard``).

A request's body can come inside its scope: Serve's proxy guard reads a small body itself
and sends it with the request (``scope["extensions"][BODY_IN_SCOPE]``), so the gateway does
not call the proxy back for it (Serve's replica fetches a body from the proxy actor with one
more Ray call, which waits behind everything else a busy proxy does). This middleware then
answers the handler's first ``receive()`` with that body and drops the empty
``http.request`` the proxy still forwards; a disconnect comes through as before.

Where a request's time went before the route handler (``Generation.timings_ms``): this
middleware leaves in ``scope["state"]["ingress"]`` the ``perf_counter()`` instant it saw the
request (``received``) and, for a request that Serve's proxy stamped (``PROXY_AT``, wall-clock
seconds, written by ``proxy_guard``), the same clock's instant the proxy received it
(``proxied``). A stamp in the future or older than ``MAX_PROXY_STAMP_S`` is ignored.

Every answer of a generation route carries the tenant's ``x-ratelimit-*`` headers
(``rate_headers``: its limits, and what the admission service said of this request).

This middleware sits outside ``BodyLimitMiddleware``: a wrong key gets 401 even for a body
over the size limit. A 429 (the gateway's overload guard refusing the key's QoS class) drains
a body within the size limit first, so the client keeps its connection.
"""

from __future__ import annotations

import time

from kvharbor.platform import rate_headers
from kvharbor.platform.error_body import APIError, error_response

SCORING_PATHS = ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", *SCORING_PATHS)
"""The routes that run the engine (Serve's proxy guard sheds only these)."""
TOKEN_PATHS = ("/tokenize", "/detokenize")
SHED_PATHS = GENERATION_PATHS + TOKEN_PATHS
"""The routes the gateway's overload guard sheds: a token route tokenizes on the gateway's
event loop as a generation route does."""
PROTECTED_PREFIXES = ("/v1/", "/v2/", "/admin/", *TOKEN_PATHS, "/score", "/rerank")
HINT_REQUEST = b"x-kvharbor-proxy-guard"
"""Request header of Serve's proxy guard (``proxy_guard``): answer with ``HINT_RESPONSE``."""
HINT_RESPONSE = b"x-kvharbor-guard"
"""Response header ``<share>;<tenant>`` for the proxy guard (share: the key's class's share
of the overload limit, a float in (0, 1], or ``pinned``); the proxy removes it."""


PROXY_AT = b"x-kvharbor-proxy-at"
"""Request header Serve's proxy guard sets (replacing any a client sent): ``time.time()`` when
the proxy received the request, as text."""
MAX_PROXY_STAMP_S = 60.0
BODY_IN_SCOPE = "kvharbor.body"
"""``scope["extensions"]`` key of a request body that Serve's proxy guard read (bytes)."""


def body_from_scope(scope, receive):
    """``receive``, or, when ``scope`` carries the body (``BODY_IN_SCOPE``), a receive that
    gives that body first and then only what is not a body message (a disconnect)."""
    body = (scope.get("extensions") or {}).get(BODY_IN_SCOPE)
    if body is None:
        return receive
    pending = True

    async def receive_body():
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
    return receive_body


def ingress_marks(headers) -> dict[str, float]:
    """``received`` (now, ``perf_counter``) and, when ``headers`` carry a valid ``PROXY_AT``,
    ``proxied`` on the same clock."""
    received = time.perf_counter()
    marks = {"received": received}
    stamp = next((v for k, v in headers if k == PROXY_AT), None)
    if stamp is not None:
        try:
            waited = time.time() - float(stamp)
        except ValueError:
            return marks
        if 0.0 <= waited <= MAX_PROXY_STAMP_S:
            marks["proxied"] = received - waited
    return marks


def encode_hint(share: float | None, tenant: str) -> bytes:
    """``HINT_RESPONSE``'s value for a class with ``share`` (None: pinned) and ``tenant``."""
    return f"{'pinned' if share is None else f'{share:.6g}'};{tenant}".encode("latin-1")


def decode_hint(value: bytes) -> tuple[float | None, str] | None:
    """(share or None for pinned, tenant), or None if ``value`` is not a hint."""
    share, sep, tenant = value.decode("latin-1").partition(";")
    if not sep:
        return None
    if share == "pinned":
        return None, tenant
    try:
        number = float(share)
    except ValueError:
        return None
    return (number, tenant) if 0.0 < number <= 1.0 else None


def bearer_key(headers) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (raw ASGI or Starlette headers)."""
    if isinstance(headers, list | tuple):
        header = next((v.decode("latin-1") for k, v in headers if k == b"authorization"), "")
    else:
        header = headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else None


def route_path(scope) -> str:
    """The request's path inside the app: without the ``root_path`` the app is mounted at
    (Serve's ``route_prefix``; Starlette >= 0.35 keeps it in ``path``)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _body_limit(scope) -> int:
    return getattr(getattr(scope.get("app"), "state", None), "max_body_bytes", 0) or 0


async def drained(receive, limit: int) -> bool:
    """Read and drop a request body of at most ``limit`` bytes (False: it is bigger, or the
    client left), so that an authenticated client refused for load keeps its connection."""
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return False
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return seen <= limit
    return False


def tenant_principal(request):
    """The tenant principal this middleware left for ``request`` (a route under ``/v1/``), or the
    401 for an admin key or none (plain routes that keep no gateway state read it this way)."""
    principal = getattr(request.state, "principal", None)
    if principal is None or isinstance(principal, str):
        raise APIError(401, "send a tenant's API key as Authorization: Bearer <key>", "invalid_api_key")
    return principal


class AuthGateMiddleware:
    """Pure ASGI middleware; one call to ``authenticate`` per protected request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            receive = body_from_scope(scope, receive)
        authenticate = getattr(getattr(scope.get("app"), "state", None), "authenticate", None)
        path = route_path(scope)
        if scope["type"] != "http" or authenticate is None or not path.startswith(PROTECTED_PREFIXES):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["ingress"] = ingress_marks(scope.get("headers", ()))
        key = bearer_key(scope.get("headers", ()))
        hint = None
        if any(name == HINT_REQUEST for name, _ in scope.get("headers", ())):
            hint_for = getattr(scope["app"].state, "guard_hint", None)
            hint = hint_for(key, path) if hint_for is not None else None
        try:
            principal = authenticate(key, path)
        except Exception as exc:  # noqa: BLE001 - only errors that carry a status are answers
            status = getattr(exc, "status", None)
            if not isinstance(status, int):
                raise
            response = error_response(status, getattr(exc, "message", str(exc)), getattr(exc, "code", None),
                                      headers=getattr(exc, "headers", None))
            if hint is not None:
                response.headers[HINT_RESPONSE.decode()] = hint.decode("latin-1")
            if scope.get("method") in ("POST", "PUT", "PATCH") and not (
                    status == 429 and await drained(receive, _body_limit(scope))):
                response.headers["connection"] = "close"       # the unread body is not drained
            await response(scope, receive, send)
            return
        state["principal"] = principal
        limits = getattr(principal, "limits", None) if path in GENERATION_PATHS else None
        if hint is None and limits is None:
            await self.app(scope, receive, send)
            return
        with rate_headers.opened() as rates:

            async def annotated(message) -> None:
                if message["type"] == "http.response.start":
                    extra = rate_headers.headers_for(limits, rates) if limits is not None else []
                    if hint is not None:
                        extra.append((HINT_RESPONSE, hint))
                    message = dict(message, headers=[*message.get("headers", ()), *extra])
                await send(message)

            await self.app(scope, receive, annotated)
