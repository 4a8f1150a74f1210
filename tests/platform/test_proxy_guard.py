"""The overload guard in Serve's HTTP proxy (kvharbor.platform.proxy_guard): it learns each
key's class from the gateway, sheds lower classes with a 429 before any gateway call, never
premium, and the gateway tells it the class only when asked. The body the proxy sends inside
the scope: test_body_in_scope."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest

from kvharbor.platform.auth_gate import (HINT_REQUEST, HINT_RESPONSE, PROXY_AT, AuthGateMiddleware,
                                         decode_hint, encode_hint, ingress_marks)
from kvharbor.platform.ingress import PROXY_CALLBACK, PROXY_GUARD, PROXY_LAG_VAR, apply_ingress
from kvharbor.platform.overload_guard import SHED_HEADER
from kvharbor.platform.proxy_guard import (ECHO_S, HINT_TTL_S, ProxyGuardMiddleware, lag_target_ms,
                                           proxy_middlewares)
from tests.conftest import WrongKey, asgi_post, until

HINTS = {"premium-key": encode_hint(None, "acme"), "standard-key": encode_hint(1.0, "globex"),
         "batch-key": encode_hint(0.2, "initech")}


class Gateway:
    """Stands for the gateway behind the proxy: answers after ``release`` is set, with the
    key's hint when the proxy asked for it; records what reached it."""

    def __init__(self) -> None:
        self.reached: list[tuple[str, bool]] = []
        self.stamps: list[list[bytes]] = []   # the PROXY_AT values of each request that reached it
        self.release = asyncio.Event()
        self.gates: dict[str, asyncio.Event] = {}   # keys answered when their own event is set
        self.shedding: set[str] = set()      # keys its own guard refuses (429 overloaded)
        self.limiting: set[str] = set()      # keys over their tenant's rate limit (429)

    async def __call__(self, scope, receive, send) -> None:
        headers = dict(scope["headers"])
        key = headers.get(b"authorization", b"").decode()[7:]
        self.reached.append((key, HINT_REQUEST in headers))
        self.stamps.append([v for k, v in scope["headers"] if k == PROXY_AT])
        while (await receive()).get("more_body"):
            pass
        await self.gates.get(key, self.release).wait()
        out = [(b"content-type", b"application/json")]
        if HINT_REQUEST in headers and key in HINTS:
            out.append((HINT_RESPONSE, HINTS[key]))
        status = 200
        if key in self.shedding:
            status, out = 429, [*out, (SHED_HEADER.lower().encode(), b"overloaded"), (b"retry-after", b"1")]
        elif key in self.limiting:
            status, out = 429, [*out, (b"retry-after", b"7")]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})


def proxy(gateway: Gateway) -> ProxyGuardMiddleware:
    mw = ProxyGuardMiddleware(gateway, lag_ms=10.0)
    mw.guard._ensure_running = lambda: None          # the test drives the limit
    return mw


async def post(client: httpx.AsyncClient, key: str, path: str = "/app/v1/completions") -> httpx.Response:
    return await client.post(path, json={"prompt": "x" * 3000}, headers={"Authorization": f"Bearer {key}"})


def drive(mw: ProxyGuardMiddleware, scenario):
    """``scenario(client)`` against ``mw`` through an in-process HTTP client."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://t") as client:
            return await scenario(client)
    return asyncio.run(main())


async def learn_all(client: httpx.AsyncClient, gateway: Gateway) -> list[httpx.Response]:
    """One answered request per key, so the proxy knows every key's class."""
    gateway.release.set()
    return [await post(client, key) for key in HINTS]


def test_hints_round_trip_and_garbage_is_no_hint():
    assert decode_hint(encode_hint(None, "acme")) == (None, "acme")
    assert decode_hint(encode_hint(0.2, "initech")) == (0.2, "initech")
    share, tenant = decode_hint(encode_hint(1 / 3, "globex"))     # a share the proxy sheds by
    assert abs(share - 1 / 3) < 1e-6 and tenant == "globex"
    for bad in (b"", b"0.5", b"zero;t", b"0;t", b"1.5;t", b"-1;t"):
        assert decode_hint(bad) is None


def test_the_proxy_learns_classes_and_sheds_lower_ones_before_the_gateway_never_premium():
    gateway = Gateway()
    mw = proxy(gateway)

    async def scenario(client):
        first = await learn_all(client, gateway)
        assert all(HINT_RESPONSE.decode() not in r.headers for r in first)   # removed
        assert all(r.headers["content-type"] == "application/json" for r in first)   # the rest kept
        assert all(asked for _, asked in gateway.reached)
        assert mw.guard.in_flight == 0
        gateway.release.clear()
        mw.guard.min_limit, mw.guard.limit = 1, 4                # batch may hold 1, standard 4
        held = [asyncio.create_task(post(client, "standard-key")) for _ in range(2)]
        await until(lambda: len(gateway.reached) == 5)
        before = len(gateway.reached)
        refused = await asyncio.wait_for(post(client, "batch-key"), 5.0)
        assert len(gateway.reached) == before                    # no gateway call at all
        third = asyncio.create_task(post(client, "standard-key"))
        premium = [asyncio.create_task(post(client, "premium-key")) for _ in range(6)]
        await until(lambda: len(gateway.reached) == before + 7)
        assert mw.guard.in_flight == 3                            # premium is not counted
        gateway.release.set()
        done = await asyncio.gather(*held, third, *premium)
        return refused, done

    refused, done = drive(mw, scenario)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "overloaded"
    assert refused.headers.get("connection") != "close"              # its body was drained
    assert [r.status_code for r in done] == [200] * 9
    assert mw.guard.in_flight == 0 and mw.guard.shed == 1


def test_a_class_the_gateway_sheds_is_shed_at_the_proxy_for_one_window_and_no_higher_class():
    gateway = Gateway()
    mw = proxy(gateway)

    async def scenario(client):
        assert [r.status_code for r in await learn_all(client, gateway)] == [200] * 3
        gateway.limiting.add("batch-key")                        # a tenant limit is no load
        assert (await post(client, "batch-key")).status_code == 429
        gateway.limiting.clear()
        assert (await post(client, "batch-key")).status_code == 200
        gateway.shedding.add("batch-key")
        first = await post(client, "batch-key")                  # the gateway's 429
        reached = len(gateway.reached)
        echoed = [await post(client, "batch-key") for _ in range(3)]
        assert len(gateway.reached) == reached                   # none reached a gateway
        others = [await post(client, k) for k in ("standard-key", "premium-key")]
        assert len(gateway.reached) == reached + 2
        mw.echo_until -= ECHO_S                                  # the window has passed
        gateway.shedding.clear()
        after = await post(client, "batch-key")
        assert len(gateway.reached) == reached + 3               # forwarded again
        return first, echoed, others, after

    first, echoed, others, after = drive(mw, scenario)
    assert first.status_code == 429 and first.headers[SHED_HEADER] == "overloaded"
    assert [r.status_code for r in echoed] == [429] * 3
    assert all(r.json()["error"]["code"] == "overloaded" and r.headers["retry-after"] == "1" for r in echoed)
    assert [r.status_code for r in others] == [200, 200] and after.status_code == 200
    assert mw.guard.shed == 3 and mw.guard.in_flight == 0


def test_the_echo_keeps_the_highest_class_shed_in_its_window_and_starts_afresh_after_it():
    """Within one window the proxy sheds up to the highest class a gateway shed, whatever order
    the gateway's answers come in (a lower class's 429 arriving later does not lower it);
    after the window the next shed class sets it alone."""
    gateway = Gateway()
    mw = proxy(gateway)

    async def scenario(client):
        await learn_all(client, gateway)
        gateway.shedding |= {"standard-key", "batch-key"}
        gateway.gates["batch-key"] = asyncio.Event()
        slow_batch = asyncio.create_task(post(client, "batch-key"))    # forwarded, answered later
        await until(lambda: len(gateway.reached) == 4)
        assert (await post(client, "standard-key")).status_code == 429    # the gateway's
        gateway.gates["batch-key"].set()
        assert (await slow_batch).status_code == 429                    # the gateway's, after
        reached = len(gateway.reached)
        assert (await post(client, "standard-key")).status_code == 429    # shed here
        assert len(gateway.reached) == reached
        mw.echo_until -= ECHO_S                                        # a new window
        assert (await post(client, "batch-key")).status_code == 429       # the gateway's
        gateway.shedding.clear()
        standard = await post(client, "standard-key")                  # above the new echo
        assert len(gateway.reached) == reached + 2
        return standard

    assert drive(mw, scenario).status_code == 200
    assert mw.echo_share == 0.2


def test_keys_are_known_by_their_whole_digest_most_recently_used_kept(monkeypatch):
    """Two keys with a common prefix have their own classes; past MAX_KEYS the key used least
    recently is forgotten (asked of the gateway again), not one just used."""
    import kvharbor.platform.proxy_guard as pg

    monkeypatch.setattr(pg, "MAX_KEYS", 2)
    monkeypatch.setitem(HINTS, "tenant-key-1", encode_hint(0.2, "initech"))
    monkeypatch.setitem(HINTS, "tenant-key-2", encode_hint(None, "acme"))
    gateway = Gateway()
    mw = proxy(gateway)

    async def scenario(client):
        gateway.release.set()
        await post(client, "tenant-key-1")
        await post(client, "tenant-key-2")
        mw.guard.min_limit, mw.guard.limit = 0, 0                    # every unpinned class sheds
        pinned = await post(client, "tenant-key-2")                  # also used most recently
        batch = await post(client, "tenant-key-1")
        await post(client, "standard-key")                          # a third key: one goes
        again = [(await post(client, key)).status_code for key in ("tenant-key-1", "tenant-key-2")]
        return pinned, batch, again

    pinned, batch, again = drive(mw, scenario)
    assert pinned.status_code == 200 and batch.status_code == 429
    assert len(mw.hints) == 2
    # standard-key evicted tenant-key-2 (its last use came before tenant-key-1's): tenant-key-1
    # is still known, so still shed; tenant-key-2 is asked of the gateway again
    assert again == [429, 200]
    assert [(key, asked) for key, asked in gateway.reached][-2:] == [("standard-key", True), ("tenant-key-2", True)]


def test_a_known_class_is_asked_again_after_its_ttl_and_a_change_applies():
    gateway = Gateway()
    mw = proxy(gateway)

    async def scenario(client):
        gateway.release.set()
        for _ in range(3):
            await post(client, "batch-key")
        HINTS["batch-key"] = encode_hint(None, "initech")        # tenants.yaml: now pinned
        await post(client, "batch-key")                          # within the TTL: not asked
        for digest, (share, tenant, learned) in list(mw.hints.items()):
            mw.hints[digest] = (share, tenant, learned - HINT_TTL_S - 1)
        await post(client, "batch-key")                          # aged: asked again

    try:
        drive(mw, scenario)
    finally:
        HINTS["batch-key"] = encode_hint(0.2, "initech")
    assert [asked for _, asked in gateway.reached] == [True, False, False, False, True]
    assert [share for share, _, _ in mw.hints.values()] == [None]


def test_unknown_keys_other_paths_and_failures_pass_through_and_release_their_slot():
    gateway = Gateway()
    mw = proxy(gateway)

    async def broken(scope, receive, send):
        raise RuntimeError("gateway call failed")

    async def scenario(client):
        gateway.release.set()
        mw.guard.min_limit, mw.guard.limit = 0, 0                # everything would shed
        unknown = await post(client, "batch-key")                # class not learned yet
        models = await client.get("/app/v1/models", headers={"Authorization": "Bearer batch-key"})
        other = await post(client, "batch-key", "/app/v1/sessions")
        return unknown, models, other

    unknown, models, other = drive(mw, scenario)
    assert unknown.status_code == 200                               # forwarded, then learned
    assert [asked for _, asked in gateway.reached] == [True, False, False]
    assert mw.hints and other.status_code == 200 and models.status_code == 200
    mw.app = broken                                                  # the next call raises
    mw.guard.limit = 10

    async def failing(client):
        with pytest.raises(RuntimeError):
            await post(client, "batch-key")

    drive(mw, failing)
    assert mw.guard.in_flight == 0


@pytest.mark.parametrize("guard_on", [True, False])
def test_the_proxy_stamps_when_it_received_each_generation_request(guard_on):
    """One ``PROXY_AT`` per forwarded generation request, the proxy's own clock (a client's
    value is dropped), with the guard on or off; other paths are not stamped."""
    gateway = Gateway()
    mw = proxy(gateway) if guard_on else ProxyGuardMiddleware(gateway, lag_ms=None)
    assert mw.guard.enabled is guard_on

    async def scenario(client):
        gateway.release.set()
        before = time.time()
        await client.post("/app/v1/completions", json={}, headers={
            "Authorization": "Bearer standard-key", PROXY_AT.decode(): "1.0"})
        await client.get("/app/v1/models", headers={"Authorization": "Bearer standard-key"})
        return before, time.time()

    before, after = drive(mw, scenario)
    generation, models = gateway.stamps
    assert len(generation) == 1 and before <= float(generation[0]) <= after
    assert models == []


def test_the_gateway_marks_when_the_proxy_and_it_received_the_request():
    """``ingress_marks``: ``proxied`` a stamp's age before ``received``, on the
    perf_counter clock; no stamp, a garbled, future or stale one gives no ``proxied``."""
    now = time.time()
    marks = ingress_marks([(PROXY_AT, f"{now - 0.25:.6f}".encode())])
    assert 0.25 <= marks["received"] - marks["proxied"] < 0.35
    assert abs(marks["received"] - time.perf_counter()) < 0.1
    for headers in ([], [(PROXY_AT, b"soon")], [(PROXY_AT, f"{now + 5:.6f}".encode())],
                    [(PROXY_AT, f"{now - 120:.6f}".encode())]):
        assert set(ingress_marks(headers)) == {"received"}, headers


def test_the_lag_target_variable_and_the_middleware_it_installs(monkeypatch):
    for off in ("off", "None", " null "):
        assert lag_target_ms({PROXY_LAG_VAR: off}) is None
    assert lag_target_ms({PROXY_LAG_VAR: " 25 "}) == 25.0 and lag_target_ms({}) == 10.0
    for bad in ("0", "-3", "fast"):
        with pytest.raises(ValueError):
            lag_target_ms({PROXY_LAG_VAR: bad})
    monkeypatch.setenv(PROXY_LAG_VAR, "off")
    assert proxy_middlewares() == []
    monkeypatch.setenv(PROXY_LAG_VAR, "25")
    [middleware] = proxy_middlewares()
    assert middleware.cls is ProxyGuardMiddleware and middleware.kwargs["lag_ms"] == 25.0


def test_only_a_generation_post_is_counted_or_shed():
    """A GET on a generation path (or any other method) passes untouched, however loaded."""
    gateway = Gateway()
    mw = proxy(gateway)

    async def scenario(client):
        await learn_all(client, gateway)
        mw.guard.min_limit, mw.guard.limit = 0, 0
        auth = {"Authorization": "Bearer batch-key"}
        return (await client.get("/app/v1/completions", headers=auth),
                await post(client, "batch-key"))

    got, posted = drive(mw, scenario)
    assert got.status_code == 200 and posted.status_code == 429
    assert gateway.stamps[-1] == []                         # not stamped by the proxy either


def test_the_gateway_sends_the_hint_only_when_the_proxy_asks():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def completions(request):
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.state.max_body_bytes = 1 << 20
    refuse: list = []

    def authenticate(key, path):
        if refuse:
            raise _Refused()
        return SimpleNamespace(tenant="initech")

    app.state.authenticate = authenticate
    app.state.guard_hint = lambda key, path: (encode_hint(0.2, "initech")
                                              if key == "k" and path == "/v1/completions" else None)
    app.add_middleware(AuthGateMiddleware)

    async def scenario(asked: bool, prefix: str = ""):
        headers = {"Authorization": "Bearer k", **({HINT_REQUEST.decode(): "1"} if asked else {})}
        transport = httpx.ASGITransport(app=app, root_path=prefix)      # Serve's route_prefix
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(f"{prefix}/v1/completions", json={}, headers=headers)

    assert HINT_RESPONSE.decode() not in asyncio.run(scenario(False)).headers
    assert asyncio.run(scenario(True)).headers[HINT_RESPONSE.decode()] == "0.2;initech"
    mounted = asyncio.run(scenario(True, "/priority"))     # the gate sees the app's own path
    assert mounted.status_code == 200 and mounted.headers[HINT_RESPONSE.decode()] == "0.2;initech"
    refuse.append(1)                                                 # the gateway's own 429
    refused = asyncio.run(scenario(True))
    assert refused.status_code == 429 and refused.headers[HINT_RESPONSE.decode()] == "0.2;initech"


class _Refused(Exception):
    status, message, code, headers = 429, "overloaded", "overloaded", {"Retry-After": "1"}


@pytest.mark.parametrize(("refusal", "chunks", "read", "closes"), [
    (WrongKey, 4, 0, True),         # a wrong key: none of the body read, the connection closed
    (_Refused, 4, 4, False),        # refused for load, body within the limit: drained, kept open
    (_Refused, 40, 11, True),       # over the limit: reading stops one chunk past it, closed
], ids=["401", "429-within-limit", "429-over-limit"])
def test_a_refusal_reads_only_a_load_refusals_body_within_the_limit(refusal, chunks, read, closes):
    """The gate's refusals, at the ASGI level (what a socket sees): a body the gate leaves
    unread must end the connection (else its bytes would be read as the client's next
    request); a 429 drains a body up to ``max_body_bytes`` so the client keeps its connection."""
    from starlette.applications import Starlette

    app = Starlette()
    app.state.max_body_bytes = 10_000

    def authenticate(key, path):
        raise refusal()

    app.state.authenticate = authenticate
    app.add_middleware(AuthGateMiddleware)
    status, _, headers, reads = asgi_post(app, "/v1/completions", [b"x" * 1000] * chunks,
                                          [(b"authorization", b"Bearer k")])
    assert status == refusal.status and reads == read
    assert (headers.get(b"connection") == b"close") == closes, headers


@pytest.mark.parametrize(("chunks", "read", "closes"), [(8, 8, False), (40, 17, True)],
                         ids=["within-drain-limit", "over-drain-limit"])
def test_a_request_the_proxy_sheds_keeps_its_connection_only_when_its_body_was_drained(
        chunks, read, closes):
    """The proxy's own 429, at the ASGI level: a body of up to ``MAX_DRAIN_BYTES`` (1 MiB) is
    read and dropped, so the client keeps its connection; reading a bigger one stops one chunk
    past the limit and the answer closes the connection (else the unread bytes would be read
    as the client's next request)."""
    gateway = Gateway()
    gateway.release.set()
    mw = proxy(gateway)
    auth = [(b"authorization", b"Bearer batch-key")]
    assert asgi_post(mw, "/v1/completions", [b"{}"], auth)[0] == 200   # class learned
    mw.guard.min_limit, mw.guard.limit = 0, 0          # every unpinned class sheds
    reached = len(gateway.reached)
    status, body, headers, reads = asgi_post(mw, "/v1/completions", [b"x" * 65536] * chunks, auth)
    assert status == 429 and "overloaded" in body and len(gateway.reached) == reached
    assert reads == read
    assert (headers.get(b"connection") == b"close") == closes, headers


def test_the_cluster_env_names_the_proxy_guard_through_serves_proxy_only():
    env: dict = {}
    assert apply_ingress("proxy", env, overload_lag_ms=None) == "proxy"
    assert env[PROXY_CALLBACK] == PROXY_GUARD and lag_target_ms(env) is None
    env = {PROXY_CALLBACK: "mine:callback"}
    apply_ingress("proxy", env, overload_lag_ms=25.0)
    assert env[PROXY_CALLBACK] == "mine:callback" and lag_target_ms(env) == 25.0
    env = {}
    apply_ingress("proxy", env)
    assert lag_target_ms(env) == 10.0 and PROXY_LAG_VAR not in env
    with pytest.raises(ValueError):
        lag_target_ms({PROXY_LAG_VAR: "-3"})
    env = {}
    if apply_ingress("haproxy", env) == "haproxy":          # no Serve proxy on the path
        assert PROXY_CALLBACK not in env


def test_the_running_app_has_the_guard_in_serves_proxy(kvharbor_app):
    """Through Serve's proxy (the default ingress) the proxy runs the guard: once a key's
    class is known its gauges appear (lag, in-flight count, limit -1: none yet; the metrics
    recorder test never sets -1); the hint never reaches the client."""
    from tests.conftest import DEMO, INGRESS
    from tests.observability.recorder_actor import scrape_until

    body = {"model": kvharbor_app.model, "prompt": "hello", "max_tokens": 1}
    with kvharbor_app.client(DEMO["batch"]) as client:
        answers = [client.post("/v1/completions", json=body) for _ in range(2)]
    assert [r.status_code for r in answers] == [200, 200]
    assert all(HINT_RESPONSE.decode() not in r.headers for r in answers)
    if INGRESS[0] == "proxy":
        scrape_until([r"^ray_kvharbor_proxy_overload_limit\{.*\} -1(\.0)?$",
                      r"^ray_kvharbor_proxy_loop_lag_seconds\{.*",
                      r"^ray_kvharbor_proxy_overload_in_flight\{.*"])
